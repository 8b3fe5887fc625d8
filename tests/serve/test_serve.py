"""The OpenAI-compatible server (deepfuse.serve) on the CPU with the tiny model (V4 vocabulary):
one server subprocess on 127.0.0.1 for the module, driven with the official `openai` client
and httpx. Every request loop is bounded in count and time."""
import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

for _m in ("fastapi", "uvicorn", "openai", "httpx", "deepseek_recipe", "xgrammar", "jsonschema", "prometheus_client",
           "tokenizers"):
    pytest.importorskip(_m)

import httpx  # noqa: E402
import jsonschema  # noqa: E402
import openai  # noqa: E402

MODEL = "tiny"
MAX_MODEL_LEN = 512
MAX_PENDING = 40
NO_THINK = {"thinking": {"type": "disabled"}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    import deepfuse

    port = _free_port()
    env = dict(os.environ)
    pkg_root = str(Path(deepfuse.__file__).resolve().parent.parent)  # the deepfuse this test imports
    env["PYTHONPATH"] = os.pathsep.join([pkg_root, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "deepfuse.serve", "--model", MODEL, "--port", str(port), "--max-model-len",
           str(MAX_MODEL_LEN), "--max-pending", str(MAX_PENDING), "--max-num-seqs", "48", "--log-level", "warning"]
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"deepfuse-serve-test-{port}.log", "w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240  # first run: the tiny checkpoint is generated
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read()[-4000:]}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError("server did not come up")
            time.sleep(0.5)
        yield base
        assert proc.poll() is None, "the server died during the tests"
        assert httpx.get(base + "/health", timeout=5).status_code == 200
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=60, max_retries=0)


def stats(base):
    return httpx.get(base + "/stats", timeout=10).json()


def wait_idle(base, timeout=30.0):
    """Until the engine has no request and its cache is empty; -> the stats."""
    t0 = time.time()
    while True:
        st = stats(base)
        if st["num_pending"] == 0 and st["num_running"] == 0 and st["num_waiting"] == 0 and st["used_tokens"] == 0:
            return st
        assert time.time() - t0 < timeout, f"not idle: {st}"
        time.sleep(0.2)


def chat(client, content="Hello", **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    extra = dict(NO_THINK, **kw.pop("extra_body", {}))
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          extra_body=extra, **kw)


def stream_chat(client, content="Hello", **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    extra = dict(NO_THINK, **kw.pop("extra_body", {}))
    text, reasons, usage = [], [], None
    for ch in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                             stream=True, extra_body=extra, **kw):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            if c.delta.content:
                text.append(c.delta.content)
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return "".join(text), reasons, usage


# ------------------------------------------------------------------ units (no server)
def test_stop_matcher_holds_back_partial_stops():
    from deepfuse.serve.app import StopMatcher

    m = StopMatcher(["STOP", "xy"])
    out = [m.feed(d) for d in ["ab", "cS", "TO", "Pzz"]]
    assert "".join(o for o, _ in out) == "abc" and out[-1][1] and not any(h for _, h in out[:-1])
    m = StopMatcher(["END"])
    assert m.feed("aE") == ("a", False) and m.feed("Nd") == ("ENd", False) and m.flush() == ""


def test_incremental_detokenisation_never_splits_characters():
    from deepfuse.serve.tokenizer import Tokenizer, resolve_tokenizer_dir

    tok = Tokenizer(resolve_tokenizer_dir())
    text = "naïve 😀 caf\u00e9 深度求索 done"
    ids = tok.encode(text)
    d = tok.detokenizer()
    parts = [d.step(i) for i in ids]
    assert "".join(parts) == text == tok.decode(ids)
    assert all("\ufffd" not in p for p in parts)
    assert tok.vocab_size == 129280 and tok.bos_id == 0 and tok.eos_id == 1


def test_checkpoint_tokenizer_wins(tmp_path):
    import shutil

    from deepfuse.serve.tokenizer import bundled_tokenizer_dir, resolve_tokenizer_dir

    assert resolve_tokenizer_dir("tiny") == bundled_tokenizer_dir() == resolve_tokenizer_dir(str(tmp_path))
    shutil.copy(bundled_tokenizer_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    assert resolve_tokenizer_dir(str(tmp_path)) == tmp_path


def test_think_gate_and_safe_constraint():
    from deepfuse.serve.grammar import SafeConstraint, ThinkGate

    class Only7:  # allows token 7 only, terminates after it
        def __init__(self):
            self.done = False

        def fill_next_token_bitmask(self, bm, row):
            bm[row] = 0
            bm[row, 0] = 1 << 7

        def accept_token(self, t):
            self.done = t == 7
            return self.done

        def is_terminated(self):
            return self.done

    import torch

    g = ThinkGate(Only7(), end_id=99)
    bm = torch.full((1, 4), -1, dtype=torch.int32)
    g.fill_next_token_bitmask(bm, 0)
    assert (bm == -1).all() and g.accept_token(5) and not g.is_terminated()  # reasoning: free
    assert g.accept_token(99)  # </think>: the answer constraint starts
    g.fill_next_token_bitmask(bm, 0)
    assert bm[0, 0] == 1 << 7 and (bm[0, 1:] == 0).all() and g.accept_token(7) and g.is_terminated()

    class Broken:
        def fill_next_token_bitmask(self, bm, row):
            raise RuntimeError("boom")

    s = SafeConstraint(Broken())
    s.fill_next_token_bitmask(bm, 0)
    assert s.failed and s.is_terminated() and not s.accept_token(1)


def test_max_pending_must_be_positive():
    from deepfuse.serve import build
    from deepfuse.serve.protocol import MAX_JSON_DEPTH, APIError, parse_body

    for v in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_pending"):
            build(MODEL, max_pending=v)  # refused before the model is loaded
    deep = b'{"a": "' + b"[" * 500 + b'", "b": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert parse_body(deep)["a"] == "[" * 500  # brackets inside strings do not nest
    with pytest.raises(APIError, match="deeper"):
        parse_body(b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1))


