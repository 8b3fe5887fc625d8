"""Sparse multi-query attention with a per-head sink: V4's core attention.

Semantics (the reference defines them): one shared K = V head. For query (b, s, h), the
keys are the rows kv[b, j] for the j in indices[b, s, :] with j >= 0 (-1 = empty slot;
duplicates count twice). In fp32:
    l_j = scale * q[b, s, h] . kv[b, j]
    m   = max(max_j l_j, sink[h])
    p_j = exp(l_j - m) / (sum_j exp(l_j - m) + exp(sink[h] - m))
    o   = sum_j p_j kv[b, j]                      (cast to q.dtype)
The sink only enlarges the denominator; a query whose slots are all empty gets o = 0.
q: [B, S, H, D], kv: [B, N, D], indices: [B, S, K] int32/int64 in [-1, N), sink: [H] fp32.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from deepfuse import _ext
from deepfuse import kv_format as _KVF
from deepfuse.ops._checks import check_choice, check_int, check_tensor
from deepfuse.ops._fallback import need_reference
from deepfuse.ops._registry import op

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def sparse_attention_ref(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                         scale: float) -> torch.Tensor:
    B, S, H, D = q.shape
    K = indices.shape[-1]
    out = torch.zeros(B, S, H, D, dtype=q.dtype, device=q.device)
    if K == 0 or S == 0:
        return out
    sinkf = sink.float().view(1, 1, H)
    # Bound the gathered [B, chunk, K, D] block (this reference also runs on the GPU).
    chunk = max(1, (1 << 24) // max(1, B * K * (D + H)))
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        idx = indices[:, s0:s1].long()
        valid = idx >= 0
        rows = kv.gather(1, idx.clamp(min=0).reshape(B, -1, 1).expand(-1, -1, D)).view(B, s1 - s0, K, D).float()
        logits = torch.einsum("bshd,bskd->bshk", q[:, s0:s1].float(), rows) * scale
        logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
        m = torch.maximum(logits.amax(-1), sinkf)
        p = torch.exp(logits - m.unsqueeze(-1))
        denom = p.sum(-1) + torch.exp(sinkf - m)
        out[:, s0:s1] = torch.einsum("bshk,bskd->bshd", p / denom.unsqueeze(-1), rows).to(q.dtype)
    return out


@op("sparse_attention")
def _sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                      scale: float) -> torch.Tensor:
    return sparse_attention_ref(q, kv, indices, sink, scale)


# No kernel: the full-sequence form (dense kv rows) is the model's oracle path; the engine's
# step runs sparse_attention_paged. On CUDA it runs the reference only where allowed (ops._fallback).
@_sparse_attention.register_kernel("cuda")
def _(q, kv, indices, sink, scale):
    need_reference("sparse_attention", "kv as dense rows (the full-sequence form; the kernel is "
                   "sparse_attention_paged's)")
    return sparse_attention_ref(q, kv, indices, sink, scale)


@_sparse_attention.register_fake
def _(q, kv, indices, sink, scale):
    return torch.empty_like(q)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of q [B, S, H, D] over the rows of kv [B, N, D] named by indices [B, S, K]."""
    op = "sparse_attention"
    check_tensor(op, "q", q, dtypes=_FLOATS, ndim=4)
    B, S, H, D = q.shape
    check_tensor(op, "kv", kv, dtypes=(q.dtype,), ndim=3, device=q.device)
    if kv.shape[0] != B or kv.shape[2] != D:
        raise ValueError(f"deepfuse: {op}: kv must have shape [{B}, N, {D}], got {list(kv.shape)}")
    check_tensor(op, "indices", indices, dtypes=(torch.int32, torch.int64), ndim=3, device=q.device)
    if tuple(indices.shape[:2]) != (B, S):
        raise ValueError(f"deepfuse: {op}: indices must have shape [{B}, {S}, K], got {list(indices.shape)}")
    check_tensor(op, "sink", sink, dtypes=(torch.float32,), shape=(H,), device=q.device)
    return torch.ops.deepfuse.sparse_attention(q, kv, indices, sink, float(scale))


