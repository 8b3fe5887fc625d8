"""ops.indexer_logits_paged's C++ launcher (csrc/indexer/api.cpp): it checks every tensor behind
the op's Python checks. The kernel against its reference: tests/ops/test_rows_gpu.py."""
import pytest
import torch

from deepfuse import _ext
from deepfuse import kv_format as F

needs_ext = pytest.mark.skipif(not _ext.has_cuda_kernels(), reason="needs the compiled extension")
BF16 = torch.bfloat16


def _launch_args(N=3, B=2, C=40, ps=16, P=4, H=64, device="cpu"):
    """Valid keyword arguments of _C.indexer_logits_paged."""
    a = dict(q=torch.zeros(N, H, 128, dtype=BF16), weights=torch.zeros(N, H),
             pages=torch.zeros(P, ps * F.IDX_ROW_BYTES, dtype=torch.uint8),
             entry_slots=torch.zeros(B, C, dtype=torch.int64), token_req=torch.zeros(N, dtype=torch.int64),
             n_vis=torch.zeros(N, dtype=torch.int32), scale=0.1, out=torch.empty(N, C))
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in a.items()}


@needs_ext
@pytest.mark.parametrize("change,match", [
    (dict(q=torch.zeros(3, 64, 128)), r"argument 'q' must be bfloat16 \(got float32\[3, 64, 128\] on cpu\)"),
    (dict(q=torch.zeros(3, 48, 128, dtype=BF16)), "argument 'q' must have 32 or 64 heads"),
    (dict(q=torch.zeros(3, 64, 64, dtype=BF16)), r"argument 'q' must have shape \[\*, 64, 128\]"),
    (dict(q=torch.zeros(3, 32, 128, dtype=BF16)), r"argument 'weights' must have shape \[3, 32\]"),
    (dict(q=torch.zeros(3, 128, 64, dtype=BF16).transpose(1, 2)), "argument 'q' must be contiguous"),
    (dict(weights=torch.zeros(3, 64, dtype=BF16)), "argument 'weights' must be float32"),
    (dict(weights=torch.zeros(2, 64)), r"argument 'weights' must have shape \[3, 64\]"),
    (dict(pages=torch.zeros(4, 16, 128, dtype=BF16)), "argument 'pages' must be uint8"),
    (dict(pages=torch.zeros(4, 16 * 132 + 4, dtype=torch.uint8)), r"argument 'pages' must be FP8 key pages"),
    (dict(pages=torch.zeros(4, 2 * 132, dtype=torch.uint8)), "must have a stride in dim 0 that is a multiple of 16"),
    (dict(entry_slots=torch.zeros(2, 40, dtype=torch.int32)), "argument 'entry_slots' must be int64"),
    (dict(entry_slots=torch.zeros(40, 2, dtype=torch.int64).t()), "argument 'entry_slots' must have stride 1"),
    (dict(token_req=torch.zeros(3, dtype=torch.int32)), "argument 'token_req' must be int64"),
    (dict(n_vis=torch.zeros(4, dtype=torch.int32)), r"argument 'n_vis' must have shape \[3\]"),
    (dict(n_vis=torch.zeros(3, dtype=torch.int64)), "argument 'n_vis' must be int32"),
    (dict(out=torch.empty(3, 41)), r"argument 'out' must have shape \[3, 40\]"),
    (dict(out=torch.empty(3, 40, dtype=torch.float64)), "argument 'out' must be float32"),
    (dict(), "argument 'q' must be a CUDA tensor"),
])
def test_launcher_rejects_dtype_shape_and_device(change, match):
    """dtype and shape errors come before the device check, so a CPU call reaches them."""
    with pytest.raises(ValueError, match=match):
        _ext._C.indexer_logits_paged(**{**_launch_args(), **change})


@needs_ext
def test_launcher_valid_arguments_reach_the_device_check():
    # any number of tokens per request (the kernel groups a request's tokens by the shapes alone)
    for kw in (dict(N=0), dict(C=0), dict(ps=64, P=1), dict(N=8, B=2), dict(N=7, B=2), dict(N=6, B=2),
               dict(N=1, B=5), dict(H=32)):
        with pytest.raises(ValueError, match="argument 'q' must be a CUDA tensor"):
            _ext._C.indexer_logits_paged(**_launch_args(**kw))
    with pytest.raises(TypeError):  # keywords only
        _ext._C.indexer_logits_paged(*_launch_args().values())


@pytest.mark.gpu
def test_gpu_launcher_rejects_mixed_devices():
    a = _launch_args(device="cuda")
    for name in ("weights", "n_vis", "out"):
        with pytest.raises(ValueError, match=f"argument '{name}' must be a CUDA tensor"):
            _ext._C.indexer_logits_paged(**{**a, name: a[name].cpu()})
    _ext._C.indexer_logits_paged(**a)  # the same arguments on one device run
    torch.cuda.synchronize()
    assert bool((a["out"] == float("-inf")).all())  # n_vis = 0: nothing visible


def test_quantize_q_e4m3_rule():
    """q_fp8's rounding (ops.indexer.quantize_q_e4m3): per row a power-of-two scale with amax / s in
    [128, 256), values e4m3(q / s) * s (nearest even), zeros and tiny rows included."""
    from deepfuse.ops.indexer import quantize_q_e4m3

    g = torch.Generator().manual_seed(3)
    q = (torch.randn(6, 128, generator=g) * torch.tensor([1.0, 2.0 ** -40, 2.0 ** 40, 3.0, 0.0, 2.0 ** -125])[:, None])
    q = q.to(BF16)
    out = quantize_q_e4m3(q)
    amax = q.float().abs().amax(-1)
    for i in range(6):
        if amax[i] == 0:
            assert (out[i] == 0).all()
            continue
        e = int(torch.floor(torch.log2(amax[i].double())))
        s = 2.0 ** (max(e + 127, 8) - 134)
        x = q[i].double() / s
        if e + 127 >= 8:
            assert 128 <= x.abs().max() < 256
        want = x.float().to(torch.float8_e4m3fn).double() * s
        assert torch.equal(out[i].double(), want)
        assert ((out[i] - q[i].float()).abs() <= 2.0 ** -4 * q[i].float().abs() + s * 2.0 ** -10).all()


def test_reference_q_fp8_rounds_q_only():
    """indexer_logits_paged_ref(q_fp8=True) is the plain reference of the rounded q."""
    from deepfuse.ops.indexer import indexer_logits_paged_ref, quantize_q_e4m3

    g = torch.Generator().manual_seed(4)
    N, C, ps = 3, 20, 16
    pages = torch.randn(2, ps, 128, generator=g)
    q = torch.randn(N, 32, 128, generator=g).to(BF16)
    w = torch.randn(N, 32, generator=g)
    entry = torch.randint(-1, 2 * ps, (2, C), generator=g)
    req = torch.tensor([0, 1, 1])
    nv = torch.tensor([20, 5, 0], dtype=torch.int32)
    a = indexer_logits_paged_ref(q, w, pages, ps, entry, req, nv, 0.5, True)
    b = indexer_logits_paged_ref(quantize_q_e4m3(q), w, pages, ps, entry, req, nv, 0.5)
    assert torch.equal(a, b)
    c = indexer_logits_paged_ref(q, w, pages, ps, entry, req, nv, 0.5)
    assert not torch.equal(a, c)
