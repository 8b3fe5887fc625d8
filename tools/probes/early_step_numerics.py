"""Early speculative steps against the plain loop on the GPU (issue 28): the setting of
tests/engine/test_early_launch.py::test_cuda_early_steps_emit_what_the_plain_loop_emits (tiny,
graphs, greedy, overlap on vs off) per dtype and k.

    python tools/probes/early_step_numerics.py [cuda|cpu] [bf16:3:model,bf16:3,fp32:3,fp32:1]

(a case: dtype:k[:draft head, EngineConfig.spec_draft_head, default the engine's])

Prints whether the tokens are equal; for each request's first differing token: the step that
emitted it in both runs (early or not, the host counts per request after binding (an early
step runs k + 1 rows per request on the device), verified drafts, graph bucket or None =
eager, fused), and the full forward's top-3 logits after the common prefix (a near-tie there
means rounding, not a wrong token); then whether overlap with early steps disabled equals the
plain loop. Run from the repository root."""
import sys
import time
import torch
sys.path.insert(0, "tests")
sys.path.insert(0, "tests/engine")  # prompts_for
from deepfuse import models
from deepfuse.engine import LLM, SamplingParams
from test_engine import prompts_for

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
cases = sys.argv[2].split(",") if len(sys.argv) > 2 else ["bf16:3:model", "bf16:3", "fp32:3", "fp32:1"]
MODELS = {}


def model(dt):
    if dt not in MODELS:
        MODELS[dt] = models.tiny.load(device=dev, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dt])
    return MODELS[dt]


def run(m, k, overlap, early=True, **extra):
    prompts = prompts_for([1, 5, 17, 40, 130, 3], m.cfg.vocab_size)
    sp = [SamplingParams(max_tokens=12 + (5 * i) % 13, ignore_eos=True) for i in range(len(prompts))]
    kw = dict(max_num_seqs=8, max_total_tokens=3000, num_speculative_tokens=k, **extra)
    llm = LLM(m, **kw, cuda_graphs=True, overlap=overlap)
    eng = llm.engine
    if not early:
        eng._early_ok = lambda f: False
    emitted = {}  # rid -> [(token index, step info)]
    commit = eng._commit

    def rec_commit(f, host):
        b = f.res.batch
        g = f.res.ctx.graph
        info = dict(step=f.step, early=b.early is not None, B=len(b.chunks), counts=b.counts.tolist(),
                    verified=b.verified.tolist(), bucket=(g.pad.reqs if g is not None else None),
                    fused=getattr(b, 'fused', None))
        before = {c.req.request_id: len(c.req.output_token_ids) for c in b.chunks}
        outs = commit(f, host)
        for c, n in zip(b.chunks, host["num_emitted"]):
            rid = c.req.request_id
            after = len(c.req.output_token_ids)
            for t in range(before[rid], after):
                emitted.setdefault(rid, {})[t] = info
        return outs
    eng._commit = rec_commit
    launch = eng.runner.launch

    def rec_launch(batch, prev=None):
        L = launch(batch, prev)
        batch.fused = L.fused
        return L
    eng.runner.launch = rec_launch
    for i, (p, s) in enumerate(zip(prompts, sp)):
        eng.add_request(f"r{i}", p, s)
    got = {}
    while eng.has_unfinished():
        for o in eng.step():
            got.setdefault(o.request_id, []).extend(o.token_ids)
    return prompts, [got[f"r{i}"] for i in range(len(prompts))], emitted, eng


def margin(m, prompt, toks, t):
    with torch.no_grad():
        lg = m(torch.tensor([prompt + toks[:t]], device=dev))[0, -1].float()
    v, i = lg.topk(3)
    return (v[0] - v[1]).item(), i.tolist(), v.tolist()


for case in cases:
    dt, k, *head = case.split(":")
    k, head = int(k), dict(spec_draft_head=head[0]) if head else {}
    m = model(dt)
    t0 = time.time()
    prompts, ref, rem, reng = run(m, k, False, **head)
    _, got, gem, geng = run(m, k, True, **head)
    st = reng.stats()["spec"]
    acc = [None if a is None else round(a, 3) for a in st["acceptance_per_position"]]
    print(f"== tiny {dt} k={k} draft head {st['draft_head']}: overlap+early == plain: {got == ref}; early steps "
          f"{geng.runner.early_steps} of {geng.num_steps}, fused {geng.runner.fused_steps} (plain loop: fused "
          f"{reng.runner.fused_steps}, acceptance per position {acc}) [{time.time() - t0:.1f} s]")
    for i, (a, b) in enumerate(zip(ref, got)):
        if a == b:
            continue
        t = next((t for t, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"  r{i}: first difference at output token {t} of {len(a)} / {len(b)}: plain {a[t:t + 3]} early {b[t:t + 3]}")
        print(f"    plain step: {rem[f'r{i}'].get(t)}")
        print(f"    early step: {gem[f'r{i}'].get(t)}")
        for name, toks in (("plain", a), ("early", b)):
            mg, ids, vals = margin(m, prompts[i], toks, t)
            print(f"    full forward after the common prefix ({name} tokens): top3 ids {ids} logits "
                  f"{[round(v, 4) for v in vals]} top-2 margin {mg:.5f}")
            break  # (the prefix before t is common)
    if got != ref:
        _, nr, _, _ = run(m, k, True, early=False, **head)
        print(f"  overlap with early steps off == plain: {nr == ref}")
