"""Tensor and expert parallel V4 over the GPUs of one node (one process per rank).

Every rank runs the same flat batch (the engine's rank 0 broadcasts each step's context,
engine/distributed.py); the activations between sublayers (the mHC streams) are replicated,
and each sublayer ends in one collective that makes them whole again:

- attention: tensor parallel over heads. Rank r holds heads [r H/N, (r+1) H/N): its rows of
  wq_b, its attn_sink entries, its o_groups / N groups of wo_a (group g reads heads g H/G ..,
  so the local heads are exactly the local groups) and the matching input columns of wo_b,
  whose partial products are summed by an all-reduce. The shared K = V head, wq_a, wkv, the
  compressors and the indexer are replicated: every rank holds the whole KV cache (one head,
  so it cannot be split by heads; V4's cache is small: 1/4 and 1/128 compressed rows).
- MoE: expert parallel (expert_parallel=True): rank r holds experts [r E/N, (r+1) E/N) and
  runs them on the tokens routed there (local ids = global - offset; ops.moe_experts skips
  ids outside the shard), or tensor parallel inside every expert (expert_parallel=False:
  rank r holds rows [r I/N, ..) of w1 / w3 and those columns of w2). Either way each rank
  has a partial sum over the routed experts, combined by one all-reduce. The router and the
  shared expert are replicated (the shared expert is added after the combine).
- embedding and lm head: vocab parallel. Rank r holds vocab rows [r V', (r+1) V'),
  V' = ceil(V / N) (the last shard zero-padded); the embedding is a masked lookup plus an
  all-reduce, the head an all-gather of the logits shards.
- mHC, norms and everything else: replicated.

Collectives per layer and step: 2 all-reduces of [N, d] (attention out, MoE combine), plus
one all-reduce of the embedding and one all-gather of the logits per step. Dispatch needs no
collective, as every rank holds every token (head-parallel attention).

shard_modules(model, pc) turns a V4Model built on the meta device into rank pc.rank's part
(local shapes; each sharded tensor names its slice of the checkpoint tensor in `shard` /
`_slot_shards`), and models.load(..., parallel=pc) reads only those slices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import Attention
from .linear import Linear, add_slot
from .moe import Experts

# (dim, start, stop, size): rows/columns [start, stop) of the checkpoint tensor along dim,
# zero-padded to `size` along it (size == stop - start except for the last vocab shard)
Shard = tuple[int, int, int, int]


@dataclass(frozen=True)
class ParallelConfig:
    world_size: int = 1
    rank: int = 0
    expert_parallel: bool = True
    group: Any = None  # process group of the model collectives (None: the default group)

    def __post_init__(self):
        if not (isinstance(self.world_size, int) and self.world_size >= 1 and 0 <= self.rank < self.world_size):
            raise ValueError(f"deepfuse: ParallelConfig: need world_size >= 1 and 0 <= rank < world_size, got "
                             f"world_size={self.world_size!r}, rank={self.rank!r}")

    def even(self, n: int, what: str) -> tuple[int, int]:
        """[start, stop) of this rank's n / world_size of n things (n must divide)."""
        if n % self.world_size:
            raise ValueError(f"deepfuse: {what} ({n}) is not a multiple of the tensor parallel size "
                             f"({self.world_size})")
        per = n // self.world_size
        return self.rank * per, (self.rank + 1) * per

    def padded(self, n: int) -> tuple[int, int, int]:
        """(start, stop, per): this rank's part of n split in ceil(n / world) parts."""
        per = -(-n // self.world_size)
        a = min(self.rank * per, n)
        return a, min(a + per, n), per


def check(cfg, pc: ParallelConfig) -> None:
    """ValueError naming what does not divide."""
    pc.even(cfg.num_attention_heads, "num_attention_heads")
    pc.even(cfg.o_groups, "o_groups")
    if pc.expert_parallel:
        pc.even(cfg.n_routed_experts, "n_routed_experts")
    else:
        pc.even(cfg.moe_intermediate_size, "moe_intermediate_size")


# ----------------------------------------------------------------------------- collectives
def all_reduce(x: torch.Tensor, pc: ParallelConfig) -> torch.Tensor:
    if pc.world_size > 1:
        import torch.distributed as dist

        x = x.contiguous()
        dist.all_reduce(x, group=pc.group)
    return x


def all_gather_last(x: torch.Tensor, pc: ParallelConfig) -> torch.Tensor:
    """Concatenate every rank's x along the last dim (rank order)."""
    if pc.world_size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(pc.world_size)]
    dist.all_gather(parts, x, group=pc.group)
    return torch.cat(parts, dim=-1)


