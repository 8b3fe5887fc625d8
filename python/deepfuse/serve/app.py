"""The OpenAI-compatible HTTP server (FastAPI): /v1/chat/completions, /v1/completions,
/v1/models, /tokenize, /health, /metrics.

Chat: deepseek-recipe converts the request (ChatCompletionRequest -> ConversationRequest),
renders and encodes the V4 prompt, and its StreamProcessor turns the engine's tokens into
Chat Completions chunks (incremental detokenisation, reasoning content, DSML tool calls,
stop strings, logprobs, usage). Completions: the prompt text or ids go to the engine as
they are; tokenizers' DecodeStream detokenises incrementally and stop strings are matched
on the text. Either way a stop string ends the request in the engine (abort) and the
client gets finish_reason "stop"; a client that goes away aborts its request."""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from deepfuse.engine import SamplingParams

from .engine_loop import EngineLoop, Item
from .grammar import GrammarError, Grammars, constraint_for
from .metrics import Metrics
from .protocol import (APIError, bad, check_chat, check_model, common_sampling, conversion_param, parse_body,
                       response_format)

log = logging.getLogger("deepfuse.serve")

# fields taken out of a chat body before deepseek-recipe sees it (handled here / by the engine)
_EXTRAS = ("top_k", "min_p", "stop_token_ids", "ignore_eos", "seed", "repetition_penalty")


