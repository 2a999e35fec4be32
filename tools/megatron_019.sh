#!/usr/bin/env bash
# Prints a folder holding megatron-core 0.19.0's Python code, to put first on PYTHONPATH:
#     PYTHONPATH=$(tools/megatron_019.sh) .venv/bin/python -m pytest tests/dist/test_checkpoint.py
# setup.py allows megatron-core < 0.20 and a Python 3.12 image installs 0.19, while this
# machine's Python 3.11 has no 0.19 wheel. Its code is pure Python but for the dataset
# helpers (a cp312 extension this project never imports), so the 3.12 wheel's files run here.
# Fetched once from PyPI and cached under .cache/ (git-ignored); later calls only print.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${MEGATRON_CORE_VERSION:-0.19.0}
dir=$PWD/.cache/megatron-core-$version
py=${PYTHON:-.venv/bin/python}
if [[ ! -f $dir/.complete ]]; then
  tmp=$dir.partial
  rm -rf "$tmp"  # a download killed half-way; only ever this script's own folder
  mkdir -p "$tmp/wheel"
  "$py" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 "megatron-core==$version" -d "$tmp/wheel" 2>&1 |
    { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
  "$py" -m zipfile -e "$tmp"/wheel/megatron_core-*.whl "$tmp/site"
  mv -T "$tmp" "$dir"
  touch "$dir/.complete"
fi
echo "$dir/site"
