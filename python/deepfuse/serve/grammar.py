"""Constrained decoding with xgrammar: response_format (json_schema, json_object, regex,
EBNF grammar) and required tool calls (xgrammar's DeepSeek V4 structural tag) compiled once
per distinct grammar, one GrammarMatcher per request, handed to Engine.add_request as its
constraint (the engine masks the logits with the matcher's bitmask before sampling and
advances it with each sampled token).

JSON is compact (separators "," and ":", no free whitespace), so that even a random model
finishes a small schema in a few dozen tokens. In thinking mode the answer constraint
starts after the model closes its reasoning (`</think>`); the reasoning itself is free."""
from __future__ import annotations

import json
import logging
import threading
from typing import Optional

log = logging.getLogger("deepfuse.serve")

THINK_END = "</think>"
FORMAT_MARKERS = ("｜DSML｜", "<think>", "</think>")
MAX_WHITESPACE = 2  # whitespace characters allowed between structural elements (none unbounded)


class GrammarError(ValueError):
    """A grammar / schema that cannot be compiled (-> 400 naming `param`)."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(message)
        self.param = param


class ThinkGate:
    """A constraint that lets every token through until `end_id` (the end of reasoning) has
    been sampled, then forwards to `inner`."""

    def __init__(self, inner, end_id: int):
        self.inner, self.end_id, self.open = inner, end_id, False

    def fill_next_token_bitmask(self, bitmask, row):
        if self.open:
            self.inner.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        if self.open:
            return self.inner.accept_token(token_id)
        if token_id == self.end_id:
            self.open = True
        return True

    def is_terminated(self) -> bool:
        return self.open and self.inner.is_terminated()


class JsonGuard:
    """A compact-JSON matcher made strict: (1) tokens whose text holds a raw control character
    (U+0000-U+001F) are masked: xgrammar 0.2.9 lets strings with minLength / maxLength take
    them, no JSON parser accepts them, and compact JSON (no free whitespace) has no other
    place for them, so the mask is exact; (2) the finished text is parsed and validated
    against the schema (jsonschema, when installed): a failure raises ValueError from
    is_terminated(), which SafeConstraint turns into the request's error, so an answer that
    ends with "stop" always parses (and validates)."""

    def __init__(self, inner, keep, tokenizer, schema):
        self.inner, self.keep = inner, keep  # keep: int32 [ceil(V / 32)], bit 0 for control tokens
        self.tok, self.schema = tokenizer, schema  # schema None: any JSON object
        self.ids: list = []
        self.checked = False

    def fill_next_token_bitmask(self, bitmask, row):
        self.inner.fill_next_token_bitmask(bitmask, row)
        n = min(bitmask.shape[1], self.keep.shape[0])
        bitmask[row, :n] &= self.keep[:n].to(bitmask.device)

    def accept_token(self, token_id: int) -> bool:
        ok = self.inner.accept_token(token_id)
        if ok:
            self.ids.append(token_id)
        return ok

    def is_terminated(self) -> bool:
        done = self.inner.is_terminated()
        if done and not self.checked:
            self.checked = True
            check_json(self.tok.decode(self.ids, skip_special_tokens=True), self.schema)
        return done


def check_json(text: str, schema) -> None:
    """ValueError unless text is a JSON value that schema accepts (schema None: an object)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"the constrained output is not valid JSON ({e}): {text[:200]!r}") from None
    if schema is None:
        if not isinstance(value, dict):
            raise ValueError(f"the constrained output is not a JSON object: {text[:200]!r}")
        return
    try:
        import jsonschema
    except ImportError:  # parsing is checked; validation needs jsonschema
        return
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        raise ValueError(f"the constrained output does not match the schema ({e.message}): {text[:200]!r}") from None
    except jsonschema.SchemaError:
        pass


class SafeConstraint:
    """Wraps a constraint so that an error inside it ends the request instead of failing the
    engine step that all running requests share (the engine loop then reports the request
    as failed: `failed`, `error`)."""

    def __init__(self, inner):
        self.inner, self.failed, self.error = inner, False, None

    def _fail(self, e: Exception):
        log.error("constraint failed; ending its request: %s: %s", type(e).__name__, e)
        self.failed, self.error = True, f"{type(e).__name__}: {e}"

    def fill_next_token_bitmask(self, bitmask, row):
        if self.failed:
            return
        try:
            self.inner.fill_next_token_bitmask(bitmask, row)
        except Exception as e:  # noqa: BLE001
            self._fail(e)

    def accept_token(self, token_id: int) -> bool:
        if self.failed:
            return False
        try:
            return bool(self.inner.accept_token(token_id))
        except Exception as e:  # noqa: BLE001
            self._fail(e)
            return False

    def is_terminated(self) -> bool:
        if self.failed:
            return True
        try:
            return bool(self.inner.is_terminated())
        except Exception as e:  # noqa: BLE001
            self._fail(e)
            return True