# ----------------------------------------------------------------------------- paged sources
# sparse_attention_paged: the same attention reading paged KV caches (kv_format.py) directly.
#
# Each query row t (T rows, e.g. one per token of a flat engine batch) names its keys by slot
# ids (page * page_size + row) into up to two sources: `kv` (the window: ring pages) with
# indices [T, K1], and `extra_kv` (compressed rows) with extra_indices [T, K2]. Only
# indices[t, :lengths[t]] count (lengths None: all K); slot -1 (any negative) is skipped;
# duplicates count twice. A source is FP8 uint8 [P, page_size * 584] (KV_ROW_BYTES rows, the
# serving format; D = 512) or dense float [P, page_size, D] (bf16 on the GPU; the CPU path
# also takes fp32 / fp16 and any D, for the engine's lossless "auto" caches). Keys are the
# dequantised rows (fp32 math). Softmax over the keys of both sources with the sink in the
# denominator only; lse [T, H] fp32 = log sum_j exp(l_j) over the keys (no sink; -inf for a
# row without keys, whose output is 0). inv_rope = (cos, sin) [T, R/2] fp32 applies the
# inverse RoPE to the last R dims of o (ops.rope's convention) before the output cast.
# out_format "bf16": o in q's dtype [T, H, D]; "mxfp8": mxfp8_cast(o as [T, H * D]) computed
# from the fp32 result -> (e4m3 [T, H * D], UE8M0 uint8 [T, H * D / 32]).
_OUT_FORMATS = ("bf16", "mxfp8")


def _source_rows(src: torch.Tensor, page_size: int, slots: torch.Tensor, D: int) -> torch.Tensor:
    """fp32 rows [*slots.shape, D] of a paged source (slots already clamped to valid)."""
    flat = slots.reshape(-1)
    if src.dtype == torch.uint8:
        from deepfuse.ops.kvcache import kv_dequantise_rows

        pages = src.view(src.shape[0], -1)
        page, row = flat // page_size, flat % page_size
        data = pages[:, :page_size * _KVF.KV_DATA_BYTES].view(src.shape[0], page_size, _KVF.KV_DATA_BYTES)
        scales = pages[:, page_size * _KVF.KV_DATA_BYTES:page_size * _KVF.KV_ROW_BYTES].view(
            src.shape[0], page_size, _KVF.KV_SCALE_BYTES)
        rows = kv_dequantise_rows(data[page, row], scales[page, row]).float()
    else:
        rows = src.reshape(-1, D)[flat].float()
    return rows.view(*slots.shape, D)


