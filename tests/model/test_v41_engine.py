"""LLM("tiny-v4.1"): the engine runs the tiny V4.1 model (V41CacheManager, the V4.1 step,
the Engram history per chunk) token for token as its full forward: batched requests, chunked
prefill, prefix caching, a small cache, the overlapped loop, logprobs."""
import math

import pytest
import torch

from deepfuse.engine import LLM
from deepfuse.engine.request import SamplingParams
from deepfuse.engine.v41_cache import V41CacheManager


_REF: dict = {}


def _greedy_full(model, prompt, n):
    key = (tuple(prompt), n)
    if key in _REF:
        return _REF[key]
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    _REF[key] = seq[len(prompt):]  # every LLM here loads the same tiny weights
    return _REF[key]


@pytest.mark.parametrize("kw", [dict(), dict(max_num_batched_tokens=7), dict(enable_prefix_caching=True),
                                dict(max_total_tokens=48, max_num_seqs=3),
                                dict(overlap=True, max_num_batched_tokens=9, enable_prefix_caching=True)])
def test_llm_tiny_v41_equals_full_forward(kw):
    llm = LLM("tiny-v4.1", max_model_len=128, **kw)
    assert isinstance(llm.engine.cache, V41CacheManager)
    assert llm.engine.overlap == kw.get("overlap", False)
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 129280, (14,), generator=g).tolist()
    prompts = [base[:3], base + [5, 6], base[:11], torch.randint(0, 129280, (20,), generator=g).tolist()]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, logprobs=2))
    for p, o in zip(prompts, outs):
        assert o.token_ids == _greedy_full(llm.model, p, 6), (kw, len(p))
        full = torch.log_softmax(llm.model(torch.tensor([p + o.token_ids]))[0], -1)
        for i, (t, lp) in enumerate(zip(o.token_ids, o.logprobs)):
            assert math.isclose(lp, float(full[len(p) - 1 + i, t]), rel_tol=1e-3, abs_tol=1e-3)
    if kw.get("enable_prefix_caching"):  # the same prompts again: served from saved prefixes
        again = llm.generate(prompts, SamplingParams(max_tokens=6))
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_memory_profiling_step_runs():
    """engine/memory.py's largest step (the CUDA memory plan's probe) runs a V4.1 model."""
    from deepfuse.engine.memory import largest_step
    from deepfuse.models import tiny

    m = tiny.load("v4.1")
    c = V41CacheManager(m.cfg, model_dtype=m.dtype, device="cpu", max_num_seqs=4, max_num_batched_tokens=64,
                        max_total_tokens=1024, max_model_len=256, page_size=16)
    assert largest_step(m, c, max_num_batched_tokens=64, max_num_seqs=4, max_len=256).shape == (4,)
