"""RMSNorm, with or without a weight, and its fusions with RoPE and the cache stores.

Semantics (the references define them):
- rms_norm: y = x * rsqrt(mean(x^2, -1) + eps) [* weight], computed in fp32 and cast back to
  x.dtype once. The weight is read in fp32 (V4 keeps norm weights in fp32).
- norm_rope(x, weight, eps, cos, sin) = rope(rms_norm(x, weight, eps), cos, sin) (each step
  rounded to x.dtype, as the two ops are): V4's q path (per-head norm without a weight).
- norm_rope_store(x, ..., target, slots): the same rows, also stored at `slots` of one
  layer's cache pages (ops.kvcache.RowTarget: the KV row or indexer key formats, or dense
  rows), as the cache's store op would store them; returns the rows. V4's kv path.

CUDA (csrc/norm): bf16 x, D % 8 == 0, D <= 16384, fp32 weight / cos / sin: one warp per row
up to D 4096, one block of 4 warps per row above (V4.1's 5120, V4-Pro's 7168; no cache store
there), the row in registers; the standalone ops and the fusions run the same device code, so
a fused store writes exactly what rms_norm + rope + kv_store write. Other inputs on CUDA run
the references only where allowed (ops._fallback), else raise.
"""
from __future__ import annotations

from typing import Optional

import torch

from deepfuse.ops._checks import check_tensor
from deepfuse.ops._fallback import need_reference
from deepfuse.ops._registry import op
from deepfuse.ops._rows import ROW_MAX, _f32, launch_rows, rows_gap, rows_kernel_gap  # noqa: F401 (re-exported)
from deepfuse.ops.kvcache import RowTarget, store_rows
from deepfuse.ops.rope import rope_ref

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm_ref(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


def norm_rope_ref(x, weight, eps, cos, sin):
    return rope_ref(rms_norm_ref(x, weight, eps), cos, sin, False)


# ----------------------------------------------------------------------------- CUDA launcher
def store_gap(D: int, target: RowTarget) -> Optional[str]:
    """Why the fused row store cannot write D-wide rows to target (None: it can)."""
    if not target.kernel_ok():
        return (f"target pages have dtype {str(target.pages.dtype)[6:]} (the fused store writes FP8 or "
                f"bfloat16 pages)")
    if target.kind == "dense":
        fits, want = D <= 512, "<= 512"
    else:
        width = 512 if target.kind == "kv_fp8" else 128
        fits, want = D == width, f"== {width}"
    if not fits:
        return f"rows are {D} wide (the fused store into {target.kind} pages takes D {want})"
    return None


# ----------------------------------------------------------------------------- custom ops
@op("rms_norm")
def _rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    return rms_norm_ref(x, weight, eps)


@_rms_norm.register_kernel("cuda")
def _(x, weight, eps):
    why = rows_kernel_gap(x)
    if why is not None:
        need_reference("rms_norm", why)
        return rms_norm_ref(x, weight, eps)
    xc = x.contiguous()
    y = torch.empty_like(xc)
    launch_rows(xc, y, norm=True, weight=_f32(weight), eps=eps)
    return y


@_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@op("norm_rope")
def _norm_rope(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    return norm_rope_ref(x, weight, eps, cos, sin)


@_norm_rope.register_kernel("cuda")
def _(x, weight, eps, cos, sin):
    why = rows_kernel_gap(x)
    if why is not None:
        need_reference("norm_rope", why)
        return norm_rope_ref(x, weight, eps, cos, sin)
    xc = x.contiguous()
    y = torch.empty_like(xc)
    launch_rows(xc, y, norm=True, weight=_f32(weight), eps=eps, cos=_f32(cos), sin=_f32(sin))
    return y


@_norm_rope.register_fake
def _(x, weight, eps, cos, sin):
    return torch.empty_like(x)


@op("norm_rope_store", "(Tensor x, Tensor? weight, float eps, Tensor cos, Tensor sin, Tensor(a!) pages, str kind, "
                       "int page_size, Tensor slots) -> Tensor")
def _norm_rope_store(x, weight, eps, cos, sin, pages, kind, page_size, slots):
    y = norm_rope_ref(x, weight, eps, cos, sin)
    store_rows(RowTarget(pages, kind, page_size), y, slots)
    return y


@_norm_rope_store.register_kernel("cuda")
def _(x, weight, eps, cos, sin, pages, kind, page_size, slots):
    target = RowTarget(pages, kind, page_size)
    why = rows_kernel_gap(x) or store_gap(x.shape[-1], target)
    if why is None and slots.dtype != torch.int64:
        why = f"slots has dtype {str(slots.dtype)[6:]} (the kernel takes int64)"
    if why is not None:
        need_reference("norm_rope_store", why)
        y = norm_rope_ref(x, weight, eps, cos, sin)
        store_rows(target, y, slots)
        return y
    xc = x.contiguous()
    y = torch.empty_like(xc)
    launch_rows(xc, y, norm=True, weight=_f32(weight), eps=eps, cos=_f32(cos), sin=_f32(sin),
                target=target, slots=slots.contiguous())
    return y


@_norm_rope_store.register_fake
def _(x, weight, eps, cos, sin, pages, kind, page_size, slots):
    return torch.empty_like(x)


# ----------------------------------------------------------------------------- public API
def _check_norm(op_name: str, x, weight, eps) -> None:
    check_tensor(op_name, "x", x, dtypes=_FLOATS)
    if x.dim() == 0:
        raise ValueError(f"deepfuse: {op_name}: x must have at least one dimension")
    if weight is not None:
        check_tensor(op_name, "weight", weight, dtypes=_FLOATS, shape=(x.shape[-1],), device=x.device)
    if not eps > 0:
        raise ValueError(f"deepfuse: {op_name}: eps must be > 0, got {eps}")


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6) -> torch.Tensor:
    """RMS-normalise the last dimension of x ([..., D]); weight is None or [D]."""
    _check_norm("rms_norm", x, weight, eps)
    return torch.ops.deepfuse.rms_norm(x, weight, float(eps))


def norm_rope(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor:
    """rope(rms_norm(x, weight, eps), cos, sin): x [*L, D] or [*L, H, D], cos/sin [*L, R/2]."""
    from deepfuse.ops.rope import check_rope

    _check_norm("norm_rope", x, weight, eps)
    check_rope("norm_rope", x, cos, sin)
    return torch.ops.deepfuse.norm_rope(x, weight, float(eps), cos, sin)


def norm_rope_store(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float, cos: torch.Tensor,
                    sin: torch.Tensor, target: RowTarget, slots: torch.Tensor) -> torch.Tensor:
    """norm_rope of rows x [N, D], also stored at slots [N] (int64; negative: skipped) of target."""
    from deepfuse.ops.rope import check_rope

    op_name = "norm_rope_store"
    _check_norm(op_name, x, weight, eps)
    if x.dim() != 2:
        raise ValueError(f"deepfuse: {op_name}: x must be [N, D], got {list(x.shape)}")
    check_rope(op_name, x, cos, sin)
    if not isinstance(target, RowTarget):
        raise TypeError(f"deepfuse: {op_name}: target must be an ops.kvcache.RowTarget, got {type(target).__name__}")
    target.check(op_name, x.shape[-1], x.device)
    check_tensor(op_name, "slots", slots, dtypes=(torch.int64,), shape=(x.shape[0],), device=x.device)
    return torch.ops.deepfuse.norm_rope_store(x, weight, float(eps), cos, sin, target.pages, target.kind,
                                              int(target.page_size), slots)
