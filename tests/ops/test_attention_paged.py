"""ops.sparse_attention_paged: reference semantics (CPU), validation, and the sm90 kernel (GPU).

GPU error bounds (kernel vs the fp32 reference on the same cache; stated, not tuned):
- bf16 out: |o - ref| <= 2^-7 * vmax + 2^-7 * |ref|, vmax = max |key value| of the cache
  (P is rounded to bf16 before the PV MMA: 2^-9 relative per weight, so at most
  2^-9 * vmax summed over the softmax; bf16 output rounding 2^-9 |ref|; the rest is margin).
  Also ||o - ref|| / ||ref|| < 4e-3.
- lse: |lse - ref| <= 1e-4 + 1e-5 * |ref| (fp32 logits, exp2/log2 in fp32).
- mxfp8 out: scale bytes within 1 of the reference's; dequantised values within
  eps_o * (1 + 2^-4) + 2^-4 * |ref| + 2^-10 * s of the reference fp32 output (eps_o: the
  bf16 bound above; half an e4m3 ulp; s the group scale), and NaN-free.
Every output element is written (outputs are poisoned through the caching allocator first),
slots out of range are skipped (never read), poisoned (NaN) pages are never touched.
"""
import math

import pytest
import torch

from deepfuse import _ext, ops
from deepfuse import kv_format as F
from deepfuse.ops import attention as A
from deepfuse.ops import cast as C
from deepfuse.ops.rope import rope_ref

FP8 = torch.float8_e4m3fn


# ----------------------------------------------------------------------------- helpers
def make_cache(P, ps, dtype, fill, gen, device="cpu", scale=1.0):
    """One-layer KV pages (poisoned), `fill` random distinct slots written by kv_store.
    -> (pages [P, page...], written slots (sorted), dequantised rows fp32 [P * ps, 512])."""
    pages = F.alloc_kv_pages(1, P, ps, dtype, device="cpu", poison=True)
    slots = torch.randperm(P * ps, generator=gen)[:fill]
    rows = (torch.randn(fill, 512, generator=gen) * scale).to(torch.bfloat16)
    ops.kv_store(pages, slots, rows)
    deq = ops.kv_dequant(pages)[0].reshape(P * ps, 512).float()
    data = pages.data[0]
    if device != "cpu":
        data = data.to(device)
    return data, slots.sort().values, deq


def pick(slots, n, gen):
    return slots[torch.randint(0, slots.numel(), (n,), generator=gen)]


def make_indices(T, K, G, slots, gen, holes=0.1, diverge=0.15, boundary=None):
    """[T, K] int32: each group of G consecutive rows starts from one list; rows diverge at some
    positions (other slots or -1), some holes (-1), duplicates (sampling with replacement),
    optional page-boundary slots."""
    out = torch.empty(T, K, dtype=torch.int32)
    for g0 in range(0, T, G):
        base = pick(slots, K, gen)
        if boundary is not None and K:
            nb = min(K, boundary.numel())
            base[torch.randperm(K, generator=gen)[:nb]] = boundary[torch.randperm(boundary.numel(), generator=gen)[:nb]]
        for r in range(g0, min(T, g0 + G)):
            row = base.clone()
            if r > g0:
                m = torch.rand(K, generator=gen) < diverge
                row[m] = pick(slots, int(m.sum()), gen)
            row[torch.rand(K, generator=gen) < holes] = -1
            out[r] = row
    return out


def naive(q, rows_list, sink, scale, cos=None, sin=None):
    """float64 loop reference: rows_list[t] = [n_t, D] key rows of query row t."""
    T, H, D = q.shape
    o = torch.zeros(T, H, D, dtype=torch.float64)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64)
    for t in range(T):
        r = rows_list[t].double()
        for h in range(H):
            if r.shape[0] == 0:
                continue
            lg = (r @ q[t, h].double()) * scale
            m = max(lg.max().item(), sink[h].item())
            p = torch.exp(lg - m)
            o[t, h] = (p @ r) / (p.sum() + math.exp(sink[h].item() - m))
            lse[t, h] = math.log(p.sum().item()) + m
    if cos is not None:
        o = rope_ref(o, cos.double(), sin.double(), True)
    return o, lse


def rows_of(deq, idx, lens):
    out = []
    for t in range(idx.shape[0]):
        n = idx.shape[1] if lens is None else min(int(lens[t]), idx.shape[1])
        s = idx[t, :n].long()
        out.append(deq[s[s >= 0]])
    return out