# ------------------------------------------------------------------ endpoints
def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server + "/health").json() == {"status": "ok"}
    chat(client, max_tokens=3)
    text = httpx.get(server + "/metrics").text
    for name in ("deepfuse_num_requests_waiting", "deepfuse_num_requests_running", "deepfuse_cache_usage_ratio",
                 "deepfuse_generation_tokens_per_second", "deepfuse_time_to_first_token_seconds_bucket",
                 "deepfuse_inter_token_latency_seconds_bucket"):
        assert name in text, name
    assert re.search(r'deepfuse_time_to_first_token_seconds_count\{model_name="tiny"\} [1-9]', text)


def test_chat_stream_equals_non_stream(client):
    r = chat(client, "Tell me a story", max_tokens=16, seed=7)
    c = r.choices[0]
    assert c.finish_reason in ("length", "stop") and c.message.role == "assistant" and c.message.content
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens == 16 and \
        r.usage.total_tokens == r.usage.prompt_tokens + 16
    text, reasons, usage = stream_chat(client, "Tell me a story", max_tokens=16, seed=7,
                                       stream_options={"include_usage": True})
    assert text == c.message.content and reasons == [c.finish_reason]
    assert usage is not None and usage.completion_tokens == 16
    # sampled (temperature 1, top_p / top_k / min_p) with a seed: reproducible, streamed or not
    kw = dict(temperature=1.0, top_p=0.9, seed=123, max_tokens=10, extra_body={"top_k": 50, "min_p": 0.01})
    a = chat(client, "Hi", **kw).choices[0].message.content
    assert stream_chat(client, "Hi", **kw)[0] == a


def test_chat_logprobs(client):
    r = chat(client, max_tokens=5, logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert len(lp) == 5 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in lp)
    assert abs(lp[0].logprob - max(t.logprob for t in lp[0].top_logprobs)) < 1e-4  # greedy = the top one


def test_thinking_mode_reasoning_content(client):
    r = chat(client, max_tokens=8, extra_body={"thinking": {"type": "enabled"}})
    m = r.choices[0].message
    assert getattr(m, "reasoning_content", None) or (m.model_extra or {}).get("reasoning_content")


def test_chat_text_parts_multi_turn_and_system(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, extra_body=NO_THINK)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


def test_completions(server, client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=10, temperature=0,
                                  logprobs=2)
    c = r.choices[0]
    assert c.finish_reason == "length" and r.usage.completion_tokens == 10
    assert len(c.logprobs.tokens) == 10 and "".join(c.logprobs.tokens) == c.text
    parts = [ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=10, temperature=0, stream=True) if ch.choices]
    assert "".join(parts) == c.text
    ids = httpx.post(server + "/tokenize", json={"model": MODEL, "prompt": "The capital of France is"}).json()["tokens"]
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0).choices[0].text == c.text


def test_chat_rendering_matches_deepseek_recipe(server):
    import deepseek_recipe as dr
    from deepfuse.serve.tokenizer import Tokenizer, resolve_tokenizer_dir

    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3? 😀"}]
    for thinking in ("disabled", "enabled"):
        body = {"model": MODEL, "messages": msgs, "thinking": {"type": thinking}}
        got = httpx.post(server + "/tokenize", json=body).json()
        opts = dr.ConversionOptions().with_model_alias(MODEL, dr.ModelVersion.DeepseekV4Pro)
        conv = dr.ChatCompletionRequest(body).convert(opts).conversation
        want = dr.DeepseekV4Encoding().render_conversation(conv).prompt
        assert got["prompt"] == want
        assert want.startswith("<｜begin▁of▁sentence｜>") and \
            "You are terse.<｜User｜>2+2?<｜Assistant｜></think>4<｜end▁of▁sentence｜><｜User｜>and 3+3? 😀" in want
        assert want.endswith("<｜Assistant｜><think>" if thinking == "enabled" else "<｜Assistant｜></think>")
        tok = Tokenizer(resolve_tokenizer_dir())
        assert tok.decode(got["tokens"]) == want
        assert got["tokens"] == dr.DeepseekV4Encoding().with_tokenizer(tok.recipe).encode(conv)


