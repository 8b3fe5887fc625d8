"""The engine's sampler: greedy, seeded sampling with top-k / top-p / min-p, logprobs."""
import math

import pytest
import torch

from deepfuse.engine.sampler import Sampler, SamplingBatch, _mix64, gumbel_noise

M64 = (1 << 64) - 1


def batch(R, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=0, position=None, **kw):
    """A SamplingBatch of R rows; scalars are broadcast, lists taken as they are."""
    def rows(x):
        return list(x) if isinstance(x, (list, tuple, range)) else [x] * R
    pos = range(R) if position is None else position
    return SamplingBatch.from_lists(rows(temperature), rows(top_k), rows(top_p), rows(min_p),
                                    rows(seed), rows(pos), **kw)


def cat(*bs):
    """Rows of several batches, in order, as one batch (flags recomputed from the lists)."""
    f = lambda name: sum((getattr(b, name).tolist() for b in bs), [])
    return SamplingBatch.from_lists(f("temperature"), f("top_k"), f("top_p"), f("min_p"),
                                    f("seed"), f("position"))


def take(b, idx):
    f = lambda name: [getattr(b, name).tolist()[i] for i in idx]
    return SamplingBatch.from_lists(f("temperature"), f("top_k"), f("top_p"), f("min_p"),
                                    f("seed"), f("position"))


# ----------------------------------------------------------------------------- references
def mix64_py(z):
    z &= M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def gumbel_py(seed, position, token):
    key = mix64_py(mix64_py(seed) + position)
    z = mix64_py(key + (token + 1) * 0x9E3779B97F4A7C15)
    u = ((z >> 12) + 0.5) * 2.0 ** -52
    return -math.log(-math.log(u))


def exact_probs(logits, T, k, p, m):
    """The target distribution {token: probability}, computed from the definitions in float64."""
    s = [x / T for x in logits]
    order = sorted(range(len(s)), key=lambda i: (-s[i], i))
    kept = order[:k] if k else order
    w = [math.exp(s[i] - s[kept[0]]) for i in kept]
    q = [x / sum(w) for x in w]
    if p < 1:
        n, cum = 0, 0.0
        while cum < p:
            assert n == 0 or abs(cum - p) > 1e-6, "test case too close to a top-p boundary"
            cum += q[n]
            n += 1
        kept, q = kept[:n], [x / cum for x in q[:n]]
    keep = [(i, x) for i, x in zip(kept, q) if x >= m * q[0]]
    total = sum(x for _, x in keep)
    return {i: x / total for i, x in keep}


