"""The engine's start-up memory plan: how many context tokens the caches hold.

gpu_memory_utilization u (vLLM's name and meaning): this engine may use u x the device's
TOTAL memory, the model's weights included. On CUDA the plan measures before it sizes:

1. weights: what torch holds once the probes below are freed (the model, lazily made
   workspaces and tables);
2. activations: one profiling step on minimal caches, the largest the scheduler can build:
   max_num_batched_tokens tokens, one request at the deepest context (its last token at
   max_model_len - 1: entry tables and the indexer's scores at their widest) and
   max_num_seqs - 1 short requests (T = k + 1 tokens each with speculation), every logits
   row sampled with top-k, top-p, min-p and 20 logprobs. Its peak of torch's reserved memory
   above the start;
3. graphs: the CUDA graphs of every (bucket, T) captured against those minimal caches
   (their memory depends on the buckets and max_model_len, not on the cache size): torch's
   reserved memory after the capture minus before; then probes and graphs are freed;
4. non_torch: device memory in use that torch did not reserve (the CUDA context, library
   handles, other processes on the GPU);
5. caches = total x u - weights - activations - graphs - non_torch - margin; max_total_tokens
   = the most tokens whose caches fit that (never more than max_num_seqs x max_model_len),
   max_model_len = min(the configured one or the model's max_position_embeddings,
   max_total_tokens).

The real caches are then allocated and the graphs captured again, against them; the plan
records that capture's memory too (graphs_actual). An explicit max_total_tokens wins: a
ValueError when its caches, the activations, the graphs and the margin do not fit in the
free memory, a note when they only exceed the utilization budget. Not covered: prompt-logprob
rows (a chunk of prompt rows with logits, [rows, vocab] fp32 several times over) and the
MTP drafting step (B x k tokens); the margin and the 1 - u left over are their room.

On the CPU nothing is measured: max_total_tokens defaults to 128K tokens.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from .cache import default_total_tokens, resolve_kv_dtype

log = logging.getLogger("deepfuse.engine")

GiB = float(1 << 30)
MARGIN_MIN = 512 << 20        # bytes kept free besides the plan's items ...
MARGIN_FRACTION = 0.005       # ... or this fraction of the device's memory, the larger
PROFILE_LOGPROBS = 20         # top logprobs the profiling step asks for (the most a request may)


@dataclass
class MemoryPlan:
    """The numbers of the plan (bytes, except where named); as_dict() for stats()."""

    device: str
    kv_dtype: str
    max_total_tokens: int
    max_model_len: int
    measured: bool = False                 # False: CPU, tensor parallel ranks (nothing measured)
    source: str = "default"                # "planned", "explicit" or "default"
    total: int = 0                         # device memory
    utilization: float = 0.0
    weights: int = 0
    activations: int = 0
    graphs: int = 0                        # graph memory measured on the minimal caches
    non_torch: int = 0
    margin: int = 0
    cache_budget: int = 0                  # what the caches may take
    cache: int = 0                         # what they take (the real caches' bytes)
    graphs_actual: Optional[int] = None    # graph memory of the real capture
    graph_buckets: tuple = ()
    graph_tokens: tuple = ()
    capture_s: float = 0.0
    plan_s: float = 0.0                    # seconds spent measuring
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        d = asdict(self)
        for k in ("total", "weights", "activations", "graphs", "non_torch", "margin", "cache_budget", "cache",
                  "graphs_actual"):
            if d[k] is not None:
                d[k + "_gib"] = round(d[k] / GiB, 3)
        d["graph_buckets"], d["graph_tokens"] = list(self.graph_buckets), list(self.graph_tokens)
        return d

    def summary(self) -> str:
        """The start-up lines: capacity, max_model_len, kv dtype, graphs, the plan in GiB."""
        g = lambda b: f"{b / GiB:.2f}"  # noqa: E731
        lines = [f"cache: {self.max_total_tokens} tokens ({self.source}), max_model_len {self.max_model_len}, "
                 f"kv {self.kv_dtype}, {g(self.cache)} GiB"]
        if self.graph_buckets:
            lines.append(f"cuda graphs: buckets {list(self.graph_buckets)} x tokens {list(self.graph_tokens)}, "
                         f"captured in {self.capture_s:.2f} s"
                         + (f", {g(self.graphs_actual)} GiB" if self.graphs_actual is not None else ""))
        if self.measured:
            lines.append(f"memory plan: {g(self.total)} GiB x {self.utilization} = weights {g(self.weights)} + "
                         f"activations {g(self.activations)} + graphs {g(self.graphs)} + non-torch "
                         f"{g(self.non_torch)} + margin {g(self.margin)} + caches {g(self.cache_budget)} GiB "
                         f"(planned in {self.plan_s:.1f} s)")
        lines += self.notes
        return "\n".join(lines)


# ----------------------------------------------------------------------------- arithmetic
def cache_budget(total: int, utilization: float, weights: int, activations: int, graphs: int, non_torch: int,
                 margin: int) -> int:
    """Bytes the caches may take: total x utilization less everything else the plan counts."""
    return int(total * utilization) - weights - activations - graphs - non_torch - margin


def default_margin(total: int) -> int:
    return max(MARGIN_MIN, int(total * MARGIN_FRACTION))


def fit_tokens(budget: int, cache_bytes: Callable[[int], int], cap: int) -> int:
    """The most tokens T in [1, cap] with cache_bytes(T) <= budget (cache_bytes non-decreasing);
    0 when not even one token fits."""
    if cap < 1 or cache_bytes(1) > budget:
        return 0
    if cache_bytes(cap) <= budget:
        return cap
    lo, hi = 1, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cache_bytes(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class Measured:
    """What the probes measured (bytes)."""

    total: int
    weights: int
    activations: int
    graphs: int
    non_torch: int
    free: int = -1                # free device memory when sized (-1: total - weights - non_torch)


def size_caches(m: Measured, utilization: float, cache_bytes: Callable[[int], int], *, max_len: int,
                max_num_seqs: int, min_tokens: int, explicit: Optional[int] = None,
                margin: Optional[int] = None) -> tuple[int, int, int, int, list]:
    """-> (max_total_tokens, max_model_len, cache budget, margin, notes) from the measured
    numbers; ValueError when the budget's caches cannot hold min_tokens, or an explicit
    max_total_tokens does not fit in the free memory (its caches, activations, graphs and the
    margin); an explicit one over the budget but within free memory is taken, with a note."""
    margin = default_margin(m.total) if margin is None else margin
    notes = []
    budget = cache_budget(m.total, utilization, m.weights, m.activations, m.graphs, m.non_torch, margin)
    parts = (f"gpu_memory_utilization {utilization} x {m.total / GiB:.2f} GiB less weights {m.weights / GiB:.2f}, "
             f"activations {m.activations / GiB:.2f}, graphs {m.graphs / GiB:.2f}, non-torch "
             f"{m.non_torch / GiB:.2f} and margin {margin / GiB:.2f} GiB leaves {budget / GiB:.2f} GiB for the caches")
    fit = fit_tokens(budget, cache_bytes, max(1, max_num_seqs * max_len))
    if explicit is not None:
        need = cache_bytes(explicit)
        free = m.free if m.free >= 0 else m.total - m.weights - m.non_torch
        room = free - m.activations - m.graphs - margin
        if need > room:
            raise ValueError(f"deepfuse: max_total_tokens={explicit} needs {need / GiB:.2f} GiB of caches; the device "
                             f"has {free / GiB:.2f} GiB free, {room / GiB:.2f} GiB after activations "
                             f"{m.activations / GiB:.2f}, graphs {m.graphs / GiB:.2f} and margin {margin / GiB:.2f} "
                             f"GiB (at most {fit_tokens(room, cache_bytes, explicit)} tokens fit)")
        if need > budget:
            notes.append(f"max_total_tokens={explicit} is over the gpu_memory_utilization budget: {parts}, the "
                         f"caches take {need / GiB:.2f} GiB")
        tokens = explicit
    else:
        if fit < min_tokens:
            raise ValueError(f"deepfuse: not enough device memory for the caches: {parts}, {fit} tokens, fewer "
                             f"than {min_tokens} (one chunk or one max_model_len request); raise "
                             f"gpu_memory_utilization or lower max_num_batched_tokens / max_num_seqs")
        tokens = fit
    return tokens, min(max_len, tokens), budget, margin, notes


# ----------------------------------------------------------------------------- measuring
def _settle(dev) -> int:
    torch.cuda.synchronize(dev)
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(dev)


def largest_step(model, cache, *, max_num_batched_tokens: int, max_num_seqs: int, max_len: int,
                 tokens_per_req: int = 1) -> torch.Tensor:
    """Run the largest step (see the module docstring) on `cache`, whose block tables point
    every entry at page 0 (no pages are taken), and sample its logits rows -> the sampled tokens."""
    from .context import build_context
    from .sampler import Sampler, SamplingBatch

    dev = cache.device
    N = min(max_num_batched_tokens, max_len)
    T = min(tokens_per_req, N)
    B = max(1, min(max_num_seqs, cache.num_slots, 1 + (N - 1) // T))
    first = N - (B - 1) * T
    counts = np.array([first] + [T] * (B - 1), np.int64)
    starts = np.array([max_len - first] + [max_len - T] * (B - 1), np.int64)
    nlog = np.array([1] + [T] * (B - 1), np.int64)
    ids = np.arange(N, dtype=np.int64) % model.cfg.vocab_size
    with torch.no_grad():
        ctx = build_context(ids, starts, counts, np.arange(B, dtype=np.int64), nlog, cache.geometry,
                            cache.block_tables, dev, cache.host_block_tables)
        hasher = getattr(model, "engram_hasher", None)
        if hasher is not None:  # V4.1 Engram: no history before the profiled chunks
            ctx.engram_history = torch.full((B, hasher.max_ngram - 1), -1, dtype=torch.int64, device=dev)
        logits = model.forward_step(ctx, cache)
        R = logits.shape[0]
        batch = SamplingBatch.from_lists([1.0] * R, [50] * R, [0.9] * R, [0.05] * R, list(range(R)),
                                         [max_len] * R, num_logprobs=PROFILE_LOGPROBS, want_logprobs=True, device=dev)
        return Sampler()(logits, batch).tokens


def profile_step(model, cache, **kw) -> int:
    """Peak reserved memory (bytes above the start) of largest_step(model, cache, **kw) (CUDA)."""
    dev = cache.device
    r0 = _settle(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    largest_step(model, cache, **kw)
    torch.cuda.synchronize(dev)
    return max(0, torch.cuda.max_memory_reserved(dev) - r0)


def measure_graphs(graphs) -> int:
    """Capture every graph of `graphs` (a GraphRunner) -> its memory (bytes of reserved memory)."""
    graphs.capture_all()
    return graphs.pool_bytes


def cache_class(cfg):
    """The cache manager of a model config: V41CacheManager for DeepSeek V4.1 (only the kv
    source layers hold compressed rows and keys: its bytes_per_token), else CacheManager."""
    if hasattr(cfg, "kv_source_layers"):
        from .v41_cache import V41CacheManager

        return V41CacheManager
    from .cache import CacheManager

    return CacheManager


def plan_memory(model, config, kv_dtype: str, max_len: int, make_cache: Callable, make_graphs: Optional[Callable],
                measure: bool) -> MemoryPlan:
    """The plan before the real caches exist (see the module docstring). make_cache(total,
    max_len) -> a CacheManager; make_graphs(cache) -> a GraphRunner or None (no graphs)."""
    dev = model.device
    explicit = config.max_total_tokens
    if dev.type != "cuda" or not measure:
        total = explicit or default_total_tokens(model.cfg, kv_dtype, model.dtype, dev, config.max_num_seqs, max_len,
                                                 manager=cache_class(model.cfg))
        return MemoryPlan(str(dev), kv_dtype, total, min(max_len, total),
                          source="explicit" if explicit else "default")
    t0 = time.perf_counter()
    L = min(max_len, explicit) if explicit else max_len
    _settle(dev)
    probe = make_cache(max(config.max_num_batched_tokens, 1), L)
    k = config.num_speculative_tokens
    act = profile_step(model, probe, max_num_batched_tokens=config.max_num_batched_tokens,
                       max_num_seqs=config.max_num_seqs, max_len=L, tokens_per_req=k + 1)
    graph_bytes = 0
    if make_graphs is not None:
        g = make_graphs(probe)
        graph_bytes = measure_graphs(g)
        del g
    layout = probe.layout()
    del probe
    reserved = _settle(dev)
    free, total = torch.cuda.mem_get_info(dev)
    m = Measured(total=total, weights=reserved, activations=act, graphs=graph_bytes,
                 non_torch=max(0, total - free - reserved), free=free)
    tokens, L, budget, margin, notes = size_caches(m, config.gpu_memory_utilization, layout.bytes,
                                            max_len=max_len, max_num_seqs=config.max_num_seqs,
                                            min_tokens=min(max_len, config.max_num_batched_tokens), explicit=explicit)
    plan = MemoryPlan(str(dev), kv_dtype, tokens, L, measured=True, source="explicit" if explicit else "planned",
                      total=total, utilization=config.gpu_memory_utilization, weights=m.weights,
                      activations=act, graphs=graph_bytes, non_torch=m.non_torch, margin=margin,
                      cache_budget=budget, plan_s=time.perf_counter() - t0, notes=notes)
    if L < max_len:
        plan.notes.append(f"max_model_len {L}: what the caches hold (the model allows {max_len})")
    return plan


def finish_plan(plan: MemoryPlan, cache, graphs, capture_s: float) -> MemoryPlan:
    """Record the real caches' and graphs' numbers; log the summary."""
    plan.cache = cache.device_bytes()
    if graphs is not None:
        plan.graph_buckets, plan.graph_tokens = tuple(graphs.buckets), tuple(graphs.tokens)
        plan.capture_s = capture_s
        if graphs.capture:
            plan.graphs_actual = graphs.pool_bytes
    log.info("%s", plan.summary())
    return plan


__all__ = ["MemoryPlan", "Measured", "resolve_kv_dtype", "cache_budget", "fit_tokens", "size_caches",
           "cache_class", "plan_memory", "finish_plan", "largest_step", "profile_step"]