def rope_tables(T, pairs, gen):
    ang = torch.rand(T, pairs, generator=gen) * 6.28
    return torch.cos(ang), torch.sin(ang)


# ----------------------------------------------------------------------------- CPU: reference
@pytest.mark.parametrize("dtype", ["fp8", "bf16", "fp32"])
def test_reference_matches_naive(dtype):
    g = torch.Generator().manual_seed(1)
    T, H, ps = 6, 4, 16
    if dtype == "fp32":
        D = 40
        kv1 = torch.randn(5, ps, D, generator=g)
        kv2 = torch.randn(3, ps, D, generator=g)
        deq1, deq2 = kv1.reshape(-1, D), kv2.reshape(-1, D)
        s1, s2 = torch.arange(5 * ps), torch.arange(3 * ps)
    else:
        D = 512
        kv1, s1, deq1 = make_cache(5, ps, dtype, 60, g)
        kv2, s2, deq2 = make_cache(3, ps, dtype, 30, g)
    q = torch.randn(T, H, D, generator=g) * 0.3
    if dtype != "fp32":
        q = q.to(torch.bfloat16)
    idx1 = make_indices(T, 9, 2, s1, g)
    idx2 = make_indices(T, 13, 2, s2, g)
    idx1[1, 2] = idx1[1, 3] = int(s1[0])  # duplicates count twice
    len1 = torch.tensor([9, 0, 4, 9, 2, 7], dtype=torch.int32)
    len2 = torch.tensor([13, 5, 0, 1, 13, 11])
    idx1[4], idx2[4] = -1, -1  # row 4: no keys at all
    sink = torch.randn(H, generator=g)
    scale = 0.7 / math.sqrt(D)
    cos, sin = rope_tables(T, 8, g)
    o, lse = ops.sparse_attention_paged(q, kv1, ps, idx1, sink, scale, lengths=len1, extra_kv=kv2, extra_page_size=ps,
                                        extra_indices=idx2, extra_lengths=len2, inv_rope=(cos, sin))
    rl = [torch.cat([a, b]) for a, b in zip(rows_of(deq1, idx1, len1), rows_of(deq2, idx2, len2))]
    ro, rlse = naive(q.float(), rl, sink, scale, cos, sin)
    assert o.dtype == q.dtype and o.shape == (T, H, D)
    tol = 1e-5 if dtype == "fp32" else 1e-2
    torch.testing.assert_close(o.double(), ro.to(o.dtype).double(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), rlse, atol=1e-4, rtol=1e-5)
    assert bool((o[4] == 0).all()) and bool(torch.isinf(lse[4]).all()) and bool((lse[4] < 0).all())


def test_reference_sink_and_single_key():
    D, H = 16, 3
    kv = torch.randn(1, 16, D)
    q = torch.randn(1, H, D)
    sink = torch.tensor([0.0, 5.0, -30.0])
    idx = torch.tensor([[3, -1, -1]])
    o, lse = ops.sparse_attention_paged(q, kv, 16, idx, sink, 0.5)
    lg = 0.5 * (q[0] @ kv[0, 3])
    w = torch.exp(lg) / (torch.exp(lg) + torch.exp(sink))
    torch.testing.assert_close(o[0], w[:, None] * kv[0, 3][None], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse[0], lg, atol=1e-6, rtol=1e-6)


def test_reference_duplicates_and_order():
    D, H = 8, 2
    g = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 16, D, generator=g)
    q = torch.randn(1, H, D, generator=g)
    sink = torch.zeros(H)
    a = ops.sparse_attention_paged(q, kv, 16, torch.tensor([[5, 5, 9]]), sink, 1.0)[0]
    b = ops.sparse_attention_paged(q, kv, 16, torch.tensor([[9, 5, -1, 5]]), sink, 1.0)[0]
    # the same keys split over the two sources
    c = ops.sparse_attention_paged(q, kv, 16, torch.tensor([[5]]), sink, 1.0, extra_kv=kv, extra_page_size=16,
                                   extra_indices=torch.tensor([[9, 5]]))[0]
    single = ops.sparse_attention_paged(q, kv, 16, torch.tensor([[5, 9]]), sink, 1.0)[0]
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(a, single)


