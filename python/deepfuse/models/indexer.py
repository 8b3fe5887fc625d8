"""Lightning indexer (CSA layers): picks, per query, the top index_topk compressed entries.

Keys: a second overlapping 4:1 compressor at index_head_dim. Queries: wq_b(qr) viewed as
[index_n_heads, index_head_dim] with compress RoPE at the query position. Weights:
weights_proj(x) * n_heads^-0.5; scores: deepfuse.ops.indexer_scores with scale
head_dim^-0.5. Entry i is visible to the query at position p iff i < (p + 1) // ratio; the
top min(index_topk, C) of the visible scores are kept and slots that point at invisible
entries become -1 (as the transformers oracle does).

The oracle applies no Hadamard rotation or FP8/FP4 rounding to the indexer's q/k (DeepSeek's
reference does); we follow the oracle.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from deepfuse import ops
from deepfuse.step import CompressPlan, LayerCacheView, StepContext

from .compressor import Compressor
from .config import V4Config
from .linear import Linear
from .rope import RopeTable


def select_topk(scores: torch.Tensor, k: int, lengths: torch.Tensor) -> torch.Tensor:
    """Indices [..., k] (int64) of the k largest scores of each row [..., C] among its first
    `lengths` entries; slots beyond a row's length are -1. Runs deepfuse.ops.topk."""
    C = scores.shape[-1]
    lead = scores.shape[:-1]
    flat = scores.reshape(-1, C)
    lens = lengths.expand(lead).reshape(-1).to(torch.int32)
    idx = ops.topk(flat.contiguous(), k, lengths=lens, return_values=False, index_dtype=torch.int64)
    return idx.view(*lead, k)


class Indexer(nn.Module):
    def __init__(self, cfg: V4Config, ratio: int):
        super().__init__()
        self.cfg, self.ratio = cfg, ratio
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads)
        self.compressor = Compressor(cfg, ratio, self.head_dim, overlap=True)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        """Full forward: x [B, T, d] from position 0 -> selected entry indices [B, T, k]
        (int64, -1 = empty slot)."""
        B, T, _ = x.shape
        keys = self.compressor(x, rope)
        C = keys.shape[1]
        if C == 0:
            return torch.empty(B, T, 0, dtype=torch.long, device=x.device)
        cos, sin = rope(positions)
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = ops.rope(q, cos.expand(B, -1, -1), sin.expand(B, -1, -1))
        w = self.weights_proj(x).float() * self.n_heads ** -0.5
        scores = ops.indexer_scores(q, keys, w, self.head_dim ** -0.5)
        visible = ((positions + 1) // self.ratio).expand(B, -1)
        return select_topk(scores, min(self.topk, C), visible)

    def step(self, x: torch.Tensor, qr: torch.Tensor, ctx: StepContext, plan: CompressPlan, cache: LayerCacheView,
             rope: RopeTable):
        """One flat step: x [N, d], qr [N, q_lora_rank] -> cache slots [N, k] of the selected
        compressed rows (-1 = none), or None when no request of the step has an entry yet.
        Scores over the paged keys (ops.indexer_logits_paged), the top-k written as slots
        (ops.topk_slots)."""
        self.compressor.step(x, plan, cache, "index", rope)
        C = plan.max_entries
        if C == 0:
            return None
        N = x.shape[0]
        cos, sin = ctx.rope("compress", rope)
        q = ops.rope(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), cos, sin)
        w = self.weights_proj(x).float() * self.n_heads ** -0.5
        k = min(self.topk, C)
        sel = torch.empty(N, k, dtype=torch.int64, device=x.device)
        chunk = max(1, (1 << 25) // C)  # tokens per launch pair: bounds the [tokens, C] scores
        for t0 in range(0, N, chunk):
            t1 = min(N, t0 + chunk)
            req = ctx.token_req[t0:t1]
            scores = ops.indexer_logits_paged(q[t0:t1], w[t0:t1], cache.index, cache.page_size, plan.entry_slots,
                                              req, plan.n_vis[t0:t1], self.head_dim ** -0.5)
            sel[t0:t1] = ops.topk_slots(scores, k, plan.n_vis[t0:t1], plan.entry_slots, req)
        return sel
