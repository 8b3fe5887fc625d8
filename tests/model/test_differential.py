"""Differential suite: the engine against the model's full forward, across the V4 model space.

A fixed seed draws small random V4 configurations (window 4-128, CSA 4:1, HCA 8 / 16 / 128,
1-64 index heads, index_topk from 1 to more than the visible rows, hc_mult 1 / 2 / 4, layer
mixes incl. all-SWA / all-CSA / all-HCA, hash-MoE layers, with and without an MTP layer) and,
per configuration, several engine settings (chunk budget 1 / odd / small / large, token
budgets that force queueing and preemption, max_num_seqs, prefix caching with shared and
repeated prompts, speculation k 0-3, overlap, padded "graph" steps, page size 16 / 64,
prompts on window / ratio / page boundaries, requests arriving mid-run). fp32, "auto"
(lossless) caches on the CPU. Checks, per finished request:

- greedy: every generated token is the argmax of one full forward over prompt + output at
  its position; where that forward's top two logits are within NEAR_TIE (relative) either
  token is accepted, counted, and the suite fails if such near-ties are frequent;
- logits: every logits row the engine computed on a context that the final sequence
  confirms (prefill, decode, accepted verify rows) equals the full forward's row to LOGITS_TOL;
- speculation: each first draft is the argmax of the MTP layer's own full forward (its
  caches are checked too: drafts cannot change greedy outputs);
- per configuration, where transformers is installed: our full forward equals
  DeepseekV4ForCausalLM's logits (v4_oracle.canonical_ties: the oracle's indexer breaks
  equal scores by the lower index, as deepfuse.ops.topk does).

V4.1 (models/v41.py) the same way: random V4.1 configurations (ratio-1 / ratio-2 kv sources
shared by later layers, index sources, an optional candidate source, 0-2 Engram layers with
1-3 heads and n-grams up to 4 over a smaller compressed vocabulary, hc_mult 1 / 2 / 4, with or
without DSpark draft stages), engine settings as above (DSpark speculation k 0-3 with
confidence thresholds 0 / 0.5 / 1 instead of the MTP layer; bounded replay off: the engine
must be exact), checked against V41Model.forward token for token and row for row; each first
DSpark draft against the drafter run on the full forward's target features; per
configuration the full forward against the float64 transcription of the release
(tests/model/test_v41.py: oracle_logits).

Size: DEEPFUSE_DIFF_PAIRS (default 200) pairs, PER_CONFIG settings per configuration,
drawn from DEEPFUSE_DIFF_SEED (default 0); V4.1: DEEPFUSE_DIFF_V41_PAIRS (default 36),
PER_CONFIG_V41 per configuration. A failing pair prints its configuration, its settings and
a one-line repro: DEEPFUSE_DIFF_ONLY=<config>:<setting> (V4.1: v41:<config>:<setting>)
selects one pair.
"""
from __future__ import annotations

import json
import os
import random
import warnings

import pytest
import torch

from deepfuse import models
from deepfuse.engine import LLM, SamplingParams
from deepfuse.models import tiny
from deepfuse.models.dspark import DSparkDrafter, capture_target_inputs
from deepfuse.models.v41_config import V41Config
from deepfuse.models.v41_random import random_model
from deepfuse.ops import engram as E
from v4_oracle import one_thread  # noqa: F401

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
SEED = int(os.environ.get("DEEPFUSE_DIFF_SEED", "0"))
PAIRS = int(os.environ.get("DEEPFUSE_DIFF_PAIRS", "200"))
PER_CONFIG = 5
V41_PAIRS = int(os.environ.get("DEEPFUSE_DIFF_V41_PAIRS", "36"))
PER_CONFIG_V41 = 3
ONLY = os.environ.get("DEEPFUSE_DIFF_ONLY")  # "c" or "c:s"; V4.1: "v41:c" or "v41:c:s"
NEAR_TIE = 1e-4          # top-2 logits within 1e-4 * max(1, |top1|): either token is greedy
MAX_NEAR_TIES = 0.01     # ... but at most this fraction of all checked tokens
LOGITS_TOL = 1e-4        # relative (row norm) error of an engine logits row
ORACLE_TOL = 1e-4        # relative error of our full forward against transformers'
YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
MAX_LEN = 512

STATS = {"pairs": 0, "tokens": 0, "near_ties": 0, "rows": 0, "drafts": 0, "max_logits_err": 0.0, "preemptions": 0,
         "prefix_hits": 0, "verify_rows": 0, "accepted_drafts": 0}
STATS_V41 = dict(STATS)
COUNTED = ("tokens", "near_ties", "rows", "drafts", "preemptions", "prefix_hits", "verify_rows", "accepted_drafts")