# ------------------------------------------------------------------ constrained decoding
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "color", "n"], "additionalProperties": False}


def test_json_schema(client):
    for stream in (False, True):
        kw = dict(max_tokens=60, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
        if stream:
            text, reasons, _ = stream_chat(client, "Give JSON", **kw)
        else:
            c = chat(client, "Give JSON", **kw).choices[0]
            text, reasons = c.message.content, [c.finish_reason]
        assert reasons == ["stop"], text
        jsonschema.validate(json.loads(text), SCHEMA)
    c = chat(client, "Answer in json", max_tokens=60, temperature=1.0, seed=3,
             response_format={"type": "json_object"}).choices[0]
    assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict)


def test_regex_and_grammar(client):
    rx = r"[a-z]{2,6}-[0-9]{1,3}"
    c = chat(client, max_tokens=30, response_format={"type": "regex", "regex": rx}).choices[0]
    assert c.finish_reason == "stop" and re.fullmatch(rx, c.message.content), c.message.content
    g = 'root ::= ("yes" | "no") "!" [0-9]'
    c = chat(client, max_tokens=30, temperature=1.0, seed=1,
             response_format={"type": "grammar", "grammar": g}).choices[0]
    assert c.finish_reason == "stop" and re.fullmatch(r"(yes|no)![0-9]", c.message.content), c.message.content
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=30, temperature=0,
                                  extra_body={"response_format": {"type": "regex", "regex": rx}})
    assert re.fullmatch(rx, r.choices[0].text) and r.choices[0].finish_reason == "stop"


def test_tool_calls_required_and_named(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather now",
                                               "parameters": {"type": "object",
                                                              "properties": {"unit": {"enum": ["c", "f"]}},
                                                              "required": ["unit"], "additionalProperties": False}}},
             {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                           tools=tools, tool_choice=choice, max_tokens=200, temperature=0,
                                           extra_body=NO_THINK)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
        for call in c.message.tool_calls:
            args = json.loads(call.function.arguments)
            assert call.function.name in ("get_weather", "get_time")
            if call.function.name == "get_weather":
                assert args["unit"] in ("c", "f")
        if choice != "required":
            assert [t.function.name for t in c.message.tool_calls] == ["get_weather"]
            # streamed: the same call in tool_call deltas
            calls: dict = {}
            reasons = []
            for ch in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                                     tools=tools, tool_choice=choice, max_tokens=200, temperature=0,
                                                     stream=True, extra_body=NO_THINK):
                for cc in ch.choices:
                    reasons += [cc.finish_reason] if cc.finish_reason else []
                    for d in cc.delta.tool_calls or []:
                        e = calls.setdefault(d.index, {"name": "", "arguments": ""})
                        e["name"] += (d.function.name or "") if d.function else ""
                        e["arguments"] += (d.function.arguments or "") if d.function else ""
            assert reasons == ["tool_calls"] and [v["name"] for v in calls.values()] == ["get_weather"]
            assert json.loads(calls[0]["arguments"]) == json.loads(c.message.tool_calls[0].function.arguments)
    # a tool result in the history
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools, max_tokens=4, temperature=0,
                                       extra_body=NO_THINK)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


# ------------------------------------------------------------------ stops
def test_stop_strings(client):
    base = chat(client, "Count", max_tokens=24).choices[0].message.content
    assert len(base) > 8
    stop = base[len(base) // 2: len(base) // 2 + 3]
    want = base[:base.index(stop)]
    c = chat(client, "Count", max_tokens=24, stop=[stop]).choices[0]
    assert c.finish_reason == "stop" and c.message.content == want
    text, reasons, _ = stream_chat(client, "Count", max_tokens=24, stop=[stop])
    assert text == want and reasons == ["stop"]
    r = client.completions.create(model=MODEL, prompt="Count", max_tokens=24, temperature=0)
    full = r.choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    for stream in (False, True):
        if stream:
            got = "".join(ch.choices[0].text for ch in client.completions.create(
                model=MODEL, prompt="Count", max_tokens=24, temperature=0, stop=stop, stream=True) if ch.choices)
        else:
            c = client.completions.create(model=MODEL, prompt="Count", max_tokens=24, temperature=0, stop=stop).choices[0]
            assert c.finish_reason == "stop"
            got = c.text
        assert got == full[:full.index(stop)]


def test_stop_token_ids(server, client):
    r = client.completions.create(model=MODEL, prompt="Count", max_tokens=8, temperature=0, logprobs=0)
    ids = httpx.post(server + "/tokenize", json={"model": MODEL, "prompt": "Count"}).json()["tokens"]
    toks = httpx.post(server + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 8,
                                                         "temperature": 0, "logprobs": 0}).json()
    assert toks["choices"][0]["text"] == r.choices[0].text
    # the engine's own tokens: ask again with stop_token_ids = the 4th token's id
    from deepfuse.serve.tokenizer import Tokenizer, resolve_tokenizer_dir

    tok = Tokenizer(resolve_tokenizer_dir())
    gen = tok.encode(r.choices[0].text)
    if len(gen) >= 4 and tok.decode(gen) == r.choices[0].text:
        c = client.completions.create(model=MODEL, prompt="Count", max_tokens=8, temperature=0,
                                      extra_body={"stop_token_ids": [gen[3]]}).choices[0]
        assert c.finish_reason == "stop" and r.choices[0].text.startswith(c.text) and len(c.text) < len(
            r.choices[0].text)


