"""Speculative decoding with V4's MTP layer: chain drafting, verification, exact acceptance.

Per decoding request and step, the target verifies its last token plus k_r <= k drafts in
one forward (rows j = 0..k_r at positions n-1+j, row j predicting position n+j). Acceptance
(Leviathan et al.): draft d_j+1 ~ q_j is kept with probability min(1, p_j(d) / q_j(d));
at the first rejection the token is drawn from normalise(max(p_j - q_j, 0)); if all are
kept, a bonus token is drawn from p_k. p and q are the distributions the sampler would draw
from (temperature, top-k, top-p, min-p applied to target and draft alike; greedy rows are
one-hot at the argmax, so greedy acceptance is "the longest prefix equal to the target's
argmax, plus the target's token"). Noise: the sampler's counter-based streams, keyed by the
request's seed and the token's position (drafts, acceptance uniforms and residual draws on
derived seeds), so outputs do not depend on batch neighbours. The whole test is one batched
pass over the step's rows (Sampler.verify); the accepted lengths stay on the device.

Drafting (engine/model_runner.py: ModelRunner._draft), in the same runner call: the MTP
layer runs teacher-forced over every row of the step on the target's step context (main
streams X_t and the token after t: the next input token, or the token the row emitted), so
its caches stay in step with the target's; the row of each request's last accepted token
gives d_1; then the layer is chained on its own output streams for d_2..d_k, one token per
request at positions that live on the device (context.decode_context; SGLang's V4 MTP
chain, top-k 1). Rows after the first rejected one compute garbage that no later step
reads: the window ring has W + k - 1 rows and the compressor-state rings R + k - 1 (a
rejected row can only overwrite a row no later step reads), compressed rows of rejected
positions are rewritten before any query sees them, and the next step's teacher-forced pass
recomputes from the first unaccepted position.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from .request import Request
from .sampler import ACCEPT, DRAFT, RESIDUAL, accept_drafts  # noqa: F401  (re-exported)


DRAFT_HEADS = ("fp8", "model")
_DRAFT_HEADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (weight key, head)


def draft_head_gap(model) -> Optional[str]:
    """Why an FP8 copy of model's lm head cannot serve its draft steps (None: it can; off CUDA
    the FP8 linear's reference)."""
    from deepfuse.ops.linear import linear_gap

    head = model.head
    if head.fmt != "dense":
        return f"the lm head is {head.fmt} already"
    par = getattr(model, "parallel", None)
    if par is not None and par.world_size > 1:
        return "the lm head is sharded (tensor parallel)"
    if model.device.type != "cuda":
        return None
    return linear_gap(model.dtype, head.in_features, torch.empty(0, device="meta"),
                      torch.empty(0, device="meta"), "fp8")


def make_draft_head(model, mode: Optional[str]):
    """The lm head of the MTP draft steps (EngineConfig.spec_draft_head) -> a Linear, or None
    for the model's own head (mode None / "model", the default).

    mode "fp8": an FP8 copy of the model's dense head (128 x 128 block scales, fp32; the FP8
    linear kernels, activations cast per 128), made once per model and weights. Drafts are
    proposals only: verification uses the model's head, so outputs stay exact, and a sampled
    draft's q is the distribution it was drawn from (these logits). Off CUDA a dense Linear
    of the FP8 values (what the FP8 linear's reference computes). Not the default: on the
    H200 it saves 0.06 ms of a 0.26 ms head read at 1-8 rows and costs 0.25 ms more at 32
    (docs/notes/runner.md, "The drafts' lm head")."""
    if mode not in (None,) + DRAFT_HEADS:
        raise ValueError(f"deepfuse: spec_draft_head must be None or one of {DRAFT_HEADS}, got {mode!r}")
    if mode != "fp8":
        return None
    why = draft_head_gap(model)
    if why is not None:
        raise ValueError(f"deepfuse: spec_draft_head 'fp8': {why}")
    from deepfuse import ops
    from deepfuse.models.linear import Linear

    w = model.head.weight
    key = (w.data_ptr(), w._version, tuple(w.shape))
    hit = _DRAFT_HEADS.get(model)
    if hit is not None and hit[0] == key:
        return hit[1]
    head = Linear(model.head.in_features, model.head.out_features)
    with torch.no_grad():
        q, s = ops.fp8_block_cast(w.contiguous(), (128, 128), scale_fmt="fp32")
    if w.is_cuda:
        head.set_weight(q, s, "fp8")
    else:  # the reference's arithmetic (x @ the dequantised weight), dequantised once instead of per call
        head.set_weight(ops.linear.dequant_weight(q, s, "fp8", model.dtype))
    _DRAFT_HEADS[model] = (key, head)
    return head