def chi2_sf(x, df):
    """Survival function of the chi-square distribution, integer df (closed forms)."""
    h = x / 2
    if df % 2 == 0:
        return math.exp(-h) * sum(h ** i / math.factorial(i) for i in range(df // 2))
    return math.erfc(math.sqrt(h)) + math.exp(-h) * sum(
        h ** (i + 0.5) / math.gamma(i + 1.5) for i in range((df - 1) // 2))


def test_chi2_sf():
    # 0.9999 quantiles from tables
    for df, q in [(1, 15.137), (2, 18.421), (3, 21.108), (6, 27.856), (11, 37.367)]:
        assert chi2_sf(q, df) == pytest.approx(1e-4, rel=2e-3)


# ----------------------------------------------------------------------------- noise
def test_noise_matches_python_reference():
    vals = [0, 1, 7, 2**31 - 1, 2**32 + 5, 2**63 - 1, -1, -(2**63), -123456789]
    z = _mix64(torch.tensor(vals, dtype=torch.int64))
    assert [x & M64 for x in z.tolist()] == [mix64_py(v) for v in vals]
    seeds, positions = [0, 12345, 2**64 - 1, 2**63 + 17], [0, 3, 1000, 2**40]
    b = batch(4, seed=seeds, position=positions)
    tokens = torch.tensor([0, 1, 2, 99, 129279])
    g = gumbel_noise(b.seed, b.position, tokens)
    ref = torch.tensor([[gumbel_py(s, p, t) for t in tokens.tolist()] for s, p in zip(seeds, positions)],
                       dtype=torch.float64)
    torch.testing.assert_close(g, ref, rtol=1e-13, atol=0)


def test_noise_is_gumbel():
    b = batch(200, seed=7)
    g = gumbel_noise(b.seed, b.position, torch.arange(500)).flatten()
    assert torch.isfinite(g).all()
    # Gumbel(0, 1): mean = Euler's gamma, variance = pi^2 / 6; n = 1e5 samples
    assert abs(g.mean().item() - 0.5772157) < 0.02
    assert abs(g.var().item() - math.pi ** 2 / 6) < 0.05


# ----------------------------------------------------------------------------- greedy
def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(9, 1000)
    logits[3, [10, 20, 700]] = 50.0  # ties: lowest id
    out = Sampler()(logits, batch(9, temperature=0.0))
    assert torch.equal(out.tokens, logits.argmax(-1))
    assert out.tokens[3] == 10
    # greedy rows in a sampled batch ignore temperature and the filters
    mixed = batch(9, temperature=[0, 1.0] * 4 + [0], top_k=5, top_p=0.5, min_p=0.3)
    tokens = Sampler()(logits, mixed).tokens
    assert torch.equal(tokens[0::2], logits.argmax(-1)[0::2])


# ----------------------------------------------------------------------------- streams
def test_reproducible_and_distinct_streams():
    V, R = 1000, 500
    logits = torch.zeros(R, V)  # uniform: two independent streams agree with probability 1/V
    sampler = Sampler()
    a = sampler(logits, batch(R, seed=1)).tokens
    assert torch.equal(a, sampler(logits, batch(R, seed=1)).tokens)
    assert torch.equal(a, sampler(logits, batch(R, seed=1, top_p=0.999999)).tokens)  # the sort path
    b = sampler(logits, batch(R, seed=2)).tokens
    c = sampler(logits, batch(R, seed=1, position=range(1, R + 1))).tokens
    for other in (b, c):
        assert (a == other).float().mean() < 0.02
    assert len(set(a.tolist())) > 300  # ~ V (1 - e^{-R/V}) = 393 distinct tokens


def test_batch_independence():
    torch.manual_seed(1)
    V = 300
    base = batch(12, temperature=[0.5, 1.0, 1.7] * 4, top_k=[0, 3, 40, 0] * 3,
                 min_p=[0.0] * 6 + [0.05] * 6, seed=range(100, 112), position=range(50, 62))
    logits = torch.randn(12, V) * 2
    ref = Sampler()(logits, base).tokens
    # one row at a time
    for i in range(12):
        assert Sampler()(logits[i:i + 1], take(base, [i])).tokens.item() == ref[i]
    # permuted, with extra rows that use top-p (so top-k rows take the full-sort path)
    extra = batch(5, top_p=[0.3, 0.9, 1.0, 0.6, 0.95], top_k=[0, 0, 7, 2, 5000], seed=9)
    perm = torch.randperm(12)
    big = cat(take(base, perm.tolist()), extra)
    out = Sampler()(torch.cat([logits[perm], torch.randn(5, V)]), big).tokens
    assert torch.equal(out[:12], ref[perm])


# ----------------------------------------------------------------------------- distribution
# V = 12; ids 2 and 9 hold the same value (a tie at the top-k = 2 boundary).
LOGITS = [0.3, -1.2, 1.5, 2.0, -0.4, 0.7, -3.0, 1.0, 0.0, 1.5, -2.0, -0.8]
CASES = [  # (temperature, top_k, top_p, min_p)
    (1.0, 0, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.0, 2, 1.0, 0.0),    # the tie at the boundary: id 2 stays, id 9 goes
    (1.3, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.1),
    (2.0, 6, 0.7, 0.0),
    (0.9, 8, 0.9, 0.05),
    (1.5, 0, 0.95, 0.15),
    (1.0, 1, 1.0, 0.0),
]


def test_distribution_matches_exact_probabilities():
    N = 20000
    rows = [(case, i) for i, case in enumerate(CASES) for _ in range(N)]
    b = SamplingBatch.from_lists([c[0] for c, _ in rows], [c[1] for c, _ in rows],
                                 [c[2] for c, _ in rows], [c[3] for c, _ in rows],
                                 [1000 + i for _, i in rows], list(range(N)) * len(CASES))
    tokens = Sampler()(torch.tensor([LOGITS] * len(rows)), b).tokens.view(len(CASES), N)
    for case, t in zip(CASES, tokens):
        q = exact_probs(LOGITS, *case)
        counts = torch.bincount(t, minlength=len(LOGITS)).tolist()
        assert all(c == 0 for i, c in enumerate(counts) if i not in q), (case, counts, q)
        if len(q) == 1:
            assert counts[next(iter(q))] == N
            continue
        stat = sum((counts[i] - N * x) ** 2 / (N * x) for i, x in q.items())
        assert chi2_sf(stat, len(q) - 1) > 1e-4, (case, counts, q, stat)
    assert exact_probs(LOGITS, *CASES[2]).keys() == {3, 2}


def test_top_k_ties_keep_exactly_k_lowest_ids():
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0, 2.0, 1.0, -1.0]]).repeat(4000, 1)
    b = batch(4000, top_k=3)
    seen = set(Sampler()(logits, b).tokens.tolist())
    assert seen == {5, 1, 2}
    b = batch(4000, top_k=3, top_p=0.9999)  # the same through the sort path
    assert set(Sampler()(logits, b).tokens.tolist()) == {5, 1, 2}


def test_extreme_parameters_stay_in_range():
    """top_p that rounds to 0 in fp32 keeps the top token (it indexed row -1 before); a
    temperature below MIN_TEMPERATURE is greedy (1e-40 overflowed the scaled logits); top_k
    beyond the vocabulary (or int32) is no filter; in every mix of rows and paths."""
    torch.manual_seed(3)
    R, V = 64, 300
    logits = torch.randn(R, V) * 4
    argmax = logits.argmax(-1)
    s = Sampler()
    for b in (batch(R, top_p=5e-324), batch(R, top_p=1e-45, top_k=7), batch(R, temperature=1e-40),
              batch(R, temperature=[1e-40, 1.0] * (R // 2), top_p=[5e-324, 1.0] * (R // 2)),
              batch(R, temperature=9e-6, top_k=2 ** 40, min_p=0.5)):
        out = s(logits, b)
        greedy = b.temperature == 0
        top1 = b.top_p < 1e-30
        assert torch.equal(out.tokens[greedy | top1], argmax[greedy | top1])
        lp = s.log_probs(logits, b)
        assert torch.isfinite(lp.max(-1).values).all()
    wide = s(logits, batch(R, top_k=2 ** 31 - 1, seed=5)).tokens
    assert torch.equal(wide, s(logits, batch(R, top_k=0, seed=5)).tokens)
    assert torch.equal(wide, s(logits, batch(R, top_k=V + 1, seed=5)).tokens)


# ----------------------------------------------------------------------------- logprobs
def test_logprobs_are_of_the_raw_distribution():
    torch.manual_seed(2)
    R, V = 16, 500
    logits = torch.randn(R, V) * 3
    b = batch(R, temperature=[0.0, 0.5, 1.0, 2.0] * 4, top_k=[0, 10] * 8, top_p=0.9,
              num_logprobs=5, want_logprobs=True)
    out = Sampler()(logits, b)
    lp = torch.log_softmax(logits.double(), -1).float()
    torch.testing.assert_close(out.logprobs, lp.gather(1, out.tokens[:, None]).squeeze(1))
    ref_lp, ref_ids = lp.topk(5, dim=-1)
    assert out.top_ids.dtype == torch.int64 and out.top_ids.shape == (R, 5)
    assert torch.equal(out.top_ids, ref_ids)
    torch.testing.assert_close(out.top_logprobs, ref_lp)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    plain = Sampler()(logits, batch(R))
    assert plain.logprobs is None and plain.top_ids is None and plain.top_logprobs is None


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_cuda_matches_cpu_without_sync():
    torch.manual_seed(3)
    R, V = 64, 129280
    logits = torch.randn(R, V) * 2.5
    cfg = dict(temperature=[0.0, 0.6, 1.0, 1.4] * 16,
               top_k=[0, 1, 20, 50, 0, 4096, 300, 0] * 8,
               min_p=[0.0, 0.0, 0.02, 0.0] * 16,
               seed=range(R), position=range(1000, 1000 + R), num_logprobs=4, want_logprobs=True)
    sampler = Sampler()
    for top_p in ([1.0] * R, [1.0, 0.9, 0.5, 0.95] * 16):  # ops.topk path, then the sort path
        cpu = sampler(logits, batch(R, top_p=top_p, **cfg))
        b = batch(R, top_p=top_p, device="cuda", **cfg)
        x = logits.cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            gpu = sampler(x, b)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(gpu.tokens.cpu(), cpu.tokens)
        torch.testing.assert_close(gpu.logprobs.cpu(), cpu.logprobs)
        torch.testing.assert_close(gpu.top_logprobs.cpu(), cpu.top_logprobs)
        assert torch.equal(gpu.top_ids.cpu(), cpu.top_ids)
