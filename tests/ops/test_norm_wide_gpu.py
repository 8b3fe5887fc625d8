"""csrc/norm's row kernel on rows wider than a warp holds (4096 < D <= 16384: DeepSeek V4.1's
hidden 5120, V4-Pro's 7168; one block of 4 warps per row, csrc/norm/norm_rope.cu) against the
references: rms_norm with and without a weight, norm_rope / rope over heads, strided rows,
the warp kernel's side of the boundary, rejections past it. Fresh random inputs, poisoned
outputs, every element checked."""
import pytest
import torch

from deepfuse import _ext, ops
from deepfuse.ops._fallback import NoKernelError
from deepfuse.ops.norm import norm_rope_ref, rms_norm_ref
from deepfuse.ops.rope import rope_ref

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16_ULP = 2.0 ** -7


def _g(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def _randn(*shape, g, scale=1.0):
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(torch.bfloat16)


def _close_bf16(out, ref, ulps):
    """|out - ref| <= ulps bf16 ulps of |ref| (+ the same of the row's rms for values near 0)."""
    o, r = out.float(), ref.float()
    assert o.shape == r.shape
    tol = ulps * BF16_ULP * (r.abs() + r.square().mean(-1, keepdim=True).sqrt() * 2 ** -6)
    bad = ~((o - r).abs() <= tol)  # NaN fails
    assert not bad.any(), f"{bad.sum().item()} of {bad.numel()} values off; max err {(o - r).abs().max().item()}"


@pytest.mark.parametrize("D", [4104, 5120, 7168, 8192, 12288, 16384])
@pytest.mark.parametrize("rows", [1, 3, 37, 2049])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_wide(D, rows, weighted):
    g = _g(D + rows)
    x = _randn(rows, D, g=g, scale=3.0)
    w = torch.rand(D, generator=g, device=DEV) + 0.5 if weighted else None
    out = ops.rms_norm(x, w, 1e-6)
    _close_bf16(out, rms_norm_ref(x, w, 1e-6), 1)  # the sum order and rsqrt differ from torch's


def test_rms_norm_wide_leading_dims_eps_and_strided_rows():
    g = _g(1)
    x = _randn(2, 3, 5, 5120, g=g)  # [*L, D]
    w = torch.rand(5120, generator=g, device=DEV).to(torch.bfloat16)  # read as fp32
    _close_bf16(ops.rms_norm(x, w, 1e-20), rms_norm_ref(x, w, 1e-20), 1)  # V4.1's eps
    big = _randn(9, 6144, g=g)
    v = big[:, 512:512 + 5120]  # strided 2-D rows (the launcher copies what it must)
    _close_bf16(ops.rms_norm(v, None, 1e-6), rms_norm_ref(v, None, 1e-6), 1)
    zero = torch.zeros(4, 5120, dtype=torch.bfloat16, device=DEV)
    assert torch.equal(ops.rms_norm(zero, None, 1e-6), zero)


def test_wide_launcher_writes_every_value_and_nothing_else():
    """Through the typed launcher with a poisoned output (and its tail): every value written."""
    g = _g(2)
    D, rows = 5120, 13
    x = _randn(rows, D, g=g)
    w = torch.rand(D, generator=g, device=DEV) + 0.5
    y = torch.full((rows + 1, D), float("nan"), dtype=torch.bfloat16, device=DEV)
    _ext.ext(x.device).norm_rope(x=x, y=y[:rows], norm=True, weight=w, eps=1e-6)
    _close_bf16(y[:rows], rms_norm_ref(x, w, 1e-6), 1)
    assert y[rows].isnan().all()


@pytest.mark.parametrize("inverse", [False, True])
def test_norm_rope_wide_over_heads(inverse):
    """x [T, H, D] with cos / sin per token [T, half]: norm_rope is rope(rms_norm) bit for bit
    (the same device code) and within two roundings of the reference; rope alone within one."""
    g = _g(3)
    T, H, D, half = 5, 3, 5120, 32
    x = _randn(T, H, D, g=g, scale=2.0)
    a = torch.rand(T, half, generator=g, device=DEV) * 6.3
    cos, sin = a.cos().contiguous(), a.sin().contiguous()
    fused = ops.norm_rope(x, None, 1e-6, cos, sin)
    assert torch.equal(fused, ops.rope(ops.rms_norm(x, None, 1e-6), cos, sin))
    _close_bf16(fused, norm_rope_ref(x, None, 1e-6, cos, sin), 2)
    out = ops.rope(x, cos, sin, inverse=inverse)
    assert torch.equal(out[..., :-2 * half], x[..., :-2 * half])
    _close_bf16(out, rope_ref(x, cos, sin, inverse), 1)


def test_boundary_and_rejections():
    g = _g(4)
    x = _randn(7, 4096, g=g)  # the warp kernel's widest: unchanged
    _close_bf16(ops.rms_norm(x, None, 1e-6), rms_norm_ref(x, None, 1e-6), 1)
    for D in (16392, 5124):  # past the widest / not a multiple of 8: no kernel
        with pytest.raises(NoKernelError, match=f"x rows are {D} wide"):
            ops.rms_norm(_randn(2, D, g=g))
    with pytest.raises(Exception, match="D <= 16384"):
        _ext.ext(x.device).norm_rope(x=_randn(2, 16392, g=g), y=torch.empty(2, 16392, dtype=torch.bfloat16,
                                                                            device=DEV), norm=True)


def test_v41_flash_widths_need_no_norm_reference():
    """models.references: at V4.1-Flash widths rms_norm is no longer a kernel gap."""
    from deepfuse.ops._rows import rows_gap

    assert rows_gap(5120, torch.bfloat16) is None and rows_gap(7168, torch.bfloat16) is None


@pytest.mark.sanitize
def test_norm_wide_sanitize_small():
    """Both wide instantiations (CPT 8, 16) once, small, for compute-sanitizer."""
    g = _g(5)
    for D in (5120, 16384):
        x = _randn(3, D, g=g)
        w = torch.rand(D, generator=g, device=DEV)
        _close_bf16(ops.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), 1)
        xh = _randn(2, 2, D, g=g)
        a = torch.rand(2, 32, generator=g, device=DEV)
        _close_bf16(ops.norm_rope(xh, None, 1e-6, a.cos(), a.sin()), norm_rope_ref(xh, None, 1e-6, a.cos(), a.sin()),
                    2)