# ----------------------------------------------------------------------------- drawing
def draw_config(rng: random.Random) -> dict:
    """A tiny V4 config.json (transformers keys plus the legacy compress_ratios, whose
    trailing entry gives the MTP layer's kind)."""
    L = rng.choice([1, 2, 2, 3, 3, 4])
    hca = rng.choice([8, 16, 128])
    mix = rng.random()
    if mix < 0.12:
        types = [SWA] * L
    elif mix < 0.24:
        types = [HCA] * L
    elif mix < 0.34:
        types = [CSA] * L
    else:
        types = [rng.choice([SWA, CSA, HCA]) for _ in range(L)]
    mlp = ["hash_moe" if rng.random() < 0.4 else "moe" for _ in range(L)]
    H = rng.choice([1, 2, 4])
    mtp = [rng.choice([SWA, SWA, CSA, HCA])] if rng.random() < 0.5 else []
    ratio = {SWA: 0, CSA: 4, HCA: hca}
    cfg = dict(
        model_type="deepseek_v4", vocab_size=rng.choice([64, 128, 256]), hidden_size=rng.choice([32, 48, 64]),
        num_hidden_layers=L, layer_types=types, mlp_layer_types=mlp, compress_rates={CSA: 4, HCA: hca},
        compress_ratios=[ratio[t] for t in types + mtp], num_nextn_predict_layers=len(mtp),
        num_attention_heads=H, o_groups=rng.choice([g for g in (1, 2, 4) if H % g == 0]),
        head_dim=rng.choice([16, 32]), qk_rope_head_dim=8, q_lora_rank=16, o_lora_rank=8,
        sliding_window=rng.choice([4, 5, 7, 8, 12, 16, 24, 32, 48, 64, 100, 128]),
        n_routed_experts=rng.choice([4, 8]), num_experts_per_tok=rng.choice([1, 2, 3]), moe_intermediate_size=16,
        n_shared_experts=1, scoring_func=rng.choice(["sqrtsoftplus", "sqrtsoftplus", "sigmoid"]),
        index_n_heads=rng.choice([1, 2, 3, 4, 8, 16, 64]), index_head_dim=rng.choice([8, 16]),
        index_topk=rng.choice([1, 2, 3, 4, 7, 16, 64, 1000]), hc_mult=rng.choice([1, 2, 4]),
        hc_sinkhorn_iters=rng.choice([3, 20]), max_position_embeddings=4096, eos_token_id=None,
        bos_token_id=None, pad_token_id=None)
    if rng.random() < 0.7:
        cfg["rope_scaling"] = YARN
    return cfg


def _length(rng: random.Random, cfg: dict, page: int, hi: int) -> int:
    """A prompt length, mostly next to a window / compression / page boundary (V4.1: the
    ratio-2 groups, the candidate blocks' span)."""
    W = cfg["sliding_window"]
    if "kv_source_layer_ids" in cfg:
        span = cfg.get("candidate_topk_blocks", 0) * cfg.get("candidate_block_size", 0) or 6
        marks = [W, 2 * W, 2, 4, span, 2 * span, page, 2 * page, 128, 256]
    else:
        hca = cfg["compress_rates"][HCA]
        marks = [W, 2 * W, 4, 8, hca, 2 * hca, page, 2 * page, 128, 256]
    marks = [m for m in marks if 2 <= m <= hi - 1]
    if marks and rng.random() < 0.75:
        return max(1, min(hi, rng.choice(marks) + rng.choice([-1, 0, 1, 2])))
    return rng.randint(1, hi)


def draw_settings(rng: random.Random, cfg: dict) -> dict:
    """Engine settings and a request schedule (prompts as lengths / shared prefixes)."""
    budget_kind = rng.choice(["one", "odd", "small", "large"])
    budget = {"one": 1, "odd": rng.choice([3, 5, 7, 13, 37, 61]), "small": rng.choice([8, 16, 32, 64]),
              "large": 4096}[budget_kind]
    page = rng.choice([16, 64])
    prefix = rng.random() < 0.3
    n = rng.randint(1, 5)
    # a chunk budget of 1 runs one prompt token per step: keep those prompts short
    hi = 40 if budget == 1 else 300
    reqs = []
    base = rng.randint(64, 160) if prefix else 0
    for i in range(n):
        if prefix and i and rng.random() < 0.3:
            j = rng.randrange(len(reqs))  # a repeated prompt
            r = dict(prefix=reqs[j]["prefix"], suffix=reqs[j]["suffix"], same_as=j)
        elif prefix:
            r = dict(prefix=min(base, hi), suffix=rng.randint(0, 60))
        else:
            r = dict(prefix=0, suffix=_length(rng, cfg, page, hi))
        r["max_tokens"] = rng.randint(1, 12) if rng.random() < 0.95 else 0  # 0: the prefill only
        r["stop"] = [rng.randrange(cfg["vocab_size"]) for _ in range(3)] if rng.random() < 0.25 else []
        r["arrival"] = 0 if i == 0 or rng.random() < 0.6 else rng.randint(1, 30)
        reqs.append(r)
    k = rng.choice([0, 1, 2, 3]) if cfg["num_nextn_predict_layers"] else 0
    st = dict(max_num_batched_tokens=budget, page_size=page, max_num_seqs=rng.choice([1, 2, 3, 4, 8]),
              enable_prefix_caching=prefix, num_speculative_tokens=k, overlap=rng.random() < 0.4,
              cuda_graphs=rng.random() < 0.3, requests=reqs)
    if prefix:
        st["prefix_checkpoint"] = rng.choice([16, 32, 64, 1024])
        st["prefix_cache_entries"] = rng.choice([1, 2, 64])  # few entries: eviction
    if rng.random() < 0.15:  # the longest request ends exactly at max_model_len (drafts clamped there)
        st["max_model_len"] = max(r["prefix"] + r["suffix"] + r["max_tokens"] for r in reqs)
    if rng.random() < 0.35:  # a token budget that forces queueing and preemption
        longest = max(r["prefix"] + r["suffix"] + r["max_tokens"] for r in reqs)
        total = sum(r["prefix"] + r["suffix"] + r["max_tokens"] for r in reqs)
        st["max_total_tokens"] = max(longest + k + 1, int(total * rng.uniform(0.3, 0.8)))
    if k:  # the random MTP layer's drafts are almost never accepted: verify the right ones too
        st["good_drafts"] = rng.random() < 0.6
    if "kv_source_layer_ids" in cfg:  # V4.1: DSpark drafts (k <= its block; DSpark runs eager steps)
        if k:
            st["num_speculative_tokens"] = min(k, cfg["dspark_block_size"])
            st["dspark_threshold"] = rng.choice([0.0, 0.0, 0.5, 1.0])
    return st


