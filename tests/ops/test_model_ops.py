"""The model-graph ops (rms_norm, rope, mHC, sparse attention, indexer scores, compressor
pooling, quantised linears, MoE): reference semantics, agreement with the transformers
oracle's components, opcheck, validation errors. CPU only; GPU kernels come later."""
import pytest
import torch
import torch.nn.functional as F

from deepfuse import _ext, ops

from v4_oracle import one_thread  # noqa: F401

g = torch.Generator().manual_seed(0)


def rn(*shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


# ----------------------------------------------------------------------------- norm / rope
def test_rms_norm():
    x, w = rn(3, 5, 48), rn(48)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ref)
    torch.testing.assert_close(ops.rms_norm(x, None, 1e-6), ref / w)
    xb = x.bfloat16()
    assert ops.rms_norm(xb, w).dtype == torch.bfloat16
    torch.library.opcheck(torch.ops.deepfuse.rms_norm, (x, w, 1e-6))
    with pytest.raises(ValueError, match="weight must have shape"):
        ops.rms_norm(x, rn(47))


def test_rope_matches_complex_rotation_and_inverts():
    T, H, D, R = 7, 3, 32, 8
    x = rn(T, H, D)
    ang = rn(T, R // 2)
    cos, sin = ang.cos(), ang.sin()
    y = ops.rope(x, cos, sin)
    # DeepSeek's reference formulation: pairs as complex numbers times e^{i a}
    z = torch.view_as_complex(x[..., -R:].reshape(T, H, R // 2, 2).contiguous())
    ref = torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang).unsqueeze(1)).flatten(-2)
    torch.testing.assert_close(y[..., -R:], ref)
    assert torch.equal(y[..., :-R], x[..., :-R])
    torch.testing.assert_close(ops.rope(y, cos, sin, inverse=True), x, atol=1e-5, rtol=1e-5)
    torch.library.opcheck(torch.ops.deepfuse.rope, (x, cos, sin, False))
    with pytest.raises(ValueError, match="must be"):
        ops.rope(x, cos[:-1], sin[:-1])


# ----------------------------------------------------------------------------- mHC
@pytest.mark.parametrize("n", [2, 4])
def test_hc_pre_post_head_match_oracle(n):
    pytest.importorskip("transformers")
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

    d = 16
    cfg = DeepseekV4Config(hidden_size=d, hc_mult=n, hc_sinkhorn_iters=20, num_hidden_layers=1,
                           vocab_size=8, compress_ratios=[0])
    hc, head = M.DeepseekV4HyperConnection(cfg), M.DeepseekV4HyperHead(cfg)
    with torch.no_grad():
        for p in list(hc.parameters()) + list(head.parameters()):
            p.requires_grad_(False)
            p.copy_(rn(*p.shape, scale=0.5) + (1 if p.dim() == 1 and p.numel() <= 3 else 0))
    x = rn(2, 5, n, d)
    post_r, comb_r, y_r = hc(x)
    y, post, comb = ops.hc_pre(x, hc.fn, hc.scale, hc.base, iters=20)
    torch.testing.assert_close(y, y_r)
    torch.testing.assert_close(post, post_r)
    torch.testing.assert_close(comb, comb_r)
    # Sinkhorn: comb is (nearly) doubly stochastic; the last step normalises the columns
    torch.testing.assert_close(comb.sum(-2), torch.ones(2, 5, n), atol=1e-4, rtol=0)
    assert bool(((comb.sum(-1) - 1).abs() < 0.1).all())  # rows converge more slowly
    f = rn(2, 5, d)
    ref = post_r.unsqueeze(-1) * f.unsqueeze(-2) + torch.matmul(comb_r.transpose(-1, -2), x)
    torch.testing.assert_close(ops.hc_post(f, x, post, comb), ref)
    torch.testing.assert_close(ops.hc_head(x, head.hc_fn, head.hc_scale, head.hc_base), head(x))
    torch.library.opcheck(torch.ops.deepfuse.hc_pre, (x, hc.fn, hc.scale, hc.base, 1e-6, 1e-6, 20))
    torch.library.opcheck(torch.ops.deepfuse.hc_post, (f, x, post, comb))
    torch.library.opcheck(torch.ops.deepfuse.hc_head, (x, head.hc_fn, head.hc_scale, head.hc_base, 1e-6, 1e-6))
    with pytest.raises(ValueError, match="fn must have shape"):
        ops.hc_pre(x, hc.fn[:-1], hc.scale, hc.base)


# ----------------------------------------------------------------------------- attention
def _dense_attention_with_sink(q, kv, idx, sink, scale):
    """Independent formulation: dense logits, mask, sink column appended, softmax, drop it."""
    B, S, H, D = q.shape
    N = kv.shape[1]
    logits = torch.einsum("bshd,bnd->bshn", q, kv) * scale
    count = torch.zeros(B, S, N + 1)
    count.scatter_add_(2, torch.where(idx >= 0, idx, N), torch.ones(idx.shape))
    count = count[..., :N]  # multiplicity of each row among the slots
    w = torch.where(count > 0, count, torch.zeros_like(count)).unsqueeze(2)
    logits = torch.where(w > 0, logits + torch.log(w.clamp(min=1e-30)), torch.full_like(logits, float("-inf")))
    full = torch.cat([logits, sink.view(1, 1, H, 1).expand(B, S, H, 1)], -1)
    p = torch.softmax(full, -1)[..., :-1]
    return torch.einsum("bshn,bnd->bshd", p, kv)


def test_sparse_attention_reference():
    B, S, H, D, N, K = 2, 9, 4, 16, 30, 12
    q, kv, sink = rn(B, S, H, D), rn(B, N, D), rn(H)
    idx = torch.randint(-1, N, (B, S, K), generator=g)
    idx[0, 0] = -1  # a query with no keys: o = 0
    idx[1, 1, :3] = 5  # duplicates count with multiplicity
    out = ops.sparse_attention(q, kv, idx, sink, D ** -0.5)
    torch.testing.assert_close(out, _dense_attention_with_sink(q, kv, idx, sink, D ** -0.5))
    assert torch.equal(out[0, 0], torch.zeros(H, D))
    torch.library.opcheck(torch.ops.deepfuse.sparse_attention, (q, kv, idx.int(), sink, 0.25))
    with pytest.raises(ValueError, match="indices must have shape"):
        ops.sparse_attention(q, kv, idx[:, :-1], sink, 1.0)
    with pytest.raises(ValueError, match="sink must have shape"):
        ops.sparse_attention(q, kv, idx, sink[:-1], 1.0)


def test_indexer_scores_match_oracle_scorer():
    pytest.importorskip("transformers")
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

    cfg = DeepseekV4Config(hidden_size=24, index_n_heads=4, index_head_dim=16, num_hidden_layers=1,
                           vocab_size=8, compress_ratios=[0])
    sc = M.DeepseekV4IndexerScorer(cfg)
    q, k, x = rn(2, 6, 4, 16), rn(2, 10, 16), rn(2, 6, 24)
    ref = sc(q, k, x)
    w = sc.weights_proj(x) * 4 ** -0.5
    torch.testing.assert_close(ops.indexer_scores(q, k, w, 16 ** -0.5), ref)
    torch.library.opcheck(torch.ops.deepfuse.indexer_scores, (q, k, w.detach(), 0.25))


def test_compress_pool():
    kv, s = rn(3, 8, 16), rn(3, 8, 16)
    s[:, :2] = float("-inf")  # missing rows get weight 0
    ref = (kv * torch.softmax(s, 1)).sum(1)
    torch.testing.assert_close(ops.compress_pool(kv, s), ref)
    torch.library.opcheck(torch.ops.deepfuse.compress_pool, (kv, s))


# ----------------------------------------------------------------------------- linears
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_quant_and_grouped_linear(fmt):
    N, K, G = 192, 256, 4
    w = rn(N, K, scale=0.1)
    if fmt == "fp8":
        q, s = ops.fp8_block_cast(w, (128, 128), scale_fmt="ue8m0")
    else:
        q, s = ops.mxfp4_cast(w)
    wd = ops.linear.dequant_weight(q, s, fmt)
    x = rn(5, K)
    torch.testing.assert_close(ops.quant_linear(x, q, s, fmt), x @ wd.t())
    xg = rn(3, G, K)  # [*, G, Kg = K]; group g owns rows g * N/G ..
    torch.testing.assert_close(ops.grouped_linear(xg, q, s, fmt),
                               torch.einsum("bgk,grk->bgr", xg, wd.view(G, N // G, K)))
    # (test_schema compares fp8 tensors with ops the CPU lacks for float8)
    utils = ("test_faketensor", "test_aot_dispatch_dynamic") if fmt == "fp8" else "ALL"
    torch.library.opcheck(torch.ops.deepfuse.quant_linear, (x, q, s, fmt), test_utils=utils)
    torch.library.opcheck(torch.ops.deepfuse.grouped_linear, (xg, q, s, fmt), test_utils=utils)
    with pytest.raises(ValueError, match="scale must have shape"):
        ops.quant_linear(x, q, s[:-1], fmt)


# ----------------------------------------------------------------------------- MoE
@pytest.mark.parametrize("hashed", [False, True])
def test_moe_route_matches_oracle_routers(hashed):
    pytest.importorskip("transformers")
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

    cfg = DeepseekV4Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=3, num_hidden_layers=1,
                           vocab_size=20, compress_ratios=[0], routed_scaling_factor=2.5)
    r = M.DeepseekV4HashRouter(cfg) if hashed else M.DeepseekV4TopKRouter(cfg)
    with torch.no_grad():
        r.weight.copy_(rn(8, 16))
        if hashed:
            r.tid2eid.copy_(torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(20)]))
        else:
            r.e_score_correction_bias.copy_(rn(8, scale=0.3))
    x, tok = rn(11, 16), torch.randint(0, 20, (11,), generator=g)
    _, w_ref, i_ref = r(x, tok) if hashed else r(x)
    w, i = ops.moe_route(F.linear(x, r.weight), 3, bias=None if hashed else r.e_score_correction_bias,
                         route_scale=2.5, hash_ids=r.tid2eid[tok] if hashed else None)
    # same set of experts with the same weights per token (order free)
    o_ref, o = i_ref.sort(-1), i.sort(-1)
    assert torch.equal(o.values, o_ref.values)
    torch.testing.assert_close(w.gather(-1, o.indices), w_ref.gather(-1, o_ref.indices))
    logits = F.linear(x, r.weight).detach()
    args = (None, 3, 2.5, "sqrtsoftplus", r.tid2eid[tok]) if hashed else (r.e_score_correction_bias, 3, 2.5,
                                                                          "sqrtsoftplus", None)
    torch.library.opcheck(torch.ops.deepfuse.moe_route, (logits,) + args)


def test_moe_experts_match_oracle_experts():
    pytest.importorskip("transformers")
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

    cfg = DeepseekV4Config(hidden_size=32, n_routed_experts=5, moe_intermediate_size=16, num_hidden_layers=1,
                           vocab_size=8, compress_ratios=[0], swiglu_limit=0.7)
    ex = M.DeepseekV4Experts(cfg)
    with torch.no_grad():
        ex.gate_up_proj.copy_(rn(5, 32, 32, scale=0.5))
        ex.down_proj.copy_(rn(5, 32, 16, scale=0.5))
    x = rn(9, 32)
    ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(9)])
    w = rn(9, 2).abs()
    ref = ex(x, ids, w)
    w1, w3 = ex.gate_up_proj[:, :16].detach(), ex.gate_up_proj[:, 16:].detach()
    out = ops.moe_experts(x, ids, w, w1, w3, ex.down_proj.detach(), limit=0.7)
    torch.testing.assert_close(out, ref)
    # ids outside [0, E) contribute nothing (expert-parallel shards)
    ids2 = ids.clone()
    ids2[:, 1] = 7
    only0 = ops.moe_experts(x, ids2, w, w1, w3, ex.down_proj.detach(), limit=0.7)
    torch.testing.assert_close(only0, ex(x, ids[:, :1], w[:, :1]))
    torch.library.opcheck(torch.ops.deepfuse.moe_experts,
                          (x, ids, w, w1, w3, ex.down_proj.detach(), None, None, None, "dense", 0.7) + (None,) * 6)
    with pytest.raises(ValueError, match="w2 must be"):
        ops.moe_experts(x, ids, w, w1, w3, ex.down_proj[:3].detach())