def test_reference_mxfp8_is_cast_of_fp32_output():
    g = torch.Generator().manual_seed(4)
    kv, slots, _ = make_cache(4, 16, "fp8", 50, g)
    T, H = 3, 2
    q = torch.randn(T, H, 512, generator=g)  # fp32 q: the "bf16" path returns fp32 o
    idx = make_indices(T, 20, 1, slots, g)
    sink = torch.randn(H, generator=g)
    cos, sin = rope_tables(T, 32, g)
    o, _ = ops.sparse_attention_paged(q, kv, 16, idx, sink, 0.05, inv_rope=(cos, sin))
    (q8, s8), lse = ops.sparse_attention_paged(q, kv, 16, idx, sink, 0.05, inv_rope=(cos, sin), out_format="mxfp8")
    r8, rs = ops.mxfp8_cast(o.reshape(T, H * 512))
    assert q8.dtype == FP8 and q8.shape == (T, H * 512) and s8.shape == (T, H * 16)
    assert torch.equal(q8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(s8, rs)


def test_reference_inv_rope_only_touches_tail():
    g = torch.Generator().manual_seed(5)
    kv = torch.randn(1, 16, 64, generator=g)
    q = torch.randn(2, 2, 64, generator=g)
    idx = torch.randint(0, 16, (2, 5), generator=g)
    cos, sin = rope_tables(2, 8, g)
    a, _ = ops.sparse_attention_paged(q, kv, 16, idx, torch.zeros(2), 0.2)
    b, _ = ops.sparse_attention_paged(q, kv, 16, idx, torch.zeros(2), 0.2, inv_rope=(cos, sin))
    torch.testing.assert_close(b[..., :48], a[..., :48])
    torch.testing.assert_close(b, rope_ref(a, cos, sin, True))


def test_plan_does_not_change_cpu_results():
    g = torch.Generator().manual_seed(6)
    kv, slots, _ = make_cache(4, 16, "bf16", 60, g)
    q = torch.randn(4, 64, 512, generator=g).to(torch.bfloat16)
    idx = make_indices(4, 30, 2, slots, g)
    sink = torch.randn(64, generator=g)
    plan = A.sparse_attention_plan(4, 64, 30, rows_per_request=2, share=True, device="cpu")
    assert plan == A.SparseAttentionPlan(2, 1)
    assert A.sparse_attention_plan(4, 64, 30, rows_per_request=2, device="cpu") == A.SparseAttentionPlan(1, 1)
    a = ops.sparse_attention_paged(q, kv, 16, idx, sink, 0.04)
    b = ops.sparse_attention_paged(q, kv, 16, idx, sink, 0.04, plan=plan)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ----------------------------------------------------------------------------- CPU: validation
def _args(**over):
    g = torch.Generator().manual_seed(7)
    kv, slots, _ = make_cache(2, 16, "fp8", 20, g)
    a = dict(q=torch.randn(2, 64, 512).to(torch.bfloat16), kv=kv, kv_page_size=16,
             indices=pick(slots, 6, g).view(2, 3).int(), sink=torch.zeros(64), scale=0.1)
    a.update(over)
    return a


def _call(a, **kw):
    a = dict(a)
    return ops.sparse_attention_paged(a.pop("q"), a.pop("kv"), a.pop("kv_page_size"), a.pop("indices"), a.pop("sink"),
                                      a.pop("scale"), **a, **kw)


@pytest.mark.parametrize("over,kw,err,match", [
    (dict(q=torch.zeros(2, 64, 512, dtype=torch.int32)), {}, TypeError, "q"),
    (dict(q=torch.zeros(2, 64, 256, dtype=torch.bfloat16)), {}, ValueError, "512"),
    (dict(kv_page_size=8), {}, ValueError, "kv"),
    (dict(kv=torch.zeros(2, 16 * 584 + 1, dtype=torch.uint8)), {}, ValueError, "kv"),
    (dict(kv=torch.zeros(2, 16 * 584, dtype=torch.int16)), {}, TypeError, "kv"),
    (dict(indices=torch.zeros(3, 3, dtype=torch.int32)), {}, ValueError, "indices"),
    (dict(indices=torch.zeros(2, 3, dtype=torch.float32)), {}, TypeError, "indices"),
    (dict(indices=torch.tensor([[0, 1, 32], [0, 0, 0]], dtype=torch.int32)), {}, ValueError, "slots >= 32"),
    (dict(sink=torch.zeros(63)), {}, ValueError, "sink"),
    ({}, dict(lengths=torch.zeros(3, dtype=torch.int32)), ValueError, "lengths"),
    ({}, dict(extra_indices=torch.zeros(2, 1, dtype=torch.int32)), ValueError, "extra_kv"),
    ({}, dict(out_format="fp8"), ValueError, "out_format"),
    ({}, dict(inv_rope=(torch.zeros(2, 300), torch.zeros(2, 300))), ValueError, "inv_rope"),
    ({}, dict(inv_rope=(torch.zeros(2, 32), torch.zeros(2, 16))), ValueError, "inv_rope"),
    ({}, dict(plan=(1, 2)), TypeError, "plan"),
])
def test_validation(over, kw, err, match):
    with pytest.raises(err, match=match):
        _call(_args(**over), **kw)


def test_validation_slots_past_lengths_are_ignored_on_cpu():
    a = _args()
    a["indices"][0, 2] = 999
    o, _ = _call(a, lengths=torch.tensor([2, 3], dtype=torch.int32))
    assert torch.isfinite(o.float()).all()
    with pytest.raises(ValueError, match="extra_indices"):
        _call(_args(), extra_kv=a["kv"], extra_page_size=16, extra_indices=torch.tensor([[40], [0]]))


def test_plan_validation():
    with pytest.raises(ValueError, match="rows_per_request"):
        A.sparse_attention_plan(4, 64, 100, rows_per_request=3, share=True)
    with pytest.raises(ValueError, match="rows_per_request"):
        A.sparse_attention_plan(4, 64, 100, rows_per_request=5)
    with pytest.raises(ValueError, match="rows_per_request"):
        A.sparse_attention_plan(4, 128, 100, rows_per_request=8, share=True)
    assert A.sparse_attention_plan(6, 64, 100, rows_per_request=3).group_rows == 1


# ----------------------------------------------------------------------------- CPU: the C++ launcher's checks
needs_ext = pytest.mark.skipif(not _ext.has_cuda_kernels(), reason="needs the compiled extension")
BF16 = torch.bfloat16


def _launch_args(T=2, H=64, K=3, mx=False, splits=1, device="cpu"):
    """Valid keyword arguments of _C.sparse_attention_paged (two FP8 sources, RoPE tables)."""
    a = dict(q=torch.zeros(T, H, 512, dtype=BF16), kv=torch.zeros(2, 16 * 584, dtype=torch.uint8),
             indices=torch.zeros(T, K, dtype=torch.int32), lengths=torch.full((T,), K, dtype=torch.int32),
             extra_kv=torch.zeros(3, 32 * 584, dtype=torch.uint8), extra_indices=torch.zeros(T, 5, dtype=torch.int64),
             extra_lengths=None, sink=torch.zeros(H), scale=0.1, cos=torch.zeros(T, 32), sin=torch.zeros(T, 32),
             out=torch.empty(T, H * 512, dtype=FP8) if mx else torch.empty(T, H, 512, dtype=BF16),
             out_scale=torch.empty(T, H * 16, dtype=torch.uint8) if mx else None, lse=torch.empty(T, H),
             group_rows=1, splits=splits)
    if splits > 1:
        a.update(ws_o=torch.empty(splits, T, H, 512), ws_ml=torch.empty(splits, T, H, 2))
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in a.items()}