def _rng(*key) -> random.Random:
    return random.Random(":".join(str(k) for k in (SEED,) + key))


def pairs(n: int = PAIRS, per: int = PER_CONFIG, v41: bool = False) -> list[tuple[int, list[int]]]:
    n_cfg = -(-n // per)
    out = [(c, list(range(min(per, n - c * per)))) for c in range(n_cfg)]
    if ONLY:
        only = ONLY[4:] if ONLY.startswith("v41:") else ONLY
        if ONLY.startswith("v41:") != v41:
            return []
        c, _, s = only.partition(":")
        out = [(int(c), [int(s)] if s else list(range(per)))]
    return out


def repro(c: int, s: int, v41: bool = False) -> str:
    return (f"DEEPFUSE_DIFF_SEED={SEED} DEEPFUSE_DIFF_ONLY={'v41:' if v41 else ''}{c}:{s} "
            f"pytest tests/model/test_differential.py")


# ----------------------------------------------------------------------------- one pair
def _prompts(st: dict, vocab: int, rng: random.Random) -> list[list[int]]:
    shared = [rng.randrange(vocab) for _ in range(max((r["prefix"] for r in st["requests"]), default=0))]
    out = []
    for r in st["requests"]:
        if r.get("same_as") is not None:
            out.append(list(out[r["same_as"]]))
        else:
            out.append(shared[:r["prefix"]] + [rng.randrange(vocab) for _ in range(r["suffix"])] or [0])
    return out


def _capture(engine, rows: list) -> None:
    """Keep every logits row the engine computes: (request id, chunk start, chunk input ids
    up to the row, logits)."""
    runner = engine.runner
    orig = runner.forward

    def forward(chunks, ctx, **kw):
        out = orig(chunks, ctx, **kw)
        logits = out[0] if isinstance(out, tuple) else out
        R = logits.shape[0]
        if R:
            ids = ctx.input_ids[:ctx.num_tokens].tolist()
            li = ctx.logits_indices[:R].tolist()
            cu = [0]
            for n in ctx.counts:
                cu.append(cu[-1] + int(n))
            for r in range(R):
                i = int(ctx.logits_req[r])
                rows.append((chunks[i].req.request_id, int(ctx.starts[i]), ids[cu[i]:li[r] + 1], logits[r].clone()))
        return out

    runner.forward = forward


def _dspark_first_draft_logits(model, seq: list[int], cap: dict, at: list[int]) -> torch.Tensor:
    """The DSpark drafter's logits of the first draft at each position n of `at` (anchor
    seq[n - 1] at n - 1, context rows of the full forward's target features at [n - 1 - W,
    n - 1)) -> [len(at), vocab]."""
    dr = DSparkDrafter(model)
    T = len(seq)
    pos = torch.arange(T)[None]
    rows = dr.context_rows(dr.main_hidden(cap), pos)
    B = len(at)
    a = torch.tensor(at) - 1
    out = dr.propose(torch.tensor(seq)[a], a, [r.expand(B, -1, -1) for r in rows], pos.expand(B, -1), k=1)
    return out.logits[:, 0]


def run_pair(model, cfg: dict, st: dict, seed: int) -> tuple[list[str], dict]:
    """Run one settings draw on the model -> (failure messages, counts). cfg: the config.json
    dict (V4.1: its text_config)."""
    v41 = "kv_source_layer_ids" in cfg
    rng = random.Random(seed)
    prompts = _prompts(st, cfg["vocab_size"], rng)
    kw = {k: v for k, v in st.items() if k not in ("requests", "good_drafts")}
    kw.setdefault("max_model_len", MAX_LEN)
    ref = None
    if st.get("good_drafts"):  # the greedy continuations (+ k), from a plain engine run
        k = st["num_speculative_tokens"]
        ref = [o.token_ids for o in LLM(model, max_model_len=MAX_LEN).generate(
            prompts, [SamplingParams(max_tokens=r["max_tokens"] + k, ignore_eos=True) for r in st["requests"]])]
    llm = LLM(model, **kw)
    eng = llm.engine
    rows: list = []
    _capture(eng, rows)
    drafts: list = []  # (request id, position of the first draft, the MTP layer's first draft)
    drng = random.Random(seed + 1)

    def force(req, ds):
        if not ds:
            return ds
        drafts.append((req.request_id, req.num_tokens, ds[0]))
        if ref is None:
            return ds
        n = len(req.output_token_ids)
        good = ref[int(req.request_id[1:])][n:n + len(ds)]
        good += ds[len(good):]
        if drng.random() < 0.4:  # one wrong draft: a partial acceptance
            j = drng.randrange(len(good))
            good[j] = (good[j] + 1) % cfg["vocab_size"]
        return good

    if eng.spec is not None:
        eng.spec.force_drafts = force
    order = sorted(range(len(prompts)), key=lambda i: st["requests"][i]["arrival"])
    got = {i: [] for i in range(len(prompts))}
    reasons = {}
    step = 0
    while order or eng.has_unfinished():
        if order and not eng.has_unfinished():
            step = max(step, st["requests"][order[0]]["arrival"])
        while order and st["requests"][order[0]]["arrival"] <= step:
            i = order.pop(0)
            r = st["requests"][i]
            eng.add_request(f"r{i}", prompts[i], SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True,
                                                                stop_token_ids=r.get("stop", [])))
        for o in eng.step():
            i = int(o.request_id[1:])
            got[i].extend(o.token_ids)
            if o.finished:
                reasons[i] = o.finish_reason
        step += 1
        if step > 5000:
            return [f"no progress after {step} steps"], {}
    fails = []
    counts = {"tokens": 0, "near_ties": 0, "rows": 0, "max_logits_err": 0.0, "drafts": 0}
    by_req: dict[str, list] = {}
    for rid, start, ids, lg in rows:
        by_req.setdefault(rid, []).append((start, ids, lg))
    for i, p in enumerate(prompts):
        out, want, stop = got[i], st["requests"][i]["max_tokens"], st["requests"][i].get("stop", [])
        first = next((j + 1 for j, t in enumerate(out) if t in stop), None)
        if out and first == len(out) and reasons.get(i) == "stop":
            pass
        elif reasons.get(i) != "length" or len(out) != want or first is not None:
            fails.append(f"r{i}: finished {reasons.get(i)!r} with {len(out)} tokens {out}, expected 'length' after "
                         f"{want} or 'stop' at the first of {stop}")
            continue
        seq = p + out
        P = len(p)
        mine = [(n, d) for rid, n, d in drafts if rid == f"r{i}"]
        with torch.no_grad():
            if v41:  # DSpark: the first draft of each anchor from the full forward's target features
                with capture_target_inputs(model) as cap:
                    full = model(torch.tensor([seq]))[0]
                mtp = _dspark_first_draft_logits(model, seq, cap, [n for n, _ in mine]) if mine else None
            else:
                full, streams = model(torch.tensor([seq]), return_streams=True)
                full = full[0]
                if mine:  # MTP logits at t (token t + 2) from the main streams at t and token t + 1
                    mtp = model.mtp_forward(streams[:, :-1], torch.tensor([seq[1:]]))[0][0]
        for j, (n, d) in enumerate(mine):  # the first draft is the drafter's own full-forward argmax
            row = mtp[j] if v41 else mtp[n - 2]
            top = int(row.argmax())
            counts["drafts"] += 1
            m = float(row[top])
            if d != top and float(row[d]) < m - NEAR_TIE * max(1.0, abs(m)):
                fails.append(f"r{i} (prompt {P} tokens): first draft for position {n} is {d}, the "
                             f"{'DSpark drafter' if v41 else 'MTP layer'}'s full forward argmax is {top} "
                             f"({float(row[d]):.6f} vs {m:.6f})")
                break
        for j, tok in enumerate(out):
            row = full[P - 1 + j]
            top = int(row.argmax())
            counts["tokens"] += 1
            if tok == top:
                continue
            m = float(row[top])
            if float(row[tok]) >= m - NEAR_TIE * max(1.0, abs(m)):
                counts["near_ties"] += 1
                continue
            fails.append(f"r{i} (prompt {P} tokens): generated token {j} is {tok}, the full forward's argmax is "
                         f"{top} (logits {float(row[tok]):.6f} vs {m:.6f}: not a near-tie within {NEAR_TIE:g})")
            break
        for start, ids, lg in by_req.get(f"r{i}", ()):
            pos = start + len(ids) - 1
            if pos + 1 >= len(seq) or seq[start:pos + 1] != ids:
                continue  # a row of rejected drafts, or the token after the last one
            ref = full[pos]
            err = float((lg - ref).norm() / ref.norm())
            counts["rows"] += 1
            counts["max_logits_err"] = max(counts["max_logits_err"], err)
            if err > LOGITS_TOL:
                fails.append(f"r{i} (prompt {P} tokens): engine logits at position {pos} (chunk from {start}) "
                             f"differ from the full forward: rel err {err:.2e} > {LOGITS_TOL:g}")
                break
    es = eng.stats()
    counts["preemptions"] = es["num_preemptions"]
    counts["prefix_hits"] = es.get("prefix_cache", {}).get("hits", 0)
    if eng.spec is not None:
        counts["verify_rows"] = eng.spec.stats.verify_rows
        counts["accepted_drafts"] = sum(eng.spec.stats.accepted)
    c = eng.cache
    if c.used_tokens or c.free_slots != c.num_slots:
        fails.append(f"cache not empty at the end: used_tokens {c.used_tokens}, free slots {c.free_slots}")
    if counts["near_ties"] > max(1, MAX_NEAR_TIES * 5 * counts["tokens"]):
        fails.append(f"{counts['near_ties']} near-ties in {counts['tokens']} tokens: too many to be rounding")
    return fails, counts


