"""One V4 decoder block: mHC pre-mix -> attn_norm -> attention -> mHC post-mix, then the
same around ffn_norm -> MoE. Official names: attn, ffn, attn_norm, ffn_norm, hc_attn_*,
hc_ffn_*."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from . import mhc
from .attention import Attention
from .cache import LayerCache
from .config import V4Config
from .moe import MoE
from .norm import RMSNorm
from .rope import RopeTable


class Block(nn.Module):
    def __init__(self, cfg: V4Config, layer_type: str, is_hash: bool):
        super().__init__()
        self.cfg = cfg
        self.attn = Attention(cfg, layer_type)
        self.ffn = MoE(cfg, is_hash)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        mhc.add_mix_slots(self, "attn", cfg)
        mhc.add_mix_slots(self, "ffn", cfg)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, p0: int, ropes: dict[str, RopeTable],
                input_ids: Optional[torch.Tensor], cache: Optional[LayerCache] = None) -> torch.Tensor:
        """Streams x [B, T, hc, d] -> [B, T, hc, d]."""
        h, post, comb = mhc.pre(self, "attn", x, self.cfg)
        h = self.attn(self.attn_norm(h), positions, p0, ropes[self.attn.rope_kind], cache)
        x = mhc.post(h, x, post, comb)
        h, post, comb = mhc.pre(self, "ffn", x, self.cfg)
        h = self.ffn(self.ffn_norm(h), input_ids)
        return mhc.post(h, x, post, comb)
