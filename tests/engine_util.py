"""Drives the model's flat forward (engine caches and step contexts) over a chunk schedule
with every row's logits kept: the logits-level check of the engine path."""
from __future__ import annotations

import numpy as np
import torch

from deepfuse.engine.cache import CacheManager
from deepfuse.engine.context import build_context


@torch.no_grad()
def run_chunks(model, x: torch.Tensor, cuts, kv_dtype: str = "auto", page_size: int = 16) -> torch.Tensor:
    """x [B, T] token ids; cuts: chunk boundaries 0 = c0 < c1 < ... = T (every request advances
    through the same chunks, all in one step each) -> logits [B, T, vocab] fp32."""
    B, T = x.shape
    cache = CacheManager(model.cfg, model_dtype=model.dtype, device=model.device, kv_dtype=kv_dtype,
                         max_num_seqs=B, max_num_batched_tokens=B * T, max_total_tokens=B * T + 64,
                         max_model_len=T + 64, page_size=page_size)
    rcs = [cache.admit() for _ in range(B)]
    xs = x.cpu().numpy()
    out = []
    for a, b in zip(cuts, cuts[1:]):
        for rc in rcs:
            cache.grow(rc, b)
        cache.flush()
        n = b - a
        ctx = build_context(xs[:, a:b].reshape(-1), np.full(B, a), np.full(B, n), np.array([rc.slot for rc in rcs]),
                            np.full(B, n), cache.geometry, cache.block_tables, model.device,
                            cache.host_block_tables)
        out.append(model.forward_step(ctx, cache).view(B, n, -1))
    return torch.cat(out, 1)

def chi2_ok(counts: np.ndarray, probs: np.ndarray, n: int) -> bool:
    """Pearson chi-square over the support of probs; scipy-free bound: the statistic must stay
    under dof + 6 sqrt(2 dof) (about the 0.99999 quantile for these dof)."""
    m = probs > 0
    assert counts[~m].sum() == 0, "a token outside the target's support was emitted"
    exp = probs[m] * n
    stat = ((counts[m] - exp) ** 2 / exp).sum()
    dof = m.sum() - 1
    return stat < dof + 6 * np.sqrt(2 * dof), (stat, dof)


def prompts_for(lengths, vocab, seed=1):
    """Random prompts of the given lengths (token ids below vocab), reproducible by seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
