"""mHC residual streams: X [B, T, hc, d]; each sublayer reads a pre-mix of the streams and
writes back through post / comb (Sinkhorn-normalised) mixing. The math is in deepfuse.ops.mhc.

Parameters use the official names: hc_{attn,ffn}_{fn,base,scale} on each block and
hc_head_{fn,base,scale} on the model and on each MTP layer.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from deepfuse import ops

from .config import V4Config
from .linear import add_slot


def add_mix_slots(module: nn.Module, prefix: str, cfg: V4Config) -> None:
    """hc_<prefix>_fn [(2+n)n, n d], _base [(2+n)n], _scale [3] (fp32)."""
    n, d = cfg.hc_mult, cfg.hidden_size
    add_slot(module, f"hc_{prefix}_fn", ((2 + n) * n, n * d), "fp32")
    add_slot(module, f"hc_{prefix}_base", ((2 + n) * n,), "fp32")
    add_slot(module, f"hc_{prefix}_scale", (3,), "fp32")


def add_head_slots(module: nn.Module, cfg: V4Config) -> None:
    """hc_head_fn [n, n d], hc_head_base [n], hc_head_scale [1] (fp32)."""
    n, d = cfg.hc_mult, cfg.hidden_size
    add_slot(module, "hc_head_fn", (n, n * d), "fp32")
    add_slot(module, "hc_head_base", (n,), "fp32")
    add_slot(module, "hc_head_scale", (1,), "fp32")


def expand(h: torch.Tensor, cfg: V4Config) -> torch.Tensor:
    """Embedding [B, T, d] -> streams [B, T, hc, d] (a copy per stream)."""
    return h.unsqueeze(-2).expand(*h.shape[:-1], cfg.hc_mult, h.shape[-1]).contiguous()


def pre(module: nn.Module, prefix: str, x: torch.Tensor, cfg: V4Config):
    """-> (sublayer input [B, T, d], post [B, T, hc], comb [B, T, hc, hc])."""
    return ops.hc_pre(x, getattr(module, f"hc_{prefix}_fn"), getattr(module, f"hc_{prefix}_scale"),
                      getattr(module, f"hc_{prefix}_base"), norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps,
                      iters=cfg.hc_sinkhorn_iters)


def post(f: torch.Tensor, x: torch.Tensor, post_w: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    return ops.hc_post(f, x, post_w, comb)


def head(module: nn.Module, x: torch.Tensor, cfg: V4Config) -> torch.Tensor:
    """Collapse the streams [B, T, hc, d] -> [B, T, d] before the final norm."""
    return ops.hc_head(x, module.hc_head_fn, module.hc_head_scale, module.hc_head_base,
                       norm_eps=cfg.rms_norm_eps, hc_eps=cfg.hc_eps)
