"""Access to the compiled extension deepfuse._C, with clear errors when it cannot serve."""
from __future__ import annotations

import functools

import torch

try:
    from deepfuse import _C  # type: ignore[attr-defined]

    _IMPORT_ERROR: Exception | None = None
except ImportError as e:  # pure-Python install (DEEPFUSE_BUILD_CUDA=OFF) or broken build
    _C = None
    _IMPORT_ERROR = e


def has_cuda_kernels() -> bool:
    """True when this install carries the compiled CUDA kernels."""
    return _C is not None


def built_archs() -> list[str]:
    """CUDA archs (e.g. ['90a']) this install has machine code for; [] without kernels."""
    return list(_C.built_archs()) if _C is not None else []


@functools.lru_cache(maxsize=None)
def _check_device(index: int) -> None:
    major, minor = torch.cuda.get_device_capability(index)
    have = built_archs()
    if not any(a.rstrip("af") == f"{major}{minor}" for a in have):
        name = torch.cuda.get_device_name(index)
        raise RuntimeError(
            f"deepfuse: this install was built for CUDA archs {have}, but cuda:{index} "
            f"({name}) is sm_{major}{minor}. Install the wheel built for your GPU "
            f"(DEEPFUSE_CUDA_ARCHS={major}{minor}a)."
        )


def ext(device: torch.device):
    """The extension module, after checking that it can run on `device`."""
    if _C is None:
        raise RuntimeError(
            "deepfuse: the CUDA kernels are not part of this install "
            f"({_IMPORT_ERROR}). Install a wheel built for your GPU, or build with "
            "DEEPFUSE_BUILD_CUDA=ON; CPU tensors use the reference implementations."
        )
    _check_device(device.index if device.index is not None else torch.cuda.current_device())
    return _C


def stream(device: torch.device) -> int:
    """The current CUDA stream of `device` as an integer handle (the capture stream in graphs)."""
    return torch.cuda.current_stream(device).cuda_stream