@needs_ext
@pytest.mark.parametrize("change,match", [
    (dict(q=torch.zeros(2, 64, 512)), r"argument 'q' must be bfloat16 \(got float32\[2, 64, 512\] on cpu\)"),
    (dict(q=torch.zeros(2, 64, 256, dtype=BF16)), "argument 'q' must have size 512 in dim 2"),
    (dict(q=torch.zeros(2, 32, 512, dtype=BF16)), "argument 'q' must have 64 or 128 heads"),
    (dict(q=torch.zeros(2, 64, 1024, dtype=BF16)[..., ::2]), "argument 'q' must have stride 1 in its last dim"),
    (dict(kv=torch.zeros(2, 16 * 584, dtype=torch.int16)), "argument 'kv' must be uint8 or bfloat16"),
    (dict(kv=torch.zeros(2, 16 * 584 + 1, dtype=torch.uint8)), "argument 'kv' must be FP8 pages"),
    (dict(kv=torch.zeros(2, 8 * 584, dtype=torch.uint8)), "page_size a multiple of 16"),
    (dict(kv=torch.zeros(2, 16, 256, dtype=BF16)), r"argument 'kv' must have shape \[\*, \*, 512\]"),
    (dict(kv=torch.zeros(2, 16, 512, dtype=BF16).transpose(0, 1)), "argument 'kv' must be contiguous"),
    (dict(indices=torch.zeros(2, 3)), "argument 'indices' must be int32 or int64"),
    (dict(indices=torch.zeros(3, 3, dtype=torch.int32)), r"argument 'indices' must have shape \[2, \*\]"),
    (dict(lengths=torch.zeros(3, dtype=torch.int32)), r"argument 'lengths' must have shape \[2\]"),
    (dict(extra_lengths=torch.zeros(2)), "argument 'extra_lengths' must be int32 or int64"),
    (dict(extra_indices=None), "argument 'extra_indices' is required"),
    (dict(extra_kv=None), "argument 'extra_indices' must be None without extra_kv"),
    (dict(sink=torch.zeros(63)), r"argument 'sink' must have shape \[64\]"),
    (dict(sink=torch.zeros(64, dtype=BF16)), "argument 'sink' must be float32"),
    (dict(cos=torch.zeros(2, 300), sin=torch.zeros(2, 300)), "argument 'cos' must have at most 256 columns"),
    (dict(sin=torch.zeros(2, 16)), r"argument 'sin' must have shape \[2, 32\]"),
    (dict(cos=None), "argument 'sin' must be None without cos"),
    (dict(out=torch.empty(2, 64, 512)), "argument 'out' must be bfloat16 or float8_e4m3fn"),
    (dict(out=torch.empty(2, 64, 256, dtype=BF16)), r"argument 'out' must have shape \[2, 64, 512\]"),
    (dict(out=torch.empty(2, 64 * 512, dtype=FP8)), "argument 'out_scale' is required"),
    (dict(out_scale=torch.empty(2, 64 * 16, dtype=torch.uint8)), "argument 'out_scale' must be None"),
    (dict(lse=torch.empty(2, 32)), r"argument 'lse' must have shape \[2, 64\]"),
    (dict(group_rows=3), "argument 'group_rows' must be 1, 2 or 4"),
    (dict(splits=0), r"argument 'splits' must be in \[1, 65535\]"),
    (dict(splits=2), "argument 'ws_o' is required"),
    (dict(splits=2, ws_o=torch.empty(2, 2, 64, 512), ws_ml=torch.empty(2, 2, 64, 3)),
     r"argument 'ws_ml' must have shape \[2, 2, 64, 2\]"),
    (dict(), "argument 'q' must be a CUDA tensor"),
])
def test_launcher_rejects_dtype_shape_and_device(change, match):
    """_C.sparse_attention_paged checks every tensor (behind the op's Python checks) before any
    launch; dtype and shape errors come before the device check, so a CPU call reaches them."""
    with pytest.raises(ValueError, match=match):
        _ext._C.sparse_attention_paged(**{**_launch_args(), **change})