def _err(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


@dataclass
class ServerState:
    engine_loop: EngineLoop
    tokenizer: Any
    grammars: Optional[Grammars]
    model_name: str
    max_model_len: int
    metrics: Metrics
    eos_ids: frozenset
    thinking_default: bool = False
    encoding: str = "v4"
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        import deepseek_recipe as dr

        version = dr.ModelVersion.DeepseekV41Flash if self.encoding == "v4.1" else dr.ModelVersion.DeepseekV4Pro
        self.conv_opts = dr.ConversionOptions(default_thinking_mode=self.thinking_default).with_model_alias(
            self.model_name, version)
        enc = dr.DeepseekV41Encoding() if self.encoding == "v4.1" else dr.DeepseekV4Encoding()
        self.chat_encoding = enc.with_tokenizer(self.tokenizer.recipe)
        self.served = {self.model_name}


# ---------------------------------------------------------------------------------- helpers
class StopMatcher:
    """Stop strings on the detokenised text: feed(delta) -> (text safe to emit, hit)."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.text = ""
        self.emitted = 0
        self.longest = max((len(s) for s in stops), default=0)

    def feed(self, delta: str) -> tuple[str, bool]:
        self.text += delta
        if not self.stops:
            out = self.text[self.emitted:]
            self.emitted = len(self.text)
            return out, False
        lo = max(0, self.emitted - self.longest + 1)
        hits = [p for p in (self.text.find(s, lo) for s in self.stops) if p >= 0]
        if hits:
            p = min(hits)
            out = self.text[self.emitted:p]
            self.text = self.text[:p]
            self.emitted = p
            return out, True
        hold = 0  # the longest tail that could start a stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        end = max(self.emitted, len(self.text) - hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out, False

    def flush(self) -> str:
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out


def _sampling(s: dict, *, logprobs: Optional[int], max_tokens: int, **extra) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=float(s["temperature"]), top_k=s["top_k"],
                              top_p=float(s["top_p"]), min_p=float(s["min_p"]), seed=s["seed"],
                              stop_token_ids=s["stop_token_ids"], ignore_eos=s["ignore_eos"], logprobs=logprobs,
                              **extra)
    except (ValueError, TypeError, OverflowError) as e:
        m = re.search(r"SamplingParams\.(\w+)", str(e))
        name = m.group(1) if m else None
        raise bad({"max_tokens": s.get("max_tokens_param", "max_tokens")}.get(name, name), str(e)) from None


def _check_ids(st: ServerState, s: dict) -> None:
    """Token ids against the model's vocabulary; a top_k of the vocabulary or more is off."""
    V = st.engine_loop.engine.vocab_size
    out = [t for t in s["stop_token_ids"] if t >= V]
    if out:
        raise bad("stop_token_ids", f"'stop_token_ids' has ids outside the vocabulary [0, {V}): {out[:5]}")
    if s["top_k"] >= V:
        s["top_k"] = 0


def _has_prompt_logprobs() -> bool:
    """Whether the engine reports prompt logprobs (SamplingParams.prompt_logprobs)."""
    import dataclasses

    return any(f.name == "prompt_logprobs" for f in dataclasses.fields(SamplingParams))


def _sse(data: str) -> str:
    return f"data: {data}\n\n"


class _Waiter:
    """Next engine Items for one request, and every second a look at the client connection:
    None (and the request aborted) once the client has gone away."""

    def __init__(self, q: asyncio.Queue, request: Request, rid: str, st: "ServerState"):
        self.q, self.request, self.rid, self.st = q, request, rid, st
        self.checked = time.monotonic()

    async def _gone(self) -> bool:
        self.checked = time.monotonic()
        if await self.request.is_disconnected():
            self.st.engine_loop.abort(self.rid)
            return True
        return False

    async def next(self) -> Optional[Item]:
        if time.monotonic() - self.checked > 1.0 and await self._gone():
            return None
        try:
            return self.q.get_nowait()
        except asyncio.QueueEmpty:
            pass
        while True:
            try:
                return await asyncio.wait_for(self.q.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await self._gone():
                    return None


def _strip_stop_token(item: Item, params: SamplingParams, eos_ids) -> list:
    """The tokens whose text the client sees: a final EOS / stop token id is not text."""
    toks = item.token_ids
    if item.finished and item.finish_reason == "stop" and toks and (
            toks[-1] in params.stop_token_ids or (not params.ignore_eos and toks[-1] in eos_ids)):
        return toks[:-1]
    return toks


# ---------------------------------------------------------------------------------- chat
@dataclass
class ChatJob:
    rid: str
    ids: list
    params: SamplingParams
    constraint: Any
    conv: Any          # deepseek_recipe.ConversationRequest
    stream: bool
    include_usage: bool
    want_logprobs: bool
    queue: Optional[asyncio.Queue] = None  # the engine's Items (set when submitted)

    def submit(self, st: "ServerState"):
        self.queue = st.engine_loop.submit(self.rid, self.ids, self.params, self.constraint)


def prepare_chat(st: ServerState, body: dict) -> ChatJob:
    import deepseek_recipe as dr

    check_chat(body)
    s = common_sampling(body, default_max_tokens=None)
    kind, spec = response_format(body)
    _check_ids(st, s)
    tool_choice, parallel = body.get("tool_choice"), body.get("parallel_tool_calls")
    for k in _EXTRAS:
        body.pop(k, None)
    body.pop("max_completion_tokens", None)  # deepseek-recipe reads max_tokens only
    if s["max_tokens"] is not None:
        body["max_tokens"] = s["max_tokens"]
    if any(isinstance(m, dict) and m.get("role") == "developer" for m in body["messages"]):
        body["messages"] = [dict(m, role="system") if m.get("role") == "developer" else m for m in body["messages"]]
    if kind == "grammar":  # not a recipe response_format: constrained here, the prompt stays plain
        body.pop("response_format", None)
    try:
        conv = dr.ChatCompletionRequest(body).convert(st.conv_opts)
    except dr.ConversionError as e:
        try:
            err = json.loads(e.body)["error"]
            msg = err.get("message") or str(e)
        except Exception:  # noqa: BLE001
            msg = str(e)
        status = e.status_code if 400 <= e.status_code < 600 else 400
        raise APIError(status, msg, conversion_param(msg)) from None
    except (ValueError, TypeError) as e:
        raise bad(conversion_param(str(e)), str(e)) from None
    try:
        ids = st.chat_encoding.encode(conv.conversation)
    except Exception as e:  # noqa: BLE001
        raise bad("messages", f"cannot encode the conversation: {e}") from None
    try:
        max_tokens = conv.resolve_max_tokens(len(ids), st.max_model_len)
    except dr.ConversionError as e:
        try:
            msg = json.loads(e.body)["error"]["message"]
        except Exception:  # noqa: BLE001
            msg = str(e)
        raise bad(s["max_tokens_param"] if s["max_tokens"] and len(ids) < st.max_model_len else "messages",
                  f"{msg} (prompt: {len(ids)} tokens, context: {st.max_model_len})") from None
    if len(ids) + max_tokens > st.max_model_len:
        raise bad("messages", f"the prompt ({len(ids)} tokens) leaves no room in the context ({st.max_model_len})")
    io = conv.inference_options
    # deepseek-recipe resolves temperature / top_p (thinking mode: its fixed values) and logprobs
    s["temperature"] = io.temperature if io.temperature is not None else (s["temperature"] or 1.0)
    s["top_p"] = io.top_p if io.top_p is not None else (s["top_p"] or 1.0)
    logprobs = None
    if io.logprobs:
        logprobs = io.top_logprobs or 0
    params = _sampling(s, logprobs=logprobs, max_tokens=max_tokens)
    thinking = conv.conversation.thinking_mode
    constraint = None
    try:
        if kind == "grammar":
            constraint = constraint_for(st.grammars, "grammar", spec, thinking=thinking)
        else:
            oc = io.output_constraint
            if oc is not None and oc.kind == "json":
                k = "json_object" if not oc.schema else "json_schema"
                constraint = constraint_for(st.grammars, k, oc.schema or None, thinking=thinking)
            elif oc is not None and oc.kind == "regex":
                constraint = constraint_for(st.grammars, "regex", oc.schema, thinking=thinking)
            elif oc is not None and oc.kind == "tool_call_required":
                tail = st.tokenizer.decode(ids[-16:]) if conv.parsing_options.starts_in_tool_calls else ""
                tools = json.loads(oc.schema)
                forced = isinstance(tool_choice, dict)
                if forced:
                    name = (tool_choice.get("function") or {}).get("name")
                    tools = [t for t in tools if (t.get("function") or {}).get("name") == name] or tools
                constraint = constraint_for(st.grammars, "tool_call_required", None, tools=tools, thinking=thinking,
                                            prompt_tail=tail, tool_choice=tool_choice if forced else "required",
                                            parallel_tool_calls=parallel is not False)
    except GrammarError as e:
        raise bad(e.param, str(e)) from None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    return ChatJob(rid, ids, params, constraint, conv, s["stream"], s["include_usage"], bool(io.logprobs))


def _chat_chunk(item_tokens, item: Item, job: ChatJob):
    import deepseek_recipe as dr

    if not job.want_logprobs or item.logprobs is None:
        return dr.InferenceChunk.tokens(item_tokens)
    n = len(item_tokens)
    tops = item.top_logprobs or [{}] * n
    lps = [(float(item.logprobs[i]), [(int(k), float(v)) for k, v in tops[i].items()]) for i in range(n)]
    return dr.InferenceChunk.tokens(item_tokens, lps)


async def run_chat(st: ServerState, job: ChatJob, request: Request):
    """Yields recipe output chunks (ChatCompletionChunk) for the job; aborts on stop strings."""
    import deepseek_recipe as dr

    gen = dr.ChatCompletionRequest.chunk_generator(job.conv, job.rid, st.model_name)
    proc = dr.StreamProcessor(gen, job.conv.parsing_options, st.tokenizer.recipe)
    waiter = _Waiter(job.queue, request, job.rid, st)
    detok = st.tokenizer.detokenizer()
    held = 0  # tokens whose text is still incomplete (a multi-byte character split across tokens)
    done = False
    try:
        for c in proc.push(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(prompt_tokens=len(job.ids)))):
            yield c
        while not proc.finished:
            item = await waiter.next()
            if item is None:
                return
            if item.error is not None:
                done = True
                raise APIError(item.status, f"generation failed: {item.error}")
            toks = _strip_stop_token(item, job.params, st.eos_ids)
            chunk = None
            if toks and job.want_logprobs:  # the parser decodes the ids and reports their logprobs
                chunk = _chat_chunk(toks, item, job)
            elif toks:  # our incremental detokenisation; the parser reads the text (markers spelt in pieces too)
                text = "".join(detok.step(t) for t in toks)
                held += len(toks)
                if text:
                    chunk, held = dr.InferenceChunk.text(text, held), 0
            if chunk is not None:
                for c in proc.push(chunk):
                    yield c
            if item.finished:
                done = True
                if not proc.finished:
                    reason = dr.InferenceFinishReason.Length if item.finish_reason == "length" \
                        else dr.InferenceFinishReason.Stop
                    for c in proc.push(dr.InferenceChunk.finish(reason)):
                        yield c
                break
        if not done:  # the parser ended the answer first (a stop string): end it in the engine too
            st.engine_loop.abort(job.rid)
            done = True
        if not proc.finished:
            for c in proc.finish():
                yield c
    finally:
        if not done:
            st.engine_loop.abort(job.rid)
        try:
            proc.close()
        except Exception:  # noqa: BLE001
            pass


# ---------------------------------------------------------------------------------- completions
@dataclass
class CompletionJob:
    rid: str
    index: int                 # the choice's index (the prompt's position in the request)
    ids: list
    params: Optional[SamplingParams]  # None: nothing for the engine (echo with max_tokens 0, no logprobs)
    constraint: Any
    stops: list
    logprobs: Optional[int]
    echo: bool
    prompt_text: str
    queue: Optional[asyncio.Queue] = None

    @property
    def prompt_logprobs(self) -> bool:
        return self.echo and self.logprobs is not None


@dataclass
class CompletionBatch:
    """One /v1/completions request: a job per prompt."""
    id: str
    jobs: list
    stream: bool
    include_usage: bool

    def submit(self, st: "ServerState"):
        for j in self.jobs:
            if j.params is None:
                st.engine_loop.release()
            else:
                j.queue = st.engine_loop.submit(j.rid, j.ids, j.params, j.constraint)


def _is_ids(p) -> bool:
    return isinstance(p, list) and bool(p) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)


