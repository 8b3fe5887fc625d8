"""The ops a V4Model runs as torch references on CUDA knowingly (the model's choice, see
deepfuse.ops._fallback): every other CUDA call that no kernel serves raises.

V4Model.allow_reference sets it:
- None (default): what the model's own configuration needs, on a CUDA device:
  * activations other than bf16 (fp32 / fp16: the oracle precisions): every op;
  * bf16: the ops whose kernels do not serve its widths or weight formats (each op module's
    *_gap function decides, the same one its CUDA path asks): e.g. rms_norm for V4-Pro's
    7168-wide rows, sparse_attention_paged for 32 heads per rank under tensor parallelism,
    grouped_linear / moe_experts for dense weights, and, with a cache other than "fp8" (the
    lossless "auto" / "bf16" formats a user chose), indexer_logits_paged;
  * the full-sequence forward (forward, mtp_forward) also runs sparse_attention,
    indexer_scores and compress_pool, which have no kernels (the engine's step has them).
  At V4-Flash widths with FP8 weights and the "fp8" cache the engine's step allows nothing.
- True: every op; False: none (every gap raises NoKernelError); a tuple of op names: those.
Allowed references warn once per op and are counted (deepfuse.ops.reference_calls()).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from deepfuse import ops

FULL_FORWARD_OPS = ("sparse_attention", "indexer_scores", "compress_pool")
ALL = ("*",)
_ROW_OPS = ("rms_norm", "norm_rope", "norm_rope_store", "rope")


def _cache_kind(cache) -> Optional[tuple]:
    return None if cache is None else (bool(cache.fp8), cache.dtype)


def kernel_gaps(model, cache=None) -> tuple[str, ...]:
    """The ops whose CUDA kernels cannot serve `model` (bf16 activations) with `cache` (a
    CacheManager, or None: the cache-independent gaps); ("*",) for other activation dtypes."""
    from deepfuse.ops import attention as A, compressor as C, indexer as I, linear as L, mhc as M, moe as MO
    from deepfuse.ops import norm as N
    from deepfuse.ops.kvcache import RowTarget

    from .attention import Attention
    from .indexer import Indexer
    from .linear import Linear
    from .moe import MoE

    if model.dtype != torch.bfloat16:
        return ALL
    cfg, bf16 = model.cfg, torch.bfloat16
    gaps: set[str] = set()
    if any(N.rows_gap(D, bf16) for D in (cfg.hidden_size, cfg.q_lora_rank)):
        gaps.add("rms_norm")
    if any(N.rows_gap(D, bf16) for D in (cfg.head_dim, cfg.index_head_dim)):
        gaps.update(_ROW_OPS)
    if M.mix_gap(cfg.hc_mult, cfg.hidden_size, bf16):
        gaps.update(("hc_pre", "hc_post", "hc_head"))
    step = cache is not None  # the paged ops, stores and compressor steps run in engine steps only
    fp8 = step and cache.fp8
    page_dtype = torch.uint8 if fp8 else (cache.dtype if step else bf16)

    def target(kind: str) -> RowTarget:
        return RowTarget(torch.empty(0, dtype=page_dtype), kind if fp8 else "dense", 16)

    for m in model.modules():
        if isinstance(m, Attention):
            D = m.head_dim
            if step and A.paged_gap(bf16, m.n_heads, D, page_dtype):
                gaps.add("sparse_attention_paged")
            if step and N.store_gap(D, target("kv_fp8")):
                gaps.add("norm_rope_store")
            wo = m.wo_a
            G = m.o_groups
            if L.grouped_gap(bf16, wo.in_features, wo.out_features // G, wo.weight, wo.scale, wo.fmt):
                gaps.add("grouped_linear")
        elif isinstance(m, Indexer):
            if step and I.paged_gap(bf16, m.n_heads, m.head_dim, page_dtype):
                gaps.add("indexer_logits_paged")
        elif isinstance(m, MoE):
            if MO.route_gap(cfg.n_routed_experts, cfg.num_experts_per_tok):
                gaps.add("moe_route")
            e = m.experts
            if MO.experts_gap(cfg.hidden_size, bf16, e.w1, e.s1, e.s3, e.s2, e.fmt):
                gaps.add("moe_experts")
            if MO.shared_gap(e.inter, m._fused_shared()):
                gaps.add("moe_experts")
        elif isinstance(m, Linear) and m.fmt != "dense":
            if L.linear_gap(bf16, m.in_features, m.weight, m.scale, m.fmt):
                gaps.add("quant_linear")
    for kind, D in (("kv_fp8", cfg.head_dim), ("idx_fp8", cfg.index_head_dim)):
        if step and C.compress_gap(D, bf16, target(kind)):
            gaps.add("compress_store")
        if step and (D % 8 or cache.dtype != bf16):
            gaps.add("state_store")
    return tuple(sorted(gaps))


def reference_ops(model, cache=None, full: bool = False) -> tuple[str, ...]:
    """The ops `model` allows to run their references on CUDA (module doc); ("*",): all."""
    setting = getattr(model, "allow_reference", None)
    if setting is True:
        return ALL
    if setting is False:
        return ()
    if setting is not None:
        return tuple(setting)
    memo = model.__dict__.setdefault("_reference_ops_memo", {})
    key = (full, _cache_kind(cache))
    if key not in memo:
        gaps = kernel_gaps(model, cache)
        memo[key] = gaps if gaps == ALL else tuple(sorted(set(gaps) | set(FULL_FORWARD_OPS if full else ())))
    return memo[key]


def scoped(full: bool, cache_arg: Optional[int] = None):
    """Decorator of a V4Model entry point: on CUDA it runs inside ops.allow_reference(...) of the
    model's reference_ops (the cache is positional argument `cache_arg`, if any)."""

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(self, *args, **kwargs):
            if self.device.type != "cuda":
                return fn(self, *args, **kwargs)
            cache = None
            if cache_arg is not None:
                cache = args[cache_arg] if len(args) > cache_arg else kwargs.get("cache")
            names = reference_ops(self, cache, full)
            if not names:
                return fn(self, *args, **kwargs)
            with ops.allow_reference(*(() if names == ALL else names)):
                return fn(self, *args, **kwargs)

        return wrapper

    return deco
