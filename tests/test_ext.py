"""The extension loader: clear errors when the compiled kernels cannot serve."""
import pytest
import torch

import deepfuse
from deepfuse import _ext


def test_missing_extension_error(monkeypatch):
    monkeypatch.setattr(_ext, "_C", None)
    monkeypatch.setattr(_ext, "_IMPORT_ERROR", ImportError("no _C"))
    assert not _ext.has_cuda_kernels() and _ext.built_archs() == []
    with pytest.raises(RuntimeError, match="CUDA kernels are not part of this install"):
        _ext.ext(torch.device("cuda", 0))


def test_wrong_arch_error(monkeypatch):
    if not deepfuse.has_cuda_kernels():
        pytest.skip("built without CUDA kernels")
    assert deepfuse.built_archs(), "a CUDA build must report its archs"
    _ext._check_device.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "Old GPU")
    with pytest.raises(RuntimeError, match="sm_75"):
        _ext._check_device(0)
    _ext._check_device.cache_clear()


def test_every_op_runs_on_cuda_tensors():
    # Each deepfuse op needs a CUDA kernel or the reference registered for all devices;
    # a CPU-only registration would fail on the GPU with "Could not run ... CUDA backend".
    import deepfuse.ops  # noqa: F401  (registers the ops)

    quals = sorted({n.split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("deepfuse::")})
    assert len(quals) >= 10, quals
    for qual in quals:
        has = any(torch._C._dispatch_has_kernel_for_dispatch_key(qual, k)
                  for k in ("CUDA", "CompositeExplicitAutograd", "CompositeImplicitAutograd"))
        assert has, f"{qual} has no kernel that serves CUDA tensors"
