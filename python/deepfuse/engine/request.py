"""Request-side types: sampling parameters, a request's state, the outputs the engine reports."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from typing import Optional


# Temperatures below this are greedy: dividing logits by a (fp32-denormal) 1e-40 overflows.
MIN_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_finite(v) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


@dataclass(init=False)
class SamplingParams:
    """Per-request sampling. Ranges (ValueError "deepfuse: SamplingParams.<field> ..." otherwise):
    max_tokens int in [0, 2^63) (0: run the prefill only, e.g. for prompt_logprobs);
    temperature finite >= 0 (below MIN_TEMPERATURE: greedy); top_k int in [0, 2^31) (0 or
    >= the vocabulary: no filter); top_p finite in (0, 1] (the top token always stays);
    min_p in [0, 1]; seed None or int in [0, 2^64); stop_token_ids an int or ints (the engine
    checks they are in the vocabulary); logprobs / prompt_logprobs None or int in [0, 20]
    (prompt_logprobs: the logprob of every prompt token given its prefix, and n > 0 the top-n
    per position)."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # top-n logprobs per generated token (0: the sampled token's only)
    prompt_logprobs: Optional[int] = None  # logprob of each prompt token (0) and the top-n per position (n > 0)

    def __init__(self, **kw):
        names = {f.name for f in fields(self)}
        for k in kw:
            if k not in names:
                raise ValueError(f"deepfuse: SamplingParams: unknown field {k!r} (fields: {sorted(names)})")
        for f in fields(self):
            setattr(self, f.name, kw.get(f.name, f.default))
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def validate(self) -> "SamplingParams":
        def need(ok, name, what):
            if not ok:
                v = repr(getattr(self, name))
                raise ValueError(f"deepfuse: SamplingParams.{name} {what}, got {v if len(v) <= 80 else v[:77] + '...'}")

        st = self.stop_token_ids
        if st is None:
            st = ()
        elif _is_int(st):
            st = (st,)
        elif isinstance(st, (list, tuple)):
            st = tuple(st)
        else:
            need(False, "stop_token_ids", "must be an int or a list of ints")
        self.stop_token_ids = st
        need(_is_int(self.max_tokens) and 0 <= self.max_tokens < 1 << 63, "max_tokens", "must be an int in [0, 2^63)")
        need(_is_finite(self.temperature) and self.temperature >= 0, "temperature", "must be a finite number >= 0")
        need(_is_int(self.top_k) and 0 <= self.top_k < 1 << 31, "top_k", "must be an int in [0, 2^31) (0 = off)")
        need(_is_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be a number in (0, 1]")
        need(_is_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be a number in [0, 1]")
        need(self.seed is None or _is_int(self.seed) and 0 <= self.seed < 1 << 64, "seed",
             "must be None or an int in [0, 2^64)")
        need(all(_is_int(t) for t in self.stop_token_ids), "stop_token_ids", "must be an int or a list of ints")
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a bool")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            need(v is None or _is_int(v) and 0 <= v <= MAX_LOGPROBS, name,
                 f"must be None or an int in [0, {MAX_LOGPROBS}]")
        return self


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: int                                  # admission order key (lower = older)
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0                         # tokens whose KV is in the cache
    cache: Optional[object] = None                # the CacheManager's ReqCache while running
    finish_reason: Optional[str] = None
    first_token_time: Optional[float] = None
    arrival_time: float = 0.0
    num_preemptions: int = 0
    constraint: Optional[object] = None           # a token constraint (see Engine.add_request)
    counted: bool = False                         # its prompt counted in the prefix-cache hit rate
    last_checkpoint: int = 0                      # computed tokens at its last prefix-cache entry
    pending: Optional[tuple] = None               # (step, row) of its last token while still on the device
    final_pending: bool = False                   # that token is its last (max_tokens / max_model_len)
    drafts: list[int] = field(default_factory=list)  # draft tokens proposed for the next verify step
    draft_logq: Optional[object] = None           # their draft log-probs [k, V] (sampled requests)
    draft_src: Optional[tuple] = None             # (drafts [B, k] on the device, row): drafts not read back
    error: Optional[str] = None                   # why it failed (finish_reason "error")
    prompt_lps: Optional[list] = None             # prompt_logprobs: [P] logprob of token j given j's prefix
    prompt_tops: Optional[list] = None            # ... and [P] top-n dicts (prompt_logprobs > 0)
    prompt_done: bool = False                     # every prompt row's logprobs computed
    prompt_sent: bool = False                     # ... and delivered in an output
    prefix_hashes: list = field(default_factory=list)  # the prefix cache's chained hashes of its prompt blocks

    num_tokens: int = 0                           # prompt + generated (kept by append_token)

    def __post_init__(self):
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def wants_prompt_rows(self) -> bool:
        """Its prefill must compute logits on every prompt row (prompt_logprobs still due)."""
        return self.prompt_lps is not None and not self.prompt_done

    def append_token(self, tok: int) -> None:
        self.output_token_ids.append(tok)
        self.num_tokens += 1

    def token(self, i: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < n else self.output_token_ids[i - n]

    def tokens(self, a: int, b: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if b <= n:
            return self.prompt_token_ids[a:b]
        if a >= n:
            return self.output_token_ids[a - n:b - n]
        return self.prompt_token_ids[a:] + self.output_token_ids[:b - n]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]                          # new tokens (engine.step) or all generated (LLM.generate)
    finished: bool = False
    finish_reason: Optional[str] = None           # "stop" | "length" | "abort" | "error"
    logprobs: Optional[list[float]] = None        # per token in token_ids, when asked
    top_logprobs: Optional[list[dict]] = None     # per token: {token id: logprob}, when logprobs > 0
    metrics: Optional[dict] = None                # on the final output: arrival_time, first_token_time,
                                                  # finish_time (time.perf_counter()), num_preemptions
    error: Optional[str] = None                   # finish_reason "error": what failed (other requests go on)
    prompt_logprobs: Optional[list] = None        # [P] (position 0: None), on the first output after the prefill
    prompt_top_logprobs: Optional[list] = None    # [P] {token id: logprob} (position 0: None), prompt_logprobs > 0