def num_prompts(body: dict) -> int:
    """How many prompts a completions body holds (its in-flight slots)."""
    p = body.get("prompt")
    if isinstance(p, list) and p and not _is_ids(p) and all(isinstance(x, (str, list)) for x in p):
        return len(p)
    return 1


def _prompts(st: ServerState, prompt) -> list:
    """'prompt': a string, a list of token ids, or a list of those -> [(ids, text or None)]."""
    tok, V = st.tokenizer, st.engine_loop.engine.vocab_size

    def one(p, name):
        if isinstance(p, str):
            if not p:
                raise bad("prompt", f"'{name}' must not be empty")
            return tok.encode(p, add_bos=True), p
        if _is_ids(p):
            out = [t for t in p if not 0 <= t < V]
            if out:
                raise bad("prompt", f"'{name}' has token ids outside the vocabulary [0, {V}): {out[:5]}")
            return list(p), None
        raise bad("prompt", f"'{name}' must be a non-empty string or a non-empty list of token ids")

    if prompt is None:
        raise bad("prompt", "'prompt' is required")
    if isinstance(prompt, str) or _is_ids(prompt):
        return [one(prompt, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [one(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    raise bad("prompt", "'prompt' must be a string, a list of token ids, or a list of those")


def prepare_completion(st: ServerState, body: dict) -> CompletionBatch:
    s = common_sampling(body, default_max_tokens=16, min_max_tokens=0)
    _check_ids(st, s)
    prompts = _prompts(st, body.get("prompt"))
    if body.get("suffix") is not None:
        raise bad("suffix", "'suffix' is not supported")
    if body.get("best_of") not in (None, 1):
        raise bad("best_of", "only best_of = 1 is supported")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise bad("echo", "'echo' must be a boolean")
    lp = body.get("logprobs")
    if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= 20):
        raise bad("logprobs", "'logprobs' must be an integer in [0, 20]")
    max_tokens = s["max_tokens"]
    if max_tokens == 0 and not echo:
        raise bad(s["max_tokens_param"], f"'{s['max_tokens_param']}' must be >= 1 (0 only with 'echo': the prompt "
                                         "and its logprobs, nothing generated)")
    if echo and lp is not None and not _has_prompt_logprobs():
        raise bad("echo", "'echo' with 'logprobs' needs prompt logprobs, which this engine does not report")
    s["temperature"] = 1.0 if s["temperature"] is None else s["temperature"]
    s["top_p"] = 1.0 if s["top_p"] is None else s["top_p"]
    for i, (ids, _) in enumerate(prompts):
        if len(ids) + max_tokens > st.max_model_len:
            param = "prompt" if len(ids) >= st.max_model_len else s["max_tokens_param"]
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise bad(param, f"the {where} ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                             f"length ({st.max_model_len})")
    kind, spec = response_format(body)
    cid = f"cmpl-{uuid.uuid4().hex}"
    jobs = []
    for i, (ids, text) in enumerate(prompts):
        params = constraint = None
        if max_tokens > 0 or (echo and lp is not None):
            extra = {"prompt_logprobs": lp} if echo and lp is not None else {}
            params = _sampling(s, logprobs=lp, max_tokens=max_tokens, **extra)
        if kind and max_tokens > 0:
            try:
                constraint = constraint_for(st.grammars, kind, spec)
            except GrammarError as e:
                raise bad(e.param, str(e)) from None
        jobs.append(CompletionJob(f"{cid}-{i}", i, ids, params, constraint, s["stop"], lp, echo,
                                  text if text is not None else st.tokenizer.decode(ids)))
    return CompletionBatch(cid, jobs, s["stream"], s["include_usage"])


def _lp_piece(tok, ids: list, lps: list, tops: Optional[list], n: Optional[int], offset: int,
              actual_in_top: bool = False) -> tuple[dict, int]:
    """OpenAI completions logprobs for tokens ids (lps: their logprobs, None where there is
    none; tops: their {id: logprob} dicts) -> (the piece, the text offset after it).
    actual_in_top: each position's own token joins its top dict (vLLM's prompt logprobs)."""
    texts = [tok.token_text(t) for t in ids]
    top = None
    if n:
        top = []
        for t, lp, d in zip(ids, lps, tops or [None] * len(ids)):
            if lp is None:
                top.append(None)
                continue
            e = {tok.token_text(int(k)): float(v) for k, v in (d or {}).items()}
            if actual_in_top:
                e.setdefault(tok.token_text(t), float(lp))
            top.append(e)
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": texts, "token_logprobs": [None if x is None else float(x) for x in lps],
            "top_logprobs": top, "text_offset": offsets}, offset


def _join_lp(a: Optional[dict], b: Optional[dict]) -> Optional[dict]:
    if a is None or b is None:
        return a or b
    return {k: (a[k] or []) + (b[k] or []) if a[k] is not None or b[k] is not None else None for k in a}


async def run_completion(st: ServerState, job: CompletionJob, request: Request):
    """Yields (text delta, logprobs piece or None, finish_reason or None, n_generated)."""
    if job.params is None:
        yield job.prompt_text, None, "length", 0
        return
    waiter = _Waiter(job.queue, request, job.rid, st)
    detok = st.tokenizer.detokenizer()
    stopper = StopMatcher(job.stops)
    tok = st.tokenizer
    n_gen = 0
    done = False
    offset = 0
    need_prompt = job.prompt_logprobs  # the echoed prompt goes out with its logprobs (first output)
    try:
        if job.echo and not need_prompt:
            yield job.prompt_text, None, None, 0
            offset = len(job.prompt_text)
        while True:
            item = await waiter.next()
            if item is None:
                return
            if item.error is not None:
                done = True
                raise APIError(item.status, f"generation failed: {item.error}")
            head, head_lp = "", None
            if need_prompt:
                if item.prompt_logprobs is None or len(item.prompt_logprobs) != len(job.ids):
                    done = True
                    st.engine_loop.abort(job.rid)
                    raise APIError(500, "the engine did not report the prompt's logprobs")
                head_lp, offset = _lp_piece(tok, job.ids, list(item.prompt_logprobs), item.prompt_top_logprobs,
                                            job.logprobs, 0, actual_in_top=True)
                head, need_prompt = job.prompt_text, False
            n_gen += len(item.token_ids)
            toks = _strip_stop_token(item, job.params, st.eos_ids)
            text = "".join(detok.step(t) for t in toks)
            out, hit = stopper.feed(text)
            lp = None
            if job.logprobs is not None and item.logprobs is not None and toks:
                lp, offset = _lp_piece(tok, toks, list(item.logprobs[:len(toks)]),
                                       item.top_logprobs[:len(toks)] if item.top_logprobs else None,
                                       job.logprobs, offset)
            lp = _join_lp(head_lp, lp)
            if hit:
                st.engine_loop.abort(job.rid)
                done = True
                yield head + out, lp, "stop", n_gen
                return
            if item.finished:
                done = True
                yield head + out + stopper.flush(), lp, "length" if item.finish_reason == "length" else "stop", n_gen
                return
            if head or out or lp:
                yield head + out, lp, None, n_gen
    finally:
        if not done:
            st.engine_loop.abort(job.rid)


async def _merged(st: ServerState, jobs: list, request: Request):
    """run_completion of every job at once -> (job, its next piece) as they come; the first
    error ends them all (and is raised)."""
    if len(jobs) == 1:
        async for r in run_completion(st, jobs[0], request):
            yield jobs[0], r
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(j):
        try:
            async for r in run_completion(st, j, request):
                q.put_nowait((j, r))
            q.put_nowait((j, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 (handed to the consumer)
            q.put_nowait((j, e))

    tasks = [asyncio.create_task(pump(j)) for j in jobs]
    try:
        left = len(jobs)
        while left:
            j, r = await q.get()
            if r is None:
                left -= 1
            elif isinstance(r, Exception):
                raise r
            else:
                yield j, r
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---------------------------------------------------------------------------------- the app
def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    if e.status_code == 404:
        msg = f"no route {request.method} {request.url.path}"
    elif e.status_code == 405:
        msg = f"method {request.method} is not allowed on {request.url.path}"
    else:
        msg = str(e.detail)
    err = APIError(e.status_code, msg, code={404: "not_found", 405: "method_not_allowed"}.get(e.status_code))
    return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))


def create_app(st: ServerState) -> FastAPI:
    app = FastAPI(title="deepfuse", version="0.1")
    app.state.server = st

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        st.metrics.reject(e.status)
        return _err(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return _http_error(request, e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return _err(bad(None, f"invalid request: {e.errors()}"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("internal error")
        return _err(APIError(500, f"internal error: {type(e).__name__}: {e}"))

    async def admit(request: Request, prepare, count=lambda body: 1):
        """Parse, take the request's in-flight slots (before any await, so a burst cannot
        overshoot max_pending), prepare it in the thread pool, submit it to the engine."""
        body = parse_body(await request.body())
        check_model(body, st.served)
        loop = st.engine_loop
        if not loop.alive:
            raise APIError(503, "the engine is not running", type="service_unavailable")
        n = count(body)
        if n > loop.max_pending:
            raise bad("prompt", f"{n} prompts in one request exceed the server's limit of {loop.max_pending} "
                                "requests in flight")
        if not loop.reserve(n):
            raise APIError(503, f"server overloaded: {loop.num_pending} requests in flight "
                                f"(limit {loop.max_pending}); retry later",
                           type="service_unavailable", code="overloaded")
        try:
            job = await run_in_threadpool(prepare, st, body)
        except BaseException:
            loop.release(n)
            raise
        job.submit(st)
        return job

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        import deepseek_recipe as dr

        job = await admit(request, prepare_chat)
        if job.stream:
            async def events():
                try:
                    async for c in run_chat(st, job, request):
                        text = c.to_json()
                        if not job.include_usage and '"usage":{' in text:  # usage only when asked for
                            d = json.loads(text)
                            d["usage"] = None
                            text = json.dumps(d, ensure_ascii=False)
                        yield _sse(text)
                except APIError as e:
                    yield _sse(json.dumps(e.body()))
                except Exception as e:  # noqa: BLE001 (the stream still ends with an error event and [DONE])
                    log.exception("stream failed")
                    yield _sse(json.dumps(APIError(500, f"internal error: {type(e).__name__}: {e}").body()))
                yield _sse("[DONE]")
            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        resp = dr.ChatCompletionResponse(job.rid, st.model_name, int(time.time()), len(job.ids), 0)
        got = False
        async for c in run_chat(st, job, request):
            resp.accumulate(c)
            got = True
        if not got:
            return Response(status_code=499)
        return Response(resp.to_json(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        batch = await admit(request, prepare_completion, num_prompts)
        created = int(time.time())

        def chunk(choices, usage=None):
            return {"id": batch.id, "object": "text_completion", "created": created, "model": st.model_name,
                    "choices": choices, "usage": usage}

        def choice(i, text, lp, reason):
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": reason}

        def usage(n_gen: dict):
            p = sum(len(j.ids) for j in batch.jobs)
            n = sum(n_gen.values())
            return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}

        n_gen = {j.index: 0 for j in batch.jobs}
        if batch.stream:
            async def events():
                try:
                    async for j, (text, lp, reason, n) in _merged(st, batch.jobs, request):
                        n_gen[j.index] = n
                        yield _sse(json.dumps(chunk([choice(j.index, text, lp, reason)]), ensure_ascii=False))
                    if batch.include_usage:
                        yield _sse(json.dumps(chunk([], usage(n_gen))))
                except APIError as e:
                    yield _sse(json.dumps(e.body()))
                except Exception as e:  # noqa: BLE001 (the stream still ends with an error event and [DONE])
                    log.exception("stream failed")
                    yield _sse(json.dumps(APIError(500, f"internal error: {type(e).__name__}: {e}").body()))
                yield _sse("[DONE]")
            return StreamingResponse(events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        texts = {j.index: [] for j in batch.jobs}
        lps: dict = {j.index: None for j in batch.jobs}
        reasons: dict = {j.index: None for j in batch.jobs}
        async for j, (text, lp, r, n) in _merged(st, batch.jobs, request):
            texts[j.index].append(text)
            lps[j.index] = _join_lp(lps[j.index], lp)
            reasons[j.index] = r or reasons[j.index]
            n_gen[j.index] = n
        if any(r is None for r in reasons.values()):
            return Response(status_code=499)
        out = []
        for j in batch.jobs:
            lp = lps[j.index]
            if j.logprobs is not None and lp is None:
                lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [] if j.logprobs > 0 else None,
                      "text_offset": []}
            out.append(choice(j.index, "".join(texts[j.index]), lp, reasons[j.index]))
        return JSONResponse(chunk(out, usage(n_gen)))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": st.model_name, "object": "model", "created": st.created,
                                            "owned_by": "deepfuse", "max_model_len": st.max_model_len}]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        if name not in st.served:
            raise APIError(404, f"The model '{name}' does not exist", "model", code="model_not_found")
        return {"id": name, "object": "model", "created": st.created, "owned_by": "deepfuse",
                "max_model_len": st.max_model_len}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """{"model", "messages": [...]} (chat template) or {"model", "prompt": "..."} -> tokens."""
        body = parse_body(await request.body())
        check_model(body, st.served)
        if "messages" in body:
            job = await run_in_threadpool(prepare_chat, st, dict(body, max_tokens=1))
            text = st.chat_encoding.render_conversation(job.conv.conversation).prompt
            ids = job.ids
        elif isinstance(body.get("prompt"), str):
            text, ids = body["prompt"], st.tokenizer.encode(body["prompt"], add_bos=True)
        else:
            raise bad("prompt", "'messages' or a string 'prompt' is required")
        return {"tokens": ids, "count": len(ids), "max_model_len": st.max_model_len, "prompt": text}

    @app.get("/health")
    async def health():
        if not st.engine_loop.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/stats")
    async def stats():
        return dict(st.engine_loop.stats, num_pending=st.engine_loop.num_pending)

    @app.get("/metrics")
    async def metrics():
        st.metrics.update(st.engine_loop.stats, 0)
        return Response(st.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