# ------------------------------------------------------------------ load, disconnects, overload
def test_32_concurrent_streams(server):
    async def one(ac, i):
        n, reason = 0, None
        s = await ac.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"req {i}"}],
                                             max_tokens=8 + i % 5, temperature=0.7, seed=i, stream=True,
                                             extra_body=NO_THINK)
        async for ch in s:
            for c in ch.choices:
                n += 1
                reason = c.finish_reason or reason
        return reason, n

    async def main():
        ac = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", timeout=120, max_retries=0)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(ac, i) for i in range(32))), 150)
        finally:
            await ac.close()

    res = asyncio.run(main())
    assert len(res) == 32 and all(r in ("length", "stop") and n > 1 for r, n in res), res
    wait_idle(server)


def test_disconnect_frees_cache_and_overload_503(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "go on"}], "max_tokens": 400,
            "ignore_eos": True, "stream": True, **NO_THINK}

    async def main():
        async with httpx.AsyncClient(base_url=server, timeout=60) as ac:
            streams = []
            for _ in range(MAX_PENDING):
                cm = ac.stream("POST", "/v1/chat/completions", json=body)
                r = await cm.__aenter__()
                assert r.status_code == 200
                it = r.aiter_lines()
                while not (await it.__anext__()).startswith("data:"):
                    pass
                streams.append((cm, it))
            t0 = time.time()
            while (st := stats(server))["num_running"] + st["num_waiting"] < MAX_PENDING:
                assert time.time() - t0 < 30, st
                await asyncio.sleep(0.1)
            assert st["num_pending"] == MAX_PENDING and st["used_tokens"] > 0
            over = await ac.post("/v1/chat/completions", json=dict(body, stream=False))
            assert over.status_code == 503 and over.json()["error"]["code"] == "overloaded"
            for cm, _ in streams:  # the clients go away mid-stream
                await cm.__aexit__(None, None, None)

    asyncio.run(main())
    st = wait_idle(server)
    held = st.get("prefix_cache", {}).get("pages_held", {})  # pages kept by the prefix index, by design
    assert st["used_tokens"] == 0 and st["free_slots"] == 48, st
    assert all(n == held.get(r, held.get(str(r), 0)) for r, n in st["pages_in_use"].items()), st
    assert aborts(server) >= MAX_PENDING
    # and a non-streaming client that goes away
    n = aborts(server)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server + "/v1/chat/completions", json=dict(body, stream=False, max_tokens=480), timeout=1.0)
    wait_idle(server, timeout=30)
    assert aborts(server) == n + 1


def aborts(base) -> int:
    text = httpx.get(base + "/metrics").text
    m = re.search(r'deepfuse_requests_finished_total\{[^}]*finish_reason="abort"[^}]*\} ([0-9.]+)', text)
    return int(float(m.group(1))) if m else 0


# ------------------------------------------------------------------ bad input
LONG = "word " * 700

BAD = [
    # (path, body (dict or raw bytes), status, param)
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "bogus", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"},
                                                           {"role": "wizard", "content": "y"}]}, 400,
     "messages[1].role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "reasoning_effort": "extreme"}, 400, "reasoning_effort"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"type": "nope"}}}}, 400, "response_format"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "a"}}], "tool_choice": {"type": "function", "function": {
            "name": "b"}}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, 400, "tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"},
                                                           {"role": "tool", "content": "r"}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "parallel_tool_calls": "x"}, 400, "parallel_tool_calls"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "sometimes"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "stop_token_ids": [129280]}, 400, "stop_token_ids"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "stop_token_ids": 5}, 400, "stop_token_ids"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2 ** 64},
     400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 2 ** 64}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 100000, **NO_THINK}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_k": 2 ** 31}, 400,
     "top_k"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "seed": 2 ** 64}, 400,
     "seed"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "presence_penalty": 10 ** 400}, 400, "presence_penalty"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 1e999}',
     400, "temperature"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
     400, None),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_p": Infinity}',
     400, None),
    ("/v1/chat/completions", b"[" * 100000 + b"]" * 100000, 400, None),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "x": ' + b'{"a": ' *
     5000 + b"1" + b"}" * 5000 + b"}", 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]}, 400, "messages[0].content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400,
     "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}, 400,
     "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
     400, "temperature"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 0}, 400,
     "top_p"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "seed": "s"}, 400,
     "seed"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": 5}, 400, "stop"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400,
     "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400,
     "stream"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "regex", "regex": "(unclosed"}}, 400, "response_format"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "grammar", "grammar": "root ::= nope"}}, 400,
     "response_format"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "thinking": {"type": "sometimes"}}, 400, "thinking.type"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": "x"}, 400,
     "tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": LONG}], **NO_THINK}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000,
                              **NO_THINK}, 400, "max_tokens"),
    ("/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 400, "model"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 999999]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", ""]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", [1, 999999]]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", 5]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2 ** 64}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 2 ** 63}, 400, "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [10 ** 12]}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 1e300}, 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": {"a": 1}}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 3}, 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": 1.5}, 400, "top_k"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
]


