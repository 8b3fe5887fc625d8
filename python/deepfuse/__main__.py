"""The main job: greedy decoding with the bundled tiny DeepSeek V4 model (or a checkpoint).

    python -m deepfuse [--model DIR] [--device cuda|cpu] [--batch 4] [--prompt-len 48]
                       [--new-tokens 32]

Runs a batch of random prompts through prefill and a decode loop with the per-request
cache, checks the decoded tokens against one full forward over the whole sequence, and
prints throughput. Uses the GPU when there is one.
"""
from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deepfuse", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled tiny V4)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    import deepfuse
    from deepfuse import models
    from deepfuse.engine.decode import greedy_decode

    device = torch.device(a.device)
    dtype = getattr(torch, a.dtype) if a.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    print(f"deepfuse {deepfuse.__version__} | device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f" | CUDA kernels: {deepfuse.has_cuda_kernels()} {deepfuse.built_archs()} | dtype {str(dtype)[6:]}")
    if a.model:
        model = models.load(a.model, device=device, dtype=dtype)
        where = a.model
    else:
        where = models.tiny.path()
        model = models.load(where, device=device, dtype=dtype)
    cfg = model.cfg
    print(f"model {where}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")

    g = torch.Generator().manual_seed(a.seed)
    prompts = torch.randint(0, cfg.vocab_size, (a.batch, a.prompt_len), generator=g).to(device)
    res = greedy_decode(model, prompts, a.new_tokens)
    print(f"prefill {a.batch} x {a.prompt_len} tokens: {res.prefill_s * 1e3:.1f} ms | "
          f"decode {a.new_tokens} steps: {res.decode_s * 1e3:.1f} ms, {res.decode_tok_per_s:.1f} tok/s")
    print("request 0 continuation:", res.tokens[0, a.prompt_len:].tolist())

    # The decode loop must reproduce one full forward over the whole sequence.
    with torch.no_grad():
        full = model(res.tokens.to(device))[:, a.prompt_len - 1:-1].argmax(-1).cpu()
    agree = (full == res.tokens[:, a.prompt_len:]).float().mean().item()
    print(f"full-forward greedy agreement with the decode loop: {agree:.1%}")
    return 0 if agree >= (1.0 if dtype == torch.float32 else 0.9) else 1


if __name__ == "__main__":
    sys.exit(main())
