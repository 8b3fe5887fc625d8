"""DSpark drafting on the tiny V4.1 model (models/dspark.py; docs/notes/v41.md).

- The drafter equals an independent float64 transcription of the release's DSpark forward
  (DSparkAttention over the context window plus the whole block, the draft stages with the
  shifted mHC pre-mix, the head, the Markov head, the confidence head) on random target
  features, anchors, positions and context layouts (padding, rows past the window, rows at or
  after the anchor).
- A greedy speculative loop (DSpark drafts, the full forward verifies, the longest matching
  prefix plus the bonus token is kept) yields exactly the plain greedy continuation.
- verify_lengths: thresholds, modes, min / max, errors.
"""
import dataclasses
import types

import pytest
import torch

from deepfuse.models import tiny
from deepfuse.models.dspark import DSparkDrafter, capture_target_inputs, verify_lengths
from test_v41 import _mixes, _moe, _rms, _rope, _w


@pytest.fixture(scope="module")
def model():
    return tiny.load("v4.1")


# ----------------------------------------------------------------------------- the float64 oracle
def _draft_attention(attn, H_in, a, ctx, cfg):
    """Block queries at positions a .. a + S - 1 over the context rows ctx (already roped)
    and every block row (non-causal), with the sink; H_in [S, d] -> [S, d]."""
    S = H_in.shape[0]
    R, D, Hh = cfg.rope_head_dim, cfg.head_dim, cfg.num_attention_heads
    params = cfg.rope_main
    q = [_rope((_w(attn.wq_b) @ _rms(_w(attn.wq_a) @ H_in[s], attn.q_norm.weight, cfg.rms_norm_eps)).view(Hh, D),
               a + s, params, R) for s in range(S)]
    blk = [_rope(_rms(_w(attn.wkv) @ H_in[s], attn.kv_norm.weight, cfg.rms_norm_eps), a + s, params, R)
           for s in range(S)]
    K = torch.stack(list(ctx) + blk)
    sink = attn.attn_sink.double()
    outs = []
    for s in range(S):
        logits = q[s] @ K.T * D ** -0.5
        mx = torch.maximum(logits.max(-1).values, sink)
        e = torch.exp(logits - mx[:, None])
        o = (e @ K) / (e.sum(-1) + torch.exp(sink - mx))[:, None]
        o = _rope(o, a + s, params, R, inverse=True)
        G = cfg.o_groups
        z = torch.einsum("grk,gk->gr", _w(attn.wo_a).view(G, cfg.o_lora_rank, -1), o.reshape(G, -1))
        outs.append(_w(attn.wo_b) @ z.reshape(-1))
    return torch.stack(outs)


def oracle_draft(model, anchor, a, main_hidden, pos, follow):
    """One request: anchor at position a, target features main_hidden [C, 3d] at pos [C] ->
    (biased logits [S, V], confidence [S]) with the Markov predecessors anchor, follow[:-1]."""
    cfg = model.cfg
    eps, n, S, W = cfg.rms_norm_eps, cfg.hc_mult, cfg.dspark_block_size, cfg.sliding_window
    st0, last = model.mtp[0], model.mtp[-1]
    keep = [j for j in range(len(pos)) if 0 <= pos[j] < a and pos[j] >= a - W]
    main_x = [_rms(_w(st0.main_proj) @ main_hidden[j].double(), st0.main_norm.weight, eps) for j in keep]
    ids = [anchor] + [cfg.dspark_noise_token_id] * (S - 1)
    X = model.embed.weight[ids].double()[:, None, :].repeat(1, n, 1)
    pre = torch.zeros(S, n, dtype=torch.float64)
    pre[:, 0] = 1
    dcfg = cfg.draft_moe()
    for st in model.mtp:
        ctx = [_rope(_rms(_w(st.attn.wkv) @ mx, st.attn.kv_norm.weight, eps), pos[j], cfg.rope_main,
                     cfg.rope_head_dim) for mx, j in zip(main_x, keep)]
        mix = [_mixes(X[s], st.hc_attn_fn, st.hc_attn_scale, st.hc_attn_base, cfg) for s in range(S)]
        h = torch.stack([_rms((pre[s, :, None] * X[s]).sum(0), st.attn_norm.weight, eps) for s in range(S)])
        h = _draft_attention(st.attn, h, a, ctx, cfg)
        X = torch.stack([mix[s][1][:, None] * h[s] + mix[s][2].T @ X[s] for s in range(S)])
        attn_pre = torch.stack([m[0] for m in mix])
        mix = [_mixes(X[s], st.hc_ffn_fn, st.hc_ffn_scale, st.hc_ffn_base, cfg) for s in range(S)]
        h = [_moe(st.ffn, _rms((attn_pre[s, :, None] * X[s]).sum(0), st.ffn_norm.weight, eps), dcfg)
             for s in range(S)]
        X = torch.stack([mix[s][1][:, None] * h[s] + mix[s][2].T @ X[s] for s in range(S)])
        pre = torch.stack([m[0] for m in mix])
    hid = [(pre[s, :, None] * X[s]).sum(0) for s in range(S)]
    mk = last.markov_head
    prevs = [anchor] + list(follow[:-1])
    logits, conf = [], []
    for s in range(S):
        e = mk.embed.weight[prevs[s]].double()
        logits.append(_w(model.head) @ _rms(hid[s], last.norm.weight, eps) + _w(mk.head) @ e)
        conf.append(torch.sigmoid(_w(last.confidence_head.proj) @ torch.cat([hid[s], e]))[0])
    return torch.stack(logits), torch.stack(conf)