@dataclass
class SpecStats:
    k: int
    verify_rows: int = 0                             # requests verified (one per request and step)
    proposed: list = field(default_factory=list)     # drafts verified at position j
    accepted: list = field(default_factory=list)     # ... and accepted by the target (real, also when simulating)
    emitted: int = 0                                 # tokens emitted by verify steps
    simulated: bool = False                          # spec_simulate_acc_len set: emitted lengths are simulated
    draft_head: str = "model"                        # the drafts' lm head: "model" or "fp8" (make_draft_head)

    def __post_init__(self):
        self.proposed = [0] * self.k
        self.accepted = [0] * self.k

    def add(self, verified: int, accepted: int, emitted: int) -> None:
        self.verify_rows += 1
        self.emitted += emitted
        for j in range(verified):
            self.proposed[j] += 1
            self.accepted[j] += j < accepted

    def as_dict(self) -> dict:
        acc = [a / p if p else None for a, p in zip(self.accepted, self.proposed)]
        return {"num_speculative_tokens": self.k, "verify_steps": self.verify_rows,
                "acceptance_per_position": acc, "simulated": self.simulated, "draft_head": self.draft_head,
                "mean_accepted_length": self.emitted / self.verify_rows if self.verify_rows else None}


class SpecDecoder:
    """Speculation's settings and bookkeeping (the runner runs the drafts and the test)."""

    def __init__(self, model, k: int, *, simulate_acc_len: Optional[float] = None):
        if not len(model.mtp):
            raise ValueError("deepfuse: num_speculative_tokens > 0 needs a model with an MTP layer")
        self.k = k
        self.stats = SpecStats(k, simulated=simulate_acc_len is not None)
        self.simulate_acc_len = simulate_acc_len
        self._sim = 0.0  # spec_simulate_acc_len's running fraction (error diffusion)
        # test hook: (request, proposed drafts) -> drafts to verify instead (greedy requests)
        self.force_drafts: Optional[Callable[[Request, list[int]], list[int]]] = None

    def simulated_lengths(self, verified: np.ndarray) -> Optional[np.ndarray]:
        """Benchmark knob: accepted drafts per chunk, int(a) or int(a) + 1 for a =
        spec_simulate_acc_len - 1 (at most the drafts it verifies) -> [B] or None (real
        acceptance). The + 1 comes by error diffusion over the chunks in order, so that any
        run of draws has the mean a (to within one draw): a B = 1 benchmark of 20 steps got
        3.0 tokens per step at 3.25 from random draws (Random(0)'s first 25 are all >= 0.25)."""
        if self.simulate_acc_len is None:
            return None
        x = self.simulate_acc_len - 1
        n, f = int(x), x - int(x)
        out = np.zeros(len(verified), np.int64)
        for i, kr in enumerate(verified.tolist()):
            if kr:
                self._sim += f
                extra = self._sim >= 1.0 - 1e-9
                self._sim -= extra
                out[i] = min(kr, n + extra)
        return out

    @staticmethod
    def draft_logq(chunks, num_logits: np.ndarray, verified: np.ndarray, R: int,
                   drafts: torch.Tensor) -> Optional[torch.Tensor]:
        """q of the verified rows [R, V] fp64 (-inf outside; greedy drafts one-hot at the
        draft), or None when every verified draft is greedy."""
        if not any(c.req.draft_logq is not None for c, v in zip(chunks, verified) if v):
            return None
        V = next(c.req.draft_logq.shape[-1] for c, v in zip(chunks, verified) if v and c.req.draft_logq is not None)
        logq = torch.full((R, V), float("-inf"), dtype=torch.float64, device=drafts.device)
        logq.scatter_(1, drafts[:, None], 0.0)
        first = 0
        for c, nl, v in zip(chunks, num_logits.tolist(), verified.tolist()):
            lq = c.req.draft_logq
            if v and lq is not None:
                logq[first:first + v] = lq[:v].double()
            first += nl
        return logq
