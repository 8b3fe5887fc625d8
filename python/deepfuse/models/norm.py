"""RMSNorm with an fp32 weight (V4 keeps every norm weight in fp32)."""
from __future__ import annotations

import torch
import torch.nn as nn

from deepfuse import ops

from .linear import add_slot


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.dim, self.eps = dim, eps
        add_slot(self, "weight", (dim,), "fp32")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
