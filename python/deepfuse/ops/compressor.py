"""Gated pooling of the V4 KV compressor.

Semantics (the reference defines them): per dimension, a softmax over the L rows of a
block: out[..., j] = sum_l softmax_l(score[..., l, j]) * kv[..., l, j], in fp32, cast to
kv.dtype. score already holds gate + positional bias; rows with score -inf get weight 0
(V4's overlapping 4:1 blocks use that for the missing half of the first block).
kv, score: [*, L, D] -> [*, D].
"""
from __future__ import annotations

import torch

from deepfuse.ops._checks import check_tensor
from deepfuse.ops._registry import op

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def compress_pool_ref(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(score.float(), dim=-2)
    return (kv.float() * p).sum(-2).to(kv.dtype).contiguous()


# no kernel yet: the op's body (the reference) also serves CUDA tensors.
@op("compress_pool")
def _compress_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    return compress_pool_ref(kv, score)


@_compress_pool.register_fake
def _(kv, score):
    return kv.new_empty(*kv.shape[:-2], kv.shape[-1])


def compress_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Softmax-gated pooling of blocks: kv, score [*, L, D] -> [*, D]."""
    op = "compress_pool"
    check_tensor(op, "kv", kv, dtypes=_FLOATS)
    if kv.dim() < 2:
        raise ValueError(f"deepfuse: {op}: kv must be [*, L, D], got {list(kv.shape)}")
    check_tensor(op, "score", score, dtypes=_FLOATS, shape=tuple(kv.shape), device=kv.device)
    return torch.ops.deepfuse.compress_pool(kv, score)
