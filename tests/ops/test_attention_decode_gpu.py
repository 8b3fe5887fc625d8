"""ops.sparse_attention_paged on the warp-specialised wgmma kernel (csrc/attention/sparse_decode_sm90.cuh):
one query row per CTA group (plan group_rows 1), H 64 / 128, FP8 pages. The kernel is selected by
DEEPFUSE_SPARSE_DECODE (1: on, 0: the mma.sync kernel); each test sets it. H 128 runs by default
as a cluster of two CTAs sharing the dequantised key tiles when the call has splits or at most 4
waves of CTAs (every small H 128 case without an explicit switch; T 280 runs without), or with
DEEPFUSE_SPARSE_DECODE_CLUSTER=0 / 1 forced off / on (test_h128_no_cluster, test_h128_cluster, the
graph and sanitize cases with cluster "0"). The consumer
warpgroups split the softmax by keys unless DEEPFUSE_SPARSE_DECODE_SPLIT=0 (test_unsplit_softmax);
DEEPFUSE_SPARSE_DECODE_SPLIT=2 splits QK itself by keys (test_key_split_qk). DEEPFUSE_SPARSE_DECODE_REDUCE=1
merges the split-KV partials inside a cluster of a row's splits instead of the combine kernel
(test_split_reduce, test_split_reduce_matches_combine, graph and sanitize cases).
One-split calls of more rows than one wave run on persistent CTAs by default for MXFP8 outputs
(DEEPFUSE_SPARSE_DECODE_PERSIST=0 / 1 forces it off / on: test_persistent, sanitize cases). The split-KV
combine is a programmatic dependent launch of the main kernel by default (DEEPFUSE_SPARSE_ATTN_PDL=0 / 1:
test_combine_pdl, graph and sanitize cases; calls of <= 4 64-head row blocks reduce their splits in a cluster
by default instead, so those tests set DEEPFUSE_SPARSE_DECODE_REDUCE=0). The producer reads the slot indices through a shared-memory
ring by default; DEEPFUSE_SPARSE_DECODE_PROD=0 selects the previous producer (indices in registers,
loop unrolled by three) on the plain split-softmax paths (test_old_producer, sanitize cases).

Inputs, poisoning and bounds are test_attention_paged._run_case's (stated in that module's
docstring): fresh random caches written by kv_store into NaN-poisoned pages, -1 holes,
duplicates, page-boundary slots, ragged lengths on both sources, a random sink, inverse RoPE,
outputs poisoned through the caching allocator, every element checked against the fp32
reference (bf16: |o - ref| <= 2^-7 vmax + 2^-7 |ref| and relative Frobenius < 4e-3; lse
1e-4 + 1e-5 |ref|; MXFP8: scale bytes within 1, values within the bf16 bound + half an e4m3 ulp).
Shapes: B requests x s_q rows (s_q 1 / 2 / 4 are T = B * s_q independent rows here), window
128 + selected 512 (CSA decode), HCA-like long lists, forced splits, out-of-range slots.
"""
import pytest
import torch

from deepfuse import ops
from deepfuse.ops import attention as A

from test_attention_paged import _run_case, make_cache, make_indices

ENV = "DEEPFUSE_SPARSE_DECODE"
ENV_CLUSTER = "DEEPFUSE_SPARSE_DECODE_CLUSTER"
ENV_REDUCE = "DEEPFUSE_SPARSE_DECODE_REDUCE"
ENV_PERSIST = "DEEPFUSE_SPARSE_DECODE_PERSIST"
ENV_PDL = "DEEPFUSE_SPARSE_ATTN_PDL"
ENV_PROD = "DEEPFUSE_SPARSE_DECODE_PROD"


