"""MoE reference semantics on the CPU: the sync-free (capture) form, the shared expert, the
formats, and validation; the C++ launchers' own checks (dtype, shape, device) run on the CPU too."""
import pytest
import torch

from deepfuse import _ext, ops
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


# ----------------------------------------------------------------------------- the C++ launchers' checks
FP8 = torch.float8_e4m3fn
needs_ext = pytest.mark.skipif(not _ext.has_cuda_kernels(), reason="needs the compiled extension")


def _launch_args(T=4, d=256, I=128, E=3, k=2, fmt="fp8", shared=False, device="cpu"):
    """moe_experts launcher arguments, every one well formed (on the CPU the launcher must
    still refuse: its tensors are not CUDA tensors)."""
    def weight(*n_k):
        N, K = n_k[-2:]
        lead = n_k[:-2]
        if fmt == "fp8" or not lead:
            return (torch.zeros(*lead, N, K, dtype=FP8, device=device),
                    torch.zeros(*lead, -(-N // 128), -(-K // 128), device=device))
        return (torch.zeros(*lead, N, K // 2, dtype=torch.uint8, device=device),
                torch.zeros(*lead, N, K // 32, dtype=torch.uint8, device=device))

    a = dict(x=torch.zeros(T, d, dtype=torch.bfloat16, device=device),
             ids=torch.zeros(T, k, dtype=torch.int64, device=device), weights=torch.zeros(T, k, device=device),
             out=torch.empty(T, d, dtype=torch.bfloat16, device=device), limit=0.0)
    for name, shape in (("w1", (E, I, d)), ("w3", (E, I, d)), ("w2", (E, d, I))):
        a[name], a[name + "_scale"] = weight(*shape)
        if shared:
            a["shared_" + name], a[f"shared_{name}_scale"] = weight(*shape[1:])
    nbytes = _ext._C.moe_workspace_bytes(T=T, d=d, inter=I, E=E, k=k, shared=shared)
    a["workspace"] = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return a


@needs_ext
@pytest.mark.parametrize("change, match", [
    (dict(), r"moe_experts: argument 'x' must be a CUDA tensor \(got bfloat16\[4, 256\] on cpu\)"),
    (dict(shared=True), r"argument 'x' must be a CUDA tensor"),
    (dict(fmt="mxfp4", shared=True), r"argument 'x' must be a CUDA tensor"),
    (dict(x=torch.zeros(4, 256, dtype=torch.float16)), r"argument 'x' must be bfloat16 or float32"),
    (dict(x=torch.zeros(4, 200, dtype=torch.bfloat16)), r"argument 'x' must have d % 32 == 0"),
    (dict(ids=torch.zeros(4, 2)), r"argument 'ids' must be int32 or int64"),
    (dict(ids=torch.zeros(5, 2, dtype=torch.int64)), r"argument 'ids' must have size 4 in dim 0"),
    (dict(weights=torch.zeros(4, 3)), r"argument 'weights' must have shape \[4, 2\]"),
    (dict(weights=torch.zeros(4, 2, dtype=torch.bfloat16)), r"argument 'weights' must be float32"),
    (dict(w1=torch.zeros(3, 128, 256)), r"argument 'w1' must be float8_e4m3fn or uint8"),
    (dict(w3=torch.zeros(3, 128, 128, dtype=torch.uint8)), r"argument 'w3' must be float8_e4m3fn \(got uint8"),
    (dict(w2=torch.zeros(3, 256, 64, dtype=FP8)), r"argument 'w2' must have shape \[3, 256, 128\]"),
    (dict(w2=torch.zeros(3, 128, 256, dtype=FP8).transpose(1, 2)), r"argument 'w2' must be contiguous"),
    (dict(w2_scale=torch.zeros(3, 1, 2)), r"argument 'w2_scale' must have shape \[3, 2, 1\]"),
    (dict(w1_scale=torch.zeros(3, 1, 2, dtype=torch.float16)), r"argument 'w1_scale' must be float32 or uint8"),
    (dict(w1_scale=None), r"argument 'w1_scale' is required"),
    (dict(out=torch.empty(4, 256)), r"argument 'out' must be bfloat16"),
    (dict(out=torch.empty(4, 128, dtype=torch.bfloat16)), r"argument 'out' must have shape \[4, 256\]"),
    (dict(workspace=torch.empty(64, dtype=torch.uint8)), r"argument 'workspace' must hold at least \d+ bytes"),
    (dict(workspace=torch.empty(1 << 20)), r"argument 'workspace' must be uint8"),
    (dict(shared_w3=torch.zeros(128, 256, dtype=FP8)), r"argument 'shared_w3' must be None without shared_w1"),
    (dict(stream_max_t=-1), r"argument 'stream_max_t' must be >= 0"),
    (dict(prefill_min_t=-1), r"argument 'prefill_min_t' must be >= 0"),
])
def test_moe_experts_launcher_rejects(change, match):
    sizes = {k: v for k, v in change.items() if k in ("shared", "fmt")}
    a = _launch_args(**sizes)
    a.update({k: v for k, v in change.items() if k not in sizes})
    with pytest.raises(ValueError, match=match):
        _ext._C.moe_experts(**a)


@needs_ext
def test_moe_experts_launcher_rejects_formats():
    a = _launch_args(fmt="mxfp4")
    a["w1_scale"] = a["w1_scale"].float()
    with pytest.raises(ValueError, match=r"argument 'w1_scale' must be uint8 \(got float32\[3, 128, 8\]"):
        _ext._C.moe_experts(**a)
    a = _launch_args(fmt="mxfp4", I=96)  # mxfp4 kernels: d and inter multiples of 128
    with pytest.raises(ValueError, match=r"argument 'w1' \(mxfp4\) needs d and inter multiples of 128"):
        _ext._C.moe_experts(**a)
    a = _launch_args(shared=True)
    a["shared_w2"] = a["shared_w2"][:, :64]  # the shared expert's inter must be the experts'
    with pytest.raises(ValueError, match=r"argument 'shared_w2' must have shape \[256, 128\]"):
        _ext._C.moe_experts(**a)
    a = _launch_args(shared=True)
    a["shared_w1_scale"] = None
    with pytest.raises(ValueError, match=r"argument 'shared_w1_scale' is required"):
        _ext._C.moe_experts(**a)
    with pytest.raises(ValueError, match=r"moe_workspace_bytes: argument 'E' must be >= 1"):
        _ext._C.moe_workspace_bytes(T=4, d=256, inter=128, E=0, k=2)
    with pytest.raises(TypeError):  # keywords name the sizes; no problem tuple
        _ext._C.moe_workspace_bytes((4, 256, 128, 3, 2))


def _route_args(T=4, E=8, k=2, device="cpu", **change):
    a = dict(logits=torch.zeros(T, E, device=device), bias=torch.zeros(E, device=device), hash_ids=None,
             weights=torch.empty(T, k, device=device), ids=torch.empty(T, k, dtype=torch.int64, device=device),
             route_scale=1.0, score_func="sqrtsoftplus")
    a.update(change)
    return a


@needs_ext
@pytest.mark.parametrize("change, match", [
    (dict(), r"moe_route: argument 'logits' must be a CUDA tensor \(got float32\[4, 8\] on cpu\)"),
    (dict(logits=torch.zeros(4, 8, dtype=torch.bfloat16)), r"argument 'logits' must be float32"),
    (dict(logits=torch.zeros(4, 2048)), r"argument 'logits' must have at most 1024 experts"),
    (dict(bias=torch.zeros(7)), r"argument 'bias' must have shape \[8\]"),
    (dict(hash_ids=torch.zeros(4, 2)), r"argument 'hash_ids' must be int32 or int64"),
    (dict(hash_ids=torch.zeros(4, 3, dtype=torch.int32)), r"argument 'hash_ids' must have shape \[4, 2\]"),
    (dict(ids=torch.empty(4, 2, dtype=torch.int32)), r"argument 'ids' must be int64"),
    (dict(weights=torch.empty(4, 9)), r"argument 'weights' must have k in \[1, min\(32, E\)\]"),
    (dict(weights=torch.empty(3, 2)), r"argument 'weights' must have size 4 in dim 0"),
    (dict(score_func="relu"), r"argument 'score_func' must be sqrtsoftplus, sigmoid or softmax"),
])
def test_moe_route_launcher_rejects(change, match):
    with pytest.raises(ValueError, match=match):
        _ext._C.moe_route(**_route_args(**change))


@needs_ext
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("shared", [False, True])
def test_moe_kernel_path_passes_the_launcher_checks(monkeypatch, fmt, shared):
    """The CUDA registrations' keywords, dtypes and shapes pass every launcher check but the
    device one (CPU tensors here, so the launchers refuse before any launch)."""
    monkeypatch.setattr(_ext, "ext", lambda device: _ext._C)
    a = _launch_args(fmt=fmt, shared=shared)
    sh = tuple(a.get("shared_" + n) for n in ("w1", "w3", "w2", "w1_scale", "w3_scale", "w2_scale"))
    with pytest.raises(ValueError, match="moe_experts: argument 'x' must be a CUDA tensor"):
        moe._moe_experts.kernels["cuda"](a["x"], a["ids"].int(), a["weights"].bfloat16(), a["w1"], a["w3"], a["w2"],
                                         a["w1_scale"], a["w3_scale"], a["w2_scale"], fmt, 0.5, *sh)
    with pytest.raises(ValueError, match="moe_route: argument 'logits' must be a CUDA tensor"):
        moe._moe_route.kernels["cuda"](torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(8), 2, 1.0, "sigmoid",
                                       torch.zeros(4, 2, dtype=torch.int32) if shared else None)


@pytest.mark.gpu
def test_moe_launchers_reject_mixed_devices_and_small_workspace():
    a = _launch_args(shared=True, device="cuda")
    a["w2_scale"] = a["w2_scale"].cpu()
    with pytest.raises(ValueError, match="moe_experts: argument 'w2_scale' must be a CUDA tensor"):
        _ext._C.moe_experts(**a)
    a = _launch_args(device="cuda")
    a["workspace"] = a["workspace"][:-256]
    with pytest.raises(ValueError, match=r"argument 'workspace' must hold at least \d+ bytes"):
        _ext._C.moe_experts(**a)
    with pytest.raises(ValueError, match="moe_route: argument 'bias' must be a CUDA tensor"):
        _ext._C.moe_route(**_route_args(device="cuda", bias=torch.zeros(8)))
    for fmt in ("fp8", "mxfp4"):  # well-formed arguments launch: zero x -> zero out
        a = _launch_args(fmt=fmt, shared=True, device="cuda")
        a["out"].fill_(float("nan"))
        _ext._C.moe_experts(**a)
        assert torch.equal(a["out"], torch.zeros_like(a["out"])), fmt
    r = _route_args(device="cuda", logits=torch.arange(32.0, device="cuda").view(4, 8))
    _ext._C.moe_route(**r)
    assert torch.equal(r["ids"].sort(-1).values, torch.tensor([[6, 7]] * 4, device="cuda"))


def test_moe_gate_experts_is_router_then_experts():
    x, _, _, w1, w3, w2 = _dense(seed=3)
    g = torch.Generator().manual_seed(7)
    gw, bias = torch.randn(6, 32, generator=g), torch.randn(6, generator=g) * 0.1
    out, w, ids = moe.moe_gate_experts(x, gw, 2, w1, w3, w2, bias=bias, route_scale=1.5, score_func="sigmoid",
                                       limit=0.8)
    w_r, ids_r = ops.moe_route(torch.nn.functional.linear(x, gw), 2, bias=bias, route_scale=1.5, score_func="sigmoid")
    assert torch.equal(ids, ids_r) and torch.equal(w, w_r)
    torch.testing.assert_close(out, ops.moe_experts(x, ids_r, w_r, w1, w3, w2, limit=0.8), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"moe_gate_experts: gate_weight must have shape \[6, 32\]"):
        moe.moe_gate_experts(x, gw[:, :16], 2, w1, w3, w2)
    with pytest.raises(ValueError, match=r"moe_gate_experts: w1 must be \[5, ...\]"):
        moe.moe_gate_experts(x, gw[:5], 2, w1, w3, w2)


def _gate_args(fmt="fp8", **change):
    a = _launch_args(fmt=fmt, shared=True)
    del a["ids"], a["weights"]
    T, d, E, k = 4, 256, 3, 2
    a.update(gate_weight=torch.zeros(E, d), gate_bias=None, hash_ids=None, route_scale=1.0, score_func="sigmoid",
             ids=torch.empty(T, k, dtype=torch.int64), weights=torch.empty(T, k))
    a.update(change)
    return a


@needs_ext
@pytest.mark.parametrize("change, match", [
    (dict(), r"moe_gate_experts: argument 'x' must be a CUDA tensor"),
    (dict(gate_weight=torch.zeros(3, 128)), r"argument 'gate_weight' must have shape \[3, 256\]"),
    (dict(gate_weight=torch.zeros(3, 256, dtype=torch.bfloat16)), r"argument 'gate_weight' must be float32"),
    (dict(gate_bias=torch.zeros(4)), r"argument 'gate_bias' must have shape \[3\]"),
    (dict(ids=torch.empty(4, 2, dtype=torch.int32)), r"argument 'ids' must be int64"),
    (dict(weights=torch.empty(4, 4)), r"argument 'weights' must have k in \[1, min\(32, E\)\]"),
    (dict(hash_ids=torch.zeros(4, 3, dtype=torch.int32)), r"argument 'hash_ids' must have shape \[4, 2\]"),
    (dict(score_func="relu"), r"argument 'score_func' must be sqrtsoftplus, sigmoid or softmax"),
    (dict(x=torch.zeros(257, 256, dtype=torch.bfloat16)), r"argument 'x' must have at most 256 rows"),
])
def test_moe_gate_experts_launcher_rejects(change, match):
    with pytest.raises(ValueError, match=match):
        _ext._C.moe_gate_experts(**_gate_args(**change))


@needs_ext
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_moe_gate_kernel_path_passes_the_launcher_checks(monkeypatch, fmt):
    monkeypatch.setattr(_ext, "ext", lambda device: _ext._C)
    monkeypatch.setattr(moe, "GATE_FUSED_MAX_T", 256)
    monkeypatch.setattr(moe, "kernels_off_reason", lambda: None)
    a = _gate_args(fmt=fmt)
    sh = tuple(a.get("shared_" + n) for n in ("w1", "w3", "w2", "w1_scale", "w3_scale", "w2_scale"))
    with pytest.raises(ValueError, match="moe_gate_experts: argument 'x' must be a CUDA tensor"):
        moe._moe_gate_experts.kernels["cuda"](a["x"], a["gate_weight"], torch.zeros(3), 2, 1.0, "sigmoid", None,
                                              a["w1"], a["w3"], a["w2"], a["w1_scale"], a["w3_scale"], a["w2_scale"],
                                              fmt, 0.5, *sh)