# ----------------------------------------------------------------------------- model
def build(cfg: dict, path, seed: int):
    tiny.write(path, cfg, seed=seed, dtype=torch.float32, shards=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return models.load(path, dtype=torch.float32)


def oracle_error(cfg: dict, path, model, rng: random.Random) -> float | None:
    """Relative error of our full forward against transformers' on the same checkpoint
    (None without transformers)."""
    try:
        import transformers
        from transformers import DeepseekV4ForCausalLM
    except ImportError:
        return None
    from v4_oracle import canonical_ties

    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hca = cfg["compress_rates"][HCA]
    T = min(300, max(2 * hca + rng.randint(0, 7), cfg["sliding_window"] + 9, 40))
    x = torch.randint(0, cfg["vocab_size"], (2, T), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    with torch.no_grad(), canonical_ties():
        ref = ref_model(x).logits
        ours = model(x)
    return float((ours.double() - ref.double()).norm() / ref.double().norm())


def describe(cfg: dict) -> str:
    keys = ("vocab_size", "hidden_size", "layer_types", "mlp_layer_types", "compress_rates", "compress_ratios",
            "num_attention_heads", "o_groups", "head_dim", "sliding_window", "index_n_heads", "index_head_dim",
            "index_topk", "hc_mult", "num_nextn_predict_layers", "n_routed_experts", "num_experts_per_tok",
            "scoring_func", "hc_sinkhorn_iters")
    short = {k: cfg[k] for k in keys}
    short["layer_types"] = [t.split("_")[0] for t in cfg["layer_types"]]
    short["compress_rates"] = cfg["compress_rates"][HCA]
    return json.dumps(short)


@pytest.mark.parametrize("c,settings", pairs(), ids=lambda v: f"cfg{v}" if isinstance(v, int) else f"{len(v)}st")
def test_engine_equals_full_forward(c, settings, tmp_path):
    rng = _rng("config", c)
    cfg = draw_config(rng)
    model = build(cfg, tmp_path / "ckpt", seed=rng.randrange(1 << 30))
    fails = []
    err = oracle_error(cfg, tmp_path / "ckpt", model, _rng("oracle", c))
    if err is not None and not err <= ORACLE_TOL:
        fails.append(f"config {c}: full forward vs transformers' DeepseekV4ForCausalLM: rel err {err:.2e} > "
                     f"{ORACLE_TOL:g}\n  config {describe(cfg)}\n  repro: {repro(c, 0)}")
    for s in settings:
        srng = _rng("settings", c, s)
        st = draw_settings(srng, cfg)
        try:
            f, counts = run_pair(model, cfg, st, srng.randrange(1 << 30))
        except Exception as e:  # noqa: BLE001 - reported with the pair's repro line
            f, counts = [f"raised {type(e).__name__}: {e}"], {}
        STATS["pairs"] += 1
        for k in COUNTED:
            STATS[k] += counts.get(k, 0)
        STATS["max_logits_err"] = max(STATS["max_logits_err"], counts.get("max_logits_err", 0.0))
        if f:
            fails.append(f"pair {c}:{s}: " + "; ".join(f[:3]) + f"\n  config {describe(cfg)}\n  settings "
                         f"{json.dumps(st)}\n  repro: {repro(c, s)}")
    assert not fails, "\n".join(fails)


def test_near_ties_are_rare():
    """Accepting either token of a near-tie must stay the exception (else it hides bugs)."""
    print(f"differential: {STATS}")
    if STATS["tokens"] == 0:
        pytest.skip("no pair ran")
    assert STATS["near_ties"] <= MAX_NEAR_TIES * STATS["tokens"], STATS
    if STATS["pairs"] >= 200:  # the sample really exercises preemption, prefix hits and speculation
        for k in ("preemptions", "prefix_hits", "verify_rows", "accepted_drafts"):
            assert STATS[k] > 0, f"no {k} in {STATS['pairs']} pairs: the draws lost coverage"


# ----------------------------------------------------------------------------- V4.1
def draw_config_v41(rng: random.Random) -> dict:
    """A tiny V4.1 config.json (the release's layout: the text model under text_config).
    Ratios per layer 0 / 1 / 2; a compressed layer starts a new kv source (p = 0.3) or reads
    the newest one (same ratio: the config's rule); index sources: every kv source plus other
    compressed layers (p = 0.4); a candidate source (p = 0.5) among the index sources reading
    the last kv source (the release's layout: the candidate masks of later index sources
    must cover the same rows); Engram at 0-2 layers; DSpark stages (p = 2/3) with 1-3 target
    layers."""
    L = rng.choice([2, 3, 3, 4, 4, 5, 6])
    ratios, kv = [], []
    for i in range(L):
        if (i == 0 and rng.random() < 0.5) or rng.random() < 0.3:
            ratios.append(0)
            continue
        if not kv or rng.random() < 0.3:
            kv.append(i)
            ratios.append(rng.choice([1, 2, 2]))
        else:
            ratios.append(ratios[kv[-1]])
    if not kv:  # one compressed layer at least
        ratios[-1] = rng.choice([1, 2])
        kv = [L - 1]
    index = sorted(set(kv) | {i for i, r in enumerate(ratios) if r and rng.random() < 0.4})
    M, H, evocab = rng.choice([2, 3, 4]), rng.choice([1, 2, 3]), rng.choice([7, 13, 31, 61])
    engram = sorted(rng.sample(range(L), rng.choice([0, 1, 1, 2])))
    vocab = rng.choice([64, 128, 256])
    heads = rng.choice([1, 2, 4])
    drafts = rng.choice([0, 1, 2])
    text = dict(
        model_type="deepseek_v41_text", vocab_size=vocab, hidden_size=rng.choice([32, 48, 64]), num_hidden_layers=L,
        num_attention_heads=heads, o_groups=rng.choice([g for g in (1, 2, 4) if heads % g == 0]),
        head_dim=rng.choice([16, 32]), qk_rope_head_dim=8, q_lora_rank=16, o_lora_rank=8,
        sliding_window=rng.choice([4, 5, 7, 8, 12, 16, 32]), n_routed_experts=rng.choice([4, 8]),
        num_experts_per_tok=rng.choice([1, 2, 3]), moe_intermediate_size=16, n_shared_experts=1,
        scoring_func=rng.choice(["sqrtsoftplus", "sqrtsoftplus", "sigmoid"]), routed_scaling_factor=1.5,
        swiglu_limit=10.0, norm_topk_prob=True, rms_norm_eps=rng.choice([1e-6, 1e-20]), max_position_embeddings=4096,
        rope_theta=10000, compress_rope_theta=160000, compress_ratios=ratios + [0] * drafts,
        kv_source_layer_ids=kv, index_source_layer_ids=index, index_n_heads=rng.choice([1, 2, 4, 8]),
        index_head_dim=rng.choice([8, 16]), index_topk=rng.choice([1, 2, 3, 4, 7, 16, 1000]),
        hc_mult=rng.choice([1, 2, 4]), hc_sinkhorn_iters=rng.choice([3, 20]), hc_eps=1e-6,
        engram_layer_ids=engram,
        engram_num_embeddings=[int(r) for r in E.hash_primes(len(engram), M, H, evocab).sum(1)] if engram else [],
        engram_max_ngram_size=M, engram_vocab_size=evocab, engram_n_heads=H, engram_head_dim=32,
        engram_pad_token_id=2, engram_compressed_vocab_size=rng.randint(vocab // 2, vocab),
        num_nextn_predict_layers=drafts)
    if rng.random() < 0.5:
        text.update(candidate_source_layer_id=rng.choice([i for i in index if i >= kv[-1]]),
                    candidate_topk_blocks=rng.choice([1, 2, 3, 4]), candidate_block_size=rng.choice([1, 2, 3, 4]))
    if drafts:
        text.update(dspark_block_size=rng.choice([2, 3, 5]), dspark_noise_token_id=vocab - 1,
                    dspark_target_layer_ids=sorted(rng.sample(range(L), min(L, rng.choice([1, 2, 3])))),
                    dspark_markov_rank=rng.choice([4, 8]), dspark_n_routed_experts=rng.choice([2, 4]),
                    dspark_num_experts_per_tok=rng.choice([1, 2]))
    if rng.random() < 0.7:
        text["rope_scaling"] = {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                                "original_max_position_embeddings": 65536}
    return {"model_type": "deepseek_v41", "bos_token_id": None, "eos_token_id": None, "text_config": text}


def build_v41(cfg: dict, seed: int):
    """The random fp32 V4.1 model of a drawn config (models.v41_random; Engram token map id % C)."""
    return random_model(V41Config.from_dict(cfg), device="cpu", dtype=torch.float32, quant=None, expert_quant=None,
                        seed=seed)


def describe_v41(cfg: dict) -> str:
    t = cfg["text_config"]
    keys = ("vocab_size", "hidden_size", "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
            "candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size", "num_attention_heads",
            "head_dim", "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "hc_mult",
            "engram_layer_ids", "engram_max_ngram_size", "engram_n_heads", "engram_compressed_vocab_size",
            "num_nextn_predict_layers", "dspark_block_size", "dspark_target_layer_ids", "n_routed_experts",
            "num_experts_per_tok", "scoring_func", "rms_norm_eps")
    return json.dumps({k: t[k] for k in keys if k in t})


def oracle_error_v41(model, rng: random.Random) -> float:
    """Relative error of the full forward against the float64 transcription of the release
    (tests/model/test_v41.py: per-query loops) on one sequence of 12-24 tokens."""
    from test_v41 import oracle_logits

    T = rng.randint(12, 24)
    ids = torch.randint(0, model.cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    with torch.no_grad():
        want = oracle_logits(model, ids)
        got = model(ids[None])[0].double()
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("c,settings", pairs(V41_PAIRS, PER_CONFIG_V41, v41=True),
                         ids=lambda v: f"v41cfg{v}" if isinstance(v, int) else f"{len(v)}st")
def test_v41_engine_equals_full_forward(c, settings):
    rng = _rng("v41config", c)
    cfg = draw_config_v41(rng)
    model = build_v41(cfg, seed=rng.randrange(1 << 30))
    fails = []
    err = oracle_error_v41(model, _rng("v41oracle", c))
    if not err <= ORACLE_TOL:
        fails.append(f"config v41:{c}: full forward vs the float64 release transcription: rel err {err:.2e} > "
                     f"{ORACLE_TOL:g}\n  config {describe_v41(cfg)}\n  repro: {repro(c, 0, True)}")
    for s in settings:
        srng = _rng("v41settings", c, s)
        st = draw_settings(srng, cfg["text_config"])
        try:
            f, counts = run_pair(model, cfg["text_config"], st, srng.randrange(1 << 30))
        except Exception as e:  # noqa: BLE001 - reported with the pair's repro line
            f, counts = [f"raised {type(e).__name__}: {e}"], {}
        STATS_V41["pairs"] += 1
        for k in COUNTED:
            STATS_V41[k] += counts.get(k, 0)
        STATS_V41["max_logits_err"] = max(STATS_V41["max_logits_err"], counts.get("max_logits_err", 0.0))
        if f:
            fails.append(f"pair v41:{c}:{s}: " + "; ".join(f[:3]) + f"\n  config {describe_v41(cfg)}\n  settings "
                         f"{json.dumps(st)}\n  repro: {repro(c, s, True)}")
    assert not fails, "\n".join(fails)


def test_v41_near_ties_are_rare():
    print(f"differential V4.1: {STATS_V41}")
    if STATS_V41["tokens"] == 0:
        pytest.skip("no V4.1 pair ran")
    assert STATS_V41["near_ties"] <= MAX_NEAR_TIES * STATS_V41["tokens"], STATS_V41
    if STATS_V41["pairs"] >= 36:  # the sample exercises preemption, prefix hits and accepted DSpark drafts
        for k in ("preemptions", "prefix_hits", "verify_rows", "accepted_drafts"):
            assert STATS_V41[k] > 0, f"no {k} in {STATS_V41['pairs']} V4.1 pairs: the draws lost coverage"


# ----------------------------------------------------------------------------- regressions
TIED = dict(model_type="deepseek_v4", vocab_size=128, hidden_size=32, num_hidden_layers=3,
            layer_types=[CSA, SWA, CSA], mlp_layer_types=["hash_moe", "moe", "moe"], compress_rates={CSA: 4, HCA: 128},
            num_nextn_predict_layers=0, num_attention_heads=2, o_groups=2, head_dim=32, qk_rope_head_dim=8,
            q_lora_rank=16, o_lora_rank=8, sliding_window=8, n_routed_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=16, index_n_heads=2, index_head_dim=16, index_topk=4, hc_mult=2,
            rope_scaling=YARN, max_position_embeddings=4096, eos_token_id=None, bos_token_id=None)


def test_tied_indexer_scores_do_not_depend_on_chunking(tmp_path, monkeypatch):
    """Issue 25 item 1: with 2 index heads many indexer scores are exactly 0 (both heads'
    ReLU), ties sit at the top-k boundary, and which tied entry top-k kept depended on the
    tensor's shape: a 100-token prompt continued differently with max_num_batched_tokens=37
    than in one chunk. Canonical ties (the lower entry index wins) make the selection a
    function of the scores alone."""
    import deepfuse.models.indexer as idx

    model = build(TIED, tmp_path / "ckpt", seed=3)
    prompt = torch.randint(0, 128, (100,), generator=torch.Generator().manual_seed(5)).tolist()
    seen = []
    real = idx.select_topk
    monkeypatch.setattr(idx, "select_topk", lambda s, k, n: seen.append((s, k, n)) or real(s, k, n))
    with torch.no_grad():
        model(torch.tensor([prompt]))
    monkeypatch.setattr(idx, "select_topk", real)
    ties = 0
    for s, k, n in seen:  # rows whose k-th and (k+1)-th largest visible scores are equal
        for row, m in zip(s.reshape(-1, s.shape[-1]), n.expand(s.shape[:-1]).reshape(-1).tolist()):
            if m > k:
                v = row[:m].sort(descending=True).values
                ties += bool(v[k - 1] == v[k])
    assert ties >= 20, f"only {ties} tied boundaries: the case lost its point"
    outs = {}
    for budget in (37, 4096):
        st = dict(max_num_batched_tokens=budget, page_size=16, max_num_seqs=2, enable_prefix_caching=False,
                  num_speculative_tokens=0, overlap=False, cuda_graphs=False,
                  requests=[dict(prefix=0, suffix=100, max_tokens=12, arrival=0)])
        llm = LLM(model, max_model_len=MAX_LEN, **{k: v for k, v in st.items() if k != "requests"})
        outs[budget] = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
        fails, counts = run_pair(model, TIED, st, 0) if budget == 37 else ([], {})
        assert not fails, fails
    assert outs[37] == outs[4096]


MTP_PREFIX = dict(TIED, num_hidden_layers=2, layer_types=[HCA, SWA], mlp_layer_types=["hash_moe", "moe"],
                  compress_ratios=[128, 0, 4], num_nextn_predict_layers=1, hidden_size=64, vocab_size=256,
                  num_attention_heads=4, o_groups=1, sliding_window=100, n_routed_experts=4, num_experts_per_tok=1,
                  index_n_heads=3, index_head_dim=8, index_topk=2)


def test_prefix_snapshots_hold_the_mtp_layer_state(tmp_path):
    """Prefix snapshots (prompt checkpoints, finished requests) were taken before the MTP
    layer ran over the step's positions, so a request restored from one drafted from stale
    MTP window rows and compressor states: outputs stayed right (greedy verification), the
    first drafts did not equal the MTP layer's full forward. The engine now drafts first."""
    model = build(MTP_PREFIX, tmp_path / "ckpt", seed=648078961)
    reqs = [dict(prefix=100, suffix=s, max_tokens=8, arrival=a, stop=[])
            for s, a in ((0, 0), (2, 0), (10, 20), (37, 40))]
    reqs.append(dict(reqs[0], same_as=0, arrival=60))
    st = dict(max_num_batched_tokens=4096, page_size=64, max_num_seqs=8, enable_prefix_caching=True,
              num_speculative_tokens=2, overlap=False, cuda_graphs=False, prefix_checkpoint=32, requests=reqs)
    fails, counts = run_pair(model, MTP_PREFIX, st, 27175079)
    assert not fails, fails
    assert counts["prefix_hits"] >= 2 and counts["drafts"] >= 10, counts


def test_stop_token_inside_accepted_drafts(tmp_path):
    """A request that hits a stop token inside a step's accepted drafts ends with fewer
    tokens than the step computed; the MTP pass of that step (now run before its prefix
    snapshot) must cover only the rows whose next token exists (it raised a size mismatch)."""
    model = build(MTP_PREFIX, tmp_path / "ckpt", seed=648078961)
    base = dict(max_num_batched_tokens=4096, page_size=16, max_num_seqs=4, enable_prefix_caching=True,
                num_speculative_tokens=3, overlap=False, cuda_graphs=False, prefix_checkpoint=32, good_drafts=True)
    reqs = [dict(prefix=80, suffix=3, max_tokens=10, arrival=0, stop=[]),
            dict(prefix=80, suffix=3, max_tokens=10, arrival=8, stop=[], same_as=0)]
    for seed in (11, 12, 13):  # different prompts and wrong-draft positions
        prompt = _prompts(dict(base, requests=reqs), MTP_PREFIX["vocab_size"], random.Random(seed))[0]
        out = LLM(model, max_model_len=MAX_LEN).generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))
        cont = out[0].token_ids
        j = next(j for j in range(2, 10) if cont[j] not in cont[:j])
        for r in reqs:
            r["stop"] = [cont[j]]  # a stop token a few tokens in: inside a step's accepted drafts
        fails, counts = run_pair(model, MTP_PREFIX, dict(base, requests=reqs), seed)
        assert not fails, fails
        assert counts["accepted_drafts"] >= 2, counts
