"""Interleaved (GPT-J style) rotary embedding on the trailing R dims of each vector.

Semantics (the reference defines them): with R = 2 * cos.shape[-1], the last R values of x
form pairs (x[2i], x[2i+1]) rotated by angle a_i: (x0 c - x1 s, x1 c + x0 s), c = cos a_i,
s = sin a_i, in fp32, cast back to x.dtype. inverse=True rotates by -a_i (V4 applies it to
the attention output). The leading D - R values pass through unchanged.
x: [*L, D] or [*L, H, D]; cos, sin: [*L, R/2] (fp32, per token).
CUDA: the row kernel of csrc/norm (bf16 x, D % 8 == 0, D <= 16384); other inputs run the
reference only where allowed (ops._fallback), else raise.
"""
from __future__ import annotations

import torch

from deepfuse.ops._checks import check_tensor
from deepfuse.ops._fallback import need_reference
from deepfuse.ops._registry import op
from deepfuse.ops._rows import _f32, launch_rows, rows_kernel_gap

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    R = 2 * cos.shape[-1]
    if x.dim() == cos.dim() + 1:  # head axis between the token axes and D
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    c, s = cos.float(), sin.float()
    if inverse:
        s = -s
    pairs = x[..., x.shape[-1] - R:].float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rot = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2)
    return torch.cat((x[..., : x.shape[-1] - R], rot.to(x.dtype)), dim=-1)


@op("rope")
def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    return rope_ref(x, cos, sin, inverse)


@_rope.register_kernel("cuda")
def _(x, cos, sin, inverse):
    why = rows_kernel_gap(x)
    if why is not None:
        need_reference("rope", why)
        return rope_ref(x, cos, sin, inverse)
    xc = x.contiguous()
    y = torch.empty_like(xc)
    launch_rows(xc, y, norm=False, cos=_f32(cos), sin=_f32(sin), inverse=inverse)
    return y


@_rope.register_fake
def _(x, cos, sin, inverse):
    return torch.empty_like(x)


def check_rope(op: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    check_tensor(op, "cos", cos, dtypes=(torch.float32,), device=x.device)
    check_tensor(op, "sin", sin, dtypes=(torch.float32,), shape=tuple(cos.shape), device=x.device)
    lead = tuple(cos.shape[:-1])
    if x.dim() == cos.dim():
        ok = tuple(x.shape[:-1]) == lead
    elif x.dim() == cos.dim() + 1:
        ok = tuple(x.shape[:-2]) == lead
    else:
        ok = False
    if not ok:
        raise ValueError(
            f"deepfuse: {op}: x {list(x.shape)} must be [*L, D] or [*L, H, D] with cos/sin [*L, R/2] = {list(cos.shape)}"
        )
    if 2 * cos.shape[-1] > x.shape[-1]:
        raise ValueError(f"deepfuse: {op}: rotary dims {2 * cos.shape[-1]} exceed x.shape[-1] = {x.shape[-1]}")


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] dims of x (interleaved pairs); see module doc."""
    check_tensor("rope", "x", x, dtypes=_FLOATS)
    check_rope("rope", x, cos, sin)
    return torch.ops.deepfuse.rope(x, cos, sin, bool(inverse))
