"""The engine: requests in, one scheduled step at a time, outputs out."""
from __future__ import annotations

import dataclasses
import logging
import random
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from deepfuse.ops import reference_calls

from .cache import KV_DTYPES, CacheManager
from .graph_runner import GraphRunner
from .memory import finish_plan, plan_memory, resolve_kv_dtype
from .model_runner import ModelRunner, StepBatch, StepResult, logits_rows
from .request import Request, RequestOutput, SamplingParams, Status
from .prefix_cache import PrefixCache
from .replay import make_encoder_replay, make_replay
from .dspark_runner import dspark_config, make_dspark, spec_method
from .engram_state import engine_prefetch
from .scheduler import ScheduledChunk, Scheduler
from .speculative import DRAFT_HEADS, SpecDecoder, make_draft_head
from .v41_cache import V41CacheManager


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
    swa_replay_window: int = 0               # V4.1: late layers prefill only each prompt's last K tokens (approximate; 0: off)
    swa_encoder_replay: int = 0              # V4.1: windowless prefix entries; a hit re-runs its last K tokens (approx.; 0: off)
    spec_method: Optional[str] = None        # "dspark" / "mtp"; None: DSpark if the model has a DSpark head, else MTP
    dspark_threshold: float = 0.5            # DSpark: verify the leading drafts with confidence >= this (0: all k)
    spec_draft_head: Optional[str] = None    # MTP drafts' lm head: "fp8" (an FP8 copy) / "model" (None: the model's)

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
        if self.spec_draft_head not in (None,) + DRAFT_HEADS:
            raise ValueError(f"deepfuse: spec_draft_head must be None or one of {DRAFT_HEADS}, "
                             f"got {self.spec_draft_head!r}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"deepfuse: kv_dtype must be None or one of {KV_DTYPES}, got {self.kv_dtype!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"deepfuse: gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        return self


PENDING = -1  # an output token still on the device (overlap: its step is in flight)
log = logging.getLogger("deepfuse.engine")


def _msg(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


@dataclass
class _Inflight:
    """A launched step whose tokens have not been committed yet."""

    step: int
    res: StepResult
    rows: Optional[dict]           # overlap without speculation: chunk -> index of its placeholder token


class Engine:
    def __init__(self, model, config: EngineConfig = EngineConfig(), *, peers=None):
        """peers: rank 0's side of a tensor-parallel group (engine/distributed.py: Leader);
        such an engine runs without graphs, overlap and prefix caching."""
        if peers is not None:
            config = dataclasses.replace(config, overlap=False, enable_prefix_caching=False, cuda_graphs=False)
        config = dspark_config(model, config)  # (DSpark drafting: engine/dspark_runner.py)
        config.validate()
        self.model, self.config = model, config
        cfg = model.cfg
        self.vocab_size = cfg.vocab_size
        eos = cfg.eos_token_id
        self.eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else list(eos))
        self.kv_dtype = resolve_kv_dtype(config.kv_dtype, cfg, model.device, model.dtype)
        use_graphs = config.cuda_graphs if config.cuda_graphs is not None else model.device.type == "cuda"
        # the MTP draft steps' lm head (an FP8 copy if asked; made before the memory plan measures the weights)
        mtp_drafts = spec_method(model, config) == "mtp" and not hasattr(model.cfg, "kv_source_layers")
        self.draft_head = make_draft_head(model, config.spec_draft_head) if mtp_drafts and peers is None else None
        # the memory plan (engine/memory.py): measured on CUDA, then the caches are sized from it
        par = getattr(model, "parallel", None)
        max_len = config.max_model_len or cfg.max_position_embeddings
        # V4.1 host Engram tables: the side-stream prefetch (engine/engram_state.py; counted as weights by the plan)
        self.engram_prefetch = engine_prefetch(model, config.max_num_batched_tokens)
        self.memory_plan = plan_memory(model, config, self.kv_dtype, max_len, self._new_cache,
                                       self._new_graphs if use_graphs else None,
                                       measure=par is None or par.world_size == 1)
        self.max_model_len = self.memory_plan.max_model_len
        self.cache = self._new_cache(self.memory_plan.max_total_tokens, self.max_model_len)
        self.prefix = None
        if config.enable_prefix_caching:
            self.prefix = PrefixCache(self.cache, block=64,
                                      checkpoint=config.prefix_checkpoint)
        self.scheduler = Scheduler(self.cache, config.max_num_seqs, config.max_num_batched_tokens, self.prefix)
        graphs = self._new_graphs(self.cache) if use_graphs else None
        self.spec = None
        if config.num_speculative_tokens:
            self.spec = SpecDecoder(model, config.num_speculative_tokens, simulate_acc_len=config.spec_simulate_acc_len)
        if self.spec is not None:
            self.spec.stats.draft_head = "fp8" if self.draft_head is not None else "model"
        self.runner = ModelRunner(model, self.cache, graphs, spec=self.spec, peers=peers, draft_head=self.draft_head)
        self.runner.replay = make_replay(model, config)  # None unless swa_replay_window (engine/replay.py)
        self.runner.encoder_replay = make_encoder_replay(model, config)  # None unless swa_encoder_replay
        self.runner.dspark = make_dspark(model, config, self.cache, graphs)  # None unless DSpark drafts
        # captured at start-up on CUDA (seconds, reported here); on the CPU padded steps run eagerly
        self.graph_capture_s = graphs.capture_all() if graphs is not None and graphs.capture else 0.0
        if graphs is not None and graphs.capture and self.runner.dspark is not None:  # DSpark's draft graphs
            r0 = graphs._reserved()
            self.runner.dspark.capture_all()
            graphs.pool_bytes += max(0, graphs._reserved() - r0)
            self.graph_capture_s = graphs.capture_s
        finish_plan(self.memory_plan, self.cache, graphs, self.graph_capture_s)
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
        v41 = hasattr(self.model.cfg, "kv_source_layers")
        cls = V41CacheManager if v41 else CacheManager
        kw = {"prefix_windows": False} if v41 and c.swa_encoder_replay else {}  # (engine/replay.py EncoderReplay)
        return cls(self.model.cfg, **kw, model_dtype=self.model.dtype, device=self.model.device,
                            kv_dtype=self.kv_dtype, max_num_seqs=c.max_num_seqs,
                            max_num_batched_tokens=c.max_num_batched_tokens, max_total_tokens=total,
                            max_model_len=max_len, page_size=c.page_size, num_draft_tokens=c.num_speculative_tokens,
                            num_mtp_layers=1 if c.num_speculative_tokens else 0,
                            num_saved_prefixes=c.prefix_cache_entries if c.enable_prefix_caching else 0)

    def _new_graphs(self, cache: CacheManager) -> GraphRunner:
        k = self.config.num_speculative_tokens
        mtp = bool(k) and spec_method(self.model, self.config) == "mtp"  # (DSpark: engine/dspark_runner.py)
        return GraphRunner(self.model, cache, max_reqs=self.config.max_num_seqs, tokens=(1, k + 1) if k else (1,),
                           mtp=mtp, return_streams=bool(k), draft_head=self.draft_head)

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
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"deepfuse: SamplingParams.stop_token_ids has ids outside the vocabulary "
                             f"[0, {self.vocab_size}): {bad[:5]}")
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
        if params.prompt_logprobs is not None:
            req.prompt_lps = [None] * len(ids)
            req.prompt_tops = [None] * len(ids) if params.prompt_logprobs else None
            req.prompt_done = len(ids) == 1
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

    def _finish(self, req: Request, reason: str, o: RequestOutput, now: float) -> None:
        if self.prefix is not None and req.cache is not None:
            n = min(req.num_computed, req.num_tokens)  # overlap: the step after may have computed one more
            self.prefix.insert(req.cache, req.tokens(0, n), n, req.prefix_hashes, len(req.prompt_token_ids))
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
            if self.runner.replay is not None and not self.runner.replay.snapshot_ok(req, n):
                continue  # bounded replay left late-layer window rows unwritten
            if n == P or n // ck > req.last_checkpoint // ck:
                self.prefix.insert(req.cache, req.tokens(0, n), n, req.prefix_hashes, len(req.prompt_token_ids))
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
        """Run one step -> the outputs of the requests that advanced or ended. With overlap a
        step's tokens are read back (and reported) by the next call: without speculation
        after that call has launched the following step (a request's last token is patched
        in on the device); with speculation also after launching the following verify step
        where that step needs no scheduling (_early_ok), else before it schedules (the read
        waits for the accepted tokens only; the step's drafting still runs on the device)."""
        outs = [RequestOutput(r.request_id, r.prompt_token_ids, [], True, "abort") for r in self._aborted]
        self._aborted.clear()
        if self.overlap:
            return outs + (self._step_overlap() if self.spec is None else self._step_spec_overlap())
        if self._inflight is not None:  # leaving overlap: settle the step in flight first
            f, self._inflight = self._inflight, None
            outs += self._settle_safe(f)[0]
        return outs + self._step_sync()

    def _event(self):
        if self.gpu_events is None or self.model.device.type != "cuda":
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _batch(self, chunks) -> StepBatch:
        """The runner's batch; under speculation the chunks that sample and may draft get a
        draft slot, with their cache grown for the chained draft rows (k - 1 past the chunk)."""
        ds = None
        if self.spec is not None:
            k, c = self.spec.k, self.cache
            ds = np.full(len(chunks), -1, np.int64)
            for i, ch in enumerate(chunks):
                req = ch.req
                if req.constraint is not None or not logits_rows(ch)[1]:
                    continue
                need = ch.start + ch.count + k - 1
                if need <= self.max_model_len and need - req.cache.tokens <= c.free_tokens:
                    c.grow(req.cache, need)
                    ds[i] = req.cache.slot
            c.flush()
        return self.runner.batch(chunks, ds)

    def _run(self, chunks) -> tuple[StepResult, dict]:
        res = self.runner.run(self._batch(chunks))
        return res, res.wait()

    def _step_sync(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        chunks = self.scheduler.schedule()
        t_sched = time.perf_counter() - t0
        if not chunks:
            return []
        ev0 = self._event()
        try:
            res, host = self._run(chunks)
        except Exception as e:
            self.num_steps += 1
            return self._isolate(chunks, e)
        if ev0 is not None:
            self.gpu_events.append((ev0, self._event()))
        outs = self._commit(_Inflight(self.num_steps, res, None), host)
        self.num_steps += 1
        self.step_times.append(time.perf_counter() - t0)
        self.prepare_times.append(t_sched + self.runner.last_prepare_s)
        return outs

    # ------------------------------------------------------------------ the commit
    def _commit(self, f: _Inflight, host: dict) -> list[RequestOutput]:
        """Append a step's tokens (f.rows: overlap without speculation, where each sampled
        chunk's first token replaces its placeholder), resolve stop conditions and
        constraints, hand out the next drafts, save prefix checkpoints, end requests."""
        res, late = f.res, f.rows is not None
        b = res.batch
        toks, nemit = host["tokens"], host["num_emitted"]
        acc, lps = host.get("accepted"), host.get("logprobs")
        tops_i, tops_v = host.get("top_ids"), host.get("top_logprobs")
        outs, ending, now = [], [], time.perf_counter()
        by_req = {}
        for i, c in enumerate(b.chunks):
            req, n = c.req, nemit[i]
            idx = None
            if late:
                if req.pending == (f.step, i):
                    req.pending = None
                idx = f.rows.get(i)
                if req.finish_reason is not None or (idx is not None and idx >= len(req.output_token_ids)):
                    continue  # ended (or aborted) before this step was read back
            elif req.finish_reason is not None:
                continue
            else:
                req.num_computed = c.start + (n if b.verified[i] else c.count)
            if req.error is not None:  # its constraint raised in this step
                outs.append(self._fail(req, req.error))
                continue
            if n == 0:
                if not late and self._prefill_only_done(req):
                    ending.append((req, "length", None))
                continue
            if b.verified[i]:
                self.spec.stats.add(int(b.verified[i]), acc[i], n)
            o = RequestOutput(req.request_id, req.prompt_token_ids, [])
            self._attach_prompt(req, o)
            by_req[id(req)] = o
            reason = None
            for t in range(n):
                tok = toks[i][t]
                if idx is not None and t == 0:
                    req.output_token_ids[idx] = tok
                else:
                    req.append_token(tok)
                o.token_ids.append(tok)
                if req.first_token_time is None:
                    req.first_token_time = now
                m = req.params.logprobs
                if m is not None:
                    req.logprobs.append(lps[i][t])
                    o.logprobs = (o.logprobs or []) + [lps[i][t]]
                    if m > 0:
                        d = dict(zip(tops_i[i][t][:m], tops_v[i][t][:m]))
                        req.top_logprobs.append(d)
                        o.top_logprobs = (o.top_logprobs or []) + [d]
                reason = self._finish_reason(req, tok, idx + 1 if idx is not None else None)
                if req.constraint is not None:
                    try:
                        ok = req.constraint.accept_token(tok)
                        if (not ok or req.constraint.is_terminated()) and reason is None:
                            reason = "stop"
                    except Exception as ex:
                        reason = "error"
                        self._fail(req, f"constraint failed: {_msg(ex)}", o)
                if reason is not None:
                    break
            if reason is not None and reason != "error":
                if idx is not None:  # drop the tokens of the step launched after this one
                    del req.output_token_ids[idx + 1:]
                    req.num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
                req.finish_reason = reason
                ending.append((req, reason, o))
            outs.append(o)
        if self.spec is not None:
            self._hand_drafts(res, host)
        if not late:  # (overlap without speculation saved them at launch)
            self._checkpoints(b.chunks)
        for req, reason, o in ending:
            if o is None:
                outs.append(self._finish_prefill_only(req, now))
            else:
                self._finish(req, reason, o, now)
        return outs

    def _hand_drafts(self, res: StepResult, host: dict) -> None:
        """Each request that drafted in this step and decodes on verifies up to k of its
        drafts next step (as many as max_tokens and the cache allow): they stay on the
        device (req.draft_src) unless the force_drafts hook rewrites them. A request's MTP
        rows are valid up to the token before its last one (the prefix snapshot's bound)."""
        b, spec = res.batch, self.spec
        for i, c in enumerate(b.chunks):
            req = c.req
            req.drafts, req.draft_logq, req.draft_src = [], None, None
            if req.cache is None:
                continue
            req.num_computed = min(req.num_computed, req.num_tokens - 1)
            if b.draft_slots[i] < 0 or req.finish_reason is not None or res.drafts is None:
                continue
            lim = min(spec.k, req.params.max_tokens - len(req.output_token_ids) - 1)
            if "verify_len" in host:  # DSpark: the drafts its confidence head verifies
                lim = min(lim, host["verify_len"][i])
            kr = self._reserve_drafts(req, lim)
            if not kr:
                continue
            if "drafts" in host:  # read back: the force_drafts hook, tensor parallel (rank 0 sends every id)
                ds = host["drafts"][i][:kr]
                req.drafts = list(spec.force_drafts(req, ds)) if spec.force_drafts is not None else ds
            else:
                req.drafts, req.draft_src = [PENDING] * kr, (res.drafts, i)
            if res.draft_logq is not None and not req.params.greedy:
                req.draft_logq = res.draft_logq[i, :len(req.drafts)]

    # ------------------------------------------------------------------ overlap
    def _step_overlap(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        chunks = self.scheduler.schedule()
        t_sched = time.perf_counter() - t0
        launched, outs, f = None, [], self._inflight
        if chunks:
            try:
                launched, outs, f = self._launch(chunks, f)
            except Exception as e:
                self._inflight = None
                outs = self._settle_safe(f)[0] if f is not None else []
                self.num_steps += 1
                return outs + self._isolate(chunks, e)
        self._inflight = None
        if f is not None:
            settled, ok = self._settle_safe(f)
            outs += settled
            if not ok and launched is not None:
                self._rollback([c.req for c in launched.res.batch.chunks if c.req.finish_reason is None])
                launched = None
        self._inflight = launched
        if chunks:
            self.num_steps += 1
            self.step_times.append(time.perf_counter() - t0)
            self.prepare_times.append(t_sched + self.runner.last_prepare_s)
        return outs

    def _launch(self, chunks, f: Optional[_Inflight]) -> tuple[Optional[_Inflight], list[RequestOutput],
                                                               Optional[_Inflight]]:
        """Launch a step (overlap) -> (the step in flight or None, outputs, the earlier step
        still to settle or None). A step with constrained requests settles f between its
        forward and its sampling (the masks need f's tokens)."""
        r = self.runner
        ev0 = self._event()
        L = r.launch(self._batch(chunks), f.res if f is not None else None)
        for c in chunks:
            c.req.num_computed = c.start + c.count
        self._checkpoints(chunks)
        outs = []
        if f is not None and any(c.req.constraint is not None for c in chunks):
            self._inflight = None
            outs, ok = self._settle_safe(f)
            f = None
            if not ok:
                self._rollback([c.req for c in chunks if c.req.finish_reason is None])
                return None, outs, None
        res = r.finish(L)
        if ev0 is not None:
            self.gpu_events.append((ev0, self._event()))
        rows = {}
        for i, c in enumerate(chunks):
            req = c.req
            if res.ctx.num_logits[i] and req.finish_reason is None:
                req.append_token(PENDING)
                req.pending = (self.num_steps, i)
                rows[i] = len(req.output_token_ids) - 1
                if len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
                    req.final_pending = True  # it ends with this token: schedule it no more
        now = time.perf_counter()
        outs += [self._finish_prefill_only(c.req, now) for c in chunks if self._prefill_only_done(c.req)]
        return _Inflight(self.num_steps, res, rows), outs, f

    def _step_spec_overlap(self) -> list[RequestOutput]:
        """Overlap under speculation. Where it can (_early_ok: every running request verifies
        on from step N, nothing else to schedule), step N+1 is launched before N is read
        back, its positions, input ids and draft counts taken from N's outputs on the device
        (_launch_early), and N is committed while N+1 runs. Otherwise N's accepted tokens
        are read back (its drafting still runs on the device) and committed, then N+1 is
        scheduled and launched with N's drafts taken from the device."""
        outs, f = [], self._inflight
        if f is not None and self._early_ok(f):
            t0 = time.perf_counter()
            ev0 = self._event()
            try:
                g = self._launch_early(f)
            except Exception:  # it wrote only rows past the live ones: the plain path redoes the step
                log.exception("deepfuse: early launch of step %d failed; running it after the read-back",
                              self.num_steps)
                g = None
            if g is not None:
                if ev0 is not None:
                    self.gpu_events.append((ev0, self._event()))
                t_launch = time.perf_counter() - t0
                self._inflight = None
                outs, ok = self._settle_safe(f)
                self.num_steps += 1
                self.step_times.append(t_launch)
                self.prepare_times.append(self.runner.last_prepare_s)
                if not ok:
                    self._rollback([c.req for c in g.res.batch.chunks if c.req.finish_reason is None])
                    return outs
                if self._bind_early(g):
                    self._inflight = g
                return outs  # (else every request of g ended with f: g's rows are dropped unread)
        if f is not None:
            self._inflight = None
            outs += self._settle_safe(f)[0]
        t0 = time.perf_counter()
        chunks = self.scheduler.schedule()
        t_sched = time.perf_counter() - t0
        if not chunks:
            return outs
        ev0 = self._event()
        try:
            res = self.runner.run(self._batch(chunks))
        except Exception as e:
            self.num_steps += 1
            return outs + self._isolate(chunks, e)
        if ev0 is not None:
            self.gpu_events.append((ev0, self._event()))
        self._inflight = _Inflight(self.num_steps, res, None)
        self.num_steps += 1
        self.step_times.append(time.perf_counter() - t0)
        self.prepare_times.append(t_sched + self.runner.last_prepare_s)
        return outs

    def _early_ok(self, f: _Inflight) -> bool:
        """Step N+1 can be launched before step N (f) is read back: speculation without
        prefix caching on a runner that builds verify contexts on the device; no waiting
        request could be admitted (max_num_seqs running); B (k + 1) tokens fit the step's
        budget; every running request ran in N, sampled, drafted, has no constraint; the
        cache holds the worst case (N accepting all its drafts, then N+1's k + 1 tokens and
        its k - 1 chained draft rows) within max_model_len."""
        r, res = self.runner, f.res
        if (self.prefix is not None or f.rows is not None or not r.early_capable or res.drafts is None
                or self.spec.force_drafts is not None or getattr(r, "dspark", None) is not None):
            return False  # (the hook rewrites drafts on the host; DSpark drafts its own way)
        b, sch, k = res.batch, self.scheduler, self.spec.k
        if sch.waiting and len(sch.running) < sch.max_num_seqs and self.cache.free_slots:
            return False  # a waiting request may be admitted: the plain path schedules
        if len(sch.running) != len(b.chunks) or len(b.chunks) * (k + 1) > sch.max_num_batched_tokens:
            return False  # (over the token budget the scheduler would cut drafts)
        need, seen = 0, set()
        for i, c in enumerate(b.chunks):
            req = c.req
            if (req.status is not Status.RUNNING or req.finish_reason is not None or req.cache is None
                    or b.draft_slots[i] < 0 or req.constraint is not None or req.wants_prompt_rows):
                return False
            end = c.start + c.count + 2 * k
            if end > self.max_model_len:
                return False
            need += max(0, end - req.cache.tokens)
            seen.add(id(req))
        return need <= self.cache.free_tokens and all(id(q) in seen for q in sch.running)

    def _launch_early(self, f: _Inflight) -> _Inflight:
        """Launch the verify step after f before f is read back: every running request (in
        the scheduler's order) verifies f's bonus token and drafts; its cache is grown to
        the worst case first."""
        b, k = f.res.batch, self.spec.k
        row = {id(c.req): i for i, c in enumerate(b.chunks)}
        reqs = list(self.scheduler.running)
        src = np.array([row[id(q)] for q in reqs], np.int64)
        for q, i in zip(reqs, src.tolist()):
            self.cache.grow(q.cache, int(b.starts[i] + b.counts[i]) + 2 * k)
        self.cache.flush()
        chunks = [ScheduledChunk(q, -1, k + 1) for q in reqs]
        big = 1 << 62
        batch = self.runner.early_batch(
            chunks, f.res, src, np.array([len(q.output_token_ids) for q in reqs], np.int64),
            np.array([q.num_tokens for q in reqs], np.int64),
            np.array([min(q.params.max_tokens, big) for q in reqs], np.int64), self.max_model_len)
        return _Inflight(self.num_steps, self.runner.run(batch), None)

    def _bind_early(self, g: _Inflight) -> bool:
        """After the step before g is committed: g's chunks get their host starts, counts
        and verified drafts (the drafts _hand_drafts just handed out, which g verifies
        already; the device computed the same counts) -> whether a request of g goes on."""
        b, live = g.res.batch, False
        for i, c in enumerate(b.chunks):
            req = c.req
            if req.finish_reason is not None or req.cache is None:
                continue  # ended with the step before: g's rows of it are dropped
            kr = len(req.drafts)
            c.start, c.count = req.num_tokens - 1, 1 + kr
            b.starts[i], b.counts[i], b.verified[i] = c.start, c.count, kr
            req.drafts, req.draft_logq, req.draft_src = [], None, None
            live = True
        return live

    def _settle_safe(self, f: _Inflight) -> tuple[list[RequestOutput], bool]:
        """_settle(f) -> (outputs, True); if reading f back fails, the requests with sampled
        rows in f fail (False: the caller sends the requests of a step launched after f back
        to the queue)."""
        try:
            return self._settle(f), True
        except Exception as e:
            log.exception("deepfuse: reading back step %d failed", f.step)
            chunks, nl = f.res.batch.chunks, f.res.ctx.num_logits
            reqs = list({id(c.req): c.req for c, n in zip(chunks, nl) if n and c.req.finish_reason is None}.values())
            return [self._fail(q, _msg(e)) for q in reqs], False

    def _settle(self, f: _Inflight) -> list[RequestOutput]:
        """Read back a launched step and commit it."""
        return self._commit(f, f.res.wait())

    # ------------------------------------------------------------------ failures
    def _prefill_only_done(self, req: Request) -> bool:
        return req.params.max_tokens == 0 and req.finish_reason is None and req.num_computed >= req.num_tokens

    def _finish_prefill_only(self, req: Request, now: float) -> RequestOutput:
        o = RequestOutput(req.request_id, req.prompt_token_ids, [])
        self._attach_prompt(req, o)
        self._finish(req, "length", o, now)
        return o

    def _attach_prompt(self, req: Request, o: RequestOutput) -> None:
        """The prompt logprobs go out once, complete, with the first output after the prefill."""
        if req.prompt_lps is not None and req.prompt_done and not req.prompt_sent:
            req.prompt_sent = True
            o.prompt_logprobs = list(req.prompt_lps)
            o.prompt_top_logprobs = list(req.prompt_tops) if req.prompt_tops is not None else None

    def _fail(self, req: Request, msg: str, o: Optional[RequestOutput] = None) -> RequestOutput:
        """End req with finish_reason "error" and free its cache (its state is not kept in the
        prefix cache) -> its output (o, if given, is completed)."""
        log.warning("deepfuse: request %s failed: %s", req.request_id, msg)
        self.scheduler.remove(req)
        self._reqs.pop(req.request_id, None)
        while req.output_token_ids and req.output_token_ids[-1] == PENDING:
            req.output_token_ids.pop()
        req.num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
        req.pending, req.final_pending = None, False
        req.finish_reason, req.error = "error", msg
        o = o if o is not None else RequestOutput(req.request_id, req.prompt_token_ids, [])
        o.finished, o.finish_reason, o.error = True, "error", msg
        o.metrics = {"arrival_time": req.arrival_time, "first_token_time": req.first_token_time,
                     "finish_time": time.perf_counter(), "num_preemptions": req.num_preemptions}
        return o

    def _rollback(self, reqs: list[Request]) -> None:
        """Send requests of a failed step back to the queue, to be recomputed: whatever the
        step wrote of their caches is dropped (a partly run step leaves rings half-written)."""
        s = self.scheduler
        for req in sorted(reqs, key=lambda r: r.arrival, reverse=True):
            while req.output_token_ids and req.output_token_ids[-1] == PENDING:
                req.output_token_ids.pop()
            req.num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
            req.pending, req.final_pending = None, False
            if req.prompt_lps is not None and not req.prompt_sent:
                req.prompt_done = len(req.prompt_token_ids) == 1
            if req.status is Status.RUNNING:
                s.running.remove(req)
                s._free(req)
                req.status = Status.WAITING
                s.waiting.appendleft(req)

    def _bisect(self, group: list, run, err: Exception, known: bool = True) -> list[tuple]:
        """The members of group that make run(subgroup) raise -> [(member, its error)]; a
        failing group whose halves both pass counts as a whole. known: group fails with err."""
        if not known:
            try:
                run(group)
                return []
            except Exception as e:
                err = e
        if len(group) == 1:
            return [(group[0], err)]
        h = len(group) // 2
        bad = self._bisect(group[:h], run, err, False) + self._bisect(group[h:], run, err, False)
        return bad or [(m, err) for m in group]

    def _isolate(self, chunks, e: Exception) -> list[RequestOutput]:
        """A step raised: find its failing requests by re-running its chunks in halves (each
        probe is a full step: forward, sampling, drafts; the caches it writes are dropped),
        end them with the error, and send the others back to the queue. A failure that no
        probe reproduces ends every request of the step."""
        log.warning("deepfuse: step failed (%s); isolating the failing requests", _msg(e))
        live = [c for c in chunks if c.req.status is Status.RUNNING and c.req.cache is not None]
        bad = self._bisect(live, self._run, e, known=len(live) == len(chunks)) if live else []
        if not bad:
            bad = [(c, e) for c in live]
        failed = {id(c.req) for c, _ in bad}
        outs = [self._fail(c.req, _msg(err)) for c, err in bad]
        self._rollback([c.req for c in live if id(c.req) not in failed])
        return outs

    def stats(self) -> dict:
        c = self.cache
        return {
            "num_steps": self.num_steps,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "early_steps": self.runner.early_steps,   # speculative steps launched before the previous one was read back
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