def test_bad_inputs_get_4xx_naming_the_field(server):
    with httpx.Client(base_url=server, timeout=30) as c:
        for path, body, status, param in BAD:
            r = c.post(path, content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes) \
                else c.post(path, json=body)
            assert r.status_code == status, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert err["message"] and err["type"], r.text
            if param is not None:
                assert err["param"] == param, (body, err)
        assert c.get("/v1/models/nope").status_code == 404
        for method, path, status in (("GET", "/v1/nope", 404), ("POST", "/nope", 404),
                                     ("GET", "/v1/chat/completions", 405), ("PUT", "/v1/completions", 405),
                                     ("POST", "/health", 405)):
            r = c.request(method, path)
            assert r.status_code == status, (method, path, r.text)
            err = r.json()["error"]  # an OpenAI error body, not FastAPI's {"detail": ...}
            assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
        # edges the fuzz run found failing inside the step (and temperatures in fp32's denormal range): served,
        # or a 400 naming the field, never a 500 (the engine decides how tiny values sample)
        for field, v in (("temperature", 1e-40), ("temperature", 1e-45), ("temperature", 5e-324),
                         ("top_p", 5e-324), ("top_p", 1e-40), ("min_p", 5e-324), ("top_k", 2 ** 31 - 1)):
            body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "temperature": 1.0, field: v}
            r = c.post("/v1/completions", json=body)
            assert r.status_code in (200, 400), (field, v, r.text)
            if r.status_code == 400:
                assert r.json()["error"]["param"] == field, r.text
        assert c.get("/health").status_code == 200
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0).chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}])
    wait_idle(server)


# ------------------------------------------------------------------ chat limits, JSON strings
def test_chat_honours_max_completion_tokens(client):
    for kw in ({"max_completion_tokens": 5}, {"max_tokens": 7}, {"max_tokens": 30, "max_completion_tokens": 6}):
        r = chat(client, "Tell me a story", extra_body={"ignore_eos": True}, **{"max_tokens": None, **kw})
        want = kw.get("max_completion_tokens", kw.get("max_tokens"))
        assert r.usage.completion_tokens == want and r.choices[0].finish_reason == "length", (kw, r.usage)


def test_json_strings_never_hold_raw_control_characters():
    """xgrammar 0.2.9 lets a string with minLength / maxLength take raw control characters;
    the server's JSON constraint masks them. A walk over the allowed tokens that picks a
    control-character token whenever one is allowed must still give valid JSON."""
    import random

    import numpy as np
    import torch
    import xgrammar as xgr

    from deepfuse.serve.grammar import Grammars, constraint_for
    from deepfuse.serve.tokenizer import Tokenizer, resolve_tokenizer_dir

    tok = Tokenizer(resolve_tokenizer_dir())
    g = Grammars(tok)
    V, W = tok.vocab_size, -(-tok.vocab_size // 32)
    keep = g.no_control_mask()

    def allowed(bm):  # -> bool [V]
        return np.unpackbits(bm.numpy().view(np.uint8), bitorder="little")[:V].astype(bool)

    ctl_mask = ~allowed(keep)
    ctl = set(np.flatnonzero(ctl_mask).tolist())
    assert {tok.encode(c)[0] for c in "\x00\x19\n\t"} <= ctl and tok.encode("a")[0] not in ctl
    assert all(any(ord(ch) < 32 for ch in tok.token_text(t)) for t in list(ctl)[:200])
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 6},
                                               "t": {"type": "string", "maxLength": 3}},
              "required": ["s", "t"], "additionalProperties": False}
    raw_bad = 0
    for seed in range(16):
        for masked in (True, False):
            rng = random.Random(seed)
            c = constraint_for(g, "json_schema", schema) if masked else \
                xgr.GrammarMatcher(g.compile("json_schema", schema))
            out = []
            for _ in range(60):
                bm = torch.full((1, W), -1, dtype=torch.int32)
                c.fill_next_token_bitmask(bm, 0)
                al = allowed(bm[0])
                pref = np.flatnonzero(al & ctl_mask)
                pool = pref if len(pref) else np.flatnonzero(al)
                t = int(pool[rng.randrange(len(pool))])
                assert c.accept_token(t)
                if c.is_terminated():
                    break
                out.append(t)
            text = tok.decode(out)
            if masked:
                assert c.is_terminated(), text
                jsonschema.validate(json.loads(text), schema)
            else:
                try:
                    jsonschema.validate(json.loads(text), schema)
                except (ValueError, jsonschema.ValidationError):
                    raw_bad += 1
    assert raw_bad > 0  # the upstream gap is still there (drop the mask once xgrammar closes it)


