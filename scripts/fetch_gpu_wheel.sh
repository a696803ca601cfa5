#!/usr/bin/env bash
# Fetch the FlashMLA kernel wheel (PyPI `sgl-flash-mla`) into the git-ignored .whl/ folder, on a
# machine that reaches PyPI, for a GPU machine that does not (Python 3.12, x86-64).
# Install it there with:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
# (--no-deps: the wheel's metadata asks for torch>=2.14.1, but its stable-ABI build loads on
# torch 2.11; see ../shared/spec/measured_h200.md.)
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d .whl sgl-flash-mla==1.0.0
ls -l .whl
