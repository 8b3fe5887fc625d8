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


_ENABLED = True


def has_cuda_kernels() -> bool:
    """True when this install carries the compiled CUDA kernels (and they are not switched
    off with set_kernels_enabled)."""
    return _C is not None and _ENABLED


def set_kernels_enabled(enabled: bool) -> bool:
    """Switch the model-graph ops between their CUDA kernels and their torch references on
    CUDA tensors (tests and the eager baseline of the benchmarks); returns the previous
    setting. The cache and top-k ops always run their kernels."""
    global _ENABLED
    prev, _ENABLED = _ENABLED, bool(enabled)
    return prev


def built_archs() -> list[str]:
    """CUDA archs (e.g. ['90a']) this install has machine code for; [] without kernels."""
    return list(_C.built_archs()) if _C is not None else []


@functools.lru_cache(maxsize=None)
def _check_device(index: int) -> None:
    major, minor = torch.cuda.get_device_capability(index)
    have = built_archs()
    if not _covers(have, f"{major}{minor}"):
        name = torch.cuda.get_device_name(index)
        raise RuntimeError(
            f"deepfuse: this install was built for CUDA archs {have}, but cuda:{index} "
            f"({name}) is sm_{major}{minor}. Install the wheel built for your GPU "
            f"(DEEPFUSE_CUDA_ARCHS={major}{minor}a)."
        )


# _C launchers whose kernels exist for some archs only: name -> the archs that have them.
# Every other launcher has a kernel for every arch in built_archs(). The device code of these
# is compiled for those archs only (csrc/common/arch.h) and their C++ launchers refuse other
# devices too (require_sm90a).
_KERNEL_ARCHS: dict[str, tuple[str, ...]] = {
    "fp8_linear": ("90a",),  # wgmma (csrc/gemm/grouped_gemm_sm90.cuh)
    "moe_experts": ("90a",),  # wgmma (the same grouped GEMM)
    "fp8_linear_prefill": ("90a",),  # wgmma (csrc/moe/moe_prefill.cu, dense mode)
}


def _cc_name(cc: tuple[int, int]) -> str:
    return f"{cc[0]}{cc[1]}"


def _covers(archs, cc: str) -> bool:
    """Whether machine code for `archs` (e.g. ['90a']) runs on compute capability `cc` ('90')."""
    return any(a.rstrip("af") == cc for a in archs)


def has_kernel(name: str, device: torch.device) -> bool:
    """Whether the _C launcher `name` has a kernel for `device`'s arch in this install
    (False without the extension or for an arch it was not built for)."""
    if _C is None or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    cc = _cc_name(torch.cuda.get_device_capability(index))
    return _covers(built_archs(), cc) and _covers(_KERNEL_ARCHS.get(name, built_archs()), cc)


class _OnDevice:
    """_C's launchers for one device (`index`; plans take it): a launcher runs on its tensors'
    device and current stream (two GPUs in one process work). A launcher without a kernel for
    the device's arch (_KERNEL_ARCHS) raises on lookup, before any launch."""

    def __init__(self, index: int):
        self.index = index
        self.cc = _cc_name(torch.cuda.get_device_capability(index))

    def __getattr__(self, name: str):
        archs = _KERNEL_ARCHS.get(name)
        if archs is not None and not _covers(archs, self.cc):
            raise NotImplementedError(
                f"deepfuse: no sm_{self.cc} kernel for {name} yet (it has kernels for "
                f"{', '.join('sm_' + a for a in archs)} only)"
            )
        fn = getattr(_C, name)
        setattr(self, name, fn)  # cached: later lookups are plain attribute reads
        return fn


@functools.lru_cache(maxsize=None)
def _on_device(index: int) -> _OnDevice:
    return _OnDevice(index)


def ext(device: torch.device):
    """The extension's launchers bound to `device` (its index, or the current device), after
    checking that this install can run on it."""
    if _C is None:
        raise RuntimeError(
            "deepfuse: the CUDA kernels are not part of this install "
            f"({_IMPORT_ERROR}). Install a wheel built for your GPU, or build with "
            "DEEPFUSE_BUILD_CUDA=ON; CPU tensors use the reference implementations."
        )
    index = device.index if device.index is not None else torch.cuda.current_device()
    _check_device(index)
    return _on_device(index)