def test_json_guard_checks_the_finished_text():
    from deepfuse.serve.grammar import JsonGuard, SafeConstraint
    from deepfuse.serve.tokenizer import Tokenizer, resolve_tokenizer_dir

    import torch

    tok = Tokenizer(resolve_tokenizer_dir())

    class Spell:  # accepts anything, terminates after n tokens
        def __init__(self, n):
            self.n = n

        def fill_next_token_bitmask(self, bm, row):
            pass

        def accept_token(self, t):
            self.n -= 1
            return True

        def is_terminated(self):
            return self.n <= 0

    keep = torch.full((-(-tok.vocab_size // 32),), -1, dtype=torch.int32)
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    for text, schema_, error in (('[1,2]', schema, None), ('[1,1]', schema, "does not match the schema"),
                                 ('[1,', schema, "not valid JSON"), ('{"a":1}', None, None),
                                 ('[1]', None, "not a JSON object")):
        ids = tok.encode(text)
        c = SafeConstraint(JsonGuard(Spell(len(ids)), keep, tok, schema_))
        for t in ids:
            assert c.accept_token(t)
        assert c.is_terminated()
        assert (c.error is None) if error is None else (c.failed and error in c.error), (text, c.error)


def test_json_schema_keywords_xgrammar_ignores(server):
    """xgrammar 0.2.9 does not enforce uniqueItems (nor multipleOf): an answer that breaks
    them is an error naming the schema, never a silent "stop"."""
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2}, "uniqueItems": True,
              "minItems": 2, "maxItems": 3}
    with httpx.Client(base_url=server, timeout=60) as c:
        for seed in range(6):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 20, "temperature": 1.0,
                                                "seed": seed, "response_format": {
                                                    "type": "json_schema", "json_schema": {"schema": schema}}})
            if r.status_code == 200:
                ch = r.json()["choices"][0]
                assert ch["finish_reason"] == "stop", ch
                jsonschema.validate(json.loads(ch["text"]), schema)
            else:
                assert r.status_code == 500 and "does not match the schema" in r.json()["error"]["message"], r.text


def test_json_schema_strings_parse_over_many_seeds(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 3, "maxLength": 10},
                                               "tag": {"type": "string", "maxLength": 4}},
              "required": ["name", "tag"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for seed in range(6):
        c = chat(client, "JSON please", max_tokens=80, temperature=1.0, seed=seed, response_format=rf).choices[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), schema)
        assert not any(ord(ch) < 32 for ch in c.message.content)


# ------------------------------------------------------------------ an in-process server (monkeypatching)
LIVE_PENDING = 6


@pytest.fixture(scope="module")
def live():
    """A second server in this process (build() + uvicorn in a thread), so that tests can
    patch the server and the engine -> (base url, ServerState)."""
    import threading

    import uvicorn

    from deepfuse.serve import build

    app, st = build(MODEL, max_model_len=256, max_num_seqs=8, max_pending=LIVE_PENDING)
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    t0 = time.time()
    while not srv.started:
        assert th.is_alive() and time.time() - t0 < 60, "the in-process server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", st
    finally:
        srv.should_exit = True
        th.join(20)
        st.engine_loop.shutdown()


def _live_client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=60, max_retries=0)


class _Boom:
    """A constraint that fails on its third mask."""

    def __init__(self):
        self.n = 0

    def fill_next_token_bitmask(self, bm, row):
        self.n += 1
        if self.n >= 3:
            raise RuntimeError("boom in the grammar")

    def accept_token(self, t):
        return True

    def is_terminated(self):
        return False


