"""mHC kernels (csrc/mhc) against their references on the GPU: random streams and
parameters, every element; fp32 streams within 2e-5 (summation order), bf16 within
bf16 rounding of the output (2e-2 relative + 1e-2 of the max)."""
import pytest
import torch

from deepfuse import ops
from deepfuse.ops import mhc as M

pytestmark = pytest.mark.gpu
DEV = "cuda"


def params(n, d, rows, g, scale_n=3):
    fn = torch.randn(rows, n * d, device=DEV, generator=g) * (n * d) ** -0.5
    return fn, torch.rand(scale_n, device=DEV, generator=g) + 0.5, torch.randn(rows, device=DEV, generator=g) * 0.3


def close(out, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5 * ref.abs().max().item())
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=1e-2 * ref.float().abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead,d", [((1,), 4096), ((3, 5), 64), ((257,), 4096), ((64,), 7168), ((2, 1), 4100),
                                    ((70000,), 64)])  # the last: more tokens than a grid's y extent
def test_hc_pre_post_head_match_reference(dtype, lead, d):
    g = torch.Generator(device=DEV).manual_seed(d + len(lead))
    x = torch.randn(*lead, 4, d, device=DEV, generator=g).to(dtype)
    fn, scale, base = params(4, d, 24, g)
    y, post, comb = ops.hc_pre(x, fn, scale, base)
    yr, pr, cr = M.hc_pre_ref(x, fn, scale, base, 1e-6, 1e-6, 20)
    assert y.dtype == dtype and torch.isfinite(y).all()
    torch.testing.assert_close(post, pr, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(comb, cr, rtol=1e-4, atol=1e-5)
    close(y, yr, dtype)
    f = torch.randn(*lead, d, device=DEV, generator=g).to(dtype)
    close(ops.hc_post(f, x, post, comb), M.hc_post_ref(f, x, post, comb), dtype)
    hfn, hscale, hbase = params(4, d, 4, g, scale_n=1)
    close(ops.hc_head(x, hfn, hscale, hbase), M.hc_head_ref(x, hfn, hscale, hbase, 1e-6, 1e-6), dtype)


def test_mhc_launchers_reject_mixed_devices():
    from deepfuse import _ext

    x = torch.zeros(3, 4, 64, device=DEV)
    with pytest.raises(ValueError, match="hc_post: argument 'comb' must be a CUDA tensor"):
        _ext._C.hc_post(f=torch.zeros(3, 64, device=DEV), x=x, post=torch.zeros(3, 4, device=DEV),
                        comb=torch.zeros(3, 4, 4), out=torch.empty_like(x))
    with pytest.raises(ValueError, match="hc_mix: argument 'part' must hold"):
        _ext._C.hc_mix(x=x, fn=torch.zeros(4, 256, device=DEV), scale=torch.ones(1, device=DEV),
                       base=torch.zeros(4, device=DEV), y=torch.empty(3, 64, device=DEV), post=None, comb=None,
                       part=torch.empty(4, device=DEV), norm_eps=1e-6, hc_eps=1e-6, iters=1)


@pytest.mark.sanitize
def test_mhc_sanitize_small():
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(5, 4, 256, device=DEV, generator=g).to(torch.bfloat16)
    fn, scale, base = params(4, 256, 24, g)
    y, post, comb = ops.hc_pre(x, fn, scale, base)
    ops.hc_post(y, x, post, comb)
    hfn, hscale, hbase = params(4, 256, 4, g, scale_n=1)
    ops.hc_head(x, hfn, hscale, hbase)
    torch.cuda.synchronize()
