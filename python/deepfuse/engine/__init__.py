"""deepfuse.engine: continuous batching over the paged hybrid V4 caches.

    from deepfuse.engine import LLM, SamplingParams
    llm = LLM("tiny")                                   # or a checkpoint directory / a loaded model
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8))
    llm.engine.add_request("a", [1, 2, 3], SamplingParams()); llm.engine.step()
    generate(model, input_ids, 32)                      # greedy [B, T] -> [B, T + 32] of a loaded model

One concept per module: request (SamplingParams, Request, RequestOutput), context (the step
context), allocator (pages), cache (the cache manager), scheduler, sampler, model_runner,
engine, llm.
"""
from .engine import Engine, EngineConfig
from .llm import LLM, generate
from .request import RequestOutput, SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "SamplingParams", "RequestOutput", "generate"]