@needs_ext
def test_launcher_valid_arguments_reach_the_device_check():
    for kw in (dict(mx=True), dict(splits=3), dict(H=128, T=5, K=0)):
        with pytest.raises(ValueError, match="argument 'q' must be a CUDA tensor"):
            _ext._C.sparse_attention_paged(**_launch_args(**kw))
    with pytest.raises(TypeError):  # keywords only
        _ext._C.sparse_attention_paged(*_launch_args().values())


@needs_ext
@pytest.mark.parametrize("change,match", [
    (dict(group_rows=3), "argument 'group_rows' must be 1, 2 or 4"),
    (dict(T=-1), "argument 'T' must be in"),
    (dict(H=0), "argument 'H' must be in"),
    (dict(K_total=-5), "argument 'K_total' must be in"),
])
def test_plan_launcher_rejects_arguments(change, match):
    with pytest.raises(ValueError, match=match):
        _ext._C.sparse_attention_plan(**{**dict(T=4, H=64, K_total=100, group_rows=1, device=0), **change})


# ----------------------------------------------------------------------------- GPU
def _run_case(H, G, T, K1, K2, dtypes=("fp8", "fp8"), lens=True, rope=True, out_format="bf16", splits=0, seed=0,
              oob=False, ps=(64, 16), idx64=False, q_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    P1 = max(4, (K1 * 2) // ps[0] + 3)
    kv1, s1, deq1 = make_cache(P1, ps[0], dtypes[0], min(P1 * ps[0] - 8, max(K1 * 2, 8)), gen, "cuda")
    bnd1 = s1[(s1 % ps[0] == 0) | (s1 % ps[0] == ps[0] - 1)]
    idx1 = make_indices(T, K1, G, s1, gen, boundary=bnd1)
    srcs = [(kv1, ps[0], idx1, deq1)]
    if K2 is not None:
        P2 = max(4, (K2 * 2) // ps[1] + 3)
        kv2, s2, deq2 = make_cache(P2, ps[1], dtypes[1], min(P2 * ps[1] - 8, max(K2 * 2, 8)), gen, "cuda")
        bnd2 = s2[(s2 % ps[1] == 0) | (s2 % ps[1] == ps[1] - 1)]
        srcs.append((kv2, ps[1], make_indices(T, K2, G, s2, gen, boundary=bnd2), deq2))
    lensl = []
    for (_, _, idx, _) in srcs:
        K = idx.shape[1]
        if lens:
            ln = torch.randint(0, K + 1, (T,), generator=gen).int()
            ln[::3] = K
            lensl.append(ln)
        else:
            lensl.append(None)
    q = (torch.randn(T, H, 512, generator=gen) * q_scale).to(torch.bfloat16)
    sink = torch.randn(H, generator=gen)
    scale = 1.0 / math.sqrt(512)
    inv = rope_tables(T, 32, gen) if rope else None
    # reference on the CPU (the dequantised rows are exactly what the kernel sees)
    ref_idx = [s[2] for s in srcs]
    gpu_idx = [s[2].clone() for s in srcs]
    if oob:  # slots past the cache, inside lengths: the kernel skips them; the reference sees -1
        for gi, ri, (kv, pss, _, _) in zip(gpu_idx, ref_idx, srcs):
            n = (kv.shape[0]) * pss
            m = torch.rand(gi.shape, generator=gen) < 0.05
            gi[m] = n + torch.randint(0, 1 << 20, (int(m.sum()),), generator=gen).int()
            gi[m & (torch.rand(gi.shape, generator=gen) < 0.3)] = 2**31 - 1
            ri[m] = -1
    kwr = dict(lengths=lensl[0], inv_rope=inv, out_format=out_format)
    kwg = dict(lengths=lensl[0].cuda() if lensl[0] is not None else None,
               inv_rope=(inv[0].cuda(), inv[1].cuda()) if inv else None, out_format=out_format)
    if len(srcs) > 1:
        kwr.update(extra_kv=srcs[1][0].cpu(), extra_page_size=ps[1], extra_indices=ref_idx[1], extra_lengths=lensl[1])
        kwg.update(extra_kv=srcs[1][0], extra_page_size=ps[1], extra_indices=gpu_idx[1].cuda(),
                   extra_lengths=lensl[1].cuda() if lensl[1] is not None else None)
        if idx64:
            kwg["extra_indices"] = kwg["extra_indices"].long()
    g_idx0 = gpu_idx[0].cuda().long() if idx64 else gpu_idx[0].cuda()
    plan = A.SparseAttentionPlan(G, splits) if splits else A.sparse_attention_plan(T, H, K1 + (K2 or 0),
                                                                                    rows_per_request=G, share=True)
    # reference in fp32 (q as fp32 so the "bf16" path returns fp32 o)
    ro, rlse = ops.sparse_attention_paged(q.float(), kv1.cpu(), ps[0], ref_idx[0], sink, scale,
                                          **{**kwr, "out_format": "bf16"})
    # poison the blocks the caching allocator will hand out for the outputs (0xFF: NaN in
    # bf16, e4m3 and fp32; scale byte 255)
    sizes = [T * H * 4, T * H * 512 * (2 if out_format == "bf16" else 1), T * H * 16]
    junk = [torch.full((max(1, n),), 0xFF, dtype=torch.uint8, device="cuda") for n in sizes]
    del junk
    out, lse = ops.sparse_attention_paged(q.cuda(), kv1, ps[0], g_idx0, sink.cuda(), scale, plan=plan, **kwg)
    torch.cuda.synchronize()
    vmax = max(float(s[3].abs().nan_to_num(0).max()) for s in srcs) if T else 1.0
    lse = lse.cpu()
    assert torch.isfinite(lse).logical_or(torch.isneginf(lse)).all(), "lse NaN"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rlse)), "empty rows"
    fin = torch.isfinite(rlse)
    assert bool(((lse[fin] - rlse[fin]).abs() <= 1e-4 + 1e-5 * rlse[fin].abs()).all()), \
        f"lse err {(lse[fin] - rlse[fin]).abs().max()}"
    eps = 2.0**-7 * vmax + 2.0**-7 * ro.abs()
    if out_format == "bf16":
        o = out.cpu().float()
        assert not torch.isnan(o).any(), "unwritten or NaN output"
        err = (o - ro).abs()
        assert bool((err <= eps).all()), f"max err {err.max()} (bound {eps.flatten()[err.argmax()]})"
        if ro.norm() > 0:
            assert float((o - ro).norm() / ro.norm()) < 4e-3
    else:
        q8, s8 = out
        q8, s8 = q8.cpu(), s8.cpu()
        _, rs = ops.mxfp8_cast(ro.reshape(T, H * 512))
        assert int((s8.int() - rs.int()).abs().max()) <= 1, "scale bytes"
        deq = C.mxfp8_dequant(q8, s8, torch.float32).view(T, H, 512)
        assert not torch.isnan(deq).any()
        s_full = C._expand(torch.exp2(s8.float() - 127), 32, H * 512).view(T, H, 512)
        bnd = eps * (1 + 2.0**-4) + 2.0**-4 * ro.abs() + 2.0**-10 * s_full
        err = (deq - ro).abs()
        assert bool((err <= bnd).all()), f"max err {err.max()}"


@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("G", [1, 2, 4])
@pytest.mark.parametrize("out_format", ["bf16", "mxfp8"])
def test_gpu_decode_csa_shape(H, G, out_format):
    if G * H // 64 > 8:
        pytest.skip("cluster > 8")
    _run_case(H, G, 4 * G, 128, 512, out_format=out_format, seed=H + G)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    dict(H=64, G=2, T=7, K1=129, K2=300),                                       # partial last group
    dict(H=64, G=1, T=3, K1=128, K2=None, lens=False, rope=False),              # window only
    dict(H=128, G=2, T=4, K1=40, K2=70, dtypes=("bf16", "fp8")),                 # mixed sources
    dict(H=64, G=4, T=8, K1=33, K2=31, dtypes=("bf16", "bf16"), rope=False),
    dict(H=64, G=2, T=6, K1=128, K2=2048, splits=1),                            # one split, long
    dict(H=128, G=1, T=2, K1=128, K2=4096, splits=37),                          # many splits
    dict(H=64, G=2, T=2, K1=128, K2=1024, oob=True, idx64=True),                # skipped slots
    dict(H=64, G=1, T=1, K1=5, K2=0),                                           # tiny, empty extra
    dict(H=128, G=4, T=16, K1=128, K2=512, out_format="mxfp8", splits=3, q_scale=4.0),
    dict(H=64, G=1, T=300, K1=128, K2=512, ps=(16, 64)),                        # prefill-like
])
def test_gpu_cases(case):
    _run_case(**case, seed=len(str(case)))


