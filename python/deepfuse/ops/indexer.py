"""Lightning-indexer scores (V4 CSA layers).

Semantics (the reference defines them), in fp32:
    score[b, s, c] = sum_h weights[b, s, h] * relu(q[b, s, h] . k[b, c]) * scale
q: [B, S, H, Di], k: [B, C, Di] (compressed indexer keys), weights: [B, S, H] -> [B, S, C].
Causality (entry c visible to the query at position p iff c < (p + 1) // ratio) and the
top-k selection are applied by the caller.

indexer_logits_paged (the engine's step): the same scores of flat tokens q [N, H, Di] against
the keys of their requests in one layer's indexer key pages (kv_format: FP8 rows of 128 e4m3
+ fp32 scale, or dense [P, page_size, 128] rows): key e of token t is the row at slot
entry_slots[token_req[t], e] (slot < 0: a zero key), out [N, C] fp32 with -inf for
e >= n_vis[t]. CUDA (csrc/indexer, FP8 pages, H = 32 or 64, Di = 128, bf16 q; sm_90a: FP8
wgmma): q of each (token, head) gets a power-of-two scale s (amax / s in [128, 256)) and goes
to the tensor cores as e4m3: with q_fp8=False (default) as two terms of x = q / s, with
q_fp8=True as e4m3(x) alone (DeepGEMM's contract, twice the MMA rate; the reference then rounds
q the same way: quantize_q_e4m3). The two terms: H 64, x = hi + lo along K into one accumulator,
exact for |x| >= 2^-2 (each element of at least 2^-9 of its head's amax keeps its bf16 bits),
within 2^-10 s below (<= 2^-17 of the amax: far below the FP8 keys' rounding and the tensor
cores' accumulation); H 32, x = hi + lo / 16 as extra columns, exact for |x| >= 2^-6.
The key scale, ReLU and head weights are fused. The FP8 tensor cores sum the
products with a 13-bit mantissa (truncation), so the kernel matches the reference within
2^-9 * sum_h |w_h| sum_d |q_hd k_ed| * scale (tests/ops/test_rows_gpu.py), not to fp32 order.
Other archs: fp16 MMAs (H 64, q_fp8=False only).
Other inputs on CUDA (e.g. dense key pages of a bf16 / "auto" cache) and indexer_scores (no
kernel: the full-sequence form) run the reference only where allowed (ops._fallback), else raise.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from deepfuse import _ext
from deepfuse import kv_format as F
from deepfuse.ops._checks import check_tensor
from deepfuse.ops._fallback import kernels_off_reason, need_reference
from deepfuse.ops._registry import op

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def indexer_scores_ref(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    B, S, H, _ = q.shape
    C = k.shape[1]
    out = torch.empty(B, S, C, dtype=torch.float32, device=q.device)
    chunk = max(1, (1 << 24) // max(1, B * H * max(C, 1)))
    kf = k.float()
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        dots = torch.einsum("bshd,bcd->bshc", q[:, s0:s1].float(), kf)
        out[:, s0:s1] = (torch.relu(dots) * scale * weights[:, s0:s1].float().unsqueeze(-1)).sum(2)
    return out


@op("indexer_scores")
def _indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    return indexer_scores_ref(q, k, weights, scale)


@_indexer_scores.register_kernel("cuda")
def _(q, k, weights, scale):
    need_reference("indexer_scores", "k as dense rows (the full-sequence form; the kernel is "
                   "indexer_logits_paged's)")
    return indexer_scores_ref(q, k, weights, scale)


@_indexer_scores.register_fake
def _(q, k, weights, scale):
    return q.new_empty(q.shape[0], q.shape[1], k.shape[1], dtype=torch.float32)


def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Index scores [B, S, C] of queries q [B, S, H, Di] against keys k [B, C, Di]."""
    op = "indexer_scores"
    check_tensor(op, "q", q, dtypes=_FLOATS, ndim=4)
    B, S, H, Di = q.shape
    check_tensor(op, "k", k, dtypes=_FLOATS, ndim=3, device=q.device)
    if k.shape[0] != B or k.shape[2] != Di:
        raise ValueError(f"deepfuse: {op}: k must have shape [{B}, C, {Di}], got {list(k.shape)}")
    check_tensor(op, "weights", weights, dtypes=_FLOATS, shape=(B, S, H), device=q.device)
    return torch.ops.deepfuse.indexer_scores(q, k, weights, float(scale))


