"""Sparse multi-query attention with a per-head sink: V4's core attention.

Semantics (the reference defines them): one shared K = V head. For query (b, s, h), the
keys are the rows kv[b, j] for the j in indices[b, s, :] with j >= 0 (-1 = empty slot;
duplicates count twice). In fp32:
    l_j = scale * q[b, s, h] . kv[b, j]
    m   = max(max_j l_j, sink[h])
    p_j = exp(l_j - m) / (sum_j exp(l_j - m) + exp(sink[h] - m))
    o   = sum_j p_j kv[b, j]                      (cast to q.dtype)
The sink only enlarges the denominator; a query whose slots are all empty gets o = 0.
q: [B, S, H, D], kv: [B, N, D], indices: [B, S, K] int32/int64 in [-1, N), sink: [H] fp32.
"""
from __future__ import annotations

import torch

from deepfuse.ops._checks import check_tensor
from deepfuse.ops._registry import op

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def sparse_attention_ref(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                         scale: float) -> torch.Tensor:
    B, S, H, D = q.shape
    K = indices.shape[-1]
    out = torch.zeros(B, S, H, D, dtype=q.dtype, device=q.device)
    if K == 0 or S == 0:
        return out
    sinkf = sink.float().view(1, 1, H)
    # Bound the gathered [B, chunk, K, D] block (this reference also runs on the GPU).
    chunk = max(1, (1 << 24) // max(1, B * K * (D + H)))
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        idx = indices[:, s0:s1].long()
        valid = idx >= 0
        rows = kv.gather(1, idx.clamp(min=0).reshape(B, -1, 1).expand(-1, -1, D)).view(B, s1 - s0, K, D).float()
        logits = torch.einsum("bshd,bskd->bshk", q[:, s0:s1].float(), rows) * scale
        logits = logits.masked_fill(~valid.unsqueeze(2), float("-inf"))
        m = torch.maximum(logits.amax(-1), sinkf)
        p = torch.exp(logits - m.unsqueeze(-1))
        denom = p.sum(-1) + torch.exp(sinkf - m)
        out[:, s0:s1] = torch.einsum("bshk,bskd->bshd", p / denom.unsqueeze(-1), rows).to(q.dtype)
    return out


# no kernel yet: the op's body (the reference) also serves CUDA tensors.
@op("sparse_attention")
def _sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                      scale: float) -> torch.Tensor:
    return sparse_attention_ref(q, kv, indices, sink, scale)


@_sparse_attention.register_fake
def _(q, kv, indices, sink, scale):
    return torch.empty_like(q)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of q [B, S, H, D] over the rows of kv [B, N, D] named by indices [B, S, K]."""
    op = "sparse_attention"
    check_tensor(op, "q", q, dtypes=_FLOATS, ndim=4)
    B, S, H, D = q.shape
    check_tensor(op, "kv", kv, dtypes=(q.dtype,), ndim=3, device=q.device)
    if kv.shape[0] != B or kv.shape[2] != D:
        raise ValueError(f"deepfuse: {op}: kv must have shape [{B}, N, {D}], got {list(kv.shape)}")
    check_tensor(op, "indices", indices, dtypes=(torch.int32, torch.int64), ndim=3, device=q.device)
    if tuple(indices.shape[:2]) != (B, S):
        raise ValueError(f"deepfuse: {op}: indices must have shape [{B}, {S}, K], got {list(indices.shape)}")
    check_tensor(op, "sink", sink, dtypes=(torch.float32,), shape=(H,), device=q.device)
    return torch.ops.deepfuse.sparse_attention(q, kv, indices, sink, float(scale))