@pytest.mark.parametrize("wrapped", [True, False], ids=["server-guarded", "raw"])
def test_one_failing_request_never_fails_the_others(live, monkeypatch, wrapped):
    """A constraint that raises: caught by the server's SafeConstraint, or (raw) by the
    engine, which ends that request with RequestOutput.error."""
    import dataclasses

    import deepfuse.serve.app as app_mod
    from deepfuse.engine.request import RequestOutput
    from deepfuse.serve.grammar import SafeConstraint

    if not wrapped and "error" not in {f.name for f in dataclasses.fields(RequestOutput)}:
        pytest.skip("the engine has no per-request errors")
    base, st = live
    real = app_mod.constraint_for
    monkeypatch.setattr(app_mod, "constraint_for", lambda g, kind, spec, **kw: (
        SafeConstraint(_Boom()) if wrapped else _Boom()) if spec == "FAIL" else real(g, kind, spec, **kw))
    bad_body = {"model": MODEL, "prompt": "x", "max_tokens": 20, "ignore_eos": True,
                "response_format": {"type": "regex", "regex": "FAIL"}}

    async def good(ac, i):
        n, reason = 0, None
        async for ch in await ac.completions.create(model=MODEL, prompt=f"good {i}", max_tokens=24, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True},
                                                    stream_options={"include_usage": True}):
            for c in ch.choices:
                reason = c.finish_reason or reason
            n = ch.usage.completion_tokens if ch.usage else n
        return reason, n

    async def bad(hc, stream):
        if not stream:
            return await hc.post("/v1/completions", json=bad_body)
        lines = []
        async with hc.stream("POST", "/v1/completions", json=dict(bad_body, stream=True)) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
        return lines

    async def main():
        ac = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", timeout=60, max_retries=0)
        async with httpx.AsyncClient(base_url=base, timeout=60) as hc:
            try:
                return await asyncio.wait_for(asyncio.gather(good(ac, 0), good(ac, 1), good(ac, 2), bad(hc, False),
                                                             bad(hc, True)), 120)
            finally:
                await ac.close()

    *goods, r_bad, s_bad = asyncio.run(main())
    assert goods == [("length", 24)] * 3, goods
    assert r_bad.status_code == 500 and "boom in the grammar" in r_bad.json()["error"]["message"], r_bad.text
    assert s_bad[-1] == "[DONE]" and "boom in the grammar" in json.loads(s_bad[-2])["error"]["message"], s_bad
    c = _live_client(base)  # chat: the same, streamed or not
    rf = {"type": "regex", "regex": "FAIL"}
    with pytest.raises(openai.InternalServerError, match="boom in the grammar"):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=20,
                                  response_format=rf, extra_body=NO_THINK)
    with pytest.raises(openai.APIError, match="boom in the grammar"):
        for _ in c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=20,
                                           response_format=rf, stream=True, extra_body=NO_THINK):
            pass
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    wait_idle(base)


def test_a_raising_step_ends_its_requests_and_the_loop_goes_on(live, monkeypatch):
    base, st = live
    eng = st.engine_loop.engine
    real, calls = eng.step, []

    def step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("step exploded")
        return real()

    monkeypatch.setattr(eng, "step", step)
    c = _live_client(base)
    with pytest.raises(openai.InternalServerError, match="step exploded"):
        c.completions.create(model=MODEL, prompt="x", max_tokens=10, extra_body={"ignore_eos": True})
    assert st.engine_loop.alive and httpx.get(base + "/health").json() == {"status": "ok"}
    r = c.completions.create(model=MODEL, prompt="x", max_tokens=10, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    wait_idle(base)


def test_max_pending_holds_for_a_burst(live, monkeypatch):
    """N simultaneous requests over a limit L: exactly N - L get 503 while the first L are
    still being prepared (the count starts when a request is accepted)."""
    import threading

    import deepfuse.serve.app as app_mod

    base, st = live
    L, N = LIVE_PENDING, 3 * LIVE_PENDING
    real, seen, gate = app_mod.prepare_completion, [], threading.Event()

    def held(st_, body):  # preparation waits until the burst has been answered
        seen.append(st_.engine_loop.num_pending)
        gate.wait(30)
        return real(st_, body)

    monkeypatch.setattr(app_mod, "prepare_completion", held)

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=60,
                                     limits=httpx.Limits(max_connections=N + 4)) as hc:
            tasks = [asyncio.create_task(hc.post("/v1/completions", json={"model": MODEL, "prompt": f"p{i}",
                                                                          "max_tokens": 4})) for i in range(N)]
            t0 = time.time()
            while sum(t.done() for t in tasks) < N - L and time.time() - t0 < 30:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # a request over the limit that was let in would show here
            gate.set()
            return await asyncio.gather(*tasks)

    try:
        rs = asyncio.run(main())
    finally:
        gate.set()
    codes = sorted(r.status_code for r in rs)
    assert codes == [200] * L + [503] * (N - L), codes
    assert all(r.json()["error"]["code"] == "overloaded" for r in rs if r.status_code == 503)
    assert max(seen) <= L and len(seen) == L
    st_ = wait_idle(base)
    assert st_["num_pending"] == 0 and httpx.get(base + "/health").json() == {"status": "ok"}
    # a list of prompts takes a slot each: more than the limit is a 400, not an endless 503
    r = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": ["a"] * (L + 1), "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def _forward_logprobs(st, ids):
    import torch

    with torch.no_grad():
        logits = st.engine_loop.engine.model(torch.tensor([ids]))[0].float()
    lp = torch.log_softmax(logits, -1)
    return [None] + [lp[j - 1, ids[j]].item() for j in range(1, len(ids))], lp