@pytest.fixture
def wg(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    monkeypatch.delenv(ENV_CLUSTER, raising=False)  # the built-in defaults unless a test sets them
    monkeypatch.delenv(ENV_REDUCE, raising=False)
    monkeypatch.delenv(ENV_PERSIST, raising=False)
    monkeypatch.delenv(ENV_PDL, raising=False)
    monkeypatch.delenv("DEEPFUSE_SPARSE_DECODE_SPLIT", raising=False)
    monkeypatch.delenv(ENV_PROD, raising=False)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 128])
@pytest.mark.parametrize("B,s_q", [(1, 1), (1, 2), (3, 4), (16, 2), (64, 1), (128, 2)])
@pytest.mark.parametrize("out_format", ["bf16", "mxfp8"])
def test_decode_csa(wg, H, B, s_q, out_format):
    if B * s_q * H > 128 * 2 * 64 and out_format == "mxfp8":
        pytest.skip("the largest cells run once (bf16)")
    _run_case(H, 1, B * s_q, 128, 512, out_format=out_format, seed=17 * H + B + s_q)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    dict(H=64, T=3, K1=128, K2=None, lens=False, rope=False),                  # window only
    dict(H=64, T=2, K1=129, K2=300),                                            # ragged block ends
    dict(H=128, T=2, K1=129, K2=512, out_format="mxfp8"),                       # B 1 s_q 2: plan splits, 11 blocks
    dict(H=128, T=5, K1=128, K2=2048, splits=1),                                # one split, long (HCA-like)
    dict(H=64, T=2, K1=128, K2=4096, splits=37),                                # many splits (some empty)
    dict(H=128, T=2, K1=128, K2=8192),                                          # plan splits, 1M-context-like
    dict(H=64, T=4, K1=128, K2=1024, oob=True, idx64=True),                     # out-of-range slots skipped
    dict(H=64, T=1, K1=5, K2=0),                                                # tiny, empty extra
    dict(H=128, T=6, K1=128, K2=512, out_format="mxfp8", splits=3, q_scale=4.0),  # peaky logits
    dict(H=64, T=300, K1=128, K2=512, ps=(16, 64)),                             # prefill-like
    dict(H=128, T=8, K1=64, K2=64, ps=(16, 16), splits=2, out_format="mxfp8"),
    dict(H=128, T=280, K1=64, K2=128, ps=(16, 16)),                             # > 4 waves: no cluster by default
])
def test_cases(wg, case):
    _run_case(G=1, **case, seed=len(str(case)) + 5)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    dict(H=128, T=6, K1=128, K2=512),
    dict(H=128, T=4, K1=40, K2=300, splits=3, oob=True, out_format="mxfp8"),
])
def test_h128_cluster(wg, monkeypatch, case):
    """H 128 as a cluster (each CTA dequantises half of the keys into both CTAs' tiles) passes the
    same bounds."""
    monkeypatch.setenv(ENV_CLUSTER, "1")
    _run_case(G=1, **case, seed=len(str(case)) + 9)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    dict(H=128, T=6, K1=128, K2=512),
    dict(H=128, T=4, K1=40, K2=300, splits=3, oob=True, out_format="mxfp8"),
])
def test_h128_no_cluster(wg, monkeypatch, case):
    """DEEPFUSE_SPARSE_DECODE_CLUSTER=0: H 128 as two independent CTAs, each dequantising every key."""
    monkeypatch.setenv(ENV_CLUSTER, "0")
    _run_case(G=1, **case, seed=len(str(case)) + 11)


@pytest.mark.gpu
@pytest.mark.parametrize("H,T,K", [(64, 2, 640), (64, 2, 641), (128, 2, 641), (64, 8, 700), (64, 1, 60), (64, 64, 640),
                                   (128, 4, 641), (64, 2, 400)])