def test_swiglu_clamps():
    gt, up = rn(4, 8, scale=20), rn(4, 8, scale=20)
    ref = F.silu(gt.clamp(max=10)) * up.clamp(-10, 10)
    torch.testing.assert_close(ops.swiglu(gt, up, 10.0), ref)
    torch.testing.assert_close(ops.swiglu(gt, up, 0.0), F.silu(gt) * up)
    torch.library.opcheck(torch.ops.deepfuse.swiglu, (gt, up, 10.0))


# ----------------------------------------------------------------------------- the C++ launchers' checks
# csrc/{norm,compressor,mhc}/api.cpp check every tensor behind the Python checks: dtype and
# shape errors name the argument and come before the device check (so they run on CPU).
_needs_ext = pytest.mark.skipif(not _ext.has_cuda_kernels(), reason="needs the compiled extension")
BF16, F32, I64 = torch.bfloat16, torch.float32, torch.int64


def _call(fn, base, change, match):
    with pytest.raises(ValueError, match=match):
        fn(**{**base, **change})


def _rows_args():
    return dict(x=torch.zeros(4, 64, dtype=BF16), y=torch.zeros(4, 64, dtype=BF16), norm=True,
                weight=torch.ones(64), eps=1e-6, cos=torch.ones(4, 16), sin=torch.zeros(4, 16))