# ----------------------------------------------------------------------------- modules
class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of the embedding (padded to `per`); masked lookup + all-reduce."""

    def __init__(self, vocab: int, dim: int, pc: ParallelConfig):
        super().__init__()
        self.pc = pc
        self.start, self.stop, per = pc.padded(vocab)
        add_slot(self, "weight", (per, dim), "act")
        self._slot_shards = {"weight": (0, self.start, self.stop, per)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.stop - self.start)
        y = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return all_reduce(y.masked_fill(~inside.unsqueeze(-1), 0), self.pc)


class VocabParallelHead(Linear):
    """Rows [start, stop) of the lm head (padded); the logits shards are all-gathered."""

    def __init__(self, dim: int, vocab: int, pc: ParallelConfig):
        a, b, per = pc.padded(vocab)
        super().__init__(dim, per)
        self.pc, self.vocab = pc, vocab
        self.shard: Shard = (0, a, b, per)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather_last(super().forward(x), self.pc)[..., :self.vocab]


class RowParallelLinear(Linear):
    """Input columns [start, stop) of the weight; partial products summed by an all-reduce."""

    def __init__(self, in_global: int, out_features: int, pc: ParallelConfig, start: int, stop: int):
        super().__init__(stop - start, out_features)
        self.pc = pc
        self.shard: Shard = (1, start, stop, stop - start)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x), self.pc)


def _column(lin: Linear, start: int, stop: int) -> Linear:
    """Output rows [start, stop) of `lin` (a new meta Linear)."""
    new = Linear(lin.in_features, stop - start, lin.quantisable)
    new.shard = (0, start, stop, stop - start)
    return new


class ParallelExperts(Experts):
    """Expert parallel: experts [offset, offset + E / N); tensor parallel: rows
    [start, stop) of every expert's intermediate dim. Partial sums all-reduced."""

    def __init__(self, cfg, pc: ParallelConfig):
        super().__init__(cfg)
        self.pc = pc
        E, I, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.expert_offset, self.total_experts = 0, E
        self.shards: dict[str, Shard] = {}
        if pc.expert_parallel:
            a, b = pc.even(E, "n_routed_experts")
            self.expert_offset, self.num_experts = a, b - a
        else:
            a, b = pc.even(I, "moe_intermediate_size")
            self.inter = b - a
            # per-expert checkpoint tensors: w1 / w3 [I, d] (rows), w2 [d, I] (columns)
            self.shards = {"w1": (0, a, b, b - a), "w3": (0, a, b, b - a), "w2": (1, a, b, b - a)}
        E_l, I_l = self.num_experts, self.inter
        for name, shape in (("w1", (E_l, I_l, d)), ("w3", (E_l, I_l, d)), ("w2", (E_l, d, I_l))):
            self.register_buffer(name, torch.empty(shape, device=torch.device("meta")))

    def forward(self, x, ids, weights, limit: float):
        if self.expert_offset:
            ids = ids - self.expert_offset  # global ids outside the shard fall outside [0, E / N)
        return all_reduce(super().forward(x, ids, weights, limit), self.pc)


def _shard_attention(attn: Attention, pc: ParallelConfig) -> None:
    cfg = attn.cfg
    H, D, G, R = attn.n_heads, attn.head_dim, attn.o_groups, cfg.o_lora_rank
    h0, h1 = pc.even(H, "num_attention_heads")
    g0, g1 = pc.even(G, "o_groups")
    attn.n_heads, attn.o_groups = h1 - h0, g1 - g0
    attn.wq_b = _column(attn.wq_b, h0 * D, h1 * D)
    wo_a = Linear(attn.wo_a.in_features, (g1 - g0) * R, attn.wo_a.quantisable)
    wo_a.shard = (0, g0 * R, g1 * R, (g1 - g0) * R)
    attn.wo_a = wo_a
    attn.wo_b = RowParallelLinear(G * R, attn.wo_b.out_features, pc, g0 * R, g1 * R)
    add_slot(attn, "attn_sink", (h1 - h0,), "fp32")
    attn._slot_shards = {"attn_sink": (0, h0, h1, h1 - h0)}


def shard_modules(model: nn.Module, pc: ParallelConfig) -> nn.Module:
    """Turn a V4Model on the meta device into rank pc.rank's part (in place; then load it
    with models.load(..., parallel=pc)). world_size 1: unchanged."""
    if pc.world_size == 1:
        return model
    from .moe import MoE

    if any(not t.is_meta for t in model.buffers()):
        raise ValueError("deepfuse: shard_modules works on a model built on the meta device (before loading)")
    cfg = model.cfg
    check(cfg, pc)
    model.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, pc)
    model.head = VocabParallelHead(cfg.hidden_size, cfg.vocab_size, pc)
    for m in list(model.modules()):
        if isinstance(m, Attention):
            _shard_attention(m, pc)
        elif isinstance(m, MoE):
            m.experts = ParallelExperts(cfg, pc)
    model.parallel = pc
    return model


def parallel_config(model: nn.Module) -> Optional[ParallelConfig]:
    return getattr(model, "parallel", None)
