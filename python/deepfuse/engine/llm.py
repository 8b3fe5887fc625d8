"""LLM: the offline entry point (a model plus an engine; generate() runs requests to the end)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import torch

from .engine import Engine, EngineConfig
from .request import RequestOutput, SamplingParams


def _load(model, device, dtype):
    from deepfuse import models
    from deepfuse.models.v41 import V41Model

    if isinstance(model, (models.V4Model, V41Model)):
        if device is not None and torch.device(device) != model.device:
            raise ValueError(f"deepfuse: LLM: device {device} differs from the model's ({model.device})")
        if dtype is not None and dtype != model.dtype:
            raise ValueError(f"deepfuse: LLM: dtype {dtype} differs from the model's ({model.dtype})")
        return model
    if not isinstance(model, str):
        raise ValueError(f"deepfuse: LLM: model must be a checkpoint directory, 'tiny', 'tiny-v4.1', "
                         f"'random-flash[:layers]' or a V4Model / V41Model, got "
                         f"{type(model).__name__}")
    device = torch.device(device or "cpu")
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if model == "tiny":
        return models.tiny.load(device=device, dtype=dtype)
    if model == "tiny-v4.1":
        return models.tiny.load("v4.1", device=device, dtype=dtype)
    if model == "random-flash" or model.startswith("random-flash:"):
        # a random V4-Flash-width model built on the device (benchmarks): random-flash[:swa,csa,hca,...]
        from deepfuse.models import random as rnd

        kinds = {"swa": "sliding_attention", "csa": "compressed_sparse_attention",
                 "hca": "heavily_compressed_attention"}
        layers = model.split(":", 1)[1].split(",") if ":" in model else ["swa", "csa", "hca", "csa"]
        bad = [k for k in layers if k not in kinds]
        if bad:
            raise ValueError(f"deepfuse: LLM: random-flash layer kinds are swa / csa / hca, got {bad}")
        return rnd.build(rnd.flash_config([kinds[k] for k in layers]), device=device, dtype=dtype, quant="fp8",
                         expert_quant="fp8")
    return models.load(model, device=device, dtype=dtype)


class LLM:
    def __init__(self, model, device=None, dtype: Optional[torch.dtype] = None, kv_dtype: Optional[str] = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, max_total_tokens: Optional[int] = None,
                 max_model_len: Optional[int] = None, num_speculative_tokens: int = 0, tensor_parallel_size: int = 1,
                 expert_parallel: bool = True, **engine_kw):
        """tensor_parallel_size N > 1: one process per rank (GPU r on CUDA, gloo on the CPU),
        attention split over heads, the routed experts over ranks (expert_parallel=True) or
        inside each expert (False); model must then be a checkpoint directory or "tiny", and
        self.model is rank 0's part (engine/distributed.py). Call shutdown() at the end.
        kv_dtype None: "fp8" on CUDA (bf16 V4 models), "auto" (lossless) otherwise; on CUDA the
        caches are sized by the memory plan (engine/memory.py; engine_kw gpu_memory_utilization,
        default 0.9) unless max_total_tokens is given (then it is checked against the plan)."""
        known = {f.name for f in dataclasses.fields(EngineConfig)} - {"kv_dtype", "max_num_seqs",
                                                                       "max_num_batched_tokens", "max_total_tokens",
                                                                       "max_model_len", "num_speculative_tokens"}
        bad = sorted(set(engine_kw) - known)
        if bad:
            opts = sorted(known | {"device", "dtype", "kv_dtype", "max_num_seqs", "max_num_batched_tokens",
                                   "max_total_tokens", "max_model_len", "num_speculative_tokens",
                                   "tensor_parallel_size", "expert_parallel"})
            raise ValueError(f"deepfuse: LLM: unknown option(s) {', '.join(map(repr, bad))} (options: {', '.join(opts)})")
        cfg = EngineConfig(kv_dtype=kv_dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                           max_total_tokens=max_total_tokens, max_model_len=max_model_len,
                           num_speculative_tokens=num_speculative_tokens, **engine_kw).validate()
        self._ranks = None
        if tensor_parallel_size != 1:
            from .distributed import launch

            self.model, self.engine, self._ranks = launch(model, device, dtype, cfg, tensor_parallel_size,
                                                          expert_parallel)
        else:
            self.model = _load(model, device, dtype)
            self.engine = Engine(self.model, cfg)
        self._next = 0

    def shutdown(self) -> None:
        """Stop the other ranks' processes (tensor_parallel_size > 1; otherwise nothing)."""
        if self._ranks is not None:
            self._ranks.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: Union[SamplingParams, Sequence[SamplingParams], None] = None) -> list[RequestOutput]:
        """Run every prompt to completion -> RequestOutputs in prompt order (token_ids: all
        generated tokens). Requests already in the engine run along."""
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist()
        if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in prompts):
            raise ValueError("deepfuse: LLM.generate: prompts must be a list of token-id lists")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"deepfuse: LLM.generate: {len(params)} params for {len(prompts)} prompts")
        checked = [self.engine.check_request(p, sp) for p, sp in zip(prompts, params)]  # all before any runs
        ids = []
        for p, sp in checked:
            rid = f"gen-{self._next}"
            self._next += 1
            self.engine.add_request(rid, p, sp)
            ids.append(rid)
        done: dict[str, RequestOutput] = {}
        acc = {rid: RequestOutput(rid, list(p), []) for rid, p in zip(ids, prompts)}
        want = set(ids)
        try:
            self._run(acc, want, done)
        except BaseException:
            for rid in want - done.keys():  # the engine could not go on: do not leave them running
                self.engine.abort(rid)
            raise
        return [done[rid] for rid in ids]

    def _run(self, acc: dict, want: set, done: dict) -> None:
        while want - done.keys():
            for o in self.engine.step():
                a = acc.get(o.request_id)
                if a is None:
                    continue
                a.token_ids.extend(o.token_ids)
                if o.logprobs is not None:
                    a.logprobs = (a.logprobs or []) + o.logprobs
                if o.top_logprobs is not None:
                    a.top_logprobs = (a.top_logprobs or []) + o.top_logprobs
                if o.prompt_logprobs is not None:
                    a.prompt_logprobs, a.prompt_top_logprobs = o.prompt_logprobs, o.prompt_top_logprobs
                if o.finished:
                    a.finished, a.finish_reason, a.metrics, a.error = True, o.finish_reason, o.metrics, o.error
                    done[o.request_id] = a


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, eos_token_id: Optional[int] = None):
    """Greedy decoding of a loaded V4Model on the engine (paged caches, lossless "auto" KV):
    input_ids [B, T] -> [B, T + new]; a row that emits eos_token_id stops there and is padded
    with it."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"deepfuse: generate: input_ids must be a [B, T] tensor, got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    llm = LLM(model, max_num_seqs=max(1, input_ids.shape[0]))
    stop = () if eos_token_id is None else (int(eos_token_id),)
    outs = llm.generate(input_ids.tolist(), SamplingParams(max_tokens=max_new_tokens, stop_token_ids=stop,
                                                           ignore_eos=True))
    n = max(len(o.token_ids) for o in outs)
    pad = 0 if eos_token_id is None else int(eos_token_id)
    new = torch.tensor([o.token_ids + [pad] * (n - len(o.token_ids)) for o in outs], dtype=input_ids.dtype)
    return torch.cat([input_ids, new.to(input_ids.device)], dim=1)