def _paged_keys(pages: torch.Tensor, page_size: int, slots: torch.Tensor) -> torch.Tensor:
    """fp32 keys [*slots.shape, Di] of one layer's pages (zeros for negative slots)."""
    valid = slots >= 0
    s = slots.clamp(min=0)
    if pages.dtype == torch.uint8:
        ik = F.IndexerKeyPages(F.IndexerKeyFormat(page_size, "fp8"), pages.unsqueeze(0))
        page, row = torch.div(s, page_size, rounding_mode="floor"), s.remainder(page_size)
        keys = ik.keys()[0][page, row].float() * ik.scales()[0][page, row].unsqueeze(-1)
    else:
        keys = pages.reshape(-1, pages.shape[-1])[s].float()
    return keys.masked_fill(~valid.unsqueeze(-1), 0.0)


def quantize_q_e4m3(q: torch.Tensor) -> torch.Tensor:
    """fp32 q as indexer_logits_paged(q_fp8=True) uses it: per row of the last dim a power-of-two
    scale s = 2^(E - 7) for amax in [2^E, 2^(E + 1)) (biased exponent clamped to >= 8), then
    e4m3(q / s) * s (round to nearest even)."""
    qf = q.float()
    amax = qf.abs().amax(-1, keepdim=True)
    eb = ((amax.view(torch.int32) >> 23) & 0xFF).clamp(min=8)
    inv = ((261 - eb) << 23).view(torch.float32)
    s = ((eb - 7) << 23).view(torch.float32)
    return (qf * inv).to(torch.float8_e4m3fn).float() * s


