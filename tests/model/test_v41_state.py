"""The Engram history a step needs (engine/engram_state.py) gives every chunk of a sequence
the same table rows as the whole sequence hashed at once: chunked prefill, decode steps, a
prefix-cache hit, a recompute after preemption and a verify chunk with drafts."""
import random

import numpy as np
import pytest
import torch

from deepfuse.engine.engram_state import NONE, engram_history
from deepfuse.engine.request import Request, SamplingParams
from deepfuse.engine.scheduler import ScheduledChunk
from deepfuse.models import tiny
from deepfuse.models.v41 import EngramHasher
from deepfuse.models.v41_config import V41Config


@pytest.fixture(scope="module")
def hasher():
    cfg = V41Config.from_dict(tiny.CONFIG_V41)
    h = EngramHasher(cfg)
    g = np.random.default_rng(0)
    tm = g.integers(0, cfg.engram_compressed_vocab_size, cfg.vocab_size)
    tm[:cfg.engram_compressed_vocab_size] = np.arange(cfg.engram_compressed_vocab_size)  # every id used
    h.set_token_map(tm, cfg.engram_compressed_vocab_size)
    return h


def _req(prompt, out):
    return Request("r", list(prompt), SamplingParams(), 0, 0, output_token_ids=list(out))


@pytest.mark.parametrize("seed", range(6))
def test_chunks_hash_as_the_whole(hasher, seed):
    r = random.Random(seed)
    T = r.randint(2, 40)
    seq = [r.randint(0, 129279) for _ in range(T)]
    P = r.randint(1, T)
    req = _req(seq[:P], seq[P:])
    full = hasher.hashes(torch.tensor([seq]))                   # [T, L, C]
    M = hasher.max_ngram
    # random chunkings from a random start (0: fresh or recomputed; > 0: prefix-cache hit)
    for _ in range(4):
        start = r.choice([0, r.randint(0, T - 1)])
        pos = start
        while pos < T:
            n = r.randint(1, T - pos)
            ch = ScheduledChunk(req, pos, n)
            hist = engram_history([ch], hasher.token_map.numpy(), M)
            assert hist.shape == (1, M - 1)
            assert (hist[0, :max(0, M - 1 - pos)] == NONE).all()
            got = hasher.hashes(torch.tensor([seq[pos:pos + n]]), torch.from_numpy(hist))
            assert torch.equal(got, full[pos:pos + n])
            pos += n


def test_verify_chunk_with_drafts(hasher):
    r = random.Random(7)
    seq = [r.randint(0, 129279) for _ in range(12)]
    req = _req(seq[:9], seq[9:])                  # 12 committed tokens
    drafts = [r.randint(0, 129279) for _ in range(3)]
    ch = ScheduledChunk(req, 11, 4)               # the last committed token + 3 drafts
    hist = engram_history([ch], hasher.token_map.numpy(), hasher.max_ngram)
    got = hasher.hashes(torch.tensor([[seq[11]] + drafts]), torch.from_numpy(hist))
    want = hasher.hashes(torch.tensor([seq + drafts]))[11:]
    assert torch.equal(got, want)


def test_batch_of_requests(hasher):
    r = random.Random(3)
    seqs = [[r.randint(0, 129279) for _ in range(r.randint(3, 20))] for _ in range(4)]
    chunks = [ScheduledChunk(_req(s, []), r.randint(0, len(s) - 1), 1) for s in seqs]
    hist = engram_history(chunks, hasher.token_map.numpy(), hasher.max_ngram)
    for b, (s, ch) in enumerate(zip(seqs, chunks)):
        got = hasher.hashes(torch.tensor([[s[ch.start]]]), torch.from_numpy(hist[b:b + 1]))
        assert torch.equal(got, hasher.hashes(torch.tensor([s]))[ch.start:ch.start + 1])


def test_chunk_starts_on_the_device():
    """models/v41.chunk_starts (the step's per-token chunk start from device tensors only, so a
    captured graph recomputes it per replay) equals the host's np.repeat(starts, counts) on
    random flat batches, padded ones too (pad requests with no tokens, or pad tokens of their own)."""
    from types import SimpleNamespace

    import numpy as np

    from deepfuse.models.v41 import chunk_starts

    r = random.Random(11)
    for _ in range(50):
        B = r.randint(1, 9)
        starts = np.array([r.randint(0, 500) for _ in range(B)], np.int64)
        counts = np.array([r.randint(1, 7) for _ in range(B)], np.int64)
        pad = r.randint(0, 4)  # pad requests without tokens at the end of the request list
        req = np.repeat(np.arange(B), counts)
        pos = np.concatenate([s + np.arange(c) for s, c in zip(starts, counts)])
        ctx = SimpleNamespace(positions=torch.from_numpy(pos), token_req=torch.from_numpy(req),
                              req_slots=torch.zeros(B + pad, dtype=torch.int64))
        assert torch.equal(chunk_starts(ctx), torch.from_numpy(np.repeat(starts, counts)))