def test_completions_list_of_prompts(live):
    base, st = live
    c = _live_client(base)
    ps = ["The sky is", "One two three", "Hello"]
    r = c.completions.create(model=MODEL, prompt=ps, max_tokens=6, temperature=0)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 18
    for ch in r.choices:
        one = c.completions.create(model=MODEL, prompt=ps[ch.index], max_tokens=6, temperature=0).choices[0]
        assert ch.text == one.text and ch.finish_reason == one.finish_reason
    got: dict = {}
    for chunk in c.completions.create(model=MODEL, prompt=ps, max_tokens=6, temperature=0, stream=True):
        for ch in chunk.choices:
            got[ch.index] = got.get(ch.index, "") + ch.text
    assert got == {ch.index: ch.text for ch in r.choices}
    # echo with max_tokens 0: the prompt back, nothing generated
    r = c.completions.create(model=MODEL, prompt=ps[:2], max_tokens=0, echo=True)
    assert [ch.text for ch in sorted(r.choices, key=lambda x: x.index)] == ps[:2]
    assert all(ch.finish_reason == "length" for ch in r.choices) and r.usage.completion_tokens == 0
    wait_idle(base)


def test_echo_logprobs_like_lm_eval(live):
    """lm-eval's loglikelihood requests (local-completions): token-id prompts (context +
    continuation, two per request), echo, logprobs 1, max_tokens 0 or 1, temperature 0 ->
    the prompt tokens' logprobs equal a full forward's log_softmax."""
    from deepfuse.serve.app import _has_prompt_logprobs

    base, st = live
    c = _live_client(base)
    tok = st.tokenizer
    ctx = [tok.encode("Question: what colour is the sky? Answer:", add_bos=True), tok.encode("Two plus two is")]
    cont = [tok.encode(" blue"), tok.encode(" four.")]
    prompts = [a + b for a, b in zip(ctx, cont)]
    if not _has_prompt_logprobs():
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0)
        assert e.value.body["param"] == "echo"
        pytest.skip("the engine has no prompt logprobs yet: echo + logprobs is a 400")
    for max_tokens in (0, 1):
        r = c.completions.create(model=MODEL, prompt=prompts, echo=True, logprobs=1, max_tokens=max_tokens,
                                 temperature=0, seed=1234)
        for choice, ids, n_ctx in zip(sorted(r.choices, key=lambda x: x.index), prompts, map(len, ctx)):
            lp = choice.logprobs
            P = len(ids)
            assert len(lp.token_logprobs) == P + max_tokens and len(lp.tokens) == P + max_tokens
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            want, full = _forward_logprobs(st, ids)
            for j in range(1, P):
                assert abs(lp.token_logprobs[j] - want[j]) < 1e-4, (j, lp.token_logprobs[j], want[j])
                top = lp.top_logprobs[j]
                assert tok.token_text(ids[j]) in top and abs(max(top.values()) - full[j - 1].max().item()) < 1e-4
            assert choice.text.startswith(tok.decode(ids))
            # lm-eval's parse_logprobs: the continuation's sum and whether it is greedy
            ll = sum(lp.token_logprobs[n_ctx:P])
            assert abs(ll - sum(want[n_ctx:P])) < 1e-3
            greedy = all(t == max(top.values()) for t, top in zip(lp.token_logprobs[n_ctx:P], lp.top_logprobs[n_ctx:P]))
            assert greedy == all(full[j - 1].argmax().item() == ids[j] for j in range(n_ctx, P))
            if max_tokens:
                assert choice.finish_reason == "length" and lp.token_logprobs[-1] is not None
    # a string prompt: BOS first (no logprob), then every prompt token
    r = c.completions.create(model=MODEL, prompt="The sky is blue", echo=True, logprobs=0, max_tokens=0)
    ids = tok.encode("The sky is blue", add_bos=True)
    assert r.choices[0].text == "The sky is blue" and len(r.choices[0].logprobs.token_logprobs) == len(ids)
    assert r.choices[0].logprobs.top_logprobs is None
    wait_idle(base)


def test_missing_xgrammar_is_a_clear_refusal(monkeypatch):
    """Without xgrammar a constrained request is refused with a message naming the package
    (400 naming response_format through GrammarError), and the start-up warm-up only warns."""
    import builtins

    from deepfuse.serve.grammar import GrammarError, Grammars

    class _HF:
        def token_to_id(self, t):
            return None

    class _Tok:
        hf = _HF()

    real = builtins.__import__

    def no_xgrammar(name, *a, **k):
        if name == "xgrammar" or name.startswith("xgrammar."):
            raise ImportError("No module named 'xgrammar'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    g = Grammars(_Tok())
    g.warm()  # logs, does not raise
    with pytest.raises(GrammarError, match="xgrammar") as e:
        g.compile("json_object", None)
    assert e.value.param == "response_format"
