import sys
from pathlib import Path

import pytest
import torch

# microbench/ (not part of the package) is importable from the tests; the repository root
# holds no `deepfuse` folder, so the installed package is still the one imported.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# The shared helpers (engine_util, v4_oracle) sit beside this file and are imported from every
# area folder (ops/, model/, engine/, serve/).
sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the compiled kernels")
    config.addinivalue_line("markers", "sanitize: small GPU case run under compute-sanitizer")


def pytest_collection_modifyitems(config, items):
    import deepfuse

    if torch.cuda.is_available() and deepfuse.has_cuda_kernels():
        return
    why = "no CUDA device" if not torch.cuda.is_available() else "deepfuse built without CUDA kernels"
    skip = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords or "sanitize" in item.keywords:
            item.add_marker(skip)

