"""Request validation and OpenAI-style errors.

Each field a client may send is checked for type and range here, before the request
reaches deepseek-recipe's conversion, so that an error names its field (`param`). The
engine-side extensions (top_k, min_p, stop_token_ids, ignore_eos, the "grammar"
response_format) are taken out of the body here."""
from __future__ import annotations

import json
import math
import re
from typing import Any, Optional


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, type: Optional[str] = None,
                 code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type or ("invalid_request_error" if status < 500 else "internal_error")
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: Optional[str], message: str, status: int = 400, code: Optional[str] = None) -> APIError:
    return APIError(status, message, param, code=code)


MAX_JSON_DEPTH = 64   # deeper bodies are refused before parsing (json's recursion would end in a 500)
INT32_MAX = (1 << 31) - 1


def _reject_constant(name):
    raise ValueError(f"{name} is not a JSON number")


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _depth(raw: bytes, strings: bool = True) -> int:
    """How deep raw nests arrays / objects; strings=False: brackets inside strings count too
    (an upper bound, without the slower pass over the strings)."""
    import numpy as np

    a = np.frombuffer(_JSON_STRING.sub(b'""', raw) if strings else raw, dtype=np.uint8)
    step = np.isin(a, (0x5B, 0x7B)).astype(np.int32) - np.isin(a, (0x5D, 0x7D)).astype(np.int32)
    return int(np.cumsum(step).max(initial=0))


