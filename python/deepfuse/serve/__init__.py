"""deepfuse.serve: an OpenAI-compatible server over the engine.

    python -m deepfuse.serve --model tiny --port 8000
    python -m deepfuse.serve --model /path/to/DeepSeek-V4-Flash --device cuda

Modules: tokenizer (the V4 tokenizer), grammar (xgrammar constraints), engine_loop (the
engine thread and its queue), protocol (validation, errors), metrics (prometheus), app
(FastAPI routes), __main__ (the command line)."""
from .app import ServerState, create_app

__all__ = ["ServerState", "create_app", "build"]


def build(model: str = "tiny", *, device=None, dtype=None, tokenizer=None, served_model_name=None,
          thinking: bool = False, encoding: str = "v4", max_pending: int = 1024, grammar_threads: int = 2,
          **engine_kw):
    """Load the model, start the engine thread -> (FastAPI app, ServerState)."""
    from deepfuse.engine import LLM

    from .engine_loop import EngineLoop
    from .grammar import Grammars
    from .metrics import Metrics
    from .tokenizer import Tokenizer, resolve_tokenizer_dir

    if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
        raise ValueError(f"deepfuse.serve: max_pending must be an int >= 1, got {max_pending!r}")
    llm = LLM(model, device=device, dtype=dtype, **engine_kw)
    eng = llm.engine
    tok = Tokenizer(resolve_tokenizer_dir(model, tokenizer), vocab_size=eng.vocab_size)
    if tok.hf.get_vocab_size() > eng.vocab_size:
        raise ValueError(f"deepfuse.serve: the tokenizer has {tok.hf.get_vocab_size()} tokens, the model "
                         f"{eng.vocab_size}")
    name = served_model_name or ("tiny" if model == "tiny" else str(model).rstrip("/").split("/")[-1])
    metrics = Metrics(name)
    loop = EngineLoop(eng, metrics, max_pending=max_pending).start()
    grammars = Grammars(tok, max_threads=grammar_threads)
    eos = set(eng.eos_ids)
    if tok.eos_id is not None:
        eos.add(tok.eos_id)
    st = ServerState(loop, tok, grammars, name, eng.max_model_len, metrics, frozenset(eos), thinking_default=thinking,
                     encoding=encoding)
    return create_app(st), st
