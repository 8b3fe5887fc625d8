"""Lightning-indexer scores (V4 CSA layers).

Semantics (the reference defines them), in fp32:
    score[b, s, c] = sum_h weights[b, s, h] * relu(q[b, s, h] . k[b, c]) * scale
q: [B, S, H, Di], k: [B, C, Di] (compressed indexer keys), weights: [B, S, H] -> [B, S, C].
Causality (entry c visible to the query at position p iff c < (p + 1) // ratio) and the
top-k selection are applied by the caller.
"""
from __future__ import annotations

import torch

from deepfuse.ops._checks import check_tensor
from deepfuse.ops._registry import op

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def indexer_scores_ref(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    B, S, H, _ = q.shape
    C = k.shape[1]
    out = torch.empty(B, S, C, dtype=torch.float32, device=q.device)
    chunk = max(1, (1 << 24) // max(1, B * H * max(C, 1)))
    kf = k.float()
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        dots = torch.einsum("bshd,bcd->bshc", q[:, s0:s1].float(), kf)
        out[:, s0:s1] = (torch.relu(dots) * scale * weights[:, s0:s1].float().unsqueeze(-1)).sum(2)
    return out


# no kernel yet: the op's body (the reference) also serves CUDA tensors.
@op("indexer_scores")
def _indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    return indexer_scores_ref(q, k, weights, scale)


@_indexer_scores.register_fake
def _(q, k, weights, scale):
    return q.new_empty(q.shape[0], q.shape[1], k.shape[1], dtype=torch.float32)


def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Index scores [B, S, C] of queries q [B, S, H, Di] against keys k [B, C, Di]."""
    op = "indexer_scores"
    check_tensor(op, "q", q, dtypes=_FLOATS, ndim=4)
    B, S, H, Di = q.shape
    check_tensor(op, "k", k, dtypes=_FLOATS, ndim=3, device=q.device)
    if k.shape[0] != B or k.shape[2] != Di:
        raise ValueError(f"deepfuse: {op}: k must have shape [{B}, C, {Di}], got {list(k.shape)}")
    check_tensor(op, "weights", weights, dtypes=_FLOATS, shape=(B, S, H), device=q.device)
    return torch.ops.deepfuse.indexer_scores(q, k, weights, float(scale))