@_needs_ext
@pytest.mark.parametrize("change, match", [
    (dict(x=torch.zeros(4, 64)), r"norm_rope: argument 'x' must be bfloat16 \(got float32\[4, 64\] on cpu\)"),
    (dict(x=torch.zeros(4, 60, dtype=BF16)), "argument 'x' must have rows of D values, D % 8 == 0"),
    (dict(y=torch.zeros(4, 32, dtype=BF16)), "argument 'y' must have x's shape"),
    (dict(y=torch.zeros(4, 64)), "argument 'y' must be bfloat16"),
    (dict(weight=torch.ones(32)), r"argument 'weight' must have shape \[64\]"),
    (dict(weight=torch.ones(64, dtype=BF16)), "argument 'weight' must be float32"),
    (dict(cos=torch.ones(3, 16), sin=torch.zeros(3, 16)), r"argument 'cos' must be \[\*L, half\]"),
    (dict(sin=torch.zeros(4, 8)), "argument 'sin' must have cos's shape"),
    (dict(cos=None), "argument 'sin' must be None when cos is"),
    (dict(cos=torch.ones(4, 40), sin=torch.zeros(4, 40)), "argument 'cos' must have at most D / 2 = 32 columns"),
    (dict(store="kv_fp8", pages=torch.zeros(2, 16 * 584, dtype=torch.uint8), slots=torch.zeros(4, dtype=I64)),
     "argument 'store' kv_fp8 takes rows of 512 values"),
    (dict(store="dense", pages=torch.zeros(2, 16, 64, dtype=BF16), slots=torch.zeros(4, dtype=torch.int32)),
     "argument 'slots' must be int64"),
    (dict(store="dense", pages=torch.zeros(2, 16, 64), slots=torch.zeros(4, dtype=I64)),
     "argument 'pages' must be bfloat16"),
    (dict(store="bogus"), "argument 'store' must be none, kv_fp8, idx_fp8, idx_fp8_ue8m0 or dense"),
    (dict(pages=torch.zeros(2, 16, 64, dtype=BF16)), "argument 'pages' must be None when store is none"),
    (dict(x=torch.zeros(4, 2, 64, dtype=BF16), y=None, store="dense", pages=torch.zeros(2, 16, 64, dtype=BF16),
          slots=torch.zeros(4, dtype=I64)), r"argument 'x' must be \[N, D\] rows with cos \[N, half\] for a store"),
    (dict(), "argument 'x' must be a CUDA tensor"),
    (dict(x=torch.zeros(4, 2, 64, dtype=BF16), y=torch.zeros(4, 2, 64, dtype=BF16)), "argument 'x' must be a CUDA"),
])
def test_norm_rope_launcher_rejects(change, match):
    _call(_ext._C.norm_rope, _rows_args(), change, match)


