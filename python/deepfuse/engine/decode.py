"""A plain batched greedy decode loop over a model with a per-request cache.

The overlapping scheduler (CPU prepares step N+1 while the GPU runs step N) comes later;
this loop is the correctness baseline it will be checked against.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class DecodeResult:
    tokens: torch.Tensor  # [B, T_prompt + new] int64, on the CPU
    prefill_s: float
    decode_s: float
    new_tokens: int  # per request

    @property
    def decode_tok_per_s(self) -> float:
        return self.tokens.shape[0] * self.new_tokens / max(self.decode_s, 1e-9)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def greedy_decode(model, prompts: torch.Tensor, max_new_tokens: int) -> DecodeResult:
    """prompts [B, T] on the model's device -> greedy continuation of max_new_tokens >= 1."""
    if max_new_tokens < 1:
        raise ValueError(f"deepfuse: max_new_tokens must be >= 1, got {max_new_tokens}")
    device = prompts.device
    cache = model.new_cache(prompts.shape[0])
    t0 = time.perf_counter()
    logits = model(prompts, cache)
    nxt = logits[:, -1].argmax(-1, keepdim=True)
    _sync(device)
    t1 = time.perf_counter()
    out = [nxt]
    for _ in range(max_new_tokens - 1):
        nxt = model(nxt, cache)[:, -1].argmax(-1, keepdim=True)
        out.append(nxt)
    _sync(device)
    t2 = time.perf_counter()
    tokens = torch.cat([prompts] + out, dim=1).cpu()
    return DecodeResult(tokens, t1 - t0, t2 - t1, max_new_tokens)