@pytest.mark.gpu
def test_gpu_outside_the_kernel_runs_the_reference():
    """H not 64 / 128, a non-bf16 q or fp32 pages: the call raises unless the reference is
    allowed (ops.allow_reference: the tiny model's 4 heads, fp32 test models); allowed, the
    reference runs on the GPU and matches the CPU path."""
    g = torch.Generator().manual_seed(9)
    kv, slots, _ = make_cache(2, 16, "fp8", 20, g, "cuda")
    idx = pick(slots, 6, g).view(2, 3).int().cuda()
    for q, src in ((torch.randn(2, 32, 512).to(torch.bfloat16), kv), (torch.randn(2, 64, 512), kv),
                   (torch.randn(2, 64, 512).to(torch.bfloat16), torch.randn(2, 16, 512))):
        H = q.shape[1]
        sink = torch.randn(H)
        src = src.cuda()
        with pytest.raises(ops.NoKernelError, match="sparse_attention_paged: (q|kv)"):
            ops.sparse_attention_paged(q.cuda(), src, 16, idx, sink.cuda(), 0.1)
        with ops.allow_reference("sparse_attention_paged"):
            out, lse = ops.sparse_attention_paged(q.cuda(), src, 16, idx, sink.cuda(), 0.1)
        ref, rlse = ops.sparse_attention_paged(q, src.cpu(), 16, idx.cpu(), sink, 0.1)
        torch.testing.assert_close(out.cpu(), ref, rtol=2e-2, atol=2e-3)
        torch.testing.assert_close(lse.cpu(), rlse, rtol=1e-4, atol=1e-4)
    q = torch.randn(2, 64, 512, device="cuda").bfloat16()
    out, lse = ops.sparse_attention_paged(q[:0], kv, 16, idx[:0], torch.zeros(64, device="cuda"), 0.1)
    assert out.shape == (0, 64, 512) and lse.shape == (0, 64)