def _compress_args(nb=3, r=4, w=128, N=6, S=5):
    return dict(kv=torch.zeros(N, w, dtype=BF16), score=torch.zeros(N, w, dtype=BF16),
                state_kv=torch.zeros(S, w, dtype=BF16), state_score=torch.zeros(S, w, dtype=BF16),
                ape=torch.zeros(r, w), src_fresh=torch.zeros(nb, r, dtype=I64), src_state=torch.zeros(nb, r, dtype=I64),
                src_ape=torch.zeros(nb, r, dtype=I64), src_is_fresh=torch.zeros(nb, r, dtype=torch.bool),
                src_valid=torch.zeros(nb, r, dtype=torch.bool), overlap=False, norm_weight=torch.ones(w), eps=1e-6,
                cos=torch.ones(nb, 32), sin=torch.zeros(nb, 32), y=torch.zeros(nb, w, dtype=BF16), store="idx_fp8",
                pages=torch.zeros(2, 16 * 132, dtype=torch.uint8), slots=torch.zeros(nb, dtype=I64))


@_needs_ext
@pytest.mark.parametrize("change, match", [
    (dict(kv=torch.zeros(6, 128, dtype=torch.float16)), "compress_store: argument 'kv' must be bfloat16"),
    (dict(score=torch.zeros(6, 256, dtype=BF16)[:, :128]), "argument 'score' must have the row stride of 'kv'"),
    (dict(state_score=torch.zeros(5, 64, dtype=BF16)), r"argument 'state_score' must have shape \[5, 128\]"),
    (dict(ape=torch.zeros(4, 128, dtype=BF16)), "argument 'ape' must be float32"),
    (dict(src_valid=torch.zeros(3, 4, dtype=I64)), "argument 'src_valid' must be bool"),
    (dict(src_state=torch.zeros(3, 5, dtype=I64)), r"argument 'src_state' must have shape \[3, 4\]"),
    (dict(overlap=True), r"argument 'src_fresh' must have shape \[\*, 8\]"),
    (dict(norm_weight=torch.ones(64)), r"argument 'norm_weight' must have shape \[128\]"),
    (dict(cos=torch.ones(2, 32)), r"argument 'cos' must have shape \[3, \*\]"),
    (dict(y=torch.zeros(3, 128)), "argument 'y' must be bfloat16"),
    (dict(store="kv_fp8"), "argument 'store' kv_fp8 takes rows of 512 values"),
    (dict(pages=torch.zeros(2, 100, dtype=torch.uint8)), "argument 'pages' must hold whole 132-byte rows"),
    (dict(slots=torch.zeros(2, dtype=I64)), r"argument 'slots' must have shape \[3\]"),
    (dict(), "argument 'kv' must be a CUDA tensor"),
])
def test_compress_store_launcher_rejects(change, match):
    _call(_ext._C.compress_store, _compress_args(), change, match)


