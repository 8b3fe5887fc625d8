"""The V4 layer's row kernels (csrc/norm, csrc/compressor, csrc/indexer) and the top-k slot
output against their references: rms_norm, rope, norm_rope, the fused norm + RoPE + cache
store, the compressor step, the paged indexer logits and topk_slots. Fresh random inputs,
poisoned caches (every byte of every page checked)."""
import pytest
import torch

from deepfuse import kv_format as F
from deepfuse import ops
from deepfuse.ops.compressor import compress_rows_ref
from deepfuse.ops.indexer import indexer_logits_paged_ref
from deepfuse.ops.kvcache import RowTarget
from deepfuse.ops.norm import norm_rope_ref, rms_norm_ref
from deepfuse.ops.rope import rope_ref

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16_ULP = 2.0 ** -7  # relative spacing of bf16


def _g(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def _randn(*shape, g, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


def _cos_sin(n, half, g):
    a = torch.rand(n, half, generator=g, device=DEV) * 6.3
    return a.cos().contiguous(), a.sin().contiguous()


def _close_bf16(out, ref, ulps):
    """|out - ref| <= ulps bf16 ulps of |ref| (+ the same of the row's rms for values near 0)."""
    o, r = out.float(), ref.float()
    tol = ulps * BF16_ULP * (r.abs() + r.square().mean(-1, keepdim=True).sqrt() * 2 ** -6)
    bad = (o - r).abs() > tol
    assert not bad.any(), f"{bad.sum().item()} of {bad.numel()} values off; max err {(o - r).abs().max().item()}"


@pytest.mark.parametrize("D", [64, 128, 512, 1024, 4096])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm(D, weighted):
    g = _g(D)
    x = _randn(37, D, g=g, scale=3.0)
    w = torch.rand(D, generator=g, device=DEV) + 0.5 if weighted else None
    out = ops.rms_norm(x, w, 1e-6)
    # rsqrt and the sum order differ from torch's: one rounding of the bf16 result apart
    _close_bf16(out, rms_norm_ref(x, w, 1e-6), 1)


@pytest.mark.parametrize("shape", [(29, 512), (7, 64, 512), (5, 64, 128)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope(shape, inverse):
    g = _g(len(shape))
    x = _randn(*shape, g=g)
    cos, sin = _cos_sin(shape[0], 32, g)
    out = ops.rope(x, cos, sin, inverse=inverse)
    ref = rope_ref(x, cos, sin, inverse)
    assert torch.equal(out[..., :-64], x[..., :-64])
    _close_bf16(out, ref, 1)  # fma contraction order only


def test_norm_rope_is_rms_norm_then_rope():
    g = _g(3)
    x = _randn(11, 64, 512, g=g, scale=2.0)
    cos, sin = _cos_sin(11, 32, g)
    fused = ops.norm_rope(x, None, 1e-6, cos, sin)
    assert torch.equal(fused, ops.rope(ops.rms_norm(x, None, 1e-6), cos, sin))  # same device code: bit-exact
    _close_bf16(fused, norm_rope_ref(x, None, 1e-6, cos, sin), 2)


def _poisoned_pages(P, row_bytes, ps, g):
    return torch.randint(0, 256, (P, ps * row_bytes), generator=g, device=DEV, dtype=torch.uint8)


def _slots(N, P, ps, g, holes=True):
    s = torch.randperm(P * ps, generator=g, device=DEV)[:N]
    if holes:
        s[::5] = -1
    return s.to(torch.int64)


@pytest.mark.parametrize("kind", ["kv_fp8", "idx_fp8", "idx_fp8_ue8m0", "dense"])
def test_norm_rope_store_writes_what_the_separate_ops_write(kind):
    g = _g(hash(kind) % 1000)
    D = 128 if kind.startswith("idx") else 512
    N, P, ps = 45, 6, 16
    x = _randn(N, D, g=g, scale=4.0)
    w = torch.rand(D, generator=g, device=DEV) + 0.5
    cos, sin = _cos_sin(N, 32, g)
    slots = _slots(N, P, ps, g)
    if kind == "dense":
        pages = _randn(P, ps, D, g=g)
    else:
        pages = _poisoned_pages(P, F.KV_ROW_BYTES if kind == "kv_fp8" else F.IDX_ROW_BYTES, ps, g)
    sep = pages.clone()
    y = ops.norm_rope_store(x, w, 1e-6, cos, sin, RowTarget(pages, kind, ps), slots)
    rows = ops.rope(ops.rms_norm(x, w, 1e-6), cos, sin)
    assert torch.equal(y, rows)
    if kind == "kv_fp8":
        ops.kv_store(F.KVPages(F.KVFormat(ps, "fp8"), sep.unsqueeze(0)), slots, rows)
    elif kind == "dense":
        ok = slots >= 0
        sep.view(-1, D)[slots[ok]] = rows[ok]
    else:
        fmt = F.IndexerKeyFormat(ps, "fp8", "fp32" if kind == "idx_fp8" else "ue8m0")
        ops.indexer_key_store(F.IndexerKeyPages(fmt, sep.unsqueeze(0)), slots, rows)
    assert torch.equal(pages, sep)  # every byte: stored rows identical, untouched rows still poisoned


def _plan(nb, r, overlap, N, S, g):
    """Random CompressPlan-like sources: [nb, L] indices into this step's N rows / S state rows."""
    from types import SimpleNamespace

    L = 2 * r if overlap else r
    fresh = torch.rand(nb, L, generator=g, device=DEV) < 0.5
    valid = torch.rand(nb, L, generator=g, device=DEV) < 0.9
    valid[:, -1] = True  # every row has a source
    return SimpleNamespace(
        overlap=overlap, src_is_fresh=fresh, src_valid=valid,
        src_fresh=torch.randint(0, N, (nb, L), generator=g, device=DEV),
        src_state=torch.randint(0, S, (nb, L), generator=g, device=DEV),
        src_ape=torch.randint(0, r, (nb, L), generator=g, device=DEV))


@pytest.mark.parametrize("kind,D,r,overlap", [("kv_fp8", 512, 4, True), ("kv_fp8", 512, 128, False),
                                              ("idx_fp8", 128, 4, True), ("dense", 512, 4, True),
                                              ("dense", 64, 128, False)])
def test_compress_store(kind, D, r, overlap):
    g = _g(D + r)
    w = 2 * D if overlap else D
    N, S, nb, P, ps = 40, 30, 23, 4, 16
    kv, score = _randn(N, w, g=g), _randn(N, w, g=g, scale=2.0)
    skv, ssc = _randn(S, w, g=g), _randn(S, w, g=g, scale=2.0)
    ape = torch.randn(r, w, generator=g, device=DEV)
    plan = _plan(nb, r, overlap, N, S, g)
    plan.blk_slot = _slots(nb, P, ps, g)
    nw = torch.rand(D, generator=g, device=DEV) + 0.5
    cos, sin = _cos_sin(nb, 32, g)
    if kind == "dense":
        pages = _randn(P, ps, D, g=g)
    else:
        pages = _poisoned_pages(P, F.KV_ROW_BYTES if kind == "kv_fp8" else F.IDX_ROW_BYTES, ps, g)
    before = pages.clone()
    rows = ops.compress_store(kv, score, skv, ssc, ape, plan, nw, 1e-6, cos, sin, RowTarget(pages, kind, ps))
    ref = compress_rows_ref(kv, score, skv, ssc, ape, plan.src_fresh, plan.src_state, plan.src_is_fresh,
                            plan.src_valid, plan.src_ape, overlap, nw, 1e-6, cos, sin)
    # pooled rows may round to the neighbouring bf16 (fp32 softmax orders differ), then norm + RoPE
    _close_bf16(rows, ref, 3)
    # the stored bytes are the store op's of the kernel's own rows; untouched rows keep their poison
    exp = before.clone()
    t = RowTarget(exp, kind, ps)
    from deepfuse.ops.kvcache import store_rows

    ok = plan.blk_slot >= 0
    store_rows(t, rows[ok], plan.blk_slot[ok])
    assert torch.equal(pages, exp)


def test_state_store():
    g = _g(5)
    N, S, w = 50, 64, 1024
    kv, score = _randn(N, w, g=g), _randn(N, w, g=g)
    skv, ssc = _randn(S, w, g=g), _randn(S, w, g=g)
    slots = torch.randperm(S - 1, generator=g, device=DEV)[:N].to(torch.int64)
    slots[::7] = -1
    ek, es = skv.clone(), ssc.clone()
    ops.state_store(kv, score, skv, ssc, slots)
    ok = slots >= 0
    ek[slots[ok]], es[slots[ok]] = kv[ok], score[ok]
    assert torch.equal(skv[:-1], ek[:-1]) and torch.equal(ssc[:-1], es[:-1])  # the last row is the trash row


def test_row_launchers_reject_mixed_devices():
    from deepfuse import _ext

    x = torch.zeros(4, 64, dtype=torch.bfloat16, device=DEV)
    cos, sin = torch.ones(4, 16), torch.zeros(4, 16, device=DEV)
    with pytest.raises(ValueError, match="norm_rope: argument 'cos' must be a CUDA tensor"):
        _ext._C.norm_rope(x=x, y=torch.empty_like(x), norm=True, cos=cos, sin=sin)
    kv = torch.zeros(4, 64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="state_store: argument 'slots' must be a CUDA tensor"):
        _ext._C.state_store(kv=kv, score=kv, state_kv=kv.clone(), state_score=kv.clone(),
                            slots=torch.zeros(4, dtype=torch.int64))


def _idx_pages(n_keys, ps, g):
    P = n_keys // ps + 3
    pages = torch.zeros(P, ps * F.IDX_ROW_BYTES, dtype=torch.uint8, device=DEV)
    ops.indexer_key_store(F.IndexerKeyPages(F.IndexerKeyFormat(ps, "fp8"), pages.unsqueeze(0)),
                          torch.arange(P * ps, device=DEV), _randn(P * ps, 128, g=g, scale=1.5))
    return pages


def _indexer_absref(q, wts, pages, ps, entry, token_req, scale):
    """scale * s_e * sum_h |w_h| sum_d |q_hd code_ed| (the FP8 tensor cores' error scale)."""
    from deepfuse.ops.indexer import _paged_keys

    N, C = token_req.shape[0], entry.shape[1]
    out = torch.empty(N, C, dtype=torch.float32, device=q.device)
    step = max(1, (1 << 26) // max(1, C * q.shape[1]))  # tokens per chunk: [step, H, C] fp32 at most 256 MB
    for t0 in range(0, N, step):
        t1 = min(N, t0 + step)
        k = _paged_keys(pages, ps, entry[token_req[t0:t1]])  # [n, C, Di] fp32 (code * s_e)
        out[t0:t1] = torch.einsum("nhd,ncd->nhc", q[t0:t1].float().abs(), k.abs()).mul(
            wts[t0:t1].abs()[:, :, None]).sum(1) * scale
    return out


def _entries(pages, ps, B, C, g, order):
    """entry_slots [B, C]: "random" slots, "paged" (the engine's lists: each request's pages in
    random order, the rows of a page in order), "offset" (paged, shifted by 5 rows: runs of rows
    that cross pages)."""
    if order == "random":
        return torch.randperm(pages.shape[0] * ps, generator=g, device=DEV)[: B * C].view(B, C).to(torch.int64)
    off = 5 if order == "offset" else 0
    npp = (C + off + ps - 1) // ps
    pg = torch.stack([torch.randperm(pages.shape[0], generator=g, device=DEV)[:npp] for _ in range(B)])
    e = torch.arange(C, device=DEV) + off
    return (pg[:, e // ps] * ps + e % ps).to(torch.int64)


def _check_indexer(token_req, n_vis, B, C, g, ps=64, H=64, q_fp8=False, order="random"):
    """indexer_logits_paged against its reference: |out - ref| <= 2^-9 * absref + 1e-6 * max|ref|
    (the FP8 tensor cores keep 13 mantissa bits per accumulation; with q_fp8=False the second q
    term makes q exact to 2^-6 of its head's scale, far below that); -inf exactly past n_vis; every
    element written (the launcher into a NaN-poisoned out gives the same bits); and bit for bit
    against the same rows run one per CTA (entry_slots expanded to one row per token: a launch
    of single tokens), so no grouping of tokens changes a bit."""
    N = token_req.shape[0]
    pages = _idx_pages(B * C + 5 * B + ps * B, ps, g)
    entry = _entries(pages, ps, B, C, g, order)
    entry[:, -3:] = -1
    entry[0, 1] = -1
    q = _randn(N, H, 128, g=g)
    wts = torch.randn(N, H, generator=g, device=DEV) * 0.125
    sc = 128 ** -0.5
    out = ops.indexer_logits_paged(q, wts, pages, ps, entry, token_req, n_vis, sc, q_fp8=q_fp8)
    ref = indexer_logits_paged_ref(q, wts, pages, ps, entry, token_req, n_vis, sc, q_fp8)
    vis = torch.arange(C, device=DEV)[None, :] < n_vis[:, None]
    assert torch.isinf(out[~vis]).all() and (out[~vis] < 0).all()
    if vis.any():
        absref = _indexer_absref(q, wts, pages, ps, entry, token_req, sc)
        err = (out - ref).abs()[vis]
        tol = 2.0 ** -9 * absref[vis] + 1e-6 * ref[vis].abs().max()
        ratio = (err / absref[vis].clamp_min(1e-30)).max().item()
        print(f"indexer H {H} q_fp8 {q_fp8}: max err / absref {ratio:.3g}, max err {err.max().item():.3g}")
        assert (err <= tol).all(), f"{(err > tol).sum().item()} values off; max err / absref {ratio}"
    poisoned = torch.full_like(out, float("nan"))
    from deepfuse import _ext

    _ext._C.indexer_logits_paged(q=q, weights=wts.float(), pages=pages, entry_slots=entry, token_req=token_req,
                                 n_vis=n_vis, scale=sc, q_fp8=q_fp8, out=poisoned)
    assert torch.equal(out, poisoned), "an element the op's output has is not written into a poisoned out"
    single = ops.indexer_logits_paged(q, wts, pages, ps, entry[token_req].contiguous(),
                                      torch.arange(N, device=DEV), n_vis, sc, q_fp8=q_fp8)
    assert torch.equal(out, single), f"{(out != single).sum().item()} values differ from one token per CTA"
    return out


@pytest.mark.parametrize("order", ["random", "paged"])
@pytest.mark.parametrize("H,q_fp8", [(64, False), (64, True), (32, False), (32, True)])
@pytest.mark.parametrize("N,B,C", [(1, 1, 300), (9, 3, 2048), (64, 64, 700), (5, 2, 16400)])
def test_indexer_logits_paged(N, B, C, H, q_fp8, order):
    g = _g(N * 7 + C)
    token_req = torch.randint(0, B, (N,), generator=g, device=DEV)
    token_req[0] = 0
    n_vis = torch.randint(0, C + 1, (N,), generator=g, device=DEV).to(torch.int32)
    n_vis[0] = C
    out = _check_indexer(token_req, n_vis, B, C, g, H=H, q_fp8=q_fp8, order=order)
    assert out[0, 1].item() == 0.0  # a slot-less entry scores 0


@pytest.mark.parametrize("order", ["random", "paged"])
@pytest.mark.parametrize("H,q_fp8", [(64, False), (64, True), (32, False), (32, True)])
@pytest.mark.parametrize("next_n", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("B,C", [(1, 8192), (7, 700), (33, 2049)])
def test_indexer_logits_paged_drafts(next_n, B, C, H, q_fp8, order):
    """Decode with drafts: next_n consecutive tokens per request (tokens per CTA 1..4), the
    drafts seeing up to one more entry each, some requests with nothing visible."""
    g = _g(next_n * 1000 + B + C)
    token_req = torch.arange(B, device=DEV).repeat_interleave(next_n)
    base = torch.randint(0, C - next_n + 1, (B,), generator=g, device=DEV)
    base[0] = C - next_n + 1
    step = torch.randint(0, 2, (B, next_n), generator=g, device=DEV).cumsum(1) - 1
    n_vis = (base[:, None] + step).clamp(min=0).flatten().to(torch.int32)
    if B > 2:
        n_vis[next_n:2 * next_n] = 0
    _check_indexer(token_req, n_vis, B, C, g, H=H, q_fp8=q_fp8, order=order)


@pytest.mark.parametrize("case", ["prefill", "chunks", "shuffled", "tail"])
def test_indexer_logits_paged_mixed_groups(case):
    """Groups of tokens that do not share a request or their n_vis: causal prefill of one
    request (n_vis grows per token), chunks of different lengths (groups span requests), tokens
    of requests in random order, and an odd N (a short last group)."""
    g = _g(len(case))
    C = 1500
    if case == "prefill":
        B, N = 1, 301
        token_req = torch.zeros(N, dtype=torch.int64, device=DEV)
        n_vis = ((torch.arange(N, device=DEV) + 700) // 2).clamp(max=C).to(torch.int32)
    elif case == "chunks":
        lens = [5, 1, 1, 7, 2, 3, 1, 9]
        B = len(lens)
        token_req = torch.repeat_interleave(torch.arange(B, device=DEV), torch.tensor(lens, device=DEV))
        n_vis = torch.randint(0, C + 1, (token_req.shape[0],), generator=g, device=DEV).to(torch.int32)
    elif case == "shuffled":
        B = 10
        token_req = torch.arange(B, device=DEV).repeat(4)[torch.randperm(4 * B, generator=g, device=DEV)]
        n_vis = torch.full((4 * B,), C, dtype=torch.int32, device=DEV)
    else:
        B = 4
        token_req = torch.tensor([0] * 4 + [1] * 4 + [2] * 4 + [3] * 3, device=DEV)  # N 15, 4 rows per CTA
        n_vis = torch.randint(C // 2, C + 1, (15,), generator=g, device=DEV).to(torch.int32)
    _check_indexer(token_req, n_vis, B, C, g)
    _check_indexer(token_req, n_vis, B, C, g, H=32, q_fp8=True, order="paged")


@pytest.mark.parametrize("order", ["random", "paged", "offset"])
@pytest.mark.parametrize("ps", [16, 32, 48, 64, 128, 256])
def test_indexer_logits_paged_page_sizes(ps, order):
    """Page sizes other than 64: smaller and larger powers of two, 48 (the division path); entries
    in random order, the engine's page order, or shifted off the page boundaries."""
    g = _g(ps)
    B, n = 3, 2
    token_req = torch.arange(B, device=DEV).repeat_interleave(n)
    n_vis = torch.tensor([900, 901, 0, 1, 450, 451], dtype=torch.int32, device=DEV)
    _check_indexer(token_req, n_vis, B, 901, g, ps=ps, order=order)
    _check_indexer(token_req, n_vis, B, 901, g, ps=ps, H=32, q_fp8=True, order=order)


def _prefill_tokens(lens, C):
    """token_req and causal n_vis of prefill chunks: request b's lens[b] tokens are the last of
    a context whose C - 3 b compressed keys they see up to (ratio 4: C' - (len - 1 - i) // 4)."""
    req = torch.repeat_interleave(torch.arange(len(lens), device=DEV), torch.tensor(lens, device=DEV))
    nv = torch.cat([(C - 3 * b - (n - 1 - torch.arange(n, device=DEV)) // 4).clamp(min=0)
                    for b, n in enumerate(lens)])
    return req, nv.to(torch.int32)


@pytest.mark.parametrize("chain,group,tiles", [("0", "4", "32"), ("128", "4", "32"), ("256", "4", "32"),
                                               ("256", "2", "8")])
@pytest.mark.parametrize("H,q_fp8", [(64, False), (64, True), (32, False), (32, True)])
@pytest.mark.parametrize("lens,C", [([301], 1500), ([150, 77, 200, 9], 700), ([64], 4100)])
def test_indexer_logits_paged_prefill(lens, C, H, q_fp8, chain, group, tiles, monkeypatch):
    """Prefill launches (>= 8 tokens per request) with each wgmma chain width
    (DEEPFUSE_INDEXER_CHAIN_PREFILL: up to 128 / 256 columns, i.e. 1-4 tokens per chain), groups of
    4 or 2 tokens (DEEPFUSE_INDEXER_PREFILL_G), 32 or 8 tiles per CTA at most: one request or chunks
    of several (groups spanning requests, a short last group), causal n_vis; the bound, poisoned
    out and bits against one token per CTA."""
    monkeypatch.setenv("DEEPFUSE_INDEXER_CHAIN_PREFILL", chain)
    monkeypatch.setenv("DEEPFUSE_INDEXER_PREFILL_G", group)
    monkeypatch.setenv("DEEPFUSE_INDEXER_MAX_TILES", tiles)
    g = _g(sum(lens) + C + H)
    req, nv = _prefill_tokens(lens, C)
    _check_indexer(req, nv, len(lens), C, g, H=H, q_fp8=q_fp8, order="paged")


@pytest.mark.parametrize("q_fp8", [False, True])
def test_indexer_logits_paged_prefill_long_ctas(q_fp8, monkeypatch):
    """A prefill launch large enough that the default cap (up to 128 tiles per CTA in prefill
    launches; decode 32) sets the CTAs' tile runs above 32: 1024 tokens of one request x 24576
    entries (256 groups x 384 tiles over about four waves of 2 (exact q) or 3 (q_fp8) resident
    CTAs per SM: 94 or 63 tiles per CTA), causal n_vis; the bound, poisoned out and bits against one token per CTA."""
    for v in ("DEEPFUSE_INDEXER_MAX_TILES", "DEEPFUSE_INDEXER_CHAIN_PREFILL", "DEEPFUSE_INDEXER_PREFILL_G"):
        monkeypatch.delenv(v, raising=False)
    g = _g(1024 + q_fp8)
    req, nv = _prefill_tokens([1024], 24576)
    _check_indexer(req, nv, 1, 24576, g, q_fp8=q_fp8, order="paged")


@pytest.mark.parametrize("H,q_fp8,qk2", [(64, False, "0"), (64, True, "0"), (32, False, "0"), (32, True, "0"),
                                        (64, False, "1")])
def test_indexer_chain_same_bits(H, q_fp8, qk2, monkeypatch):
    """Tokens chained in one wgmma (DEEPFUSE_INDEXER_CHAIN / _CHAIN_PREFILL 128, 256; and with
    DEEPFUSE_INDEXER_SPLIT=1 groups of 4 as two chains waited one by one) give the bits of one token
    per chain (0): decode with 1-4 tokens per request and prefill chunks (each token's products and
    head sums are the same operations in the same order); both q modes, and the two exact-q terms
    along K (DEEPFUSE_INDEXER_QK2=1)."""
    monkeypatch.setenv("DEEPFUSE_INDEXER_QK2", qk2)
    g = _g(H + q_fp8)
    C, ps = 1100, 64
    pages = _idx_pages(12 * C + 12 * ps, ps, g)
    for n in (1, 2, 3, 4, 0):
        if n:
            B = 5
            req = torch.arange(B, device=DEV).repeat_interleave(n)
            nv = torch.randint(0, C + 1, (B * n,), generator=g, device=DEV).to(torch.int32)
        else:
            req, nv = _prefill_tokens([40, 3, 70], C)
            B = 3
        entry = _entries(pages, ps, B, C, g, "paged")
        q = _randn(req.shape[0], H, 128, g=g)
        w = torch.randn(req.shape[0], H, generator=g, device=DEV)
        outs = []
        for cols, split in (("0", "0"), ("128", "0"), ("256", "0"), ("256", "1")):
            monkeypatch.setenv("DEEPFUSE_INDEXER_CHAIN", cols)
            monkeypatch.setenv("DEEPFUSE_INDEXER_CHAIN_PREFILL", cols)
            monkeypatch.setenv("DEEPFUSE_INDEXER_SPLIT", split)
            outs.append(ops.indexer_logits_paged(q, w, pages, ps, entry, req, nv, 0.09, q_fp8=q_fp8))
        for o, cols in zip(outs[1:], ("128", "256", "256 split")):
            assert torch.equal(outs[0], o), f"next_n {n}, {cols} columns: {(outs[0] != o).sum().item()} values differ"


@pytest.mark.parametrize("case", ["n1", "n2", "n3", "n4", "n6", "prefill", "chunks", "ps48", "edges"])
def test_indexer_qk2(case, monkeypatch):
    """The two q terms along K (DEEPFUSE_INDEXER_QK2=1, H 64, exact q): decode with 1-6 tokens per
    request (ragged n_vis), prefill launches (one request, chunks of several), page size 48, q
    rows of extreme magnitudes; the bound, poisoned out and bits against one token per CTA."""
    monkeypatch.setenv("DEEPFUSE_INDEXER_QK2", "1")
    g = _g(len(case) * 31 + ord(case[-1]))
    if case.startswith("n"):
        n = int(case[1:])
        for B, C in ((1, 8192), (7, 700), (33, 2049)):
            req = torch.arange(B, device=DEV).repeat_interleave(n)
            nv = torch.randint(0, C + 1, (B * n,), generator=g, device=DEV).to(torch.int32)
            nv[0] = C
            _check_indexer(req, nv, B, C, g, order="paged" if B > 1 else "random")
    elif case in ("prefill", "chunks"):
        lens, C = ([301], 4100) if case == "prefill" else ([150, 77, 200, 9], 700)
        req, nv = _prefill_tokens(lens, C)
        _check_indexer(req, nv, len(lens), C, g, order="paged")
    elif case == "ps48":
        req = torch.arange(3, device=DEV).repeat_interleave(2)
        nv = torch.tensor([900, 901, 0, 1, 450, 451], dtype=torch.int32, device=DEV)
        _check_indexer(req, nv, 3, 901, g, ps=48, order="offset")
    else:
        _check_extreme_q(g, (False,))


@pytest.mark.parametrize("H,q_fp8", [(64, False), (64, True), (32, True)])
def test_indexer_decode_group_same_bits(H, q_fp8, monkeypatch):
    """Decode groups capped at 2 or 1 tokens per CTA, or chosen from the shapes (DEEPFUSE_INDEXER_DECODE_G
    2, 1, 0 = auto, the default) give the bits of groups of up to 4: next_n 2-6, ragged n_vis, one
    request with nothing visible."""
    g = _g(5 * H + q_fp8)
    C, ps = 1100, 64
    pages = _idx_pages(5 * C + 5 * ps, ps, g)
    for n in (2, 3, 4, 5, 6):
        B = 5
        req = torch.arange(B, device=DEV).repeat_interleave(n)
        nv = torch.randint(0, C + 1, (B * n,), generator=g, device=DEV).to(torch.int32)
        nv[n:2 * n] = 0
        entry = _entries(pages, ps, B, C, g, "paged")
        q = _randn(req.shape[0], H, 128, g=g)
        w = torch.randn(req.shape[0], H, generator=g, device=DEV)
        outs = []
        for cap in ("4", "2", "1", "0"):
            monkeypatch.setenv("DEEPFUSE_INDEXER_DECODE_G", cap)
            outs.append(ops.indexer_logits_paged(q, w, pages, ps, entry, req, nv, 0.09, q_fp8=q_fp8))
        for o, cap in zip(outs[1:], ("2", "1", "auto")):
            assert torch.equal(outs[0], o), f"next_n {n}, at most {cap} tokens per CTA: {(outs[0] != o).sum().item()} differ"


@pytest.mark.parametrize("H,q_fp8", [(64, False), (64, True), (32, False), (32, True)])
def test_indexer_stages_same_bits(H, q_fp8, monkeypatch):
    """Single-token CTAs with 4, 5 or 6 key stages (DEEPFUSE_INDEXER_STAGES) give the same bits
    (only the copies run further ahead); page-crossing and random entries, ragged n_vis."""
    g = _g(3 * H + q_fp8)
    C, ps = 1500, 64
    B = 6
    pages = _idx_pages(B * C + B * ps + 5 * B, ps, g)
    req = torch.arange(B, device=DEV)
    nv = torch.tensor([C, 0, 1, 63, 65, 1400], dtype=torch.int32, device=DEV)
    q = _randn(B, H, 128, g=g)
    w = torch.randn(B, H, generator=g, device=DEV)
    for order in ("offset", "random"):
        entry = _entries(pages, ps, B, C, g, order)
        outs = []
        for stages in ("4", "5", "6"):
            monkeypatch.setenv("DEEPFUSE_INDEXER_STAGES", stages)
            outs.append(ops.indexer_logits_paged(q, w, pages, ps, entry, req, nv, 0.09, q_fp8=q_fp8))
        ref = indexer_logits_paged_ref(q, w, pages, ps, entry, req, nv, 0.09, q_fp8)
        absref = _indexer_absref(q, w, pages, ps, entry, req, 0.09)
        vis = torch.arange(C, device=DEV)[None, :] < nv[:, None]
        assert ((outs[0] - ref).abs()[vis] <= 2.0 ** -9 * absref[vis] + 1e-6 * ref[vis].abs().max()).all()
        for o, stages in zip(outs[1:], ("5", "6")):
            assert torch.equal(outs[0], o), f"{order}, {stages} stages: {(outs[0] != o).sum().item()} values differ"


_COPY_VARIANTS = ("DEEPFUSE_INDEXER_TMA=0+DEEPFUSE_INDEXER_GATHER=2", "DEEPFUSE_INDEXER_TMA=0",
                  "DEEPFUSE_INDEXER_GATHER=2", "DEEPFUSE_INDEXER_CTAS=3", "DEEPFUSE_INDEXER_TMA=0+DEEPFUSE_INDEXER_CTAS=4",
                  "DEEPFUSE_INDEXER_WAVES=1+DEEPFUSE_INDEXER_MAX_TILES=256",
                  "DEEPFUSE_INDEXER_TMA=0+DEEPFUSE_INDEXER_WAVES=1+DEEPFUSE_INDEXER_MAX_TILES=256")


def _set_envs(monkeypatch, variant):
    for v in ("DEEPFUSE_INDEXER_GATHER", "DEEPFUSE_INDEXER_TMA", "DEEPFUSE_INDEXER_CTAS", "DEEPFUSE_INDEXER_WAVES",
              "DEEPFUSE_INDEXER_MAX_TILES"):
        monkeypatch.delenv(v, raising=False)
    for kv in (x for x in variant.split("+") if x):
        k, v = kv.split("=")
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("q_fp8", [False, True])
def test_indexer_copy_schemes_same_bits(q_fp8, monkeypatch):
    """The key copy schemes of H 64 single-token CTAs fill the same bytes: the default (whole-page
    tiles by TMA where a CTA's entries are whole pages in order, else the gather of 4 whole rows per
    copy instruction) against TMA off (DEEPFUSE_INDEXER_TMA=0), the sector-pair gather
    (DEEPFUSE_INDEXER_GATHER=2), fewer CTAs per SM (DEEPFUSE_INDEXER_CTAS, padded shared memory)
    and one wave of longer CTAs (DEEPFUSE_INDEXER_WAVES, _MAX_TILES): the same scores (the default
    checked against the reference), every element written into a NaN-poisoned out; page sizes
    64 / 128 / 16 / 48 (the division path), page-ordered, page-crossing and random entries, -1
    slots (TMA and gathering CTAs in one launch), ragged n_vis."""
    from deepfuse import _ext

    g = _g(11 + q_fp8)
    C, B = 1500, 6
    for ps, order in ((64, "paged"), (128, "paged"), (64, "offset"), (16, "paged"), (48, "random")):
        pages = _idx_pages(B * C + B * ps + 5 * B, ps, g)
        entry = _entries(pages, ps, B, C, g, order)
        entry[:, 7] = -1
        entry[2, 64:80] = -1
        req = torch.arange(B, device=DEV)
        nv = torch.tensor([C, 0, 1, 63, 700, 1401], dtype=torch.int32, device=DEV)
        q = _randn(B, 64, 128, g=g)
        w = torch.randn(B, 64, generator=g, device=DEV)
        _set_envs(monkeypatch, "")
        want = ops.indexer_logits_paged(q, w, pages, ps, entry, req, nv, 0.09, q_fp8=q_fp8)
        ref = indexer_logits_paged_ref(q, w, pages, ps, entry, req, nv, 0.09, q_fp8)
        absref = _indexer_absref(q, w, pages, ps, entry, req, 0.09)
        vis = torch.arange(C, device=DEV)[None, :] < nv[:, None]
        assert ((want - ref).abs()[vis] <= 2.0 ** -9 * absref[vis] + 1e-6 * ref[vis].abs().max()).all()
        assert torch.isinf(want[~vis]).all() and (want[~vis] < 0).all()
        for variant in _COPY_VARIANTS:
            _set_envs(monkeypatch, variant)
            out = torch.full_like(want, float("nan"))
            _ext._C.indexer_logits_paged(q=q, weights=w, pages=pages, entry_slots=entry, token_req=req, n_vis=nv,
                                         scale=0.09, q_fp8=q_fp8, out=out)
            assert torch.equal(want, out), f"ps {ps} {order}, {variant}: {(want != out).sum().item()} differ"


def _check_extreme_q(g, q_modes):
    """Four tokens of one request whose q rows hold zeros, tiny, huge and mixed magnitudes (the
    per-head power-of-two scale and the second q term) against 300 keys, in each q mode of
    q_modes: finite scores within 2^-9 * absref of the reference."""
    C, ps = 300, 64
    pages = _idx_pages(C, ps, g)
    entry = torch.arange(C, device=DEV, dtype=torch.int64)[None]
    q = _randn(4, 64, 128, g=g).float()
    q[0, 0] = 0.0
    q[0, 1] *= 2.0 ** -60
    q[0, 2] *= 2.0 ** 60
    q[0, 3, :64] *= 2.0 ** -10  # half the dims far below the head's amax
    q[2, 5, ::3] *= 2.0 ** -7  # a third of the dims near the exact limit of mode 3's lo term
    q[1] *= 2.0 ** -100
    q = q.to(torch.bfloat16)
    wts = torch.rand(4, 64, generator=g, device=DEV)
    req = torch.zeros(4, dtype=torch.int64, device=DEV)
    nv = torch.full((4,), C, dtype=torch.int32, device=DEV)
    absref = _indexer_absref(q, wts, pages, ps, entry, req, 1.0)
    for q_fp8 in q_modes:
        out = ops.indexer_logits_paged(q, wts, pages, ps, entry, req, nv, 1.0, q_fp8=q_fp8)
        ref = indexer_logits_paged_ref(q, wts, pages, ps, entry, req, nv, 1.0, q_fp8)
        assert torch.isfinite(out).all()
        err = (out - ref).abs()
        assert (err <= 2.0 ** -9 * absref + 1e-30).all(), f"q_fp8 {q_fp8}: max err / absref {(err / absref).max()}"


def test_indexer_q_scale_edges():
    """q rows of zeros, tiny, huge and mixed magnitudes: against the reference, both modes (exact
    q in the default mode)."""
    _check_extreme_q(_g(5), (False, True))


def test_indexer_graph_capture():
    """indexer_logits_paged captured in a CUDA graph and replayed on new inputs (no host sync)."""
    g = _g(77)
    B, n, C, ps = 4, 2, 1000, 64
    pages = _idx_pages(B * C + ps * B, ps, g)
    req = torch.arange(B, device=DEV).repeat_interleave(n)
    nv = torch.full((B * n,), C, dtype=torch.int32, device=DEV)
    q = _randn(B * n, 64, 128, g=g)
    w = torch.randn(B * n, 64, generator=g, device=DEV)
    for q_fp8, order in ((False, "random"), (True, "paged")):
        entry = _entries(pages, ps, B, C, g, order)
        ops.indexer_logits_paged(q, w, pages, ps, entry, req, nv, 0.1, q_fp8=q_fp8)  # warm up (attributes)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.indexer_logits_paged(q, w, pages, ps, entry, req, nv, 0.1, q_fp8=q_fp8)
        q.copy_(_randn(B * n, 64, 128, g=g))
        nv.copy_(torch.randint(0, C + 1, (B * n,), generator=g, device=DEV).to(torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = ops.indexer_logits_paged(q, w, pages, ps, entry, req, nv, 0.1, q_fp8=q_fp8)
        assert torch.equal(out, want)


@pytest.mark.parametrize("N,C,k", [(1, 3000, 512), (33, 1000, 512), (64, 200, 512), (8, 20000, 1024)])
def test_topk_slots(N, C, k):
    g = _g(C + k)
    x = torch.randn(N, C, generator=g, device=DEV)
    lengths = torch.randint(0, C + 1, (N,), generator=g, device=DEV).to(torch.int32)
    lengths[0] = C
    B = 5
    slot_map = torch.randperm(B * C * 2, generator=g, device=DEV)[: B * C].view(B, C).to(torch.int64)
    map_rows = torch.randint(0, B, (N,), generator=g, device=DEV)
    out = ops.topk_slots(x, min(k, C), lengths, slot_map, map_rows)
    from deepfuse.ops.topk import _topk_slots

    ref = _topk_slots.reference(x, min(k, C), lengths, slot_map, map_rows)
    for i in range(N):
        assert torch.equal(out[i].sort().values, ref[i].sort().values), f"row {i}"


@pytest.mark.sanitize
def test_rows_sanitize_small():
    """One small case of every kernel of this file for compute-sanitizer (tools/gpu/gpu_run.sh)."""
    g = _g(99)
    x = _randn(6, 4, 512, g=g)
    cos, sin = _cos_sin(6, 32, g)
    assert torch.isfinite(ops.norm_rope(x, None, 1e-6, cos, sin)).all()
    assert torch.isfinite(ops.rms_norm(_randn(3, 4096, g=g), torch.rand(4096, device=DEV), 1e-6)).all()
    ps, P = 16, 3
    for kind, D in (("kv_fp8", 512), ("idx_fp8", 128), ("dense", 512)):
        rb = F.KV_ROW_BYTES if kind == "kv_fp8" else F.IDX_ROW_BYTES
        pages = _randn(P, ps, D, g=g) if kind == "dense" else _poisoned_pages(P, rb, ps, g)
        c2, s2 = _cos_sin(5, 32, g)
        ops.norm_rope_store(_randn(5, D, g=g), torch.rand(D, device=DEV), 1e-6, c2, s2, RowTarget(pages, kind, ps),
                            _slots(5, P, ps, g))
        w = 2 * D
        plan = _plan(4, 4, True, 7, 9, g)
        plan.blk_slot = _slots(4, P, ps, g)
        c3, s3 = _cos_sin(4, 32, g)
        ops.compress_store(_randn(7, w, g=g), _randn(7, w, g=g), _randn(9, w, g=g), _randn(9, w, g=g),
                           torch.randn(4, w, device=DEV), plan, torch.rand(D, device=DEV), 1e-6, c3, s3,
                           RowTarget(pages, kind, ps))
    skv, ssc = _randn(9, 256, g=g), _randn(9, 256, g=g)
    ops.state_store(_randn(5, 256, g=g), _randn(5, 256, g=g), skv, ssc, torch.tensor([0, -1, 3, 8, 2], device=DEV))
    kp = torch.zeros(P, ps * F.IDX_ROW_BYTES, dtype=torch.uint8, device=DEV)
    entry = torch.tensor([[0, 5, -1, 17, 30, 2, 9]], device=DEV)
    n_vis = torch.tensor([7, 3, 0], dtype=torch.int32, device=DEV)
    sc = ops.indexer_logits_paged(_randn(3, 64, 128, g=g), torch.rand(3, 64, device=DEV), kp, ps, entry,
                                  torch.zeros(3, dtype=torch.int64, device=DEV), n_vis, 0.1)
    sel = ops.topk_slots(sc, 4, n_vis, entry, torch.zeros(3, dtype=torch.int64, device=DEV))
    assert sel.shape == (3, 4)
    torch.cuda.synchronize()


@pytest.mark.sanitize
def test_indexer_sanitize_groups():
    """indexer_logits_paged's paths for compute-sanitizer: a group of one request's tokens with
    different n_vis, groups spanning requests (one token at a time), a short last group, prefill
    groups (19 tokens of 2 requests); DEEPFUSE_INDEXER_CHAIN* as the environment has them."""
    g = _g(98)
    ps = 16
    kp = _idx_pages(2 * 70, ps, g)
    entry = torch.randperm(kp.shape[0] * ps, generator=g, device=DEV)[:140].view(2, 70).to(torch.int64)
    entry[1, 5] = -1
    paged = _entries(kp, ps, 2, 70, g, "paged")
    paged[1, 40] = -1
    for H, q_fp8, entry in ((64, False, entry), (32, True, entry), (64, False, paged), (64, True, paged)):
        for req, nv in (([0, 0, 0, 0], [70, 3, 0, 66]), ([0, 1, 0, 1], [70, 70, 9, 0]),
                        ([0, 0, 0, 0, 1], [1, 2, 3, 4, 70]), ([0, 0, 1, 1], [70, 69, 70, 70]),
                        ([0] * 13 + [1] * 6, list(range(50, 70)) [:13] + [70, 0, 5, 64, 65, 70])):
            n = len(req)
            sc = ops.indexer_logits_paged(_randn(n, H, 128, g=g), torch.rand(n, H, device=DEV), kp, ps, entry,
                                          torch.tensor(req, device=DEV),
                                          torch.tensor(nv, dtype=torch.int32, device=DEV), 0.1, q_fp8=q_fp8)
            assert sc.shape == (n, 70)
    torch.cuda.synchronize()


@pytest.mark.sanitize
@pytest.mark.parametrize("qk2,split,q_fp8", [("1", "0", False), ("1", "1", False), ("0", "1", True), ("0", "0", False)])
def test_indexer_sanitize_qk2(qk2, split, q_fp8, monkeypatch):
    """The two q terms along K (DEEPFUSE_INDEXER_QK2=1, the default) or as columns (0), and groups of
    4 as two chains with split waits (DEEPFUSE_INDEXER_SPLIT=1): decode groups of 1-4 tokens, groups spanning requests,
    prefill groups (19 tokens of 2 requests), page-ordered and random entries."""
    monkeypatch.setenv("DEEPFUSE_INDEXER_QK2", qk2)
    monkeypatch.setenv("DEEPFUSE_INDEXER_SPLIT", split)
    g = _g(96)
    ps = 16
    kp = _idx_pages(2 * 70, ps, g)
    rnd = torch.randperm(kp.shape[0] * ps, generator=g, device=DEV)[:140].view(2, 70).to(torch.int64)
    paged = _entries(kp, ps, 2, 70, g, "paged")
    paged[1, 40] = -1
    for entry in (rnd, paged):
        for req, nv in (([0], [70]), ([0, 0], [69, 70]), ([0, 0, 0, 0], [70, 3, 0, 66]), ([0, 1, 0, 1], [70, 70, 9, 0]),
                        ([0] * 13 + [1] * 6, list(range(50, 63)) + [70, 0, 5, 64, 65, 70])):
            n = len(req)
            sc = ops.indexer_logits_paged(_randn(n, 64, 128, g=g), torch.rand(n, 64, device=DEV), kp, ps, entry,
                                          torch.tensor(req, device=DEV),
                                          torch.tensor(nv, dtype=torch.int32, device=DEV), 0.1, q_fp8=q_fp8)
            assert sc.shape == (n, 70)
    torch.cuda.synchronize()


@pytest.mark.sanitize
@pytest.mark.parametrize("variant", _COPY_VARIANTS)
def test_indexer_sanitize_copy(variant, monkeypatch):
    """The key copy schemes of single-token CTAs and the padded launch (_COPY_VARIANTS): H 64 both
    q modes, page sizes 16 and 64, page-ordered and random entries, -1 slots, ragged n_vis."""
    _set_envs(monkeypatch, variant)
    g = _g(95)
    for ps in (16, 64):
        kp = _idx_pages(3 * 300 + 3 * ps, ps, g)
        for order in ("paged", "random"):
            entry = _entries(kp, ps, 3, 300, g, order)
            entry[1, 40] = -1
            for q_fp8 in (False, True):
                sc = ops.indexer_logits_paged(_randn(3, 64, 128, g=g), torch.rand(3, 64, device=DEV), kp, ps, entry,
                                              torch.arange(3, device=DEV),
                                              torch.tensor([300, 17, 290], dtype=torch.int32, device=DEV), 0.1,
                                              q_fp8=q_fp8)
                assert sc.shape == (3, 300)
    torch.cuda.synchronize()


@pytest.mark.sanitize
def test_indexer_sanitize_prefill_long_ctas():
    """A prefill launch whose CTAs take more than 32 tiles each with the default cap (1024 tokens
    x 24576 page-ordered entries, causal n_vis, a -1 slot; exact q: 94 tiles per CTA)."""
    g = _g(97)
    ps, C = 64, 24576
    kp = _idx_pages(C + 2 * ps, ps, g)
    entry = _entries(kp, ps, 1, C, g, "paged")
    entry[0, 7] = -1
    req, nv = _prefill_tokens([1024], C)
    sc = ops.indexer_logits_paged(_randn(1024, 64, 128, g=g), torch.rand(1024, 64, device=DEV), kp, ps, entry, req,
                                  nv, 0.1)
    assert sc.shape == (1024, C)
    torch.cuda.synchronize()
