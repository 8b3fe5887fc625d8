"""Manifold-constrained hyper-connections (mHC): the mixing around every V4 sublayer.

Semantics (the references below define them; all mixing math in fp32):
- hc_pre(x [*L, n, d], fn [(2+n)n, n d], scale [3], base [(2+n)n]):
    v = flatten(x); m = fn @ (v * rsqrt(mean(v^2) + norm_eps))
    pre  = sigmoid(m[:n] s0 + b[:n]) + hc_eps
    post = 2 sigmoid(m[n:2n] s1 + b[n:2n])
    comb = softmax_row(m[2n:].view(n, n) s2 + b[2n:]) + hc_eps, then a column
           normalisation and (iters - 1) x (row, column) normalisations, each dividing by
           (sum + hc_eps)
    -> (y = sum_i pre_i x_i  [*L, d] in x.dtype, post [*L, n], comb [*L, n, n])
- hc_post(f [*L, d], x [*L, n, d], post, comb) -> x'_j = post_j f + sum_i comb[i, j] x_i
- hc_head(x, fn [n, n d], scale [1], base [n]) -> sum_i (sigmoid(m_i s + b_i) + hc_eps) x_i

CUDA (csrc/mhc, n = 4, d % 4 == 0, bf16 / fp32 streams): pre and head in two launches (the
dot products over slices of the streams, then the mixing math and the weighted sum), post in
one elementwise launch. Other inputs on CUDA run the references only where allowed
(ops._fallback), else raise.
"""
from __future__ import annotations

from typing import Optional

import torch

from deepfuse import _ext
from deepfuse.ops._checks import check_tensor
from deepfuse.ops._fallback import kernels_off_reason, need_reference
from deepfuse.ops._registry import op

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _normed_mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    v = x.flatten(-2).float()
    v = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + norm_eps)
    return torch.nn.functional.linear(v, fn.float())


