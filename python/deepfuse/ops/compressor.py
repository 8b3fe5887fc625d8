"""The V4 KV compressor: gated pooling, and its fused engine step.

Semantics (the references define them):
- compress_pool(kv, score) [*, L, D] -> [*, D]: per dimension, a softmax over the L rows of
  a block: out[..., j] = sum_l softmax_l(score[..., l, j]) * kv[..., l, j], in fp32, cast to
  kv.dtype. score already holds gate + positional bias; rows with score -inf get weight 0
  (V4's overlapping 4:1 blocks use that for the missing half of the first block).
- compress_store(...): one step's new compressed rows (models/compressor.py, engine/context.py
  CompressPlan). Row b pools L sources: source l is token src_fresh[b, l] of this step
  (kv / score [N, w]) if src_is_fresh[b, l], else row src_state[b, l] of the state rings;
  its logits are score + ape[src_ape[b, l]]; invalid sources (src_valid false) are left out.
  overlap (w = 2D, L = 2r): sources l < r contribute columns [0, D), the others [D, 2D). The
  pooled row (kv.dtype) is RMS-normalised with norm_weight, RoPE'd with cos/sin [nb, R/2]
  (each rounded to kv.dtype) and stored at slots [nb] of target; returns the rows [nb, D].
- state_store(kv, score, state_kv, state_score, slots): state row slots[t] gets kv[t] and
  score[t]; negative slots are not stored (the reference sends them to the last, trash row).

CUDA (csrc/compressor): bf16 kv / score / states, fp32 ape / norm weight / cos / sin, D <= 512
(D % 8 == 0): one warp per new row, the pooling (online softmax, fp32) and the row epilogue
of csrc/norm. Other inputs on CUDA, and compress_pool (no kernel: the full-sequence form), run
the references only where allowed (ops._fallback), else raise.
"""
from __future__ import annotations

from typing import Optional

import torch

