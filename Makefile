# Each target installs the CPU environment first (tools/setup_env.sh is a no-op when up to date).
PY := .venv/bin/python

.PHONY: env main test
env:
	@bash tools/setup_env.sh

# The main job. Until the training loop lands it is the unbiasedness self-check.
main: env
	.venv/bin/megatron-dppo verify-unbiased --all-aggs

test: env
	$(PY) -m pytest -q tests