@_needs_ext
@pytest.mark.parametrize("change, match", [
    (dict(kv=torch.zeros(4, 64)), "state_store: argument 'kv' must be bfloat16"),
    (dict(kv=torch.zeros(4, 12, dtype=BF16)), "argument 'kv' must have rows of a positive multiple of 8 values"),
    (dict(state_score=torch.zeros(3, 32, dtype=BF16)), r"argument 'state_score' must have shape \[3, 64\]"),
    (dict(slots=torch.zeros(4, dtype=torch.int32)), "argument 'slots' must be int64"),
    (dict(), "argument 'kv' must be a CUDA tensor"),
])
def test_state_store_launcher_rejects(change, match):
    base = dict(kv=torch.zeros(4, 64, dtype=BF16), score=torch.zeros(4, 64, dtype=BF16),
                state_kv=torch.zeros(3, 64, dtype=BF16), state_score=torch.zeros(3, 64, dtype=BF16),
                slots=torch.zeros(4, dtype=I64))
    _call(_ext._C.state_store, base, change, match)


def _mix_args(head=False, T=3, d=64):
    mixes = 4 if head else 24
    return dict(x=torch.zeros(T, 4, d), fn=torch.zeros(mixes, 4 * d), scale=torch.ones(1 if head else 3),
                base=torch.zeros(mixes), y=torch.zeros(T, d), post=None if head else torch.zeros(T, 4),
                comb=None if head else torch.zeros(T, 4, 4), part=torch.zeros(4096), norm_eps=1e-6, hc_eps=1e-6,
                iters=20)