from deepfuse import _ext
from deepfuse.ops._checks import check_tensor
from deepfuse.ops._fallback import kernels_off_reason, need_reference
from deepfuse.ops._registry import op
from deepfuse.ops.kvcache import RowTarget, store_rows

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def compress_pool_ref(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(score.float(), dim=-2)
    return (kv.float() * p).sum(-2).to(kv.dtype).contiguous()


@op("compress_pool")
def _compress_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    return compress_pool_ref(kv, score)


@_compress_pool.register_kernel("cuda")
def _(kv, score):
    need_reference("compress_pool", "kv as dense blocks (the full-sequence form; the kernel is compress_store's)")
    return compress_pool_ref(kv, score)


@_compress_pool.register_fake
def _(kv, score):
    return kv.new_empty(*kv.shape[:-2], kv.shape[-1])


def compress_rows_ref(kv, score, state_kv, state_score, ape, src_fresh, src_state, src_is_fresh, src_valid, src_ape,
                      overlap: bool, norm_weight, eps: float, cos, sin) -> torch.Tensor:
    from deepfuse.ops.norm import norm_rope_ref

    w = kv.shape[-1]
    D = w // 2 if overlap else w
    r = ape.shape[0]
    fresh = src_is_fresh.unsqueeze(-1)
    bk = torch.where(fresh, kv[src_fresh], state_kv[src_state])
    bs = torch.where(fresh, score[src_fresh], state_score[src_state]).float() + ape[src_ape]
    if overlap:
        bk = torch.cat([bk[:, :r, :D], bk[:, r:, D:]], dim=1)
        bs = torch.cat([bs[:, :r, :D], bs[:, r:, D:]], dim=1)
    valid = src_valid.unsqueeze(-1)
    pooled = compress_pool_ref(bk.masked_fill(~valid, 0), bs.masked_fill(~valid, float("-inf")))
    return norm_rope_ref(pooled, norm_weight, eps, cos, sin)


_CS_SCHEMA = ("(Tensor kv, Tensor score, Tensor state_kv, Tensor state_score, Tensor ape, Tensor src_fresh, "
              "Tensor src_state, Tensor src_is_fresh, Tensor src_valid, Tensor src_ape, bool overlap, "
              "Tensor norm_weight, float eps, Tensor cos, Tensor sin, Tensor(a!) pages, str kind, int page_size, "
              "Tensor slots) -> Tensor")


@op("compress_store", _CS_SCHEMA)
def _compress_store(kv, score, state_kv, state_score, ape, src_fresh, src_state, src_is_fresh, src_valid, src_ape,
                    overlap, norm_weight, eps, cos, sin, pages, kind, page_size, slots):
    rows = compress_rows_ref(kv, score, state_kv, state_score, ape, src_fresh, src_state, src_is_fresh, src_valid,
                             src_ape, overlap, norm_weight, eps, cos, sin)
    store_rows(RowTarget(pages, kind, page_size), rows, slots)
    return rows


def _streams_gap(kv, score, state_kv, state_score) -> Optional[str]:
    """Why the compressor kernels cannot read these rows and state rings (None: they can)."""
    for name, t in (("kv", kv), ("score", score), ("state_kv", state_kv), ("state_score", state_score)):
        if t.dtype != torch.bfloat16:
            return f"{name} has dtype {str(t.dtype)[6:]} (the kernel takes bfloat16)"
        if t.stride(-1) != 1:
            return f"{name} needs unit stride in its last dim (strides {t.stride()})"
    if kv.stride(0) != score.stride(0):
        return f"kv and score need one row stride, got {kv.stride(0)} and {score.stride(0)}"
    if state_kv.stride(0) != state_score.stride(0):
        return f"state_kv and state_score need one row stride, got {state_kv.stride(0)} and {state_score.stride(0)}"
    return None


def compress_gap(D: int, dtype: torch.dtype, target: RowTarget) -> Optional[str]:
    """Why compress_store's kernel cannot pool D-wide rows of `dtype` into target (None: it can)."""
    from deepfuse.ops.norm import store_gap

    if dtype != torch.bfloat16:
        return f"kv has dtype {str(dtype)[6:]} (the kernel takes bfloat16)"
    if D % 8 or D > 512:
        return f"the pooled rows are {D} wide (the kernel takes D % 8 == 0, D <= 512)"
    return store_gap(D, target)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


@_compress_store.register_kernel("cuda")
def _(kv, score, state_kv, state_score, ape, src_fresh, src_state, src_is_fresh, src_valid, src_ape, overlap,
      norm_weight, eps, cos, sin, pages, kind, page_size, slots):
    target = RowTarget(pages, kind, page_size)
    nb, L = src_fresh.shape
    w = kv.shape[-1]
    D = w // 2 if overlap else w
    why = (kernels_off_reason() or compress_gap(D, kv.dtype, target)
           or _streams_gap(kv, score, state_kv, state_score))
    if why is None and slots.dtype != torch.int64:
        why = f"slots has dtype {str(slots.dtype)[6:]} (the kernel takes int64)"
    if why is not None:
        need_reference("compress_store", why)
        return _compress_store.reference(kv, score, state_kv, state_score, ape, src_fresh, src_state, src_is_fresh,
                                         src_valid, src_ape, overlap, norm_weight, eps, cos, sin, pages, kind,
                                         page_size, slots)
    rows = torch.empty(nb, D, dtype=kv.dtype, device=kv.device)
    if nb:
        ape, norm_weight, cos, sin = _f32(ape), _f32(norm_weight), _f32(cos), _f32(sin)
        _ext.ext(kv.device).compress_store(
            kv=kv, score=score, state_kv=state_kv, state_score=state_score, ape=ape,
            src_fresh=src_fresh.contiguous(), src_state=src_state.contiguous(), src_ape=src_ape.contiguous(),
            src_is_fresh=src_is_fresh.contiguous(), src_valid=src_valid.contiguous(), overlap=bool(overlap),
            norm_weight=norm_weight, eps=float(eps), cos=cos, sin=sin, y=rows, store=target.kind,
            pages=target.pages, slots=slots.contiguous())
    return rows


@_compress_store.register_fake
def _(kv, score, state_kv, state_score, ape, src_fresh, src_state, src_is_fresh, src_valid, src_ape, overlap,
      norm_weight, eps, cos, sin, pages, kind, page_size, slots):
    w = kv.shape[-1]
    return kv.new_empty(src_fresh.shape[0], w // 2 if overlap else w)


@op("state_store", "(Tensor kv, Tensor score, Tensor(a!) state_kv, Tensor(b!) state_score, Tensor slots) -> ()")
def _state_store(kv, score, state_kv, state_score, slots):
    trash = state_kv.shape[0] - 1
    s = torch.where(slots >= 0, slots, trash)
    state_kv.index_copy_(0, s, kv.to(state_kv.dtype))
    state_score.index_copy_(0, s, score.to(state_score.dtype))


@_state_store.register_kernel("cuda")
def _(kv, score, state_kv, state_score, slots):
    why = kernels_off_reason() or _streams_gap(kv, score, state_kv, state_score)
    if why is None and kv.shape[-1] % 8:
        why = f"kv rows are {kv.shape[-1]} wide (the kernel takes a multiple of 8)"
    if why is None and slots.dtype != torch.int64:
        why = f"slots has dtype {str(slots.dtype)[6:]} (the kernel takes int64)"
    if why is not None:
        need_reference("state_store", why)
        return _state_store.reference(kv, score, state_kv, state_score, slots)
    _ext.ext(kv.device).state_store(kv=kv, score=score, state_kv=state_kv, state_score=state_score,
                                    slots=slots.contiguous())


@_state_store.register_fake
def _(kv, score, state_kv, state_score, slots):
    return None


# ----------------------------------------------------------------------------- public API
def compress_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Softmax-gated pooling of blocks: kv, score [*, L, D] -> [*, D]."""
    op_name = "compress_pool"
    check_tensor(op_name, "kv", kv, dtypes=_FLOATS)
    if kv.dim() < 2:
        raise ValueError(f"deepfuse: {op_name}: kv must be [*, L, D], got {list(kv.shape)}")
    check_tensor(op_name, "score", score, dtypes=_FLOATS, shape=tuple(kv.shape), device=kv.device)
    return torch.ops.deepfuse.compress_pool(kv, score)


def compress_store(kv, score, state_kv, state_score, ape, plan, norm_weight, eps: float, cos, sin,
                   target: RowTarget) -> torch.Tensor:
    """The compressor's new rows of a step (see module doc): plan is the step's CompressPlan
    (src_* [nb, L], blk_slot [nb]); kv, score [N, w]; state rings [S, w]; ape [r, w]."""
    op_name = "compress_store"
    check_tensor(op_name, "kv", kv, dtypes=_FLOATS, ndim=2)
    N, w = kv.shape
    dev = kv.device
    check_tensor(op_name, "score", score, dtypes=_FLOATS, shape=(N, w), device=dev)
    check_tensor(op_name, "state_kv", state_kv, dtypes=_FLOATS, ndim=2, device=dev)
    check_tensor(op_name, "state_score", state_score, dtypes=_FLOATS, shape=tuple(state_kv.shape), device=dev)
    if state_kv.shape[1] != w:
        raise ValueError(f"deepfuse: {op_name}: state_kv must be [S, {w}], got {list(state_kv.shape)}")
    check_tensor(op_name, "ape", ape, dtypes=_FLOATS, ndim=2, device=dev)
    r = ape.shape[0]
    overlap = bool(plan.overlap)
    if ape.shape[1] != w or (overlap and w % 2):
        raise ValueError(f"deepfuse: {op_name}: ape must be [r, {w}], got {list(ape.shape)}")
    nb = plan.blk_slot.shape[0]
    L = 2 * r if overlap else r
    for name in ("src_fresh", "src_state", "src_ape"):
        check_tensor(op_name, name, getattr(plan, name), dtypes=(torch.int64,), shape=(nb, L), device=dev)
    for name in ("src_is_fresh", "src_valid"):
        check_tensor(op_name, name, getattr(plan, name), dtypes=(torch.bool,), shape=(nb, L), device=dev)
    D = w // 2 if overlap else w
    check_tensor(op_name, "norm_weight", norm_weight, dtypes=_FLOATS, shape=(D,), device=dev)
    check_tensor(op_name, "cos", cos, dtypes=(torch.float32,), ndim=2, device=dev)
    check_tensor(op_name, "sin", sin, dtypes=(torch.float32,), shape=tuple(cos.shape), device=dev)
    if cos.shape[0] != nb or 2 * cos.shape[1] > D:
        raise ValueError(f"deepfuse: {op_name}: cos must be [{nb}, <= {D // 2}], got {list(cos.shape)}")
    if not isinstance(target, RowTarget):
        raise TypeError(f"deepfuse: {op_name}: target must be an ops.kvcache.RowTarget, got {type(target).__name__}")
    target.check(op_name, D, dev)
    check_tensor(op_name, "blk_slot", plan.blk_slot, dtypes=(torch.int64,), shape=(nb,), device=dev)
    return torch.ops.deepfuse.compress_store(kv, score, state_kv, state_score, ape, plan.src_fresh, plan.src_state,
                                             plan.src_is_fresh, plan.src_valid, plan.src_ape, overlap, norm_weight,
                                             float(eps), cos, sin, target.pages, target.kind,
                                             int(target.page_size), plan.blk_slot)


def state_store(kv: torch.Tensor, score: torch.Tensor, state_kv: torch.Tensor, state_score: torch.Tensor,
                slots: torch.Tensor) -> None:
    """State rings: row slots[t] (>= 0) of state_kv / state_score [S, w] gets kv[t] / score[t] ([N, w])."""
    op_name = "state_store"
    check_tensor(op_name, "kv", kv, dtypes=_FLOATS, ndim=2)
    N, w = kv.shape
    check_tensor(op_name, "score", score, dtypes=_FLOATS, shape=(N, w), device=kv.device)
    check_tensor(op_name, "state_kv", state_kv, dtypes=_FLOATS, ndim=2, device=kv.device)
    check_tensor(op_name, "state_score", state_score, dtypes=_FLOATS, shape=tuple(state_kv.shape), device=kv.device)
    if state_kv.shape[1] != w:
        raise ValueError(f"deepfuse: {op_name}: state_kv must be [S, {w}], got {list(state_kv.shape)}")
    check_tensor(op_name, "slots", slots, dtypes=(torch.int64,), shape=(N,), device=kv.device)
    torch.ops.deepfuse.state_store(kv, score, state_kv, state_score, slots)
