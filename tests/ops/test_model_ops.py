"""The model-graph ops (rms_norm, rope, mHC, sparse attention, indexer scores, compressor
pooling, quantised linears, MoE): reference semantics, agreement with the transformers
oracle's components, opcheck, validation errors. CPU only; GPU kernels come later."""
import pytest
import torch
import torch.nn.functional as F

from deepfuse import ops

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
