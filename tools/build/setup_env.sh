#!/usr/bin/env bash
# Sourced by main.sh and run_tests.sh: a venv in .venv with torch, the build tools and
# TileLang (build-time only), then deepfuse built and installed from this tree.
#   env: PYTHON (default python3), TORCH_SPEC (default "torch"), EXTRA_PIP (more packages),
#        DEEPFUSE_CUDA_ARCHS (default 90a), DEEPFUSE_BUILD_CUDA=OFF (pure-Python install)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -c "import torch" 2>/dev/null || pip install -q "${TORCH_SPEC:-torch}"
pip install -q "tilelang==0.1.15" safetensors tqdm numpy "scikit-build-core>=0.11" \
  "pybind11>=2.13" "cmake>=3.26" ninja ${EXTRA_PIP:-}
t0=$(date +%s)
pip install -q --no-build-isolation --no-deps .
echo "deepfuse built and installed in $(( $(date +%s) - t0 )) s"
