"""Prefix caching at V4-Flash widths (engine level, a random model built on the device).

python -m microbench.bench_prefix --out DIR [--layers swa,csa,hca,csa] [--prompt 32768 --cached 31744]

- TTFT: a `prompt`-token prompt whose first `cached` tokens an earlier request left in the
  prefix cache (its prompt: exactly those tokens, as a previous turn; and, as a second figure,
  those tokens + different ones), against the same prompt on an engine without prefix
  caching (goal: >= 10x faster).
- Multi-turn: `convs` conversations of `turns` turns run together; each turn resends the
  whole history plus `user` new tokens and generates `reply` tokens; wall time and output
  tokens / s with prefix caching on and off.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import time
from pathlib import Path

import torch


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def ttft(llm, prompt, dev) -> float:
    """Seconds from add_request to the first generated token (the engine run to it alone)."""
    from deepfuse.engine import SamplingParams

    eng = llm.engine
    _sync(dev)
    t0 = time.perf_counter()
    rid = f"t{time.monotonic_ns()}"
    eng.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while True:
        if any(o.request_id == rid and o.token_ids for o in eng.step()):
            break
    _sync(dev)
    t = time.perf_counter() - t0
    while eng.has_unfinished():
        eng.step()
    return t


def multi_turn(llm, convs: int, turns: int, user: int, reply: int, V: int, dev) -> dict:
    from deepfuse.engine import SamplingParams

    g = torch.Generator().manual_seed(7)
    hist = [[] for _ in range(convs)]
    out_tokens = 0
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(turns):
        prompts = []
        for h in hist:
            h += torch.randint(0, V, (user,), generator=g).tolist()
            prompts.append(list(h))
        outs = llm.generate(prompts, SamplingParams(max_tokens=reply, ignore_eos=True))
        for h, o in zip(hist, outs):
            h += o.token_ids
            out_tokens += len(o.token_ids)
    _sync(dev)
    t = time.perf_counter() - t0
    return {"seconds": t, "output_tok_s": out_tokens / t}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--layers", default="swa,csa,hca,csa")
    ap.add_argument("--prompt", type=int, default=32768)
    ap.add_argument("--cached", type=int, default=31744)
    ap.add_argument("--convs", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user", type=int, default=1024)
    ap.add_argument("--reply", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny widths: a smoke test")
    a = ap.parse_args(argv)
    from deepfuse.engine import LLM
    from deepfuse.models import random as rnd
    from microbench.bench_step import KINDS

    dev = torch.device(a.device)
    small = dict(hidden_size=64, num_attention_heads=4, n_routed_experts=8, moe_intermediate_size=64, q_lora_rank=64,
                 o_groups=2, o_lora_rank=64, vocab_size=1000, index_n_heads=4, index_topk=8) if a.small else {}
    cfg = rnd.flash_config([KINDS[k] for k in a.layers.split(",")], **small)
    model = rnd.build(cfg, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, quant="fp8",
                      expert_quant="fp8")
    V = cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, V, (a.prompt,), generator=g).tolist()
    prompt2 = torch.randint(0, V, (a.prompt,), generator=g).tolist()
    other = prompt2[:a.cached] + torch.randint(0, V, (a.prompt - a.cached,), generator=g).tolist()
    kw = dict(kv_dtype="fp8" if dev.type == "cuda" else "auto", max_num_seqs=max(8, a.convs),
              max_num_batched_tokens=8192, max_model_len=a.prompt + 2 * a.user * a.turns + 1024,
              max_total_tokens=max(4 * a.prompt, a.convs * (a.user + a.reply) * a.turns + 4096))
    rows = {}
    for cache_on in (False, True):
        llm = LLM(model, enable_prefix_caching=cache_on, **kw)
        ttft(llm, torch.randint(0, V, (a.prompt // 4,), generator=g).tolist(), dev)  # warm-up
        row = {}
        if cache_on:
            # extend: an earlier request was exactly the first `cached` tokens (a previous turn)
            ttft(llm, prompt[:a.cached], dev)
            row["ttft_s"] = ttft(llm, prompt, dev)
            # diverge: the earlier request shared `cached` tokens, then went on differently; the
            # deepest saved state inside the shared part is the last prefill-chunk end before it
            ttft(llm, other, dev)
            row["ttft_diverge_s"] = ttft(llm, prompt2, dev)
        else:
            row["ttft_s"] = ttft(llm, prompt, dev)
        row["multi_turn"] = mt = multi_turn(llm, a.convs, a.turns, a.user, a.reply, V, dev)
        row["prefix"] = llm.engine.stats().get("prefix_cache")
        rows["cached" if cache_on else "uncached"] = row
        extra = f" (diverging earlier prompt: {row['ttft_diverge_s'] * 1e3:.1f} ms)" if cache_on else ""
        print(("prefix caching on " if cache_on else "prefix caching off"), f"TTFT {row['ttft_s'] * 1e3:.1f} ms{extra},",
              f"multi-turn {mt['seconds']:.2f} s, {mt['output_tok_s']:.0f} output tok/s")
        del llm
    rows["ttft_speedup"] = rows["uncached"]["ttft_s"] / rows["cached"]["ttft_s"]
    rows["ttft_diverge_speedup"] = rows["uncached"]["ttft_s"] / rows["cached"]["ttft_diverge_s"]
    rows["multi_turn_speedup"] = rows["uncached"]["multi_turn"]["seconds"] / rows["cached"]["multi_turn"]["seconds"]
    print(f"TTFT {rows['ttft_speedup']:.1f}x faster cached; multi-turn {rows['multi_turn_speedup']:.2f}x")
    meta = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": os.environ.get("DEEPFUSE_COMMIT", "unknown"), **vars(a)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix.json").write_text(json.dumps({"bench": "prefix", "context": meta, "rows": rows}, indent=1,
                                                default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