def indexer_logits_paged_ref(q, weights, pages, page_size: int, entry_slots, token_req, n_vis, scale: float,
                             q_fp8: bool = False):
    N, H, Di = q.shape
    if q_fp8:
        q = quantize_q_e4m3(q)
    C = entry_slots.shape[1]
    out = torch.empty(N, C, dtype=torch.float32, device=q.device)
    chunk = max(1, (1 << 24) // max(1, C * Di))
    for t0 in range(0, N, chunk):
        t1 = min(N, t0 + chunk)
        k = _paged_keys(pages, page_size, entry_slots[token_req[t0:t1]])
        out[t0:t1] = indexer_scores_ref(q[t0:t1, None], k, weights[t0:t1, None], scale)[:, 0]
    cols = torch.arange(C, device=q.device)
    return out.masked_fill(cols[None, :] >= n_vis[:, None].to(torch.int64), float("-inf"))


@op("indexer_logits_paged")
def _indexer_logits_paged(q: torch.Tensor, weights: torch.Tensor, pages: torch.Tensor, page_size: int,
                          entry_slots: torch.Tensor, token_req: torch.Tensor, n_vis: torch.Tensor,
                          scale: float, q_fp8: bool = False) -> torch.Tensor:
    return indexer_logits_paged_ref(q, weights, pages, page_size, entry_slots, token_req, n_vis, scale, q_fp8)


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def paged_gap(q_dtype: torch.dtype, H: int, Di: int, pages_dtype: torch.dtype) -> Optional[str]:
    """Why the CUDA kernel of indexer_logits_paged cannot serve these inputs (None: it can)."""
    if pages_dtype != torch.uint8:
        return (f"pages hold {str(pages_dtype)[6:]} keys (the kernel reads FP8 key pages: an engine "
                f"cache with kv_dtype='fp8')")
    if H not in (32, 64):
        return f"q has {H} index heads (the kernel takes 32 or 64)"
    if Di != F.IDX_DIM:
        return f"q has index head dim {Di} (the kernel takes {F.IDX_DIM})"
    if q_dtype != torch.bfloat16:
        return f"q has dtype {str(q_dtype)[6:]} (the kernel takes bfloat16)"
    return None


@_indexer_logits_paged.register_kernel("cuda")
def _(q, weights, pages, page_size, entry_slots, token_req, n_vis, scale, q_fp8=False):
    N, H, Di = q.shape
    why = kernels_off_reason() or paged_gap(q.dtype, H, Di, pages.dtype)
    if why is None and (H != 64 or q_fp8) and not _is_sm90(q.device.index if q.device.index is not None
                                                           else torch.cuda.current_device()):
        why = f"H {H} / q_fp8 {q_fp8} (the kernel for them is sm_90a's)"
    for name, t, dt in (("entry_slots", entry_slots, torch.int64), ("token_req", token_req, torch.int64),
                        ("n_vis", n_vis, torch.int32)):
        if why is None and t.dtype != dt:
            why = f"{name} has dtype {str(t.dtype)[6:]} (the kernel takes {str(dt)[6:]})"
    if why is not None:
        need_reference("indexer_logits_paged", why)
        return indexer_logits_paged_ref(q, weights, pages, page_size, entry_slots, token_req, n_vis, scale, q_fp8)
    C = entry_slots.shape[1]
    out = torch.empty(N, C, dtype=torch.float32, device=q.device)
    if N and C:
        qc, wc = q.contiguous(), weights.float().contiguous()
        if entry_slots.stride(1) != 1:
            entry_slots = entry_slots.contiguous()
        if pages.dim() != 2 or pages.shape[1] != page_size * F.IDX_ROW_BYTES:  # the kernel reads the page size
            raise ValueError(f"deepfuse: indexer_logits_paged: pages of {page_size} rows must be uint8 "
                             f"[P, {page_size * F.IDX_ROW_BYTES}], got {list(pages.shape)}")
        _ext.ext(q.device).indexer_logits_paged(
            q=qc, weights=wc, pages=pages, entry_slots=entry_slots, token_req=token_req.contiguous(),
            n_vis=n_vis.contiguous(), scale=float(scale), q_fp8=bool(q_fp8), out=out)
    return out


@_indexer_logits_paged.register_fake
def _(q, weights, pages, page_size, entry_slots, token_req, n_vis, scale, q_fp8=False):
    return q.new_empty(q.shape[0], entry_slots.shape[1], dtype=torch.float32)


def indexer_logits_paged(q: torch.Tensor, weights: torch.Tensor, pages: torch.Tensor, page_size: int,
                         entry_slots: torch.Tensor, token_req: torch.Tensor, n_vis: torch.Tensor,
                         scale: float = 1.0, *, q_fp8: bool = False) -> torch.Tensor:
    """Index scores [N, C] of flat tokens against their requests' paged keys (module doc).
    q [N, H, Di], weights [N, H]; pages: one layer's indexer key pages (uint8 [P, page_size *
    132] or [P, page_size, Di]); entry_slots int64 [B, C]; token_req int64 [N]; n_vis int32 [N].
    q_fp8: q rounded to e4m3 with a power-of-two scale per (token, head) (quantize_q_e4m3;
    DeepGEMM's fp8_paged_mqa_logits contract), which halves the kernel's tensor-core work."""
    op_name = "indexer_logits_paged"
    check_tensor(op_name, "q", q, dtypes=_FLOATS, ndim=3)
    N, H, Di = q.shape
    dev = q.device
    check_tensor(op_name, "weights", weights, dtypes=_FLOATS, shape=(N, H), device=dev)
    if pages.dtype == torch.uint8:
        if Di != F.IDX_DIM:
            raise ValueError(f"deepfuse: {op_name}: FP8 key pages hold {F.IDX_DIM}-dim keys, q has {Di}")
        check_tensor(op_name, "pages", pages, ndim=2, device=dev, contiguous=True)
        if pages.shape[1] != page_size * F.IDX_ROW_BYTES:
            raise ValueError(f"deepfuse: {op_name}: pages must be [P, {page_size} * {F.IDX_ROW_BYTES}], "
                             f"got {list(pages.shape)}")
    else:
        check_tensor(op_name, "pages", pages, dtypes=_FLOATS, shape=(pages.shape[0], page_size, Di), device=dev)
    check_tensor(op_name, "entry_slots", entry_slots, dtypes=(torch.int64,), ndim=2, device=dev)
    check_tensor(op_name, "token_req", token_req, dtypes=(torch.int64,), shape=(N,), device=dev)
    check_tensor(op_name, "n_vis", n_vis, dtypes=(torch.int32,), shape=(N,), device=dev)
    return torch.ops.deepfuse.indexer_logits_paged(q, weights, pages, int(page_size), entry_slots, token_req, n_vis,
                                                   float(scale), bool(q_fp8))
