import pytest
import torch


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

