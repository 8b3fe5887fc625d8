"""Weight slots and the Linear layer (dense, FP8 block-scaled or MXFP4 weights).

Modules are built on the meta device; every tensor they need is a named slot that the
loader (models/loader.py) fills from a checkpoint. A slot's kind says how it is stored:
"fp32" (kept in fp32, as V4 keeps norms, mHC, sinks, biases), "act" (the model dtype) or
"index" (int64 lookup tables).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from deepfuse import ops
from deepfuse.ops.linear import check_weight

META = torch.device("meta")


def add_slot(module: nn.Module, name: str, shape: tuple[int, ...], kind: str) -> None:
    assert kind in ("fp32", "act", "index")
    if "_slots" not in module.__dict__:
        module._slots = {}
    module._slots[name] = kind
    dt = torch.int64 if kind == "index" else torch.float32
    module.register_buffer(name, torch.empty(shape, dtype=dt, device=META))


def slots(module: nn.Module) -> dict[str, str]:
    return module.__dict__.get("_slots", {})


class Linear(nn.Module):
    """y = x W^T (no bias). W [out, in] is dense, or quantised with fmt "fp8" / "mxfp4"."""

    def __init__(self, in_features: int, out_features: int, quantisable: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quantisable = quantisable
        self.fmt = "dense"
        self.register_buffer("weight", torch.empty(out_features, in_features, device=META))
        self.register_buffer("scale", None)

    def set_weight(self, w: torch.Tensor, scale: Optional[torch.Tensor] = None, fmt: str = "dense") -> None:
        check_weight("Linear", w, scale, fmt, self.out_features, self.in_features, name="weight")
        self.weight, self.scale, self.fmt = w, scale, fmt

    def dense_weight(self, dtype=torch.float32) -> torch.Tensor:
        return ops.linear.dequant_weight(self.weight, self.scale, self.fmt, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt == "dense":
            return F.linear(x, self.weight.to(x.dtype))
        return ops.quant_linear(x, self.weight, self.scale, self.fmt)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt}"
