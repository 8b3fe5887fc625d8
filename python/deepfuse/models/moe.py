"""V4 MoE: routed experts (sqrt-softplus router with a selection bias, or hash routing via
tid2eid on the first num_hash_layers layers) plus one shared expert.

Every expert is a clamped SwiGLU: w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit)).
The shared expert is clamped too (the transformers oracle and DeepSeek's reference agree).
The router logits are computed in fp32 (DeepSeek's reference; the oracle uses the model
dtype, the same thing in fp32). Official names: gate.{weight, bias, tid2eid},
experts.<e>.w{1,2,3}.weight (+ .scale), shared_experts.w{1,2,3}.weight.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from deepfuse import ops
from deepfuse.ops.linear import check_weight

from .config import V4Config
from .linear import META, Linear, add_slot

# From this many rows on (CUDA, bf16 activations) the router logits come from one bf16 GEMM
# with fp32 accumulation and output over the gate weight's three bf16 terms (see Gate.logits).
ROUTER_SPLIT_MIN_T = 512


class Gate(nn.Module):
    def __init__(self, cfg: V4Config, is_hash: bool):
        super().__init__()
        self.is_hash = is_hash
        add_slot(self, "weight", (cfg.n_routed_experts, cfg.hidden_size), "fp32")
        if is_hash:
            add_slot(self, "tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), "index")
        else:
            add_slot(self, "bias", (cfg.n_routed_experts,), "fp32")
        self._terms, self._terms_key = None, None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 router logits x @ weight^T for x [T, d]. From ROUTER_SPLIT_MIN_T bf16 rows on CUDA:
        weight = hi + mid + lo exactly (three bf16 terms hold its 24 mantissa bits), every bf16
        product is exact in fp32, so one bf16 GEMM with fp32 output over the stacked [3E, d]
        terms equals the fp32 GEMM up to the order of the fp32 sums."""
        if x.is_cuda and x.dtype == torch.bfloat16 and x.shape[0] >= ROUTER_SPLIT_MIN_T:
            y = torch.mm(x, self._weight_terms().t(), out_dtype=torch.float32).view(x.shape[0], 3, -1)
            return (y[:, 0] + y[:, 1]) + y[:, 2]
        return F.linear(x.float(), self.weight)

    def _weight_terms(self) -> torch.Tensor:
        w = self.weight
        key = (w.data_ptr(), w._version)
        if self._terms_key != key:
            hi = w.bfloat16()
            r = w - hi.float()
            mid = r.bfloat16()
            self._terms = torch.cat([hi, mid, (r - mid.float()).bfloat16()]).contiguous()
            self._terms_key = key
        return self._terms


class Experts(nn.Module):
    """Routed experts stacked per projection: w1, w3 [E, I, d], w2 [E, d, I] (dense), or their
    quantised forms (fmt "fp8": e4m3 + [E, ceil(N/128), ceil(K/128)] scales; "mxfp4": uint8
    [E, N, K/2] + [E, N, K/32] UE8M0 scales)."""

    def __init__(self, cfg: V4Config):
        super().__init__()
        E, I, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.num_experts, self.inter, self.dim = E, I, d
        self.fmt = "dense"
        for name, shape in (("w1", (E, I, d)), ("w3", (E, I, d)), ("w2", (E, d, I))):
            self.register_buffer(name, torch.empty(shape, device=META))
            self.register_buffer(f"s{name[1]}", None)

    def proj_shape(self, name: str) -> tuple[int, int]:
        return (self.dim, self.inter) if name == "w2" else (self.inter, self.dim)

    def set_weights(self, weights: dict, scales: dict, fmt: str) -> None:
        for name in ("w1", "w3", "w2"):
            w, s = weights[name], scales.get(name)
            N, K = self.proj_shape(name)
            if w.shape[0] != self.num_experts:
                raise ValueError(f"deepfuse: experts.{name} has {w.shape[0]} experts, expected {self.num_experts}")
            check_weight("Experts", w[0], None if s is None else s[0], fmt, N, K, name=name)
            setattr(self, name, w)
            setattr(self, f"s{name[1]}", s)
        self.fmt = fmt

    def forward(self, x, ids, weights, limit: float, shared: Optional[tuple] = None):
        return ops.moe_experts(x, ids, weights, self.w1, self.w3, self.w2, s1=self.s1, s3=self.s3, s2=self.s2,
                               fmt=self.fmt, limit=limit, shared=shared)


class SharedExpert(nn.Module):
    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.w1, self.w3, self.w2 = Linear(dim, inter), Linear(dim, inter), Linear(inter, dim)

    def forward(self, x: torch.Tensor, limit: float) -> torch.Tensor:
        return self.w2(ops.swiglu(self.w1(x), self.w3(x), limit))


class MoE(nn.Module):
    def __init__(self, cfg: V4Config, is_hash: bool):
        super().__init__()
        self.cfg, self.is_hash = cfg, is_hash
        self.gate = Gate(cfg, is_hash)
        self.experts = Experts(cfg)
        inter = cfg.n_shared_experts * cfg.moe_intermediate_size
        self.shared_experts = SharedExpert(cfg.hidden_size, inter) if inter else None

    def forward(self, x: torch.Tensor, input_ids: Optional[torch.Tensor]) -> torch.Tensor:
        cfg = self.cfg
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        hash_ids = None
        if self.is_hash:
            if input_ids is None:
                raise ValueError("deepfuse: a hash-routed MoE layer needs the input token ids")
            hash_ids = self.gate.tid2eid[input_ids.reshape(-1)]
        shared = self._fused_shared()
        if shared is not None and flat.is_cuda and flat.shape[0] <= ops.moe.GATE_FUSED_MAX_T \
                and self.gate.weight.dtype == torch.float32:  # few rows: the router inside the experts' launches
            e = self.experts
            return ops.moe.moe_gate_experts(
                flat, self.gate.weight, cfg.num_experts_per_tok, e.w1, e.w3, e.w2,
                bias=None if self.is_hash else self.gate.bias, route_scale=cfg.routed_scaling_factor,
                score_func=cfg.scoring_func, hash_ids=hash_ids, s1=e.s1, s3=e.s3, s2=e.s2, fmt=e.fmt,
                limit=cfg.swiglu_limit, shared=shared)[0].view(shape)
        logits = self.gate.logits(flat)
        weights, ids = ops.moe_route(logits, cfg.num_experts_per_tok, bias=None if self.is_hash else self.gate.bias,
                                     route_scale=cfg.routed_scaling_factor, score_func=cfg.scoring_func,
                                     hash_ids=hash_ids)
        if shared is not None:  # one more expert inside the fused MoE kernels
            return self.experts(flat, ids, weights, cfg.swiglu_limit, shared=shared).view(shape)
        y = self.experts(flat, ids, weights, cfg.swiglu_limit)
        if self.shared_experts is not None:
            y = y + self.shared_experts(flat, cfg.swiglu_limit)
        return y.view(shape)

    def _fused_shared(self) -> Optional[tuple]:
        """The FP8 shared expert's tensors when it can run inside ops.moe_experts (quantised
        routed experts, not sharded), else None."""
        se = self.shared_experts
        if se is None or type(self.experts) is not Experts or self.experts.fmt not in ("fp8", "mxfp4"):
            return None
        if any(lin.fmt != "fp8" for lin in (se.w1, se.w3, se.w2)):
            return None
        return (se.w1.weight, se.w3.weight, se.w2.weight, se.w1.scale, se.w3.scale, se.w2.scale)