@pytest.mark.gpu
def test_gpu_cuda_graph():
    gen = torch.Generator().manual_seed(10)
    T, H, G = 4, 64, 2
    kv1, s1, deq1 = make_cache(8, 64, "fp8", 400, gen, "cuda")
    kv2, s2, deq2 = make_cache(40, 16, "fp8", 600, gen, "cuda")
    q = torch.empty(T, H, 512, dtype=torch.bfloat16, device="cuda")
    i1 = torch.empty(T, 128, dtype=torch.int32, device="cuda")
    i2 = torch.empty(T, 512, dtype=torch.int32, device="cuda")
    sink = torch.randn(H, generator=gen).cuda()
    plan = A.sparse_attention_plan(T, H, 640, rows_per_request=G, share=True)
    assert plan.num_splits > 1  # exercises the workspace and the combine inside the graph

    def fill(seed):
        g2 = torch.Generator().manual_seed(seed)
        qq = torch.randn(T, H, 512, generator=g2).to(torch.bfloat16)
        a, b = make_indices(T, 128, G, s1, g2), make_indices(T, 512, G, s2, g2)
        q.copy_(qq), i1.copy_(a), i2.copy_(b)
        return qq, a, b

    def call():
        return ops.sparse_attention_paged(q, kv1, 64, i1, sink, 0.05, extra_kv=kv2, extra_page_size=16,
                                          extra_indices=i2, plan=plan)

    fill(1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = call()
    qq, a, b = fill(2)
    graph.replay()
    torch.cuda.synchronize()
    ro, rl = ops.sparse_attention_paged(qq.float(), kv1.cpu(), 64, a, sink.cpu(), 0.05, extra_kv=kv2.cpu(),
                                        extra_page_size=16, extra_indices=b)
    vmax = max(float(deq1.abs().nan_to_num(0).max()), float(deq2.abs().nan_to_num(0).max()))
    assert bool(((out.cpu().float() - ro).abs() <= 2.0**-7 * (vmax + ro.abs())).all())
    torch.testing.assert_close(lse.cpu(), rl, atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
def test_gpu_launcher_rejects_mixed_devices():
    a = _launch_args(device="cuda")
    with pytest.raises(ValueError, match="argument 'sink' must be a CUDA tensor"):
        _ext._C.sparse_attention_paged(**{**a, "sink": a["sink"].cpu()})
    with pytest.raises(ValueError, match="argument 'extra_indices' must be a CUDA tensor"):
        _ext._C.sparse_attention_paged(**{**a, "extra_indices": a["extra_indices"].cpu()})
    for kw in (dict(), dict(mx=True, splits=2)):
        _ext._C.sparse_attention_paged(**_launch_args(device="cuda", **kw))  # the same arguments on one device run
    torch.cuda.synchronize()
    pl = _ext._C.sparse_attention_plan(T=4, H=64, K_total=640, group_rows=2, device=torch.cuda.current_device())
    assert set(pl) == {"group_rows", "splits", "ctas", "blocks"} and pl["group_rows"] == 2 and pl["blocks"] == 20


@pytest.mark.gpu
def test_gpu_opcheck():
    gen = torch.Generator().manual_seed(12)
    kv, slots, _ = make_cache(4, 16, "fp8", 50, gen, "cuda")
    q = torch.randn(2, 64, 512, generator=gen).to(torch.bfloat16).cuda()
    idx = make_indices(2, 40, 2, slots, gen).cuda()
    args = (q, kv, 16, idx, torch.zeros(64, device="cuda"), 0.05, None, None, 0, None, None, None, None, "bf16", 2, 0)
    torch.library.opcheck(torch.ops.deepfuse.sparse_attention_paged.default, args,
                          test_utils=("test_schema", "test_faketensor"))


# ----------------------------------------------------------------------------- sanitizer cases
@pytest.mark.sanitize
@pytest.mark.parametrize("case", [
    dict(H=64, G=2, T=4, K1=40, K2=70, splits=2, oob=True),
    dict(H=128, G=2, T=3, K1=33, K2=20, dtypes=("bf16", "fp8"), out_format="mxfp8"),
    dict(H=64, G=1, T=2, K1=64, K2=None, splits=1),
])
def test_sanitize(case):
    _run_case(**case, seed=3)
