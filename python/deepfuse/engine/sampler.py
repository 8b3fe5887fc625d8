"""Token sampling for one engine step: greedy, temperature, top-k, top-p, min-p, logprobs.

Semantics, per row (one token to sample):
- Logprobs (the sampled token's and the top-n) are of the raw model distribution,
  log_softmax(logits), before temperature and filters.
- Greedy rows (temperature below MIN_TEMPERATURE = 1e-5, 0 included) take argmax of the raw
  logits (lowest id on ties): dividing by a smaller temperature overflows.
- Other rows: s = logits / temperature, then
  top-k: keep the k largest of s;
  top-p: of those, keep the smallest prefix of the descending order whose renormalised mass
         is >= top_p (the top token always stays, also for a top_p that rounds to 0 in fp32);
  min-p: of those, drop tokens with p < min_p * p_max, tested as s - s_max < log(min_p)
         (the same thing: renormalisation does not change ratios, and the top token stays);
  then sample from the renormalised remainder.
  The order of equal values is token id ascending: at a top-k or top-p boundary that cuts
  through a group of equal values, exactly k (or the prefix length) tokens stay, lowest ids
  first.
- Randomness: Gumbel-max. Token v of row r gets noise -log(-log(u)), u in (0, 1) with 52 bits
  from a splitmix64 hash of (seed_r, position_r, v), so a row's draw depends on its seed and
  position only: not on its batch neighbours, the call order or the device.
- No host sync (graph-capturable): the host-side flags of SamplingBatch choose which work
  runs; everything else is tensor arithmetic.

Exactness of top-p: the nucleus is computed on the full descending sort of s (torch.sort)
whenever some row uses top-p. A candidate set (the top K of ops.topk) would be exact only for
rows whose nucleus fits in it, and with no host sync the exact fallback for the others would
have to run every step anyway, so it would save nothing. Rows limited by top-k alone use
ops.topk (on CUDA, k <= 4096) for their boundary value. All filters become one mask over the
vocabulary: a threshold value plus the number of tokens equal to it that stay.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from deepfuse import has_cuda_kernels, ops
from deepfuse.ops.topk import MAX_K as _TOPK_MAX_K

from .request import MIN_TEMPERATURE

_MASK64 = (1 << 64) - 1
DRAFT, ACCEPT, RESIDUAL = 1, 2, 3  # speculative decoding's noise streams (0 is the sampler's own)


def to_device(x, dtype: torch.dtype, device) -> torch.Tensor:
    """A host list / array as a device tensor without a host sync: on CUDA through pinned
    memory, non-blocking (a pageable copy would wait for the work in flight: no overlap)."""
    t = torch.as_tensor(x, dtype=dtype)
    dev = torch.device(device)
    if dev.type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev)


def _i64(c: int) -> int:
    """The int64 whose two's-complement bits are the unsigned 64-bit c."""
    c &= _MASK64
    return c - (1 << 64) if c >> 63 else c


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 lanes (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser; torch int64 + and * wrap modulo 2^64."""
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    return z ^ _srl(z, 31)


def uniform(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """fp64 uniform (0, 1) [R], one per (seed, position): element 0 of the splitmix64 stream
    keyed like gumbel_noise's (use a derived seed for a separate stream)."""
    z = _mix64(_mix64(_mix64(seed) + position))
    return (_srl(z, 12).double() + 0.5) * 2.0 ** -52


def derive_seed(seed: int, stream: int) -> int:
    """A separate, reproducible noise stream of a request (stream > 0)."""
    z = (seed + stream * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def gumbel_noise(seed: torch.Tensor, position: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """fp64 Gumbel noise [R, N] for rows (seed [R], position [R]) and token ids [N] (int64):
    element v of the splitmix64 stream keyed by mix(mix(seed) + position)."""
    key = _mix64(_mix64(seed) + position)
    z = _mix64(key[:, None] + (token_ids + 1) * _GOLDEN)
    u = (_srl(z, 12).double() + 0.5) * 2.0 ** -52  # in (0, 1), exact in fp64
    return u.log_().neg_().log_().neg_()


@dataclass
class SamplingBatch:
    """Per-row sampling parameters for one step, as tensors on the logits' device (built once
    per step by the model runner; R rows, one per token to sample)."""
    temperature: torch.Tensor   # [R] fp32, below MIN_TEMPERATURE (0) = greedy (argmax)
    top_k: torch.Tensor         # [R] int32, 0 = off (whole vocabulary; so is k >= V)
    top_p: torch.Tensor         # [R] fp32 in (0, 1], 1 = off
    min_p: torch.Tensor         # [R] fp32 in [0, 1], 0 = off
    seed: torch.Tensor          # [R] int64, the request's seed
    position: torch.Tensor      # [R] int64, the sequence position of the token being sampled
    # host-side facts about the batch, known without a sync:
    all_greedy: bool = False
    max_top_k: int = 0          # max of top_k (0 when no row uses top-k)
    any_top_p: bool = False
    any_min_p: bool = False
    num_logprobs: int = 0       # max top-n logprobs requested (0: none)
    want_logprobs: bool = False  # some row wants the sampled token's logprob

    @classmethod
    def from_lists(cls, temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float],
                   min_p: Sequence[float], seed: Sequence[int], position: Sequence[int],
                   num_logprobs: int = 0, want_logprobs: bool = False, device="cpu") -> "SamplingBatch":
        """Tensors and flags from Python lists; seeds are taken modulo 2^64, temperatures below
        MIN_TEMPERATURE become 0 (greedy), top_k is clamped to int32."""
        def t(x, dtype):
            return to_device(list(x), dtype, device)
        temperature = [0.0 if x < MIN_TEMPERATURE else x for x in temperature]
        top_k = [min(int(k), (1 << 31) - 1) for k in top_k]
        return cls(t(temperature, torch.float32), t(top_k, torch.int32), t(top_p, torch.float32),
                   t(min_p, torch.float32), t([_i64(s) for s in seed], torch.int64),
                   t(position, torch.int64),
                   all_greedy=all(x == 0 for x in temperature),
                   max_top_k=max((int(k) for k in top_k), default=0),
                   any_top_p=any(p < 1 for p in top_p), any_min_p=any(m > 0 for m in min_p),
                   num_logprobs=int(num_logprobs or 0), want_logprobs=bool(want_logprobs))


@dataclass
class SamplerOutput:
    tokens: torch.Tensor                          # [R] int64
    logprobs: Optional[torch.Tensor] = None       # [R] fp32: log-prob of the sampled token
    top_ids: Optional[torch.Tensor] = None        # [R, n] int64, descending
    top_logprobs: Optional[torch.Tensor] = None   # [R, n] fp32


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, int64 ids) of the k largest of each row, descending (tie order unspecified)."""
    if x.is_cuda and k <= _TOPK_MAX_K and has_cuda_kernels():
        v, i = ops.topk(x.contiguous(), k, sorted=True)
        return v, i.long()
    return torch.topk(x, k, dim=-1, sorted=True)


def top_logprobs(lp: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of the n largest log-probs of each row of lp [R, V], descending."""
    return _topk(lp, min(n, lp.shape[1]))


def _filter_mask(s: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Bool [R, V]: the tokens that top-k, then top-p, keep (a prefix of the order by value
    descending, id ascending)."""
    R, V = s.shape
    if b.any_top_p:
        vals, K = torch.sort(s, dim=-1, descending=True).values, V
    else:
        K = min(b.max_top_k, V)
        vals = _topk(s, K)[0]
    k = b.top_k.long()
    n = torch.where(k > 0, k.clamp(max=K), V)  # tokens kept
    if b.any_top_p:
        rank = torch.arange(K, device=s.device)
        p = torch.softmax(vals.double().masked_fill(rank >= n[:, None], float("-inf")), dim=-1)
        before = p.cumsum(-1) - p  # mass ranked before each token
        n_p = (before < b.top_p.double()[:, None]).sum(-1).clamp_(min=1)
        n = torch.where(b.top_p < 1, torch.minimum(n, n_p), n)
    # Boundary value t (the n-th largest; -inf when all stay) and how many equal to it stay.
    t = vals.gather(1, (n.clamp(max=K) - 1)[:, None])
    t = t.masked_fill(n[:, None] > K, float("-inf"))
    above, tied = s > t, s == t
    stay = n[:, None] - above.sum(-1, keepdim=True)
    return above | (tied & (tied.cumsum(-1) <= stay))


class Sampler:
    """Samples one token per row of logits [R, V] (see the module docstring)."""

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits.float()
        out = SamplerOutput(tokens=self._sample(logits, batch))
        if batch.want_logprobs or batch.num_logprobs > 0:
            lp = torch.log_softmax(logits, dim=-1)
            if batch.want_logprobs:
                out.logprobs = lp.gather(1, out.tokens[:, None]).squeeze(1)
            if batch.num_logprobs > 0:
                out.top_logprobs, out.top_ids = _topk(lp, min(batch.num_logprobs, lp.shape[1]))
        return out

    @staticmethod
    def _scores(logits: torch.Tensor, b: SamplingBatch):
        """-> (s = logits / T in fp64 with the filtered-out tokens at -inf, bool [R]: the row
        samples (temperature >= MIN_TEMPERATURE; the others are greedy))."""
        hot = b.temperature.float() >= MIN_TEMPERATURE
        s = logits / torch.where(hot, b.temperature.float(), 1.0)[:, None]
        keep = _filter_mask(s, b) if (b.any_top_p or b.max_top_k > 0) else None
        s64 = s.double()
        if b.any_min_p:
            log_min_p = b.min_p.double().log()[:, None]
            min_p_keep = s64 - s64.amax(-1, keepdim=True) >= log_min_p
            keep = min_p_keep if keep is None else keep & min_p_keep
        if keep is not None:
            s64.masked_fill_(~keep, float("-inf"))
        return s64, hot

    def log_probs(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        """fp64 [R, V]: the log of the distribution each row samples from (temperature and
        filters applied, renormalised; -inf outside it); greedy rows: 0 at the argmax (lowest
        id on ties), -inf elsewhere. Speculative decoding's p and q."""
        logits = logits.float()
        greedy = torch.full(logits.shape, float("-inf"), dtype=torch.float64, device=logits.device)
        greedy.scatter_(1, logits.argmax(-1, keepdim=True), 0.0)
        if b.all_greedy:
            return greedy
        s, hot = self._scores(logits, b)
        return torch.where(hot[:, None], torch.log_softmax(s, dim=-1), greedy)

    @staticmethod
    def sample_log_probs(logp: torch.Tensor, seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Tokens [R] drawn from the distributions exp(logp) [R, V] with the (seed, position)
        noise stream (Gumbel-max; the same draw _sample makes from the same distribution)."""
        vocab = torch.arange(logp.shape[1], device=logp.device)
        return (logp + gumbel_noise(seed.long(), position.long(), vocab)).argmax(dim=-1)

    def verify(self, logits: torch.Tensor, b: SamplingBatch, drafts: torch.Tensor, verified: torch.Tensor,
               logq: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Speculative decoding's one sampling pass over a step's rows (engine/speculative.py):
        logits [R, V]; drafts [R] int64 (the draft row r verifies); verified [R] bool (row r
        verifies a draft); logq [R, V] fp64 the draft log-probs of verified rows (None: every
        draft greedy, one-hot) -> (target [R]: the row's own draw from p, accepted [R] bool:
        u < min(1, p(d) / q(d)) on verified rows, final [R]: the token the row emits when it
        is the first one not accepted: a draw from normalise(max(p - q, 0)) on verified
        rows, target elsewhere). Greedy rows: p is one-hot at the argmax, so a draft is
        accepted iff it is the argmax, and final = target = the argmax."""
        if b.all_greedy:
            target = logits.argmax(-1)
            return target, (drafts == target) & verified, target
        logp = self.log_probs(logits, b)
        target = self.sample_log_probs(logp, b.seed, b.position)
        if logq is None:
            logq = torch.full_like(logp, float("-inf")).scatter_(1, drafts[:, None], 0.0)
        acc, res = accept_drafts(self, logp, logq, drafts, b.seed, b.position)
        return target, acc & verified, torch.where(verified, res, target)

    @staticmethod
    def _sample(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        if b.all_greedy:
            return greedy
        s64, hot = Sampler._scores(logits, b)
        vocab = torch.arange(s64.shape[1], device=s64.device)
        scores = s64.add_(gumbel_noise(b.seed.long(), b.position.long(), vocab))
        return torch.where(hot, scores.argmax(dim=-1), greedy)


def derive_seeds(seed: torch.Tensor, stream: int) -> torch.Tensor:
    """derive_seed on a device tensor of int64 seeds (their two's-complement bits)."""
    z = seed + _i64(stream * 0x9E3779B97F4A7C15)
    return _mix64(z) & ((1 << 63) - 1)


def accept_drafts(sampler: Sampler, logp: torch.Tensor, logq: torch.Tensor, drafts: torch.Tensor, seeds,
                  position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance test per verify row: logp / logq [R, V] (fp64 target / draft
    log-probs), drafts [R] (the draft each row verifies), seeds (the rows' request seeds: a
    list or an int64 tensor), position [R] (the draft's position) -> (accepted [R] bool:
    u < min(1, p(d) / q(d)), replacement [R]: a draw from normalise(max(p - q, 0)))."""
    dev = logp.device
    if not isinstance(seeds, torch.Tensor):
        seeds = torch.tensor([_i64(s) for s in seeds], dtype=torch.int64, device=dev)
    p_d = logp.gather(1, drafts[:, None])[:, 0]
    q_d = logq.gather(1, drafts[:, None])[:, 0]
    ratio = torch.exp(torch.clamp(p_d - q_d, max=0.0))
    acc = uniform(derive_seeds(seeds, ACCEPT), position) < ratio
    resid = torch.log(torch.clamp(logp.exp() - logq.exp(), min=0.0))
    return acc, sampler.sample_log_probs(resid, derive_seeds(seeds, RESIDUAL), position)
