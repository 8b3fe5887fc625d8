"""The Engram n-gram history of a step's requests (DeepSeek V4.1, models/v41.py).

A token's Engram rows hash it with the max_ngram - 1 tokens before it, so a chunk that
starts at position p > 0 (chunked prefill, a decode or verify step, a prefix-cache hit, a
recompute after preemption) needs the compressed ids at p - M + 1 .. p - 1. They are read
from the request's own committed tokens (Request.tokens), not kept as separate state: the
history is then right by construction through chunked prefill, preemption, prefix caching
and speculation (drafts are never committed tokens; a verify chunk starts at the request's
last committed token). With the overlapped step a request's newest token may still be on
the device; it is the chunk's first input, never part of the history before it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

NONE = -1  # no token at that position (before the sequence)


def engram_history(chunks: Sequence, token_map: np.ndarray, max_ngram: int) -> np.ndarray:
    """[B, M - 1] int64 compressed ids of the tokens before each chunk's start (chunks:
    ScheduledChunk-like objects with .req (a Request) and .start), NONE before position 0."""
    H = max_ngram - 1
    out = np.full((len(chunks), H), NONE, dtype=np.int64)
    for b, ch in enumerate(chunks):
        a = max(0, ch.start - H)
        toks = np.asarray(ch.req.tokens(a, ch.start), dtype=np.int64)
        if (toks < 0).any():  # a token still on the device (overlap) is always a chunk's first input
            raise ValueError(f"deepfuse: engram_history: request {ch.req.request_id} has an unsettled token before "
                             f"position {ch.start}")
        if len(toks):
            out[b, H - len(toks):] = token_map[toks]
    return out