def test_plan_splits_cover_64_key_blocks(H, T, K):
    """Small calls split into about one wave with at most one 64-key block per split (K 641 at 8 CTAs:
    11 splits, not 10, which gave 6 splits of two blocks); calls of <= 4 CTAs with >= 8 blocks take 16
    splits (reduced in a 16-CTA cluster by default)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ctas = T * (H // 64)
    want = max(1, min(sms // ctas if ctas < sms else 1, -(-K // 64)))
    if ctas <= 4 and -(-K // 64) >= 8 and sms >= 16 * ctas:
        want = 16
    assert A.sparse_attention_plan(T, H, K).num_splits == want


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    dict(H=64, T=6, K1=128, K2=512),
    dict(H=128, T=6, K1=128, K2=512),
    dict(H=128, T=4, K1=40, K2=300, splits=3, oob=True, out_format="mxfp8"),
    dict(H=64, T=2, K1=129, K2=300, idx64=True),
    dict(H=128, T=5, K1=128, K2=2048, splits=1, cluster="0"),
])
def test_old_producer(wg, monkeypatch, case):
    """DEEPFUSE_SPARSE_DECODE_PROD=0: the previous producer (slot indices in registers three blocks
    ahead) passes the same bounds; the default ring producer runs every other test."""
    case = dict(case)
    monkeypatch.setenv(ENV_PROD, "0")
    cl = case.pop("cluster", None)
    if cl is not None:
        monkeypatch.setenv(ENV_CLUSTER, cl)
    _run_case(G=1, **case, seed=len(str(case)) + 19)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    dict(H=64, T=6, K1=128, K2=512),
    dict(H=128, T=4, K1=40, K2=300, splits=3, oob=True, out_format="mxfp8"),
    dict(H=64, T=3, K1=128, K2=2048, splits=1, q_scale=4.0),
])
def test_unsplit_softmax(wg, monkeypatch, case):
    """DEEPFUSE_SPARSE_DECODE_SPLIT=0: both consumer warpgroups finish the whole logit tile (the
    default splits it by keys) and pass the same bounds."""
    monkeypatch.setenv("DEEPFUSE_SPARSE_DECODE_SPLIT", "0")
    _run_case(G=1, **case, seed=len(str(case)) + 13)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    dict(H=64, T=6, K1=128, K2=512),
    dict(H=128, T=6, K1=128, K2=512),
    dict(H=128, T=4, K1=40, K2=300, splits=3, oob=True, out_format="mxfp8"),
    dict(H=64, T=3, K1=128, K2=2048, splits=1, q_scale=4.0),
    dict(H=64, T=2, K1=129, K2=300, idx64=True),
    dict(H=128, T=5, K1=128, K2=2048, splits=1, cluster="0"),
])
def test_key_split_qk(wg, monkeypatch, case):
    """DEEPFUSE_SPARSE_DECODE_SPLIT=2: QK split by keys between the consumer warpgroups (each over all
    512 dims; only row maxima and P halves exchanged) passes the same bounds."""
    case = dict(case)
    monkeypatch.setenv("DEEPFUSE_SPARSE_DECODE_SPLIT", "2")
    cl = case.pop("cluster", None)
    if cl is not None:
        monkeypatch.setenv(ENV_CLUSTER, cl)
    _run_case(G=1, **case, seed=len(str(case)) + 17)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    dict(H=64, T=2, K1=128, K2=512, splits=10),                                  # B 1 decode: one block per split
    dict(H=128, T=3, K1=128, K2=512, splits=4, out_format="mxfp8"),
    dict(H=64, T=2, K1=128, K2=4096, splits=16),                                 # the largest cluster
    dict(H=64, T=4, K1=40, K2=300, splits=3, oob=True, idx64=True),              # odd size, empty CTAs
    dict(H=128, T=2, K1=128, K2=2048, splits=8, q_scale=4.0, out_format="mxfp8"),
    dict(H=64, T=3, K1=5, K2=0, splits=2),                                       # one short block, an empty split
    dict(H=128, T=2, K1=128, K2=512, splits=5, split="2"),                       # with the key-split QK
])
def test_split_reduce(wg, monkeypatch, case):
    """DEEPFUSE_SPARSE_DECODE_REDUCE=1: the splits of a row form a cluster and merge their partials
    through DSMEM (no workspace, no combine launch); the same bounds."""
    case = dict(case)
    monkeypatch.setenv(ENV_REDUCE, "1")
    sp = case.pop("split", None)
    if sp is not None:
        monkeypatch.setenv("DEEPFUSE_SPARSE_DECODE_SPLIT", sp)
    _run_case(G=1, **case, seed=len(str(case)) + 23)


@pytest.mark.gpu
@pytest.mark.parametrize("H,splits,out_format", [(64, 10, "bf16"), (128, 3, "mxfp8"), (64, 16, "mxfp8")])
def test_split_reduce_matches_combine(wg, monkeypatch, H, splits, out_format):
    """The in-cluster reduction does the combine kernel's arithmetic in its order on the same
    partials: outputs, scale bytes and lse equal bit for bit (H 128 as two 64-head CTAs in both)."""
    monkeypatch.setenv(ENV_CLUSTER, "0")
    gen = torch.Generator().manual_seed(31 + H + splits)
    kv1, s1, _ = make_cache(8, 64, "fp8", 400, gen, "cuda")
    kv2, s2, _ = make_cache(40, 16, "fp8", 600, gen, "cuda")
    T = 3
    i1, i2 = make_indices(T, 128, 1, s1, gen).cuda(), make_indices(T, 512, 1, s2, gen).cuda()
    q = torch.randn(T, H, 512, generator=gen).to(torch.bfloat16).cuda()
    sink = torch.randn(H, generator=gen).cuda()
    cs = torch.randn(T, 32, generator=gen).cuda()
    inv = (torch.cos(cs), torch.sin(cs))
    res = []
    for v in ("0", "1"):
        monkeypatch.setenv(ENV_REDUCE, v)
        o, lse = ops.sparse_attention_paged(q, kv1, 64, i1, sink, 0.05, extra_kv=kv2, extra_page_size=16,
                                            extra_indices=i2, inv_rope=inv, out_format=out_format,
                                            plan=A.SparseAttentionPlan(1, splits))
        res.append((o if out_format == "bf16" else o[0].view(torch.uint8), o[1] if out_format != "bf16" else None, lse))
    torch.cuda.synchronize()
    assert torch.equal(res[0][0], res[1][0])
    if out_format != "bf16":
        assert torch.equal(res[0][1], res[1][1])
    assert torch.equal(res[0][2], res[1][2])


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    dict(H=64, T=300, K1=128, K2=512, ps=(16, 64)),                              # 300 items on 132 CTAs
    dict(H=128, T=150, K1=128, K2=512, out_format="mxfp8", oob=True),            # the 2-CTA cluster, 66 units
    dict(H=64, T=200, K1=129, K2=300, idx64=True, splits=1),                     # ragged block ends
    dict(H=128, T=140, K1=64, K2=200, cluster="0"),                              # 280 items, no cluster
    dict(H=64, T=150, K1=5, K2=0, splits=1),                                     # one short block per item
    dict(H=64, T=300, K1=128, K2=512, out_format="mxfp8", persist=None),         # the MXFP8 default
    dict(H=128, T=300, K1=64, K2=200, out_format="mxfp8", persist="0"),          # forced off
])
def test_persistent(wg, monkeypatch, case):
    """DEEPFUSE_SPARSE_DECODE_PERSIST=1 (the default for MXFP8 outputs): one split and more rows than one
    wave: each CTA (or 2-CTA cluster) takes rows t, t + grid, .., its mbarrier phases running on over
    them; the same bounds (and with the switch forced off)."""
    case = dict(case)
    pe = case.pop("persist", "1")
    if pe is not None:
        monkeypatch.setenv(ENV_PERSIST, pe)
    cl = case.pop("cluster", None)
    if cl is not None:
        monkeypatch.setenv(ENV_CLUSTER, cl)
    _run_case(G=1, **case, seed=len(str(case)) + 29)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    dict(H=64, T=2, K1=128, K2=512, splits=10),
    dict(H=128, T=3, K1=128, K2=512, splits=4, out_format="mxfp8"),
    dict(H=64, T=4, K1=40, K2=300, splits=3, oob=True, idx64=True),
])
@pytest.mark.parametrize("kernel", ["1", "0"])
def test_combine_pdl(monkeypatch, case, kernel):
    """DEEPFUSE_SPARSE_ATTN_PDL=1: the split-KV combine launched as a programmatic dependent of the main
    kernel (the wgmma kernel releases it early; after the mma.sync kernel it starts at completion)
    waits for the partials: the same bounds."""
    monkeypatch.setenv(ENV, kernel)
    monkeypatch.setenv(ENV_PDL, "1")
    monkeypatch.setenv(ENV_REDUCE, "0")  # (small calls reduce in a cluster by default: no combine)
    for k in (ENV_CLUSTER, ENV_PERSIST):
        monkeypatch.delenv(k, raising=False)
    _run_case(G=1, **case, seed=len(str(case)) + 37)


@pytest.mark.gpu
def test_switch_selects_the_kernel(monkeypatch):
    """Both kernels pass the same bounds; their fp32 summation orders differ, so the bf16 outputs
    differ in some elements: the switch reaches the launcher."""
    gen = torch.Generator().manual_seed(21)
    kv, slots, _ = make_cache(16, 64, "fp8", 900, gen, "cuda")
    T, H = 4, 64
    idx = make_indices(T, 640, 1, slots, gen).cuda()
    q = torch.randn(T, H, 512, generator=gen).to(torch.bfloat16).cuda()
    sink = torch.randn(H, generator=gen).cuda()
    outs = []
    for v in ("0", "1"):
        monkeypatch.setenv(ENV, v)
        o, lse = ops.sparse_attention_paged(q, kv, 64, idx, sink, 0.05, plan=A.SparseAttentionPlan(1, 1))
        outs.append((o, lse))
    torch.cuda.synchronize()
    assert not torch.equal(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("H,cluster,reduce,pdl", [(64, None, None, None), (128, "0", None, None), (128, None, None, None),
                                                 (64, None, "1", None), (128, None, "1", None), (64, None, "0", "1"),
                                                 (128, None, None, "1"), (64, None, "0", "0")])
def test_cuda_graph(wg, monkeypatch, H, cluster, reduce, pdl):
    if cluster is not None:
        monkeypatch.setenv(ENV_CLUSTER, cluster)
    if pdl is not None:  # the combine as a programmatic dependent launch (or not) inside the graph
        monkeypatch.setenv(ENV_PDL, pdl)
    if reduce is not None:  # the splits reduced in a cluster: no combine node in the graph
        monkeypatch.setenv(ENV_REDUCE, reduce)
    gen = torch.Generator().manual_seed(10 + H)
    T = 4
    kv1, s1, deq1 = make_cache(8, 64, "fp8", 400, gen, "cuda")
    kv2, s2, deq2 = make_cache(40, 16, "fp8", 600, gen, "cuda")
    q = torch.empty(T, H, 512, dtype=torch.bfloat16, device="cuda")
    i1 = torch.empty(T, 128, dtype=torch.int32, device="cuda")
    i2 = torch.empty(T, 512, dtype=torch.int32, device="cuda")
    sink = torch.randn(H, generator=gen).cuda()
    plan = A.sparse_attention_plan(T, H, 640)
    assert plan.group_rows == 1 and plan.num_splits > 1  # the workspace and the combine in the graph

    def fill(seed):
        g2 = torch.Generator().manual_seed(seed)
        qq = torch.randn(T, H, 512, generator=g2).to(torch.bfloat16)
        a, b = make_indices(T, 128, 1, s1, g2), make_indices(T, 512, 1, s2, g2)
        q.copy_(qq), i1.copy_(a), i2.copy_(b)
        return qq, a, b

    def call():
        return ops.sparse_attention_paged(q, kv1, 64, i1, sink, 0.05, extra_kv=kv2, extra_page_size=16,
                                          extra_indices=i2, plan=plan, out_format="mxfp8")

    fill(1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (q8, s8), lse = call()
    qq, a, b = fill(2)
    graph.replay()
    torch.cuda.synchronize()
    ro, rl = ops.sparse_attention_paged(qq.float(), kv1.cpu(), 64, a, sink.cpu(), 0.05, extra_kv=kv2.cpu(),
                                        extra_page_size=16, extra_indices=b)
    from deepfuse.ops import cast as C
    deq = C.mxfp8_dequant(q8.cpu(), s8.cpu(), torch.float32).view(T, H, 512)
    vmax = max(float(deq1.abs().nan_to_num(0).max()), float(deq2.abs().nan_to_num(0).max()))
    eps = 2.0**-7 * (vmax + ro.abs())
    assert bool(((deq - ro).abs() <= eps * (1 + 2.0**-4) + 2.0**-4 * ro.abs() + 2.0**-10 * 2.0**(s8.cpu().float().max() - 127)).all())
    torch.testing.assert_close(lse.cpu(), rl, atol=1e-4, rtol=1e-5)


@pytest.mark.sanitize
@pytest.mark.parametrize("case", [
    dict(H=64, T=4, K1=40, K2=70, splits=2, oob=True),
    dict(H=128, T=3, K1=128, K2=200, out_format="mxfp8"),
    dict(H=64, T=2, K1=64, K2=None, splits=1),
    dict(H=128, T=4, K1=40, K2=70, splits=2, oob=True),
    dict(H=128, T=3, K1=128, K2=200, cluster="0"),
    dict(H=64, T=4, K1=40, K2=70, splits=2, oob=True, split="2"),
    dict(H=128, T=3, K1=128, K2=200, out_format="mxfp8", split="2"),
    dict(H=64, T=2, K1=128, K2=512, splits=10, reduce="1"),
    dict(H=128, T=3, K1=40, K2=300, splits=3, oob=True, out_format="mxfp8", reduce="1"),
    dict(H=64, T=140, K1=40, K2=70, splits=1, oob=True, persist="1"),
    dict(H=128, T=70, K1=64, K2=64, splits=1, out_format="mxfp8", persist="1"),
    dict(H=64, T=2, K1=128, K2=512, splits=10, pdl="1", reduce="0"),
    dict(H=64, T=5, K1=40, K2=300, splits=1, oob=True, idx64=True),
    dict(H=64, T=4, K1=40, K2=70, splits=2, oob=True, prod="0"),
    dict(H=128, T=3, K1=128, K2=200, prod="0"),
], ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))  # (-k selects by switch: reduce, persist, pdl)
def test_sanitize(wg, monkeypatch, case):
    case = dict(case)
    cl = case.pop("cluster", None)
    if cl is not None:
        monkeypatch.setenv(ENV_CLUSTER, cl)
    sp = case.pop("split", None)
    if sp is not None:
        monkeypatch.setenv("DEEPFUSE_SPARSE_DECODE_SPLIT", sp)
    rd = case.pop("reduce", None)
    if rd is not None:
        monkeypatch.setenv(ENV_REDUCE, rd)
    pe = case.pop("persist", None)
    if pe is not None:
        monkeypatch.setenv(ENV_PERSIST, pe)
    pd = case.pop("pdl", None)
    if pd is not None:
        monkeypatch.setenv(ENV_PDL, pd)
    pr = case.pop("prod", None)
    if pr is not None:
        monkeypatch.setenv(ENV_PROD, pr)
    _run_case(G=1, **case, seed=3)
