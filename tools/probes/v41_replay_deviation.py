"""Deviation of the engine's decoder-side SWA bounded replay (EngineConfig.swa_replay_window = K,
engine/replay.py; APPROXIMATE) from the exact engine on the tiny V4.1 model.

The engine with replay equals the model-level definition token for token and to 1e-4 in the
logits (tests/model/test_v41_replay_engine.py): its j-th generated token of a prompt of P tokens
comes from V41Model.forward(prompt + generated[:j], replay_window=K + j)[:, -1] (the late layers'
rows stay those at positions >= P - K; decode tokens run every layer). This probe measures that
against the exact forward (= the exact engine), per (K, P), over random prompts:
- the first sampled row's logits: max |error|, mean |error|, max error / max |logit|, argmax agreement;
- greedy agreement: the length of the common prefix of 8 greedy tokens, replayed vs exact.
One engine run per K confirms the model-level figures are the engine's (same tokens).

    PYTHONPATH=python:tests .venv/bin/python tools/probes/v41_replay_deviation.py [--prompts 20] [--new 8]
"""
from __future__ import annotations

import argparse

import torch


def _ids(V, T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (1, T), generator=g)


@torch.no_grad()
def greedy(model, ids, n, K):
    """n greedy tokens and the first row's logits; K None: exact, else the engine's replay."""
    seq, first, out = ids, None, []
    for j in range(n):
        row = (model(seq) if K is None else model(seq, replay_window=K + j))[0, -1]
        first = row if first is None else first
        nxt = int(row.argmax())
        out.append(nxt)
        seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    return out, first


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--ks", type=int, nargs="*", default=[8, 12, 16])
    ap.add_argument("--lens", type=int, nargs="*", default=[16, 32, 64])
    ap.add_argument("--no-engine", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from deepfuse.models import tiny
    from deepfuse.models.v41 import replay_first_layer

    m = tiny.load("v4.1")
    V = m.cfg.vocab_size
    print(f"tiny V4.1: window {m.cfg.sliding_window}, late layers {replay_first_layer(m.cfg)}.."
          f"{m.cfg.num_hidden_layers - 1}; {a.prompts} prompts per row, {a.new} greedy tokens")
    print("| K | P | first row max abs err | mean abs err | max err / max abs logit | argmax agree | "
          "greedy prefix agree | identical sequences |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for K in a.ks:
        for P in a.lens:
            mx, mean, rel, agree, pref, same = 0.0, 0.0, 0.0, 0, 0, 0
            for s in range(a.prompts):
                ids = _ids(V, P, 1000 * K + 10 * P + s)
                te, fe = greedy(m, ids, a.new, None)
                tr, fr = greedy(m, ids, a.new, K)
                d = (fr - fe).abs()
                mx, mean = max(mx, float(d.max())), mean + float(d.mean()) / a.prompts
                rel = max(rel, float(d.max() / fe.abs().max()))
                agree += int(fr.argmax() == fe.argmax())
                k = next((i for i, (x, y) in enumerate(zip(te, tr)) if x != y), a.new)
                pref += k
                same += int(k == a.new)
            print(f"| {K} | {P} | {mx:.3g} | {mean:.3g} | {rel:.3g} | {agree}/{a.prompts} | "
                  f"{pref}/{a.prompts * a.new} | {same}/{a.prompts} |")
    if a.no_engine:
        return
    from deepfuse.engine import LLM
    from deepfuse.engine.request import SamplingParams

    prompts = [_ids(V, P, 7 + P)[0].tolist() for P in a.lens]
    for K in a.ks:
        llm = LLM(m, max_model_len=max(a.lens) + a.new + 8, swa_replay_window=K, max_num_batched_tokens=11)
        outs = llm.generate(prompts, SamplingParams(max_tokens=a.new))
        ok = all(o.token_ids == greedy(m, torch.tensor([p]), a.new, K)[0] for p, o in zip(prompts, outs))
        print(f"engine (swa_replay_window {K}, chunks of <= 11 tokens) == model-level replay: {ok}")


if __name__ == "__main__":
    main()
