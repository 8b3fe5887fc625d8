"""Request-side types: sampling parameters, a request's state, the outputs the engine reports."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Optional


@dataclass(init=False)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # top-n logprobs per generated token (0: the sampled token's only)

    def __init__(self, **kw):
        names = {f.name for f in fields(self)}
        for k in kw:
            if k not in names:
                raise ValueError(f"deepfuse: SamplingParams: unknown field {k!r} (fields: {sorted(names)})")
        for f in fields(self):
            setattr(self, f.name, kw.get(f.name, f.default))
        self.stop_token_ids = tuple(self.stop_token_ids)
        self.validate()

    def validate(self) -> "SamplingParams":
        def need(ok, name, what):
            if not ok:
                raise ValueError(f"deepfuse: SamplingParams.{name} {what}, got {getattr(self, name)!r}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v

        need(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an int >= 1")
        need(is_num(self.temperature) and self.temperature >= 0, "temperature", "must be a number >= 0")
        need(is_int(self.top_k) and self.top_k >= 0, "top_k", "must be an int >= 0 (0 = off)")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(self.seed is None or is_int(self.seed), "seed", "must be an int or None")
        need(all(is_int(t) for t in self.stop_token_ids), "stop_token_ids", "must be ints")
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a bool")
        need(self.logprobs is None or is_int(self.logprobs) and 0 <= self.logprobs <= 20, "logprobs",
             "must be None or an int in [0, 20]")
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

    num_tokens: int = 0                           # prompt + generated (kept by append_token)

    def __post_init__(self):
        self.num_tokens = len(self.prompt_token_ids) + len(self.output_token_ids)

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
    finish_reason: Optional[str] = None           # "stop" | "length" | "abort"
    logprobs: Optional[list[float]] = None        # per token in token_ids, when asked
    top_logprobs: Optional[list[dict]] = None     # per token: {token id: logprob}, when logprobs > 0
    metrics: Optional[dict] = None                # on the final output: arrival_time, first_token_time,
                                                  # finish_time (time.perf_counter()), num_preemptions