class Grammars:
    """Compiles grammars for one tokenizer (xgrammar's compiler cache keeps each distinct one)."""

    def __init__(self, tokenizer, max_threads: int = 2):
        self.tok = tokenizer
        self._max_threads = max_threads
        self._compiler = None
        self._no_control = None
        self._lock = threading.Lock()
        self.think_end_id = tokenizer.hf.token_to_id(THINK_END)

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise GrammarError("constrained decoding needs the xgrammar package, which this server "
                                       "does not have (pip install 'deepfuse[serve]')") from None

                special = self._special_ids()
                vocab = ["" if i in special else (self.tok.hf.id_to_token(i) or "") for i in range(self.tok.vocab_size)]
                info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=self.tok.vocab_size,
                                         stop_token_ids=[self.tok.eos_id], add_prefix_space=False)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads)
            return self._compiler

    def warm(self) -> None:
        """Build the compiler ahead of the first constrained request (a thread at start-up);
        without xgrammar, log once that constrained requests will be refused."""
        try:
            self.compiler()
        except GrammarError as e:
            logging.getLogger("deepfuse.serve").warning("%s", e)

    def no_control_mask(self):
        """int32 [ceil(V / 32)] token bitmask (xgrammar's layout: token i is bit i % 32 of
        word i // 32) with the bits of tokens whose bytes hold 0x00-0x1F cleared."""
        with self._lock:
            if self._no_control is None:
                import numpy as np
                import torch

                inv = {c: b for b, c in _bytes_to_unicode().items()}
                special = self._special_ids()
                V = self.tok.vocab_size
                keep = np.ones(-(-V // 32) * 32, dtype=bool)
                for i in range(V):
                    t = "" if i in special else (self.tok.hf.id_to_token(i) or "")
                    if any(inv.get(ch, 0x20) < 0x20 for ch in t):
                        keep[i] = False
                words = np.packbits(keep, bitorder="little").view("<i4")
                self._no_control = torch.from_numpy(words.copy())
            return self._no_control

    def _special_ids(self) -> set:
        """Special tokens grammars never produce as text; the markers that the V4 output
        formats spell (DSML tool calls, thinking) stay usable."""
        out = set()
        for i, t in self.tok.hf.get_added_tokens_decoder().items():
            if getattr(t, "special", False) and t.content not in FORMAT_MARKERS:
                out.add(i)
        return out

    def compile(self, kind: str, spec, *, tools=None, thinking: bool = False, prompt_tail: str = "",
                tool_choice="required", parallel_tool_calls: bool = True):
        """kind: json_schema (spec: schema dict / JSON text), json_object, regex, grammar
        (EBNF text), tool_call_required (tools: OpenAI function tools; tool_choice "required" or
        a named one {"type": "function", "function": {"name": ...}}; prompt_tail: the prompt's end, which may already open the
        tool-call block) -> a compiled grammar."""
        c = self.compiler()
        import xgrammar as xgr

        try:
            if kind == "json_schema":
                schema = spec if isinstance(spec, str) else json.dumps(spec)
                return c.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"))
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=(",", ":"))
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "grammar":
                return c.compile_grammar(spec)
            if kind == "tool_call_required":
                st = xgr.get_model_structural_tag("deepseek_v4", tools=tools, tool_choice=tool_choice,
                                                  reasoning="enabled" if thinking else "disabled",
                                                  max_whitespace_cnt=MAX_WHITESPACE,
                                                  parallel_tool_calls=parallel_tool_calls)
                st = _drop_opened_prefix(st, prompt_tail)
                try:  # the DSML markers as their own tokens (V4's parser reads them as such)
                    from xgrammar.builtin_structural_tag import _bind_marker_tokens

                    st = _bind_marker_tokens(st, [m for m in FORMAT_MARKERS if m in str(st.model_dump_json())])
                except Exception:  # noqa: BLE001 (a private helper of xgrammar: keep the text form)
                    pass
                return c.compile_structural_tag(st)
        except Exception as e:  # noqa: BLE001 (xgrammar raises RuntimeError / ValueError / its own)
            raise GrammarError(f"cannot compile the {kind} constraint: {e}",
                               "tools" if kind.startswith("tool") else "response_format") from None
        raise GrammarError(f"unknown constraint kind {kind!r}")

    def matcher(self, compiled, *, gate_thinking: bool = False, json_schema=None, json_text: bool = False):
        """A fresh per-request constraint for Engine.add_request (json_text: compact JSON,
        guarded by JsonGuard against json_schema, None: any object)."""
        import xgrammar as xgr

        m = xgr.GrammarMatcher(compiled)
        if json_text:
            m = JsonGuard(m, self.no_control_mask(), self.tok, json_schema)
        if gate_thinking and self.think_end_id is not None:
            m = ThinkGate(m, self.think_end_id)
        return SafeConstraint(m)


def _drop_opened_prefix(st, prompt_tail: str):
    """V4's prompt for a required tool choice ends by opening the tool-call block
    ("\n\n<｜DSML｜tool_calls>\n"): the grammar then starts inside it, without its own opening."""
    fmt = getattr(st, "format", None)
    els = getattr(fmt, "elements", None)
    if els and getattr(els[0], "type", None) == "const_string" and prompt_tail and \
            prompt_tail.endswith(els[0].value):
        fmt.elements = list(els[1:])
    return st


def constraint_for(grammars: Optional[Grammars], kind: Optional[str], spec, *, thinking=False, **kw):
    """-> a per-request constraint or None (kw: Grammars.compile's tool-call options)."""
    if grammars is None or kind is None:
        return None
    compiled = grammars.compile(kind, spec, thinking=thinking, **kw)
    schema = None
    if kind == "json_schema":
        schema = json.loads(spec) if isinstance(spec, str) else spec
    return grammars.matcher(compiled, gate_thinking=thinking and not kind.startswith("tool"), json_schema=schema,
                            json_text=kind in ("json_schema", "json_object"))


def _bytes_to_unicode() -> dict:
    """GPT-2's byte-level alphabet: byte -> the character that spells it in the vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))