def sparse_attention_paged_ref(q, kv, kv_page_size: int, indices, sink, scale: float, lengths, extra_kv,
                               extra_page_size: int, extra_indices, extra_lengths, cos, sin, out_format: str):
    T, H, D = q.shape
    srcs = [(kv, kv_page_size, indices, lengths)]
    if extra_kv is not None:
        srcs.append((extra_kv, extra_page_size, extra_indices, extra_lengths))
    K = sum(s[2].shape[1] for s in srcs)
    o = torch.zeros(T, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    sinkf = sink.float().view(1, H)
    chunk = max(1, (1 << 24) // max(1, K * (D + H)))
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        rows, valid = [], []
        for src, ps, idx, lens in srcs:
            ix = idx[t0:t1].long()
            ok = ix >= 0
            if lens is not None:
                ok &= torch.arange(ix.shape[1], device=ix.device) < lens[t0:t1].long().unsqueeze(1)
            rows.append(_source_rows(src, ps, torch.where(ok, ix, 0), D))
            valid.append(ok)
        r, v = torch.cat(rows, 1), torch.cat(valid, 1)  # [t, K, D], [t, K]
        # skipped slots read row 0 (clamped), which may hold anything (a poisoned page): zero it
        r = torch.where(v.unsqueeze(-1), r, r.new_zeros(()))
        logits = torch.einsum("thd,tkd->thk", q[t0:t1].float(), r) * scale
        logits = logits.masked_fill(~v.unsqueeze(1), float("-inf"))
        m = torch.maximum(logits.amax(-1), sinkf)
        p = torch.exp(logits - m.unsqueeze(-1))
        s = p.sum(-1)
        o[t0:t1] = torch.einsum("thk,tkd->thd", p / (s + torch.exp(sinkf - m)).unsqueeze(-1), r)
        lse[t0:t1] = torch.where(s > 0, torch.log(s) + m, torch.full_like(s, float("-inf")))
    if cos is not None:
        from deepfuse.ops.rope import rope_ref

        o = rope_ref(o, cos, sin, True)
    if out_format == "mxfp8":
        from deepfuse.ops.cast import mxfp8_cast

        q8, s8 = mxfp8_cast(o.reshape(T, H * D))
        return q8, s8, lse
    return o.to(q.dtype), o.new_empty(0, dtype=torch.uint8), lse


@op("sparse_attention_paged",
    "(Tensor q, Tensor kv, int kv_page_size, Tensor indices, Tensor sink, float scale, Tensor? lengths, "
    "Tensor? extra_kv, int extra_page_size, Tensor? extra_indices, Tensor? extra_lengths, Tensor? cos, "
    "Tensor? sin, str out_format, int rows_per_group=1, int num_splits=0) -> (Tensor, Tensor, Tensor)")
def _sparse_attention_paged(q, kv, kv_page_size, indices, sink, scale, lengths, extra_kv, extra_page_size,
                            extra_indices, extra_lengths, cos, sin, out_format, rows_per_group=1, num_splits=0):
    return sparse_attention_paged_ref(q, kv, kv_page_size, indices, sink, scale, lengths, extra_kv,
                                      extra_page_size, extra_indices, extra_lengths, cos, sin, out_format)


@_sparse_attention_paged.register_fake
def _(q, kv, kv_page_size, indices, sink, scale, lengths, extra_kv, extra_page_size, extra_indices,
      extra_lengths, cos, sin, out_format, rows_per_group=1, num_splits=0):
    T, H, D = q.shape
    lse = q.new_empty(T, H, dtype=torch.float32)
    if out_format == "mxfp8":
        return (q.new_empty(T, H * D, dtype=torch.float8_e4m3fn), q.new_empty(T, H * D // 32, dtype=torch.uint8), lse)
    return torch.empty_like(q), q.new_empty(0, dtype=torch.uint8), lse


# ----------------------------------------------------------------------------- CUDA path
# csrc/attention (sm90a): bf16 tensor-core MMAs over FP8-dequantised (or bf16) keys. A CTA
# owns 64 heads of one query row; the G = rows_per_group consecutive rows of a group (a
# request's 1 + draft rows) form a cluster that fetches and dequantises each key once for
# all of them wherever their slots agree at the same list position (other keys are fetched
# per row: always correct, shared only where the lists align). Split-KV over the SMs with a
# combine kernel when there are few CTAs; the epilogue (sink, inverse RoPE, bf16 or MXFP8)
# runs in the last kernel. Requirements: H in {64, 128}, D = 512, bf16 q, FP8 or bf16 pages;
# other inputs on CUDA run the reference only where allowed (ops._fallback), else raise.
_CUDA_H = (64, 128)
_CUDA_G = (1, 2, 4)
_CUDA_PAGES = (torch.uint8, torch.bfloat16)


def paged_gap(q_dtype: torch.dtype, H: int, D: int, kv_dtype: torch.dtype,
              extra_dtype: Optional[torch.dtype] = None) -> Optional[str]:
    """Why the CUDA kernel of sparse_attention_paged cannot serve these inputs (None: it can)."""
    if q_dtype != torch.bfloat16:
        return f"q has dtype {str(q_dtype)[6:]} (the kernel takes bfloat16)"
    if H not in _CUDA_H:
        return f"q has {H} heads (the kernel takes {' or '.join(map(str, _CUDA_H))})"
    if D != _KVF.KV_DIM:
        return f"q has head dim {D} (the kernel takes {_KVF.KV_DIM})"
    for name, dt in (("kv", kv_dtype), ("extra_kv", extra_dtype)):
        if dt is not None and dt not in _CUDA_PAGES:
            return f"{name} pages have dtype {str(dt)[6:]} (the kernel reads FP8 (uint8) or bfloat16 pages)"
    return None


@dataclass(frozen=True)
class SparseAttentionPlan:
    """Scheduling metadata of sparse_attention_paged for one step's shapes (host-only; reuse it
    for every layer). group_rows: consecutive query rows whose CTAs form one cluster that
    fetches and dequantises each shared key once (1: every row on its own); num_splits:
    split-KV parts (1: no combine pass). A plan never changes the result, only the schedule."""

    group_rows: int = 1
    num_splits: int = 1


def sparse_attention_plan(T: int, H: int, K: int, *, rows_per_request: int = 1, share: bool = False,
                          device: Optional[torch.device] = None) -> SparseAttentionPlan:
    """Plan for T query rows of H heads over K index columns in all (K = indices.shape[1] +
    extra_indices.shape[1]); rows_per_request: consecutive rows of one request (1 + draft).
    share=True groups a request's rows into one cluster (group_rows = rows_per_request), which
    fetches each key their lists hold at the same position once; measured on the H200
    (docs/notes/attention.md) this is still slower than share=False (group_rows = 1), the
    default, which also selects the warp-specialised wgmma kernel for FP8 pages (group_rows
    > 1 runs the mma.sync kernel). Host only: no device work, no sync. Without a CUDA device (or kernels) the
    plan has one split."""
    op = "sparse_attention_plan"
    check_int(op, "T", T, lo=0)
    check_int(op, "H", H, lo=1)
    check_int(op, "K", K, lo=0)
    check_choice(op, "rows_per_request", rows_per_request, (1, 2, 3, 4))
    G = rows_per_request if share else 1
    if G not in _CUDA_G:
        raise ValueError(f"deepfuse: {op}: share=True needs rows_per_request in {_CUDA_G}, got {rows_per_request}")
    if G * max(1, H // 64) > 8:
        raise ValueError(f"deepfuse: {op}: rows_per_request * H / 64 must be <= 8 with share=True, "
                         f"got {rows_per_request} x {H}")
    dev = torch.device(device) if device is not None else (torch.device("cuda") if torch.cuda.is_available() else None)
    if dev is None or dev.type != "cuda" or not _ext.has_cuda_kernels() or H not in _CUDA_H:
        return SparseAttentionPlan(G, 1)
    e = _ext.ext(dev)
    pl = e.sparse_attention_plan(T=int(T), H=int(H), K_total=int(K), group_rows=int(G), device=e.index)
    return SparseAttentionPlan(pl["group_rows"], pl["splits"])


def _check_cuda_source(op, name, src, ps):
    """The kernel reads the page size from the pages' shape: it must be the one passed."""
    if src.dtype not in _CUDA_PAGES:
        raise ValueError(f"deepfuse: {op}: {name} must be FP8 (uint8) or bf16 pages on CUDA, got {src.dtype}")
    fp8 = src.dtype == torch.uint8
    if src.shape[1:] != ((ps * _KVF.KV_ROW_BYTES,) if fp8 else (ps, _KVF.KV_DIM)):
        raise ValueError(f"deepfuse: {op}: {name} pages of {ps} rows must be "
                         f"{f'uint8 [P, {ps * _KVF.KV_ROW_BYTES}]' if fp8 else f'bf16 [P, {ps}, {_KVF.KV_DIM}]'}, "
                         f"got {list(src.shape)}")
    n = src.shape[0] * ps
    if n >= 2**31:
        raise ValueError(f"deepfuse: {op}: {name} has {n} slots; the CUDA kernel takes < 2^31")
    if src.data_ptr() % 16:
        raise ValueError(f"deepfuse: {op}: {name} must be 16-byte aligned")


@_sparse_attention_paged.register_kernel("cuda")
def _(q, kv, kv_page_size, indices, sink, scale, lengths, extra_kv, extra_page_size, extra_indices, extra_lengths,
      cos, sin, out_format, rows_per_group=1, num_splits=0):
    op = "sparse_attention_paged"
    T, H, D = q.shape
    why = paged_gap(q.dtype, H, D, kv.dtype, extra_kv.dtype if extra_kv is not None else None)
    if why is not None:
        need_reference(op, why)
        return sparse_attention_paged_ref(q, kv, kv_page_size, indices, sink, scale, lengths, extra_kv,
                                          extra_page_size, extra_indices, extra_lengths, cos, sin, out_format)
    if q.stride(2) != 1 or q.stride(0) % 8 or q.stride(1) % 8 or q.data_ptr() % 16:
        raise ValueError(f"deepfuse: {op}: q needs unit stride in D, 16-byte aligned rows on CUDA")
    if rows_per_group not in _CUDA_G or rows_per_group * (H // 64) > 8:
        raise ValueError(f"deepfuse: {op}: rows_per_group must be in {_CUDA_G} with rows_per_group * H / 64 <= 8, "
                         f"got {rows_per_group}")
    mx = out_format == "mxfp8"
    lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    if mx:
        out = torch.empty(T, H * D, dtype=torch.float8_e4m3fn, device=q.device)
        out_s = torch.empty(T, H * D // 32, dtype=torch.uint8, device=q.device)
    else:
        out = torch.empty(T, H, D, dtype=torch.bfloat16, device=q.device)
        out_s = q.new_empty(0, dtype=torch.uint8)
    if T == 0:
        return out, out_s, lse
    _check_cuda_source(op, "kv", kv, kv_page_size)
    K_all = indices.shape[1]
    if extra_kv is not None:
        _check_cuda_source(op, "extra_kv", extra_kv, extra_page_size)
        K_all += extra_indices.shape[1]
    splits = int(num_splits)
    if splits <= 0:
        G = int(rows_per_group)
        splits = sparse_attention_plan(T, H, K_all, rows_per_request=G, share=G > 1, device=q.device).num_splits
    splits = max(1, min(splits, max(1, -(-K_all // 32))))
    ws_o = ws_ml = None
    if splits > 1:
        n = splits * T * H * D
        ws = torch.empty(n + splits * T * H * 2, dtype=torch.float32, device=q.device)
        ws_o, ws_ml = ws[:n].view(splits, T, H, D), ws[n:].view(splits, T, H, 2)
    if cos is not None:
        cos, sin = cos.contiguous(), sin.contiguous()
    _ext.ext(q.device).sparse_attention_paged(
        q=q, kv=kv, indices=indices, lengths=lengths, extra_kv=extra_kv, extra_indices=extra_indices,
        extra_lengths=extra_lengths, sink=sink.contiguous(), scale=float(scale), cos=cos, sin=sin, out=out,
        out_scale=out_s if mx else None, lse=lse, group_rows=int(rows_per_group), splits=splits, ws_o=ws_o,
        ws_ml=ws_ml)
    return out, out_s, lse


def _check_source(op: str, name: str, src, ps, idx, lens, iname: str, lname: str, T: int, D: int, device) -> None:
    check_tensor(op, name, src, device=device)
    check_int(op, f"{name} page_size", ps, lo=1)
    if src.dtype == torch.uint8:
        if D != _KVF.KV_DIM:
            raise ValueError(f"deepfuse: {op}: an FP8 {name} holds {_KVF.KV_DIM}-dim rows, q has D = {D}")
        if src.dim() != 2 or src.shape[1] != ps * _KVF.KV_ROW_BYTES:
            raise ValueError(f"deepfuse: {op}: FP8 {name} must be uint8 [num_pages, {ps} * {_KVF.KV_ROW_BYTES}], "
                             f"got {list(src.shape)}")
        if ps % _KVF.PAGE_ALIGN_ROWS:
            raise ValueError(f"deepfuse: {op}: {name} page_size must be a multiple of 16 for FP8 pages, got {ps}")
    elif src.dtype in _FLOATS:
        if src.dim() != 3 or src.shape[1] != ps or src.shape[2] != D:
            raise ValueError(f"deepfuse: {op}: {name} must be [num_pages, {ps}, {D}], got {list(src.shape)}")
    else:
        raise TypeError(f"deepfuse: {op}: {name} must be uint8 (FP8 pages) or a float dtype, got {src.dtype}")
    if not src.is_contiguous():
        raise ValueError(f"deepfuse: {op}: {name} must be contiguous")
    check_tensor(op, iname, idx, dtypes=(torch.int32, torch.int64), ndim=2, device=device, contiguous=True)
    if idx.shape[0] != T:
        raise ValueError(f"deepfuse: {op}: {iname} must be [{T}, K], got {list(idx.shape)}")
    if lens is not None:
        check_tensor(op, lname, lens, dtypes=(torch.int32, torch.int64), shape=(T,), device=device, contiguous=True)
    if device.type == "cpu" and idx.numel():  # the kernel cannot look without a host sync; it skips
        n = src.shape[0] * ps
        ok = idx < 0
        if lens is not None:
            ok |= torch.arange(idx.shape[1]) >= lens.long().unsqueeze(1)
        bad = ~ok & (idx >= n)
        if bool(bad.any()):
            raise ValueError(f"deepfuse: {op}: {iname} has slots >= {n} (the {name} cache's {src.shape[0]} pages "
                             f"x {ps} rows), e.g. {int(idx[bad][0])}")


def sparse_attention_paged(q: torch.Tensor, kv: torch.Tensor, kv_page_size: int, indices: torch.Tensor,
                           sink: torch.Tensor, scale: float, *, lengths: Optional[torch.Tensor] = None,
                           extra_kv: Optional[torch.Tensor] = None, extra_page_size: int = 0,
                           extra_indices: Optional[torch.Tensor] = None, extra_lengths: Optional[torch.Tensor] = None,
                           inv_rope=None, out_format: str = "bf16", plan=None):
    """Attention of q [T, H, D] over paged KV slots (see the section doc above).

    -> (out, lse): out [T, H, D] in q's dtype ("bf16") or (e4m3 [T, H * D], UE8M0 [T, H * D / 32])
    ("mxfp8"); lse [T, H] fp32. `plan` (sparse_attention_plan(...)) is optional per-step scheduling
    metadata: it changes the CUDA kernel's schedule, never the result; the reference ignores it."""
    op = "sparse_attention_paged"
    check_tensor(op, "q", q, dtypes=_FLOATS, ndim=3)
    T, H, D = q.shape
    dev = q.device
    check_choice(op, "out_format", out_format, _OUT_FORMATS)
    _check_source(op, "kv", kv, kv_page_size, indices, lengths, "indices", "lengths", T, D, dev)
    if extra_kv is not None:
        if extra_indices is None:
            raise ValueError(f"deepfuse: {op}: extra_kv needs extra_indices")
        _check_source(op, "extra_kv", extra_kv, extra_page_size, extra_indices, extra_lengths, "extra_indices",
                      "extra_lengths", T, D, dev)
    elif extra_indices is not None or extra_lengths is not None:
        raise ValueError(f"deepfuse: {op}: extra_indices / extra_lengths given without extra_kv")
    check_tensor(op, "sink", sink, dtypes=(torch.float32,), shape=(H,), device=dev)
    cos = sin = None
    if inv_rope is not None:
        cos, sin = inv_rope
        check_tensor(op, "inv_rope cos", cos, dtypes=(torch.float32,), ndim=2, device=dev)
        check_tensor(op, "inv_rope sin", sin, dtypes=(torch.float32,), shape=tuple(cos.shape), device=dev)
        if cos.shape[0] != T or 2 * cos.shape[1] > D:
            raise ValueError(f"deepfuse: {op}: inv_rope tables must be [{T}, R/2] with R <= {D}, got {list(cos.shape)}")
    if out_format == "mxfp8" and (H * D) % 32:
        raise ValueError(f"deepfuse: {op}: mxfp8 output needs H * D % 32 == 0, got {H * D}")
    if plan is not None and not isinstance(plan, SparseAttentionPlan):
        raise TypeError(f"deepfuse: {op}: plan must come from sparse_attention_plan(...), got {type(plan).__name__}")
    G, splits = (plan.group_rows, plan.num_splits) if plan is not None else (1, 0)
    q8, s8, lse = torch.ops.deepfuse.sparse_attention_paged(
        q, kv, int(kv_page_size), indices, sink, float(scale), lengths, extra_kv, int(extra_page_size),
        extra_indices, extra_lengths, cos, sin, out_format, G, splits)
    return ((q8, s8) if out_format == "mxfp8" else q8), lse
