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
    if not any(a.rstrip("af") == f"{major}{minor}" for a in have):
        name = torch.cuda.get_device_name(index)
        raise RuntimeError(
            f"deepfuse: this install was built for CUDA archs {have}, but cuda:{index} "
            f"({name}) is sm_{major}{minor}. Install the wheel built for your GPU "
            f"(DEEPFUSE_CUDA_ARCHS={major}{minor}a)."
        )


# the _C functions that touch a device: they take device= (the device made current for the call)
_ON_DEVICE = ("num_sms", "fp8_group_cast", "fp8_block_cast", "topk", "topk_plan", "kv_store", "indexer_key_store",
              "kv_window_copy", "sparse_attention_paged", "sparse_attention_plan",
              "moe_route", "moe_experts", "fp8_linear", "hc_mix", "hc_post", "norm_rope", "compress_store",
              "state_store", "indexer_logits_paged")


class _OnDevice:
    """_C with device=index bound into every launcher: each kernel launches on the device its
    tensors live on, whatever the current device is (two GPUs in one process)."""

    def __init__(self, index: int):
        self.index = index

    def __getattr__(self, name: str):
        fn = getattr(_C, name)
        if name in _ON_DEVICE:
            fn = functools.partial(fn, device=self.index)
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


def stream(device: torch.device) -> int:
    """The current CUDA stream of `device` as an integer handle (the capture stream in graphs)."""
    return torch.cuda.current_stream(device).cuda_stream
