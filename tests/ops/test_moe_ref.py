"""MoE reference semantics on the CPU: the sync-free (capture) form, the shared expert, the
formats, and validation."""
import pytest
import torch

from deepfuse import ops
from deepfuse.ops import moe


def _dense(T=9, d=32, I=16, E=6, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d, generator=g)
    w1, w3 = torch.randn(E, I, d, generator=g) * 0.2, torch.randn(E, I, d, generator=g) * 0.2
    w2 = torch.randn(E, d, I, generator=g) * 0.2
    ids = torch.randint(-1, E + 1, (T, k), generator=g)  # -1 and E: no contribution
    w = torch.rand(T, k, generator=g)
    return x, ids, w, w1, w3, w2


def test_moe_reference_capture_form_matches_eager(monkeypatch):
    x, ids, w, w1, w3, w2 = _dense()
    eager = moe.moe_experts_ref(x, ids, w, w1, w3, w2, None, None, None, "dense", 10.0)
    monkeypatch.setattr(moe, "_capturing", lambda t: True)
    graph = moe.moe_experts_ref(x, ids, w, w1, w3, w2, None, None, None, "dense", 10.0)
    torch.testing.assert_close(graph, eager, rtol=1e-5, atol=1e-5)
    assert eager.abs().sum() > 0


def _swiglu_expert(x, a, b, c, limit):
    return ops.swiglu(x @ a.T, x @ b.T, limit) @ c.T


def test_moe_experts_explicit_sum_with_shared_expert():
    x, ids, w, w1, w3, w2 = _dense(seed=1)
    g = torch.Generator().manual_seed(5)
    sw1, sw3, sw2 = (torch.randn(16, 32, generator=g) * 0.2, torch.randn(16, 32, generator=g) * 0.2,
                     torch.randn(32, 16, generator=g) * 0.2)
    out = ops.moe_experts(x, ids, w, w1, w3, w2, limit=0.8, shared=(sw1, sw3, sw2, None, None, None))
    want = _swiglu_expert(x, sw1, sw3, sw2, 0.8)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if 0 <= e < w1.shape[0]:
                want[t] += w[t, j] * _swiglu_expert(x[t:t + 1], w1[e], w3[e], w2[e], 0.8)[0]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_moe_experts_quantised_formats_equal_their_dequantised_weights():
    x, ids, w, w1, w3, w2 = _dense(T=5, d=64, I=64, E=3, seed=2)
    ids = ids.clamp(0, 2)
    q = {}
    for name, t in (("w1", w1), ("w3", w3), ("w2", w2)):
        fp8 = [ops.fp8_block_cast(t[e], (128, 128), scale_fmt="ue8m0") for e in range(3)]
        mx = [ops.mxfp4_cast(t[e]) for e in range(3)]
        q[name] = {"fp8": tuple(torch.stack(v) for v in zip(*fp8)), "mxfp4": tuple(torch.stack(v) for v in zip(*mx))}
    for fmt in ("fp8", "mxfp4"):
        (a, sa), (b, sb), (c, sc) = q["w1"][fmt], q["w3"][fmt], q["w2"][fmt]
        out = ops.moe_experts(x, ids, w, a, b, c, s1=sa, s3=sb, s2=sc, fmt=fmt, limit=5.0)
        deq = [torch.stack([ops.linear.dequant_weight(m[e], s[e], fmt) for e in range(3)]) for m, s in
               ((a, sa), (b, sb), (c, sc))]
        ref = ops.moe_experts(x, ids, w, *deq, limit=5.0)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert (ref - ops.moe_experts(x, ids, w, w1, w3, w2, limit=5.0)).abs().max() > 0  # quantisation is real


def test_moe_validation_names_the_argument():
    x, ids, w, w1, w3, w2 = _dense()
    with pytest.raises(TypeError, match="ids"):
        ops.moe_experts(x, ids.float(), w, w1, w3, w2)
    with pytest.raises(ValueError, match="weights"):
        ops.moe_experts(x, ids, w[:3], w1, w3, w2)
    with pytest.raises(ValueError, match="fmt"):
        ops.moe_experts(x, ids, w, w1, w3, w2, fmt="int4")
    with pytest.raises(ValueError, match="w3"):
        ops.moe_experts(x, ids, w, w1, w3[:, :8], w2)
    with pytest.raises((ValueError, TypeError), match="scale"):
        ops.moe_experts(x, ids, w, w1.to(torch.float8_e4m3fn), w3.to(torch.float8_e4m3fn),
                        w2.to(torch.float8_e4m3fn), fmt="fp8")
    with pytest.raises(ValueError, match="shared"):
        ops.moe_experts(x, ids, w, w1, w3, w2, shared=(w1[0], w3[0]))
    with pytest.raises(ValueError, match="shared w2"):
        ops.moe_experts(x, ids, w, w1, w3, w2, shared=(w1[0], w3[0], w2[0][:5], None, None, None))
    with pytest.raises(ValueError, match="k"):
        ops.moe_route(torch.randn(4, 8), 9)
    with pytest.raises(ValueError, match="score_func"):
        ops.moe_route(torch.randn(4, 8), 2, score_func="relu")
    with pytest.raises(ValueError, match="hash_ids"):
        ops.moe_route(torch.randn(4, 8), 2, hash_ids=torch.zeros(4, 3, dtype=torch.int64))
