"""RMSNorm, with or without a weight.

Semantics (the reference defines them): y = x * rsqrt(mean(x^2, -1) + eps) [* weight],
computed in fp32 and cast back to x.dtype once. The weight is read in fp32 (V4 keeps norm
weights in fp32).
"""
from __future__ import annotations

from typing import Optional

import torch

from deepfuse.ops._checks import check_tensor
from deepfuse.ops._registry import op

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm_ref(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


# no kernel yet: the op's body (the reference) also serves CUDA tensors.
@op("rms_norm")
def _rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    return rms_norm_ref(x, weight, eps)


@_rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor] = None, eps: float = 1e-6) -> torch.Tensor:
    """RMS-normalise the last dimension of x ([..., D]); weight is None or [D]."""
    op = "rms_norm"
    check_tensor(op, "x", x, dtypes=_FLOATS)
    if x.dim() == 0:
        raise ValueError("deepfuse: rms_norm: x must have at least one dimension")
    if weight is not None:
        check_tensor(op, "weight", weight, dtypes=_FLOATS, shape=(x.shape[-1],), device=x.device)
    if not eps > 0:
        raise ValueError(f"deepfuse: rms_norm: eps must be > 0, got {eps}")
    return torch.ops.deepfuse.rms_norm(x, weight, float(eps))
