"""Input validation shared by the ops: every error names the argument at fault."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def _fail(msg: str, exc: type[Exception] = ValueError):
    raise exc(f"deepfuse: {msg}")


def check_tensor(
    op: str,
    name: str,
    t,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
    last_dim_contiguous: bool = False,
) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            _fail(f"{op}: {name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of {allowed}", TypeError)
    if ndim is not None and t.dim() != ndim:
        _fail(f"{op}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            _fail(f"{op}: {name} must have shape {want}, got {list(t.shape)}")
    if device is not None and t.device != device:
        _fail(f"{op}: {name} is on {t.device}, expected {device} (all inputs on one device)")
    if contiguous and not t.is_contiguous():
        _fail(f"{op}: {name} must be contiguous (strides {t.stride()})")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(f"{op}: {name} must have a contiguous last dimension (strides {t.stride()})")


def check_aligned(op: str, name: str, t: torch.Tensor, nbytes: int = 16) -> None:
    """CUDA kernels load 16-byte vectors: the data pointer must be aligned."""
    if t.is_cuda and t.numel() > 0 and t.data_ptr() % nbytes != 0:
        _fail(f"{op}: {name} data pointer must be {nbytes}-byte aligned (offset views are not)")


def check_int(op: str, name: str, v, lo: int | None = None, hi: int | None = None, choices=None) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        _fail(f"{op}: {name} must be an int, got {type(v).__name__}", TypeError)
    if choices is not None and v not in choices:
        _fail(f"{op}: {name} must be one of {sorted(choices)}, got {v}")
    if lo is not None and v < lo:
        _fail(f"{op}: {name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        _fail(f"{op}: {name} must be <= {hi}, got {v}")


def check_choice(op: str, name: str, v, choices) -> None:
    if v not in choices:
        _fail(f"{op}: {name} must be one of {list(choices)}, got {v!r}")
