"""The engine: requests in, one scheduled step at a time, outputs out."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Optional

import torch

from deepfuse.ops import reference_calls

from .cache import KV_DTYPES, CacheManager
from .graph_runner import GraphRunner
from .memory import finish_plan, plan_memory, resolve_kv_dtype
from .model_runner import ModelRunner
from .request import Request, RequestOutput, SamplingParams
from .prefix_cache import PrefixCache
from .scheduler import Scheduler
from .speculative import Emission, SpecDecoder


@dataclass(frozen=True)
class EngineConfig:
    kv_dtype: Optional[str] = None           # "auto" / "fp8" / "bf16"; None: fp8 on CUDA (bf16 V4 models), else auto
    gpu_memory_utilization: float = 0.9      # CUDA: fraction of the device's total memory this engine may use
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_total_tokens: Optional[int] = None
    max_model_len: Optional[int] = None
    page_size: int = 64
    seed: int = 0
    overlap: Optional[bool] = None           # schedule step N+1 while step N runs (None: on for CUDA)
    enable_prefix_caching: bool = False      # reuse the state of earlier requests with the same prefix
    prefix_cache_entries: int = 64           # saved prefix states (windows + compressor states) kept
    prefix_checkpoint: int = 1024            # also save a long prompt's state every this many tokens
    num_speculative_tokens: int = 0          # MTP drafts per step (0: no speculation)
    spec_simulate_acc_len: Optional[float] = None  # benchmark knob: accept this many tokens per step on average
    cuda_graphs: Optional[bool] = None       # decode / verify steps replay captured graphs (None: on for CUDA)

    def validate(self) -> "EngineConfig":
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "prefix_cache_entries",
                     "prefix_checkpoint"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"deepfuse: {name} must be an int >= 1, got {v!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 8:
            raise ValueError(f"deepfuse: num_speculative_tokens must be an int in [0, 8], got {k!r}")
        a = self.spec_simulate_acc_len
        if a is not None and not (isinstance(a, (int, float)) and 1 <= a <= k + 1):
            raise ValueError(f"deepfuse: spec_simulate_acc_len must be in [1, num_speculative_tokens + 1], got {a!r}")
        for name in ("max_total_tokens", "max_model_len"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"deepfuse: {name} must be None or an int >= 1, got {v!r}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"deepfuse: kv_dtype must be None or one of {KV_DTYPES}, got {self.kv_dtype!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"deepfuse: gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        return self


PENDING = -1  # an output token still on the device (overlap: its step is in flight)


@dataclass
class _Inflight:
    """A launched step whose sampled tokens have not been read back yet."""

    step: int
    chunks: list
    ctx: object
    res: object                    # SamplerOutput on the device
    host: list                     # pinned host copies of res' tensors (tokens, logprobs, top ids, top values)
    event: Optional[object]        # CUDA event after the copies
    rows: list                     # (request, index of its placeholder token) per sampled row


class Engine:
    def __init__(self, model, config: EngineConfig = EngineConfig()):
        config.validate()
        self.model, self.config = model, config
        cfg = model.cfg
        self.vocab_size = cfg.vocab_size
        eos = cfg.eos_token_id
        self.eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else list(eos))
        self.kv_dtype = resolve_kv_dtype(config.kv_dtype, cfg, model.device, model.dtype)
        use_graphs = config.cuda_graphs if config.cuda_graphs is not None else model.device.type == "cuda"
        use_graphs = use_graphs and type(self) is Engine
        # the memory plan (engine/memory.py): measured on CUDA, then the caches are sized from it
        par = getattr(model, "parallel", None)
        max_len = config.max_model_len or cfg.max_position_embeddings
        self.memory_plan = plan_memory(model, config, self.kv_dtype, max_len, self._new_cache,
                                       self._new_graphs if use_graphs else None,
                                       measure=type(self) is Engine and (par is None or par.world_size == 1))
        self.max_model_len = self.memory_plan.max_model_len
        self.cache = self._new_cache(self.memory_plan.max_total_tokens, self.max_model_len)
        self.prefix = None
        if config.enable_prefix_caching:
            self.prefix = PrefixCache(self.cache, block=64,
                                      checkpoint=config.prefix_checkpoint)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens, self.prefix)
        graphs = self._new_graphs(self.cache) if use_graphs else None
        self.runner = ModelRunner(model, self.cache, graphs)
        # captured at start-up on CUDA (seconds, reported here); on the CPU padded steps run eagerly
        self.graph_capture_s = graphs.capture_all() if graphs is not None and graphs.capture else 0.0
        finish_plan(self.memory_plan, self.cache, graphs, self.graph_capture_s)
        self.spec = None
        if config.num_speculative_tokens:
            self.spec = SpecDecoder(model, self.cache, self.runner, config.num_speculative_tokens,
                                    simulate_acc_len=config.spec_simulate_acc_len)
        self._reqs: dict[str, Request] = {}
        self._aborted: list[Request] = []
        self._arrivals = 0
        self._rng = random.Random(config.seed)
        self.overlap = config.overlap if config.overlap is not None else model.device.type == "cuda"
        self._inflight: Optional[_Inflight] = None
        self.gpu_events: Optional[list] = None  # set to [] to record (start, end) CUDA events of each step's GPU work
        self.num_steps = 0
        self.step_times: list[float] = []      # wall time per step (host-synchronised by the token read)
        self.prepare_times: list[float] = []   # host time per step in scheduling + context building

    def _new_cache(self, total: int, max_len: int) -> CacheManager:
        c = self.config
        return CacheManager(self.model.cfg, model_dtype=self.model.dtype, device=self.model.device,
                            kv_dtype=self.kv_dtype, max_num_seqs=c.max_num_seqs,
                            max_num_batched_tokens=c.max_num_batched_tokens, max_total_tokens=total,
                            max_model_len=max_len, page_size=c.page_size, num_draft_tokens=c.num_speculative_tokens,
                            num_mtp_layers=1 if c.num_speculative_tokens else 0,
                            num_saved_prefixes=c.prefix_cache_entries if c.enable_prefix_caching else 0)

    def _new_graphs(self, cache: CacheManager) -> GraphRunner:
        k = self.config.num_speculative_tokens
        return GraphRunner(self.model, cache, max_reqs=self.config.max_num_seqs, tokens=(1, k + 1) if k else (1,),
                           return_streams=bool(k))

    # ------------------------------------------------------------------ requests
    def check_request(self, prompt_token_ids, params: Optional[SamplingParams]) -> tuple[list[int], SamplingParams]:
        """Validate a request -> (prompt ids, params); ValueError naming the field otherwise."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"deepfuse: params must be a SamplingParams, got {type(params).__name__}")
        params.validate()
        if isinstance(prompt_token_ids, torch.Tensor):
            prompt_token_ids = prompt_token_ids.tolist()
        if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
            raise ValueError("deepfuse: prompt_token_ids must be a non-empty list of token ids")
        ids = list(prompt_token_ids)
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"deepfuse: prompt_token_ids has ids outside the vocabulary [0, {self.vocab_size}): "
                             f"{bad[:5]}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"deepfuse: prompt_token_ids ({len(ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds max_model_len ({self.max_model_len})")
        return ids, params

    def add_request(self, request_id: str, prompt_token_ids, params: Optional[SamplingParams] = None, *,
                    constraint=None) -> None:
        """Queue a request. constraint: optional per-request token constraint with the methods
        of xgrammar's GrammarMatcher: fill_next_token_bitmask(bitmask int32 [R, ceil(V / 32)],
        row) before each sampled token, accept_token(id) -> bool after it, is_terminated()
        (then the request ends with "stop")."""
        ids, params = self.check_request(prompt_token_ids, params)
        for m in ("fill_next_token_bitmask", "accept_token", "is_terminated"):
            if constraint is not None and not callable(getattr(constraint, m, None)):
                raise ValueError(f"deepfuse: constraint has no method {m}()")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"deepfuse: request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._reqs:
            raise ValueError(f"deepfuse: request_id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(request_id, ids, params, seed, self._arrivals, arrival_time=time.perf_counter(),
                      constraint=constraint)
        self._arrivals += 1
        self._reqs[request_id] = req
        self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its cache; the next step() reports it (unknown ids: no-op)."""
        req = self._reqs.pop(request_id, None)
        if req is None:
            return
        self.scheduler.remove(req)
        req.finish_reason = "abort"
        self._aborted.append(req)

    def has_unfinished(self) -> bool:
        return bool(self._reqs) or bool(self._aborted) or self._inflight is not None

    # ------------------------------------------------------------------ one step
    def _finish_reason(self, req: Request, tok: int, n: Optional[int] = None) -> Optional[str]:
        """Why req ends with tok as its n-th generated token (default: the last one), or None."""
        p = req.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            return "stop"
        n = len(req.output_token_ids) if n is None else n
        if n >= p.max_tokens or len(req.prompt_token_ids) + n >= self.max_model_len:
            return "length"
        return None

    def _emissions(self, chunks) -> tuple[list, Optional[torch.Tensor], object]:
        """Forward + sampling (or verification) -> (per chunk Emission or None, final streams
        when speculating, the step context)."""
        r = self.runner
        ctx = r.prepare(chunks)
        if self.spec is None:
            logits = r.forward(chunks, ctx)
            out: list = [Emission([], c.count) for c in chunks]
            if logits.shape[0]:
                res = r.sampler(logits, r.sampling_batch(chunks, ctx))
                toks = res.tokens.tolist()
                lps = res.logprobs.tolist() if res.logprobs is not None else None
                tops = (res.top_ids.tolist(), res.top_logprobs.tolist()) if res.top_ids is not None else None
                for row, i in enumerate(ctx.logits_req):
                    e = out[i]
                    e.tokens = [toks[row]]
                    n = chunks[i].req.params.logprobs
                    if n is not None:
                        e.logprobs = [lps[row]]
                        if n > 0:
                            e.top_logprobs = [dict(zip(tops[0][row][:n], tops[1][row][:n]))]
            return out, None, ctx
        logits, streams = r.forward(chunks, ctx, return_streams=True)
        return self.spec.verify(chunks, ctx, logits), streams, ctx

    def _finish(self, req: Request, reason: str, o: RequestOutput, now: float) -> None:
        if self.prefix is not None and req.cache is not None:
            n = min(req.num_computed, req.num_tokens)  # overlap: the step after may have computed one more
            self.prefix.insert(req.cache, req.tokens(0, n), n)
        req.finish_reason = reason
        self.scheduler.remove(req)
        self._reqs.pop(req.request_id, None)
        o.finished, o.finish_reason = True, reason
        o.metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
                     "finish_time": now, "num_preemptions": req.num_preemptions}

    def _checkpoints(self, chunks) -> None:
        """Save prompts' states at the end of their prefill and every prefix_checkpoint tokens
        of it (the state is valid at exactly those many tokens)."""
        if self.prefix is None:
            return
        ck = self.prefix.checkpoint
        for c in chunks:
            req = c.req
            n, P = req.num_computed, len(req.prompt_token_ids)
            if req.cache is None or n > P or n <= req.last_checkpoint:
                continue
            if n == P or n // ck > req.last_checkpoint // ck:
                self.prefix.insert(req.cache, req.tokens(0, n), n)
                req.last_checkpoint = n

    def _reserve_drafts(self, req: Request, k: int) -> int:
        """Drafts req may verify next step within the cache budget (they are reserved)."""
        k = max(0, min(k, self.max_model_len - req.num_tokens - 1))
        free = self.cache.free_tokens + req.cache.tokens
        k = max(0, min(k, free - req.num_tokens))
        if k:
            self.cache.grow(req.cache, req.num_tokens + k)
            self.cache.flush()
        return k

    def step(self) -> list[RequestOutput]:
        """Run one step -> the outputs of the requests that advanced or ended. With overlap the
        step's own tokens are read back (and reported) by the next call, after that call has
        launched the following step."""
        outs = [RequestOutput(r.request_id, r.prompt_token_ids, [], True, "abort") for r in self._aborted]
        self._aborted.clear()
        if self.overlap and self.spec is None and not any(r.constraint is not None for r in self._reqs.values()):
            return outs + self._step_overlap()
        if self._inflight is not None:  # leaving overlap: settle the step in flight first
            outs += self._settle(self._inflight)
            self._inflight = None
        return outs + self._step_sync()

    def _event(self):
        if self.gpu_events is None or self.model.device.type != "cuda":
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _step_sync(self) -> list[RequestOutput]:
        outs: list[RequestOutput] = []
        t0 = time.perf_counter()
        chunks = self.scheduler.schedule()
        t_sched = time.perf_counter() - t0
        if not chunks:
            return outs
        ev0 = self._event()
        emissions, streams, ctx = self._emissions(chunks)
        if ev0 is not None:
            self.gpu_events.append((ev0, self._event()))
        now = time.perf_counter()
        ending = []
        for c, e in zip(chunks, emissions):
            req = c.req
            req.num_computed = c.start + e.computed
            if not e.tokens:
                continue
            o = RequestOutput(req.request_id, req.prompt_token_ids, [])
            reason = None
            for t, tok in enumerate(e.tokens):
                req.append_token(tok)
                o.token_ids.append(tok)
                if req.first_token_time is None:
                    req.first_token_time = now
                if e.logprobs is not None:
                    req.logprobs.append(e.logprobs[t])
                    o.logprobs = (o.logprobs or []) + [e.logprobs[t]]
                if e.top_logprobs is not None:
                    req.top_logprobs.append(e.top_logprobs[t])
                    o.top_logprobs = (o.top_logprobs or []) + [e.top_logprobs[t]]
                reason = self._finish_reason(req, tok)
                if req.constraint is not None:
                    ok = req.constraint.accept_token(tok)
                    if (not ok or req.constraint.is_terminated()) and reason is None:
                        reason = "stop"
                if reason is not None:
                    break
            if reason is not None:
                req.finish_reason = reason
                ending.append((req, reason, o))
            outs.append(o)
        if self.spec is not None:  # first: prefix snapshots must hold the MTP layer's state of this step
            self.spec.propose(chunks, emissions, streams, ctx, self._reserve_drafts)
        self._checkpoints(chunks)
        for req, reason, o in ending:
            self._finish(req, reason, o, now)
        self.num_steps += 1
        self.step_times.append(time.perf_counter() - t0)
        self.prepare_times.append(t_sched + self.runner.last_prepare_s)
        return outs

    # ------------------------------------------------------------------ overlap
    def _step_overlap(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        chunks = self.scheduler.schedule()
        t_sched = time.perf_counter() - t0
        launched = None
        if chunks:
            r = self.runner
            ev0 = self._event()
            prev = self._inflight.res.tokens if self._inflight is not None else None
            ctx = r.prepare(chunks, pending_tokens=prev)
            logits = r.forward(chunks, ctx)
            for c in chunks:
                c.req.num_computed = c.start + c.count
            self._checkpoints(chunks)
            if logits.shape[0]:
                res = r.sampler(logits, r.sampling_batch(chunks, ctx))
                tensors = [t for t in (res.tokens, res.logprobs, res.top_ids, res.top_logprobs) if t is not None]
                event = None
                if logits.is_cuda:
                    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                            for t in tensors]
                    event = torch.cuda.Event()
                    event.record()
                else:
                    host = tensors
                if ev0 is not None:
                    self.gpu_events.append((ev0, self._event()))
                rows = []
                for row, i in enumerate(ctx.logits_req):
                    req = chunks[i].req
                    req.append_token(PENDING)
                    req.pending = (self.num_steps, row)
                    rows.append((req, len(req.output_token_ids) - 1))
                    if (len(req.output_token_ids) >= req.params.max_tokens
                            or req.num_tokens >= self.max_model_len):
                        req.final_pending = True  # it ends with this token: schedule it no more
                launched = _Inflight(self.num_steps, chunks, ctx, res, host, event, rows)
        outs = self._settle(self._inflight) if self._inflight is not None else []
        self._inflight = launched
        if chunks:
            self.num_steps += 1
            self.step_times.append(time.perf_counter() - t0)
            self.prepare_times.append(t_sched + self.runner.last_prepare_s)
        return outs

    def _settle(self, f: _Inflight) -> list[RequestOutput]:
        """Read back a launched step's tokens; stop conditions are resolved here, one step late."""
        if f.event is not None:
            f.event.synchronize()
        host = [t.tolist() for t in f.host]
        toks = host[0]
        k = 1
        lps = tops_i = tops_v = None
        if f.res.logprobs is not None:
            lps, k = host[k], k + 1
        if f.res.top_ids is not None:
            tops_i, tops_v = host[k], host[k + 1]
        outs, now = [], time.perf_counter()
        for row, (req, idx) in enumerate(f.rows):
            if req.pending == (f.step, row):
                req.pending = None
            if req.finish_reason is not None or idx >= len(req.output_token_ids):
                continue  # ended (or aborted) before this token was read back
            tok = toks[row]
            req.output_token_ids[idx] = tok
            if req.first_token_time is None:
                req.first_token_time = now
            o = RequestOutput(req.request_id, req.prompt_token_ids, [tok])
            n = req.params.logprobs
            if n is not None:
                req.logprobs.append(lps[row])
                o.logprobs = [lps[row]]
                if n > 0:
                    d = dict(zip(tops_i[row][:n], tops_v[row][:n]))
                    req.top_logprobs.append(d)
                    o.top_logprobs = [d]
            reason = self._finish_reason(req, tok, idx + 1)
            if reason is not None:
                del req.output_token_ids[idx + 1:]  # tokens of the step launched after this one
                req.num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
                self._finish(req, reason, o, now)
            outs.append(o)
        return outs

    def stats(self) -> dict:
        c = self.cache
        return {
            "num_steps": self.num_steps,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "used_tokens": c.used_tokens,
            "peak_used_tokens": c.peak_used_tokens,
            "max_total_tokens": c.max_total_tokens,
            "free_slots": c.free_slots,
            "pages_in_use": c.pages_in_use(),
            "cache_bytes": c.nbytes(),
            "kv_dtype": c.kv_dtype,
            "max_model_len": self.max_model_len,
            "memory_plan": self.memory_plan.as_dict(),
            "reference_calls": reference_calls(),  # torch references run on CUDA, per op (process-wide)
            **({"spec": self.spec.stats.as_dict()} if self.spec is not None else {}),
            **({"prefix_cache": self.prefix.stats()} if self.prefix is not None else {}),
        }


__all__ = ["Engine", "EngineConfig"]
