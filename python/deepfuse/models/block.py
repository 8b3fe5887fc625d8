"""One V4 decoder block: mHC pre-mix -> attn_norm -> attention -> mHC post-mix, then the
same around ffn_norm -> MoE. Official names: attn, ffn, attn_norm, ffn_norm, hc_attn_*,
hc_ffn_*."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from . import mhc
from .attention import Attention
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

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ropes: dict[str, RopeTable],
                input_ids: Optional[torch.Tensor], ctx=None, cache=None,
                rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Streams x [B, T, hc, d] -> [B, T, hc, d]. Without ctx: the full forward of sequences
        from position 0; with the engine's step context and this layer's cache view: one flat
        step (B = 1, T = the step's tokens). rows [R] (a flat step): the attention half runs
        (and writes the cache) for every token, the FFN half for these rows only -> [1, R, hc, d]."""
        h, post, comb = mhc.pre(self, "attn", x, self.cfg)
        h = self.attn_norm(h)
        rope = ropes[self.attn.rope_kind]
        h = self.attn(h, positions, rope) if ctx is None else self.attn.step(h[0], ctx, cache, rope)[None]
        x = mhc.post(h, x, post, comb)
        if rows is not None:
            x, input_ids = x[:, rows], None if input_ids is None else input_ids[:, rows]
        h, post, comb = mhc.pre(self, "ffn", x, self.cfg)
        h = self.ffn(self.ffn_norm(h), input_ids)
        return mhc.post(h, x, post, comb)
