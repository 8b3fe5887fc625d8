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
of csrc/norm; else the references.
"""
from __future__ import annotations

import torch

from deepfuse import _ext
from deepfuse.ops._checks import check_tensor
from deepfuse.ops._registry import op
from deepfuse.ops.kvcache import RowTarget, store_rows

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def compress_pool_ref(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(score.float(), dim=-2)
    return (kv.float() * p).sum(-2).to(kv.dtype).contiguous()


@op("compress_pool")
def _compress_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
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


def _bf16(*ts) -> bool:
    return all(t.dtype == torch.bfloat16 and t.stride(-1) == 1 for t in ts)


def _f32(*ts) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in ts)


@_compress_store.register_kernel("cuda")
def _(kv, score, state_kv, state_score, ape, src_fresh, src_state, src_is_fresh, src_valid, src_ape, overlap,
      norm_weight, eps, cos, sin, pages, kind, page_size, slots):
    target = RowTarget(pages, kind, page_size)
    nb, L = src_fresh.shape
    w = kv.shape[-1]
    D = w // 2 if overlap else w
    ok = (_ext.has_cuda_kernels() and _bf16(kv, score, state_kv, state_score) and _f32(ape, norm_weight, cos, sin)
          and kv.stride(0) == score.stride(0) and state_kv.stride(0) == state_score.stride(0)
          and D % 8 == 0 and D <= 512 and target.kernel_ok() and slots.dtype == torch.int64)
    if not ok:
        return _compress_store.reference(kv, score, state_kv, state_score, ape, src_fresh, src_state, src_is_fresh,
                                         src_valid, src_ape, overlap, norm_weight, eps, cos, sin, pages, kind,
                                         page_size, slots)
    rows = torch.empty(nb, D, dtype=kv.dtype, device=kv.device)
    if nb:
        idx = [t.contiguous() for t in (src_fresh, src_state, src_ape, src_is_fresh, src_valid)]
        _ext.ext(kv.device).compress_store(
            kv.data_ptr(), score.data_ptr(), kv.stride(0), state_kv.data_ptr(), state_score.data_ptr(),
            state_kv.stride(0), ape.data_ptr(), *(t.data_ptr() for t in idx), nb, L, ape.shape[0], D, bool(overlap),
            norm_weight.data_ptr(), float(eps), cos.data_ptr(), sin.data_ptr(), cos.shape[-1], rows.data_ptr(),
            *target.launch_args(), slots.contiguous().data_ptr(), _ext.stream(kv.device))
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
    ok = (_ext.has_cuda_kernels() and _bf16(kv, score, state_kv, state_score) and kv.stride(0) == score.stride(0)
          and state_kv.stride(0) == state_score.stride(0) and kv.shape[-1] % 8 == 0 and slots.dtype == torch.int64)
    if not ok:
        return _state_store.reference(kv, score, state_kv, state_score, slots)
    _ext.ext(kv.device).state_store(kv.data_ptr(), score.data_ptr(), kv.stride(0), kv.shape[0], kv.shape[-1],
                                    state_kv.data_ptr(), state_score.data_ptr(), state_kv.stride(0),
                                    slots.contiguous().data_ptr(), _ext.stream(kv.device))


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