def hc_pre_ref(x, fn, scale, base, norm_eps: float, hc_eps: float, iters: int):
    n = x.shape[-2]
    m = _normed_mixes(x, fn, norm_eps)
    s, b = scale.float(), base.float()
    pre = torch.sigmoid(m[..., :n] * s[0] + b[:n]) + hc_eps
    post = 2 * torch.sigmoid(m[..., n : 2 * n] * s[1] + b[n : 2 * n])
    comb = m[..., 2 * n :].unflatten(-1, (n, n)) * s[2] + b[2 * n :].view(n, n)
    comb = torch.softmax(comb, dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    y = (pre.unsqueeze(-1) * x.float()).sum(-2)
    return y.to(x.dtype), post, comb


def hc_post_ref(f, x, post, comb):
    # fp32 mixing, one cast at the end (DeepSeek's reference; the transformers oracle mixes
    # in the activation dtype, which is the same thing in fp32).
    y = post.float().unsqueeze(-1) * f.float().unsqueeze(-2)
    y = y + torch.matmul(comb.float().transpose(-1, -2), x.float())
    return y.to(x.dtype)


def hc_head_ref(x, fn, scale, base, norm_eps: float, hc_eps: float):
    m = _normed_mixes(x, fn, norm_eps)
    pre = torch.sigmoid(m * scale.float()[0] + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x.float()).sum(-2).to(x.dtype)


@op("hc_pre")
def _hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            norm_eps: float, hc_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return hc_pre_ref(x, fn, scale, base, norm_eps, hc_eps, iters)


def mix_gap(n: int, d: int, dtype: torch.dtype) -> Optional[str]:
    """Why the mHC kernels cannot serve streams [*L, n, d] of `dtype` (None: they can)."""
    if n != 4:
        return f"x has {n} streams (the kernels take hc_mult 4)"
    if d % 4:
        return f"x rows are {d} wide (the kernels take d % 4 == 0)"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"x has dtype {str(dtype)[6:]} (the kernels take bfloat16 or float32)"
    return None


def _kernel_gap(x) -> Optional[str]:
    return kernels_off_reason() or mix_gap(x.shape[-2], x.shape[-1], x.dtype)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


def _mix_cuda(x, fn, scale, base, norm_eps, hc_eps, iters, head):
    """-> (y, post, comb) of the pre mix, (y, None, None) of the head."""
    lead, n, d = x.shape[:-2], x.shape[-2], x.shape[-1]
    xc = x.contiguous()
    T = xc.numel() // (n * d)
    y = torch.empty(*lead, d, dtype=x.dtype, device=x.device)
    post = comb = None
    if not head:
        post = torch.empty(*lead, n, dtype=torch.float32, device=x.device)
        comb = torch.empty(*lead, n, n, dtype=torch.float32, device=x.device)
    if T:
        C = _ext.ext(x.device)
        mixes = n if head else (2 + n) * n
        part = torch.empty(T * C.hc_mix_splits(T, d) * (mixes + 1), dtype=torch.float32, device=x.device)
        C.hc_mix(x=xc, fn=_f32(fn), scale=_f32(scale), base=_f32(base), y=y, post=post, comb=comb, part=part,
                 norm_eps=float(norm_eps), hc_eps=float(hc_eps), iters=int(iters))
    return y, post, comb


@_hc_pre.register_kernel("cuda")
def _(x, fn, scale, base, norm_eps, hc_eps, iters):
    why = _kernel_gap(x)
    if why is not None:
        need_reference("hc_pre", why)
        return hc_pre_ref(x, fn, scale, base, norm_eps, hc_eps, iters)
    return _mix_cuda(x, fn, scale, base, norm_eps, hc_eps, iters, False)


@_hc_pre.register_fake
def _(x, fn, scale, base, norm_eps, hc_eps, iters):
    n, lead = x.shape[-2], x.shape[:-2]
    return (x.new_empty(*lead, x.shape[-1]), x.new_empty(*lead, n, dtype=torch.float32),
            x.new_empty(*lead, n, n, dtype=torch.float32))


@op("hc_post")
def _hc_post(f: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    return hc_post_ref(f, x, post, comb)


@_hc_post.register_kernel("cuda")
def _(f, x, post, comb):
    why = _kernel_gap(x)
    if why is None and f.dtype != x.dtype:
        why = f"f has dtype {str(f.dtype)[6:]}, x {str(x.dtype)[6:]} (the kernel takes one dtype)"
    if why is not None:
        need_reference("hc_post", why)
        return hc_post_ref(f, x, post, comb)
    xc, fc, pc, cc = x.contiguous(), f.contiguous(), _f32(post), _f32(comb)
    d = x.shape[-1]
    T = xc.numel() // (4 * d)
    out = torch.empty_like(xc)
    if T:
        _ext.ext(x.device).hc_post(f=fc, x=xc, post=pc, comb=cc, out=out)
    return out


@_hc_post.register_fake
def _(f, x, post, comb):
    return torch.empty_like(x)


@op("hc_head")
def _hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             norm_eps: float, hc_eps: float) -> torch.Tensor:
    return hc_head_ref(x, fn, scale, base, norm_eps, hc_eps)


@_hc_head.register_kernel("cuda")
def _(x, fn, scale, base, norm_eps, hc_eps):
    why = _kernel_gap(x)
    if why is not None:
        need_reference("hc_head", why)
        return hc_head_ref(x, fn, scale, base, norm_eps, hc_eps)
    return _mix_cuda(x, fn, scale, base, norm_eps, hc_eps, 1, True)[0]


@_hc_head.register_fake
def _(x, fn, scale, base, norm_eps, hc_eps):
    return x.new_empty(*x.shape[:-2], x.shape[-1])


def _check_streams(op, x, fn, base, rows):
    check_tensor(op, "x", x, dtypes=_FLOATS)
    if x.dim() < 2:
        raise ValueError(f"deepfuse: {op}: x must be [*L, n, d], got shape {list(x.shape)}")
    n, d = x.shape[-2], x.shape[-1]
    check_tensor(op, "fn", fn, dtypes=_FLOATS, shape=(rows(n), n * d), device=x.device)
    check_tensor(op, "base", base, dtypes=_FLOATS, shape=(rows(n),), device=x.device)


def hc_pre(x, fn, scale, base, *, norm_eps: float = 1e-6, hc_eps: float = 1e-6, iters: int = 20):
    """mHC pre-mix: x [*L, n, d] -> (collapsed [*L, d], post [*L, n], comb [*L, n, n])."""
    op = "hc_pre"
    _check_streams(op, x, fn, base, lambda n: (2 + n) * n)
    check_tensor(op, "scale", scale, dtypes=_FLOATS, shape=(3,), device=x.device)
    if iters < 1:
        raise ValueError(f"deepfuse: hc_pre: iters must be >= 1, got {iters}")
    return torch.ops.deepfuse.hc_pre(x, fn, scale, base, float(norm_eps), float(hc_eps), int(iters))


def hc_post(f, x, post, comb):
    """mHC post-mix: sublayer output f [*L, d] and streams x [*L, n, d] -> new streams."""
    op = "hc_post"
    check_tensor(op, "x", x, dtypes=_FLOATS)
    lead, n, d = tuple(x.shape[:-2]), x.shape[-2], x.shape[-1]
    check_tensor(op, "f", f, dtypes=_FLOATS, shape=lead + (d,), device=x.device)
    check_tensor(op, "post", post, dtypes=_FLOATS, shape=lead + (n,), device=x.device)
    check_tensor(op, "comb", comb, dtypes=_FLOATS, shape=lead + (n, n), device=x.device)
    return torch.ops.deepfuse.hc_post(f, x, post, comb)


def hc_head(x, fn, scale, base, *, norm_eps: float = 1e-6, hc_eps: float = 1e-6):
    """mHC head: collapse the n streams of x [*L, n, d] into [*L, d] before the final norm."""
    op = "hc_head"
    _check_streams(op, x, fn, base, lambda n: n)
    if scale.numel() < 1:
        raise ValueError("deepfuse: hc_head: scale must have at least one element")
    return torch.ops.deepfuse.hc_head(x, fn, scale, base, float(norm_eps), float(hc_eps))