def parse_body(raw: bytes) -> dict:
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _depth(raw, strings=False) > MAX_JSON_DEPTH \
            and _depth(raw) > MAX_JSON_DEPTH:
        raise bad(None, f"the request body nests deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise bad(None, f"malformed JSON in the request body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object", code="invalid_json")
    return body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    if isinstance(v, int) and not isinstance(v, bool):
        return abs(v) < 1 << 53  # a float without rounding (huge ints: OverflowError in float())
    return isinstance(v, float) and math.isfinite(v)


def _int_in(lo: int, hi: int):
    return lambda v: _is_int(v) and lo <= v <= hi


def _get(body, name, check, what, default=None):
    v = body.get(name, None)
    if v is None:
        return default
    if not check(v):
        raise bad(name, f"'{name}' {what}, got {json.dumps(v)[:80]}")
    return v


def check_model(body: dict, served: set) -> str:
    m = body.get("model")
    if m is None:
        raise bad("model", "'model' is required")
    if not isinstance(m, str):
        raise bad("model", f"'model' must be a string, got {json.dumps(m)[:80]}")
    if m not in served:
        raise APIError(404, f"The model '{m}' does not exist (served: {', '.join(sorted(served))})", "model",
                       code="model_not_found")
    return m


def common_sampling(body: dict, *, default_max_tokens: Optional[int], min_max_tokens: int = 1) -> dict:
    """The sampling fields both endpoints share -> a dict of checked values (None: not given).
    max_completion_tokens wins over max_tokens (OpenAI's newer name)."""
    out: dict[str, Any] = {}
    n = _get(body, "n", _is_int, "must be an integer", 1)
    if n != 1:
        raise bad("n", f"only n = 1 is supported, got {n}")
    for name in ("max_tokens", "max_completion_tokens"):
        v = _get(body, name, _int_in(min_max_tokens, INT32_MAX),
                 f"must be an integer in [{min_max_tokens}, {INT32_MAX}]")
        if v is not None:
            out["max_tokens"] = v
            out["max_tokens_param"] = name
    out.setdefault("max_tokens", default_max_tokens)
    out.setdefault("max_tokens_param", "max_tokens")
    out["temperature"] = _get(body, "temperature", lambda x: _is_num(x) and 0 <= x <= 2, "must be a number in [0, 2]")
    out["top_p"] = _get(body, "top_p", lambda x: _is_num(x) and 0 < x <= 1, "must be a number in (0, 1]")
    top_k = _get(body, "top_k", _int_in(-1, INT32_MAX), f"must be an integer in [-1, {INT32_MAX}] (-1 or 0: off)",
                 0)
    out["top_k"] = max(top_k, 0)
    out["min_p"] = _get(body, "min_p", lambda x: _is_num(x) and 0 <= x <= 1, "must be a number in [0, 1]", 0.0)
    seed = _get(body, "seed", _int_in(-(1 << 63), (1 << 63) - 1), "must be a 64-bit signed integer")
    out["seed"] = None if seed is None else seed % (1 << 63)
    for name in ("presence_penalty", "frequency_penalty"):
        _get(body, name, lambda x: _is_num(x) and -2 <= x <= 2, "must be a number in [-2, 2]")
    for name in ("repetition_penalty",):
        _get(body, name, lambda x: _is_num(x) and x == 1, "is not supported (only 1)")
    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise bad("stop", "'stop' must be a string or a list of strings")
    if len(stops) > 16 or any(not s for s in stops):
        raise bad("stop", "'stop' takes at most 16 non-empty strings")
    out["stop"] = stops
    out["stop_token_ids"] = tuple(_get(body, "stop_token_ids",
                                       lambda x: isinstance(x, list) and len(x) <= 256 and
                                       all(_int_in(0, INT32_MAX)(t) for t in x),
                                       "must be a list of at most 256 token ids", []))
    out["ignore_eos"] = _get(body, "ignore_eos", lambda x: isinstance(x, bool), "must be a boolean", False)
    out["stream"] = _get(body, "stream", lambda x: isinstance(x, bool), "must be a boolean", False)
    so = _get(body, "stream_options", lambda x: isinstance(x, dict), "must be an object", {})
    inc = so.get("include_usage", False)
    if not isinstance(inc, bool):
        raise bad("stream_options.include_usage", "'stream_options.include_usage' must be a boolean")
    out["include_usage"] = inc
    _get(body, "user", lambda x: isinstance(x, str), "must be a string")
    _get(body, "logit_bias", lambda x: x == {}, "is not supported")
    return out


def response_format(body: dict) -> tuple[Optional[str], Any]:
    """-> (kind, spec): kind None (text), json_object, json_schema (spec: the schema),
    regex (spec: the pattern), grammar (spec: EBNF text)."""
    rf = body.get("response_format")
    if rf is None:
        return None, None
    if not isinstance(rf, dict):
        raise bad("response_format", "'response_format' must be an object")
    t = rf.get("type")
    if t == "text":
        return None, None
    if t == "json_object":
        return "json_object", None
    if t == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise bad("response_format.json_schema", "'response_format.json_schema' must be an object")
        schema = js.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise bad("response_format.json_schema.schema", "'response_format.json_schema.schema' must be an object")
        if "name" in js and not isinstance(js["name"], str):
            raise bad("response_format.json_schema.name", "'response_format.json_schema.name' must be a string")
        return "json_schema", schema
    if t == "regex":
        rx = rf.get("regex", rf.get("pattern"))
        if not isinstance(rx, str) or not rx:
            raise bad("response_format.regex", "'response_format.regex' must be a non-empty string")
        return "regex", rx
    if t in ("grammar", "ebnf"):
        g = rf.get("grammar", rf.get("ebnf"))
        if not isinstance(g, str) or not g:
            raise bad("response_format.grammar", "'response_format.grammar' must be a non-empty EBNF string")
        return "grammar", g
    raise bad("response_format.type", "'response_format.type' must be one of text, json_object, json_schema, "
                                      f"regex, grammar; got {json.dumps(t)[:80]}")


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")


def check_chat(body: dict) -> None:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("messages", "'messages' is required")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"'messages[{i}]' must be an object")
        if m.get("role") not in CHAT_ROLES:
            raise bad(f"messages[{i}].role", f"'messages[{i}].role' must be one of {', '.join(CHAT_ROLES)}, got "
                                             f"{json.dumps(m.get('role'))[:80]}")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise bad(f"messages[{i}].content", f"'messages[{i}].content' must be a string or a list of parts")
        for part in c if isinstance(c, list) else ():
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content", f"'messages[{i}].content' parts must be text parts "
                                                    "({'type': 'text', 'text': ...}); images are not supported")
    _get(body, "logprobs", lambda x: isinstance(x, bool), "must be a boolean")
    _get(body, "top_logprobs", lambda x: _is_int(x) and 0 <= x <= 20, "must be an integer in [0, 20]")
    if body.get("top_logprobs") is not None and not body.get("logprobs"):
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    tools = _get(body, "tools", lambda x: isinstance(x, list), "must be a list")
    for i, t in enumerate(tools or []):
        if not isinstance(t, dict) or not isinstance(t.get("function"), dict) or \
                not isinstance(t["function"].get("name"), str):
            raise bad(f"tools[{i}]", f"'tools[{i}]' must be {{'type': 'function', 'function': {{'name': ...}}}}")
    tc = _get(body, "tool_choice", lambda x: isinstance(x, (str, dict)), "must be a string or an object")
    names = [t["function"]["name"] for t in tools or []]
    if isinstance(tc, str):
        if tc not in ("none", "auto", "required"):
            raise bad("tool_choice", f"'tool_choice' must be none, auto, required or a named function, got "
                                     f"{json.dumps(tc)[:80]}")
        if tc == "required" and not names:
            raise bad("tool_choice", "'tool_choice' is 'required' but the request has no 'tools'")
    elif isinstance(tc, dict):
        fn = tc.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise bad("tool_choice", "'tool_choice' must be {'type': 'function', 'function': {'name': ...}}")
        if name not in names:
            raise bad("tool_choice", f"'tool_choice' names the function {json.dumps(name)[:80]}, which is not in "
                                     f"'tools' ({', '.join(names) or 'none'})")
    _get(body, "parallel_tool_calls", lambda x: isinstance(x, bool), "must be a boolean")
    th = _get(body, "thinking", lambda x: isinstance(x, dict), "must be an object")
    if th is not None and th.get("type") not in ("enabled", "disabled", "adaptive"):
        raise bad("thinking.type", "'thinking.type' must be one of enabled, disabled, adaptive")
    _get(body, "reasoning_effort", lambda x: x in REASONING_EFFORTS,
         f"must be one of {', '.join(REASONING_EFFORTS)}")


def conversion_param(message: str) -> Optional[str]:
    """Best guess of the field a deepseek-recipe conversion error is about."""
    m = message.lower()
    if "for function" in m:
        return "tools"
    if "tool_call_id" in m or "tool messages" in m:
        return "messages"
    if "'tool_call'" in m or "tool_choice" in m:
        return "tool_choice"
    if "schema" in m:
        return "response_format"
    for key in ("max_completion_tokens", "max_tokens", "top_logprobs", "logprobs", "temperature", "top_p",
                "tool_choice", "tools", "response_format", "reasoning_effort", "thinking", "stop", "messages",
                "model", "seed", "stream_options"):
        if key in m:
            return key
    if "n value" in m:
        return "n"
    if "message" in m or "prompt" in m or "role" in m or "content" in m or "context" in m:
        return "messages"
    return None
