"""V4 attention: one shared K = V head over a sliding window plus compressed entries.

q  = wq_b(q_norm(wq_a x)) viewed [H, D], each head RMS-normalised (no weight), RoPE on the
     last rope_head_dim dims;
kv = RoPE(kv_norm(wkv x)), one D-dim row per position, both key and value;
keys of the query at position p: the window positions (p - W, p] plus, on HCA layers, every
compressed entry i < (p + 1) // r and, on CSA layers, the indexer's top-k of those;
core: deepfuse.ops.sparse_attention with the per-head sink (scale D^-0.5);
out: inverse RoPE on o's last rope dims, then the grouped projection wo_a (o_groups blocks)
     and wo_b. Sliding-window layers use the main RoPE, CSA/HCA layers the compress RoPE
     (YaRN) everywhere, as the transformers oracle does.

Differences from DeepSeek's reference code, where we follow the oracle: the reference rounds
the window kv's non-RoPE dims (and the compressed rows) through FP8 per 64 values to mimic
its quantisation-aware training and keeps a bf16 KV cache; the oracle (and this graph) keep
them unrounded. The FP8 serving cache of the engine is a later, separate choice.

forward() is the full forward of [B, T] sequences from position 0 (no cache); step() is one
engine step over a flat token batch with the engine's paged caches (engine/context.py says
where each row lives): this step's window rows go to scratch slots (norm, RoPE, FP8 and the
store fused: ops.norm_rope_store), the compressors add the
rows of the blocks the step completes, the indexer picks CSA rows, then one
ops.sparse_attention_paged call reads the window and the compressed rows with the inverse
RoPE applied to its output; the last window rows of each request go to its ring after it.
On CUDA, steps of at most ops.linear.STREAM_MAX_M rows with an fp8 / mxfp4 wo_a take the
attention output as MXFP8 (its epilogue quantises) and wo_a reads it directly
(ops.grouped_linear_mx: no bf16 round trip, no cast); longer steps keep bf16. The CPU path keeps
bf16 (its references do not round activations). DEEPFUSE_WO_A_MXFP8=0 / 1: never / also on the CPU.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn

from deepfuse import ops
from deepfuse.step import LayerCacheView, StepContext

from .compressor import Compressor
from .config import CSA, SWA, V4Config
from .indexer import Indexer
from .linear import Linear, add_slot
from .norm import RMSNorm
from .rope import RopeTable

_WO_A_ENV = os.environ.get("DEEPFUSE_WO_A_MXFP8")
WO_A_MXFP8 = None if _WO_A_ENV is None else _WO_A_ENV == "1"  # None: on CUDA only


class AttentionProjections(nn.Module):
    """The projections V4 and V4.1 attention share (official names wq_a, q_norm, wq_b, wkv,
    kv_norm, wo_a, wo_b, attn_sink) and the grouped output projection."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        d, H, D = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.n_heads, self.head_dim, self.window = H, D, cfg.sliding_window
        self.o_groups = cfg.o_groups  # this rank's heads and output groups (models/parallel.py shards both)
        self.wq_a = Linear(d, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, H * D)
        self.wkv = Linear(d, D)
        self.kv_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.wo_a = Linear(H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, d)
        add_slot(self, "attn_sink", (H,), "fp32")

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        G, H, D = self.o_groups, self.n_heads, self.head_dim
        o = ops.grouped_linear(o.reshape(*o.shape[:-2], G, H * D // G), self.wo_a.weight, self.wo_a.scale, self.wo_a.fmt)
        return self.wo_b(o.flatten(-2))

    def _out_mx(self, q8: torch.Tensor, s8: torch.Tensor) -> torch.Tensor:
        """_out of the attention's MXFP8 output: q8 e4m3 [N, H * D], s8 UE8M0 [N, H * D / 32]."""
        G, N = self.o_groups, q8.shape[0]
        o = ops.grouped_linear_mx(q8.view(N, G, -1), s8.view(N, G, -1), self.wo_a.weight, self.wo_a.scale,
                                  self.wo_a.fmt)
        return self.wo_b(o.flatten(-2))


class Attention(AttentionProjections):
    def __init__(self, cfg: V4Config, layer_type: str):
        super().__init__(cfg)
        self.cfg, self.layer_type = cfg, layer_type
        self.ratio = cfg.compress_ratio(layer_type)
        self.compressor = Compressor(cfg, self.ratio, self.head_dim, overlap=layer_type == CSA) if self.ratio else None
        self.indexer = Indexer(cfg, self.ratio) if layer_type == CSA else None

    @property
    def rope_kind(self) -> str:
        return "main" if self.layer_type == SWA else "compress"

    def _q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        qr = self.q_norm(self.wq_a(x))
        q = ops.norm_rope(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), None, self.cfg.rms_norm_eps,
                          cos, sin)
        return qr, q

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        """x [B, T, d] (already attn_norm-ed) at positions 0 .. T-1 -> [B, T, d]."""
        B, T, _ = x.shape
        D, W = self.head_dim, self.window
        cos, sin = rope(positions)
        cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
        qr, q = self._q(x, cos, sin)
        rows = ops.norm_rope(self.wkv(x), self.kv_norm.weight, self.kv_norm.eps, cos, sin)
        t = torch.arange(T, device=x.device).unsqueeze(1)
        w = torch.arange(W, device=x.device).unsqueeze(0)
        win = t - W + 1 + w  # row of position p - W + 1 + w
        idx = torch.where(win >= 0, win, torch.full_like(win, -1)).unsqueeze(0).expand(B, -1, -1)
        if self.compressor is not None:
            comp = self.compressor(x, rope)
            C = comp.shape[1]
            sel = self.indexer(x, qr, positions, rope) if self.indexer is not None else None
            if C:
                if sel is None:
                    i = torch.arange(C, device=x.device).unsqueeze(0)
                    vis = i < ((positions + 1) // self.ratio).unsqueeze(1)
                    sel = torch.where(vis, i, torch.full_like(i, -1)).unsqueeze(0).expand(B, -1, -1)
                rows = torch.cat([rows, comp], dim=1)
                idx = torch.cat([idx, torch.where(sel >= 0, sel + T, sel)], dim=-1)
        o = ops.sparse_attention(q, rows, idx, self.attn_sink, D ** -0.5)
        return self._out(ops.rope(o, cos, sin, inverse=True))

    def step(self, x: torch.Tensor, ctx: StepContext, cache: LayerCacheView, rope: RopeTable) -> torch.Tensor:
        """One engine step: x [N, d] (attn_norm-ed) of the flat batch -> [N, d]."""
        cos, sin = ctx.rope(self.rope_kind, rope)
        qr, q = self._q(x, cos, sin)
        win = ctx.window
        kv = ops.norm_rope_store(self.wkv(x), self.kv_norm.weight, self.kv_norm.eps, cos, sin, cache.window_target(),
                                 win.scratch_slots)
        extra = {}
        if self.compressor is not None:
            plan = ctx.plans[(self.ratio, self.indexer is not None)]
            self.compressor.step(x, plan, cache, "attn", rope)
            if self.indexer is not None:
                sel = self.indexer.step(x, qr, ctx, plan, cache, rope)
                if sel is not None:
                    extra = dict(extra_indices=sel.contiguous())
            elif plan.max_entries:
                extra = dict(extra_indices=plan.entry_slots[ctx.token_req].contiguous(), extra_lengths=plan.n_vis)
            if extra:
                extra.update(extra_kv=cache.comp, extra_page_size=cache.page_size)
        mx = (x.is_cuda if WO_A_MXFP8 is None else WO_A_MXFP8) and self.wo_a.fmt in ("fp8", "mxfp4") \
            and x.shape[0] <= ops.linear.STREAM_MAX_M
        o, _ = ops.sparse_attention_paged(q, cache.ring, cache.ring_page_size, win.win_idx, self.attn_sink,
                                          self.head_dim ** -0.5, inv_rope=(cos, sin),
                                          out_format="mxfp8" if mx else "bf16", **extra)
        cache.store_window(kv, win.ring_slots)
        return self._out_mx(*o) if mx else self._out(o)
