#!/usr/bin/env bash
# Fresh machine -> test results: venv, test dependencies, build (CUDA extension for
# DEEPFUSE_CUDA_ARCHS, default 90a, TileLang lowered at build time), then pytest.
# GPU tests run when a GPU is present and skip otherwise.
#   env: TORCH_SPEC (pip spec for torch, default "torch"), PYTHON (default python3),
#        DEEPFUSE_BUILD_CUDA=OFF for a pure-Python install (references only)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
python -c "import torch" 2>/dev/null || pip install -q "${TORCH_SPEC:-torch}"
pip install -q "tilelang==0.1.15" "transformers>=5.23" safetensors tqdm numpy pytest \
  "scikit-build-core>=0.11" "pybind11>=2.13" "cmake>=3.26" ninja
t0=$(date +%s)
pip install -q --no-build-isolation --no-deps .
echo "build + install: $(( $(date +%s) - t0 )) s"
cd "$root/tests"   # import the installed package, not the source tree
python -c "import deepfuse; print('deepfuse', deepfuse.__version__, 'CUDA kernels:', deepfuse.has_cuda_kernels(), deepfuse.built_archs())"
python -m pytest -q -p no:cacheprovider "$root/tests" "$@"