@_needs_ext
@pytest.mark.parametrize("change, match", [
    (dict(x=torch.zeros(3, 4, 64, dtype=torch.float16)), "hc_mix: argument 'x' must be bfloat16 or float32"),
    (dict(x=torch.zeros(3, 3, 64)), r"argument 'x' must be \[\*L, 4, d\] \(4 streams\)"),
    (dict(x=torch.zeros(3, 4, 66), fn=torch.zeros(24, 264)), "argument 'x' must have rows of d values, d % 4 == 0"),
    (dict(fn=torch.zeros(10, 256)), r"argument 'fn' must have 24 \(pre\) or 4 \(head\) rows"),
    (dict(fn=torch.zeros(24, 128)), "argument 'fn' must have size 256 in dim 1"),
    (dict(scale=torch.ones(1)), r"argument 'scale' must have shape \[3\]"),
    (dict(base=torch.zeros(4)), r"argument 'base' must have shape \[24\]"),
    (dict(y=torch.zeros(3, 64, dtype=BF16)), "argument 'y' must be float32"),
    (dict(comb=torch.zeros(3, 4)), r"argument 'comb' must have shape \[3, 4, 4\]"),
    (dict(post=None), "argument 'post' is required"),
    (dict(iters=0), "argument 'iters' must be >= 1"),
    (dict(part=torch.zeros(4096, dtype=BF16)), "argument 'part' must be float32"),
    (dict(), "argument 'x' must be a CUDA tensor"),
    (_mix_args(head=True), "argument 'x' must be a CUDA tensor"),  # head: no post / comb
])
def test_hc_mix_launcher_rejects(change, match):
    _call(_ext._C.hc_mix, _mix_args(), change, match)


@_needs_ext
@pytest.mark.parametrize("change, match", [
    (dict(f=torch.zeros(2, 5, 64, dtype=BF16)), "hc_post: argument 'f' must be float32"),
    (dict(f=torch.zeros(2, 64)), r"argument 'f' must have shape \[2, 5, 64\]"),
    (dict(post=torch.zeros(2, 5, 4, dtype=BF16)), "argument 'post' must be float32"),
    (dict(comb=torch.zeros(2, 5, 4, 4)[..., ::2, :]), "argument 'comb' must have shape"),
    (dict(out=torch.zeros(2, 5, 4, 64).transpose(0, 1)), "argument 'out' must have shape"),
    (dict(out=torch.zeros(2, 5, 64, 4).transpose(-1, -2)), "argument 'out' must be contiguous"),
    (dict(), "argument 'f' must be a CUDA tensor"),
])
def test_hc_post_launcher_rejects(change, match):
    base = dict(f=torch.zeros(2, 5, 64), x=torch.zeros(2, 5, 4, 64), post=torch.zeros(2, 5, 4),
                comb=torch.zeros(2, 5, 4, 4), out=torch.zeros(2, 5, 4, 64))
    _call(_ext._C.hc_post, base, change, match)