@pytest.mark.parametrize("seed", [0, 1])
def test_drafter_equals_release_oracle(model, seed):
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    d = DSparkDrafter(model)
    B, C, S = 3, 14, cfg.dspark_block_size
    width = len(cfg.dspark_target_layer_ids) * cfg.hidden_size
    main_hidden = torch.randn(B, C, width, generator=g)
    anchor = torch.randint(0, cfg.vocab_size, (B,), generator=g)
    a = torch.tensor([2, 9, 23])
    pos = torch.stack([torch.randint(-1, int(ai) + 3, (C,), generator=g) for ai in a])
    pos[:, 0] = -1                                          # padding
    pos[1:, 1] = a[1:] - cfg.sliding_window - 1             # one past the window
    pos[:, 2] = a                                           # at the anchor: not context
    out = d.draft(anchor, a, main_hidden, pos)
    assert out.tokens.shape == (B, S) and out.logits.shape == (B, S, cfg.vocab_size)
    for b in range(B):
        ref_logits, ref_conf = oracle_draft(model, int(anchor[b]), int(a[b]), main_hidden[b], pos[b].tolist(),
                                            out.tokens[b].tolist())
        torch.testing.assert_close(out.logits[b].double(), ref_logits, rtol=2e-4, atol=2e-4)
        torch.testing.assert_close(out.confidence[b].double(), ref_conf, rtol=2e-4, atol=2e-4)
        chosen = ref_logits.gather(1, out.tokens[b][:, None])[:, 0]
        assert (chosen >= ref_logits.max(-1).values - 1e-3).all()     # each draft is the argmax
    # fewer drafts: a prefix of the block's; context rows passed separately: the same
    rows = d.context_rows(main_hidden, pos)
    part = d.propose(anchor, a, rows, pos, k=2)
    assert torch.equal(part.tokens, out.tokens[:, :2])
    # same math at a different row count: the CPU's matmul blocking (threads) may round differently
    torch.testing.assert_close(part.logits, out.logits[:, :2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(part.confidence, out.confidence[:, :2], rtol=1e-6, atol=1e-6)


def test_context_outside_the_window_is_ignored(model):
    cfg = model.cfg
    g = torch.Generator().manual_seed(5)
    d = DSparkDrafter(model)
    width = len(cfg.dspark_target_layer_ids) * cfg.hidden_size
    a = torch.tensor([20])
    pos = torch.arange(20)[None]
    mh = torch.randn(1, 20, width, generator=g)
    ref = d.draft(torch.tensor([7]), a, mh, pos)
    mh2 = mh.clone()
    mh2[:, :20 - cfg.sliding_window] = torch.randn(1, 20 - cfg.sliding_window, width, generator=g)
    out = d.draft(torch.tensor([7]), a, mh2, pos)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    mh2[:, -1] += 1                                          # the newest context row matters
    assert not torch.allclose(d.draft(torch.tensor([7]), a, mh2, pos).logits, ref.logits)


def test_validation(model):
    d = DSparkDrafter(model)
    cfg = model.cfg
    mh = torch.zeros(1, 3, len(cfg.dspark_target_layer_ids) * cfg.hidden_size)
    pos = torch.arange(3)[None]
    with pytest.raises(ValueError, match="k must be"):
        d.draft(torch.tensor([1]), torch.tensor([3]), mh, pos, k=cfg.dspark_block_size + 1)
    with pytest.raises(ValueError, match="main_hidden must be"):
        d.draft(torch.tensor([1]), torch.tensor([3]), mh[..., :-1], pos)
    with pytest.raises(ValueError, match="temperature"):
        d.draft(torch.tensor([1]), torch.tensor([3]), mh, pos, temperature=-1.0)
    with pytest.raises(ValueError, match="target layers"):
        d.main_hidden({})
    bare = types.SimpleNamespace(cfg=dataclasses.replace(cfg, dspark_markov_rank=0), mtp=model.mtp)
    with pytest.raises(ValueError, match="no DSpark head.*dspark_markov_rank"):
        DSparkDrafter(bare)


def test_temperature_draws_follow_the_generator(model):
    d = DSparkDrafter(model)
    cfg = model.cfg
    mh = torch.randn(2, 4, len(cfg.dspark_target_layer_ids) * cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(4).expand(2, 4)
    args = (torch.tensor([5, 6]), torch.tensor([4, 4]), mh, pos)
    x = d.draft(*args, temperature=0.8, generator=torch.Generator().manual_seed(11))
    y = d.draft(*args, temperature=0.8, generator=torch.Generator().manual_seed(11))
    assert torch.equal(x.tokens, y.tokens)
    greedy = d.draft(*args)
    torch.testing.assert_close(x.logits[:, 0], greedy.logits[:, 0], rtol=0, atol=0)


# ----------------------------------------------------------------------------- speculative loop
def _greedy(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def _speculative(model, d, prompt, n, threshold, min_len):
    seq = list(prompt)
    with capture_target_inputs(model) as cap:
        logits = model(torch.tensor([seq]))
        seq.append(int(logits[0, -1].argmax()))
        feats = d.main_hidden(cap)[0]                       # [T, 3d] of the positions run so far
        steps = accepted = 0
        while len(seq) < len(prompt) + n:
            a = len(seq) - 1                                # the anchor: newest token, not run yet
            out = d.draft(torch.tensor([seq[-1]]), torch.tensor([a]), feats[None, :a], torch.arange(a)[None])
            L = int(verify_lengths(out.confidence, threshold, min_len=min_len)[0])
            drafts = out.tokens[0, :L].tolist()
            logits = model(torch.tensor([seq + drafts]))
            target = logits[0, a:].argmax(-1).tolist()      # L + 1 predictions
            m = 0
            while m < L and drafts[m] == target[m]:
                m += 1
            seq += drafts[:m] + [target[m]]
            feats = d.main_hidden(cap)[0]
            steps, accepted = steps + 1, accepted + m
    return seq[len(prompt):len(prompt) + n], steps, accepted


@pytest.mark.parametrize("threshold,min_len", [(0.0, 0), (0.5, 1), (1.0, 0)])
def test_speculative_greedy_equals_plain_greedy(model, threshold, min_len):
    d = DSparkDrafter(model)
    g = torch.Generator().manual_seed(7)
    for P in (5, 11):
        prompt = torch.randint(0, model.cfg.vocab_size, (P,), generator=g).tolist()
        want = _greedy(model, prompt, 12)
        got, steps, _ = _speculative(model, d, prompt, 12, threshold, min_len)
        assert got == want
        assert steps >= 1


def test_speculative_loop_accepts_drafts(model):
    """A drafter whose Markov head repeats the target's own greedy bigrams is accepted: the loop
    commits several tokens per verify and still equals plain greedy."""
    cfg = model.cfg
    prompt = torch.randint(0, cfg.vocab_size, (6,), generator=torch.Generator().manual_seed(9)).tolist()
    want = _greedy(model, prompt, 14)
    chain = [prompt[-1]] + want
    nxt = {}
    for p, q in zip(chain, chain[1:]):
        nxt.setdefault(p, q)
    mk = model.mtp[-1].markov_head
    old = mk.embed.weight, mk.head.weight
    r = cfg.dspark_markov_rank
    emb = torch.zeros_like(old[0])
    head = torch.zeros_like(old[1])
    for j, (p, q) in enumerate(list(nxt.items())[:r]):
        emb[p, j] = 1.0
        head[q, j] = 1e4
    try:
        mk.embed.weight, mk.head.weight = emb, head
        got, steps, accepted = _speculative(model, DSparkDrafter(model), prompt, 14, 0.0, 0)
    finally:
        mk.embed.weight, mk.head.weight = old
    assert got == want
    assert accepted > 0 and steps < 14


# ----------------------------------------------------------------------------- verification length
def test_verify_lengths_rule():
    c = torch.tensor([[0.9, 0.8, 0.3, 0.9],
                      [0.2, 0.9, 0.9, 0.9],
                      [0.95, 0.95, 0.95, 0.95],
                      [0.5, 0.5, 0.49, 1.0]])
    assert verify_lengths(c, 0.5).tolist() == [2, 0, 4, 2]
    assert verify_lengths(c, 0.5, min_len=1).tolist() == [2, 1, 4, 2]
    assert verify_lengths(c, 0.5, max_len=3).tolist() == [2, 0, 3, 2]
    assert verify_lengths(c, 0.5, min_len=3, max_len=3).tolist() == [3, 3, 3, 3]
    assert verify_lengths(c, 0.0).tolist() == [4, 4, 4, 4]
    assert verify_lengths(c, 1.0).tolist() == [0, 0, 0, 0]
    # survival: running products 0.9 0.72 0.216 | 0.2 | 0.95 0.9025 0.857 0.815 | 0.5 0.25
    assert verify_lengths(c, 0.5, mode="survival").tolist() == [2, 0, 4, 1]
    assert verify_lengths(c, 0.8, mode="survival").tolist() == [1, 0, 4, 0]
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        conf = torch.rand(6, 5, generator=g)
        th = float(torch.rand(1, generator=g))
        lo = int(torch.randint(0, 3, (1,), generator=g))
        hi = int(torch.randint(lo, 6, (1,), generator=g))
        for mode in ("prefix", "survival"):
            got = verify_lengths(conf, th, lo, hi, mode=mode).tolist()
            for b in range(6):
                n, run = 0, 1.0
                for v in conf[b].tolist():
                    run = run * v if mode == "survival" else v
                    if run < th:
                        break
                    n += 1
                assert got[b] == min(max(n, lo), hi)


def test_verify_lengths_errors():
    c = torch.rand(2, 4)
    with pytest.raises(ValueError, match="threshold"):
        verify_lengths(c, 1.5)
    with pytest.raises(ValueError, match="min_len"):
        verify_lengths(c, 0.5, min_len=3, max_len=2)
    with pytest.raises(ValueError, match="min_len"):
        verify_lengths(c, 0.5, max_len=5)
    with pytest.raises(ValueError, match="mode"):
        verify_lengths(c, 0.5, mode="tree")
    with pytest.raises(ValueError, match="confidence must be"):
        verify_lengths(c[0], 0.5)


def test_capture_in_engine_steps(model):
    """capture_target_inputs records the same target features in engine steps (two chunks
    through V41CacheManager) as in the full forward, and leaves the model as it was."""
    from deepfuse.engine.request import Request, SamplingParams
    from deepfuse.engine.v41_cache import V41CacheManager
    from test_v41_step import one_step

    cfg = model.cfg
    d = DSparkDrafter(model)
    ids = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    cache = V41CacheManager(cfg, model_dtype=model.dtype, device="cpu", kv_dtype="auto", max_num_seqs=2,
                            max_num_batched_tokens=64, max_total_tokens=256, max_model_len=64, page_size=16)
    req, rc = Request("0", ids, SamplingParams(), 0, 0), cache.admit()
    with capture_target_inputs(model) as cap:
        one_step(model, cache, req, rc, 0, 5)
        first = d.main_hidden(cap)[0]
        one_step(model, cache, req, rc, 5, 4)
        second = d.main_hidden(cap)[0]
        model(torch.tensor([ids]))
        full = d.main_hidden(cap)[0]
    torch.testing.assert_close(torch.cat([first, second]), full, rtol=1e-4, atol=1e-4)
    for i in cfg.dspark_target_layer_ids:
        assert "step" not in model.layers[i].__dict__ and not model.layers[i]._forward_pre_hooks
