"""V4 mixture of experts: router, clamped SwiGLU and the routed-expert combine.

Semantics (the references define them), all in fp32:
- moe_route(logits [T, E], bias [E] | None, k, route_scale, score_func, hash_ids [T, k] | None):
    g = score(logits)  (sqrtsoftplus: sqrt(softplus(l)); sigmoid; softmax over E)
    ids = hash_ids if given, else top-k of (g + bias) (the bias only chooses)
    weights = g[ids] / (sum g[ids] + 1e-20) * route_scale
  -> (weights fp32 [T, k], ids int64 [T, k]). The transformers oracle normalises for every
  score function; DeepSeek's reference skips it for softmax. We follow the oracle.
- swiglu(gate, up, limit) = silu(min(gate, limit)) * clamp(up, -limit, limit); limit <= 0
  disables the clamps.
- moe_experts(x [T, d], ids, weights, w1 [E, I, d], w3 [E, I, d], w2 [E, d, I], ...):
    y_t = sum_j weights[t, j] * W2_e (swiglu(W1_e x_t, W3_e x_t, limit)),  e = ids[t, j]
  ids outside [0, E) contribute nothing (expert-parallel shards). (DeepSeek's reference
  scales the SwiGLU output before w2, the oracle the w2 output: the same in exact math.)
  Weights may be stored as
  "dense", "fp8" (scales [E, ceil(I/128), ceil(d/128)] etc.) or "mxfp4" (uint8 [E, I, d/2],
  scales [E, I, d/32]); see deepfuse.ops.linear for the formats. An optional shared expert
  (fp8 or dense) adds W2_s swiglu(W1_s x_t, W3_s x_t) with weight 1.

CUDA (csrc/moe): moe_route is one warp per token; moe_experts is a routing plan, an FP8
activation cast (per token per 128, fp32 scales), GEMM1 (w1 | w3 with the clamped SwiGLU in its
epilogue), the cast of h, GEMM2 (times the routing weight) and a combine that sums each token's
slots in order (deterministic). At decode (T <= STREAM_MAX_T = 256) both GEMMs
run as persistent warp-specialised TMA weight-streaming kernels (csrc/moe/moe_stream.cu) with the
two casts fused into them (same roundings); fp8 from T = PREFILL_MIN_T (257) on (mxfp4 from
PREFILL_MXFP4_MIN_T), as persistent warp-specialised TMA GEMMs with the tokens on wgmma's M side
(csrc/moe/moe_prefill.cu). FP8 e4m3 MMAs with fp32 accumulation; MXFP4 weights are decoded
to e4m3 in shared memory. Activations are quantised there (the reference does not): the error
bound in tests/ops/test_moe_gpu.py states what that costs. No host sync; graph-capturable. No
repacking: the kernels read the checkpoint layouts as stored. Other inputs on CUDA (dense
experts, shapes outside the kernels) run the references only where allowed (ops._fallback),
else raise; set_activation_quant(False) chooses the moe_experts reference explicitly. swiglu has
no kernel by design: its torch form (three elementwise passes) is what runs on every device.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from deepfuse import _ext
from deepfuse.ops._checks import check_choice, check_int, check_tensor
from deepfuse.ops._fallback import kernels_off_reason, need_reference
from deepfuse.ops._registry import op
from deepfuse.ops.linear import activation_quant, check_weight, dequant_weight

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
# moe_experts on CUDA: T up to this (<= 256) runs the streaming decode kernels
# (csrc/moe/moe_stream.cu; 0: the grouped kernels at every T; tests and benchmarks compare them).
# H200: 1.07-1.12x the grouped kernels for fp8 at T 8-256, 1.47-2.75x for mxfp4 (docs/notes/moe.md,
# "The decode path", "MXFP4 experts at decode").
STREAM_MAX_T = 256
# ... and from this T on per weight format (fp8 at T = 1: the grouped kernels measured faster, H200)
STREAM_MIN_T = {"fp8": 2, "mxfp4": 1}
# fp8 moe_experts on CUDA from this T on (> 256; 0: never) runs the prefill kernels (csrc/moe/moe_prefill.cu:
# tokens on wgmma's M side, TMA producer warp + two consumer warpgroups, persistent tiles). H200: 2.3-2.6x
# the grouped kernels at T 512 / 4096 / 16384 (docs/notes/moe.md, "The prefill path").
PREFILL_MIN_T = 257
# mxfp4 moe_experts on CUDA from this T on (> 256; 0: never) runs the same prefill structure with the e2m1
# weights decoded to e4m3 in shared memory by decode warps (csrc/moe/moe_prefill.cu); PREFILL_MIN_T = 0
# turns both formats off. H200: 2.1-2.3x the grouped kernels at T 300 / 512 / 4096 / 16384; against the torch
# pipelines 1.3-1.5x (bf16 grouped_mm), 0.8x / 1.6-1.7x (fp8 scaled_grouped_mm, T = 512 / >= 4096) (docs/notes/moe.md,
# "MXFP4 experts on the prefill path").
PREFILL_MXFP4_MIN_T = 257
# moe_gate_experts on CUDA: T up to this (<= 256; 0: off) runs the router fused into moe_experts (csrc/moe:
# the logits GEMV in one launch, route + plan in one CTA after it, ids / weights written by the kernels): the
# x.float() copy, the cuBLAS GEMV, moe_route and the plan launch become two launches. Above it (or off):
# F.linear(x.float(), gate_weight), moe_route, moe_experts (what the model ran before). H200, V4-Flash: T = 1 / 8
# 0.89 / 0.94x the unfused time, T = 64 1.05x (slower; docs/notes/moe.md, "The MoE decode step, session 5").
GATE_FUSED_MAX_T = 8
# the streaming decode kernels at T up to this (0: off): each CTA takes an equal range of 16 KB stages (a
# tile then split between two neighbouring CTAs, whose partial sums the second to finish adds) instead of
# whole tiles (T = 1: 92 of 132 CTAs take two tiles, 40 one). A split tile's sum order then depends on the
# split point (deterministic for given inputs, not independent of the rest of the batch); used only while every
# routed expert fits one task (the plan says so). Per format: H200 V4-Flash mxfp4 T = 1 / 8 / 64 1.29 / 1.10 /
# 1.17x faster (the fp8 shared expert's tiles are twice as long as the routed ones); fp8 1.00-0.91x: off.
STREAM_BALANCE_MAX_T = {"fp8": 0, "mxfp4": 256}


def route_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    lf = logits.float()
    if score_func == "sqrtsoftplus":
        return F.softplus(lf).sqrt()
    if score_func == "sigmoid":
        return lf.sigmoid()
    return lf.softmax(-1)


def moe_route_ref(logits, bias, k: int, route_scale: float, score_func: str, hash_ids):
    g = route_scores(logits, score_func)
    if hash_ids is not None:
        ids = hash_ids.to(torch.int64, copy=True)
    else:
        sel = g if bias is None else g + bias.float()
        ids = torch.topk(sel, k, dim=-1, sorted=False).indices
    w = g.gather(-1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * route_scale
    return w, ids


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    g, u = gate.float(), up.float()
    if limit > 0:
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
    return (F.silu(g) * u).to(gate.dtype)


def _expert(x, e, w1, w3, w2, s1, s3, s2, fmt, limit):
    sel = (lambda s: None if s is None else s[e])
    g = F.linear(x, dequant_weight(w1[e], sel(s1), fmt))
    u = F.linear(x, dequant_weight(w3[e], sel(s3), fmt))
    return F.linear(swiglu_ref(g, u, limit), dequant_weight(w2[e], sel(s2), fmt))


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _weight_fmt(w: torch.Tensor) -> str:
    return "fp8" if w.dtype == torch.float8_e4m3fn else "dense"


def shared_expert_ref(x, shared, limit: float):
    """The shared expert (weight 1 for every token): shared = (w1, w3, w2, s1, s3, s2), fp8 or dense."""
    w1, w3, w2, s1, s3, s2 = shared
    fmt = _weight_fmt(w1)
    st = (lambda s: None if s is None else s[None])
    return _expert(x.float(), 0, w1[None], w3[None], w2[None], st(s1), st(s3), st(s2), fmt, limit)


def moe_experts_ref(x, ids, weights, w1, w3, w2, s1, s3, s2, fmt: str, limit: float, shared=None):
    T, d = x.shape
    E = w1.shape[0]
    out = torch.zeros(T, d, dtype=torch.float32, device=x.device)
    if _capturing(x):
        # no host sync inside a CUDA graph: every expert on every token, weighted by its routing
        w = (weights.float().unsqueeze(-1) * (ids.unsqueeze(-1) == torch.arange(E, device=x.device))).sum(1)
        for e in range(E):
            out += _expert(x.float(), e, w1, w3, w2, s1, s3, s2, fmt, limit) * w[:, e:e + 1]
    else:
        for e in torch.unique(ids.reshape(-1)).tolist():  # host sync: reference only (eager)
            if e < 0 or e >= E:
                continue
            rows, slots = torch.nonzero(ids == e, as_tuple=True)
            y = _expert(x[rows].float(), e, w1, w3, w2, s1, s3, s2, fmt, limit)
            out.index_add_(0, rows, y * weights[rows, slots].float().unsqueeze(-1))
    if shared is not None:
        out += shared_expert_ref(x, shared, limit)
    return out.to(x.dtype)


def route_gap(E: int, k: int) -> Optional[str]:
    """Why the router kernel cannot serve E experts, top-k (None: it can)."""
    if E > 1024:
        return f"logits has {E} experts (the kernel takes <= 1024)"
    if k > 32:
        return f"k = {k} (the kernel takes k <= 32)"
    return None


@op("moe_route")
def _moe_route(logits: torch.Tensor, bias: Optional[torch.Tensor], k: int, route_scale: float, score_func: str,
               hash_ids: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return moe_route_ref(logits, bias, k, route_scale, score_func, hash_ids)


@_moe_route.register_kernel("cuda")
def _(logits, bias, k, route_scale, score_func, hash_ids):
    T, E = logits.shape
    why = kernels_off_reason() or route_gap(E, k)
    if why is not None:
        need_reference("moe_route", why)
        return moe_route_ref(logits, bias, k, route_scale, score_func, hash_ids)
    lf = logits.float().contiguous()
    bf = None if bias is None else bias.float().contiguous()
    hi = None if hash_ids is None else hash_ids.contiguous()
    w = torch.empty(T, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)
    if T:
        _ext.ext(logits.device).moe_route(logits=lf, bias=bf, hash_ids=hi, weights=w, ids=ids,
                                          route_scale=float(route_scale), score_func=score_func)
    return w, ids


@_moe_route.register_fake
def _(logits, bias, k, route_scale, score_func, hash_ids):
    T = logits.shape[0]
    return (logits.new_empty(T, k, dtype=torch.float32), logits.new_empty(T, k, dtype=torch.int64))


@op("swiglu")
def _swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return swiglu_ref(gate, up, limit)


@_swiglu.register_fake
def _(gate, up, limit):
    return torch.empty_like(gate)


@op("moe_experts")
def _moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                 w2: torch.Tensor, s1: Optional[torch.Tensor], s3: Optional[torch.Tensor], s2: Optional[torch.Tensor],
                 fmt: str, limit: float, sh_w1: Optional[torch.Tensor], sh_w3: Optional[torch.Tensor],
                 sh_w2: Optional[torch.Tensor], sh_s1: Optional[torch.Tensor], sh_s3: Optional[torch.Tensor],
                 sh_s2: Optional[torch.Tensor]) -> torch.Tensor:
    shared = None if sh_w1 is None else (sh_w1, sh_w3, sh_w2, sh_s1, sh_s3, sh_s2)
    return moe_experts_ref(x, ids, weights, w1, w3, w2, s1, s3, s2, fmt, limit, shared)


def experts_gap(d: int, x_dtype: torch.dtype, w1, s1, s3, s2, fmt: str) -> Optional[str]:
    """Why moe_experts' CUDA kernels cannot serve x [T, d] of x_dtype with these experts (None: they can)."""
    E, I = w1.shape[0], w1.shape[1]
    if fmt not in ("fp8", "mxfp4"):
        return f"the experts are {fmt} (the kernels take fp8 or mxfp4 experts)"
    if x_dtype not in (torch.bfloat16, torch.float32):
        return f"x has dtype {str(x_dtype)[6:]} (the kernels take bfloat16 or float32)"
    if d % 32 or I % 32 or d > 8192 or I > 8192:
        return f"x has d = {d}, the experts I = {I} (the kernels take multiples of 32, <= 8192)"
    if E > 2046:
        return f"w1 has {E} experts (the kernels take <= 2046)"
    if fmt == "mxfp4" and (d % 128 or I % 128 or any(s.dtype != torch.uint8 for s in (s1, s3, s2))):
        return f"mxfp4 experts need d, I multiples of 128 and uint8 scales for the kernels, got d = {d}, I = {I}"
    return None


def shared_gap(I: int, shared) -> Optional[str]:
    """Why the fused kernels cannot run the shared expert as one more expert (None: they can)."""
    if shared is None:
        return None
    if _weight_fmt(shared[0]) != "fp8":
        return "the shared expert is dense (the fused kernels take an fp8 shared expert)"
    if shared[0].shape[0] != I:
        return f"the shared expert has {shared[0].shape[0]} rows (the fused kernels take I = {I})"
    return None


@_moe_experts.register_kernel("cuda")
def _(x, ids, weights, w1, w3, w2, s1, s3, s2, fmt, limit, sh_w1, sh_w3, sh_w2, sh_s1, sh_s3, sh_s2):
    shared = None if sh_w1 is None else (sh_w1, sh_w3, sh_w2, sh_s1, sh_s3, sh_s2)
    T, d = x.shape
    E, I, k = w1.shape[0], w1.shape[1], ids.shape[1]
    if not activation_quant():
        need_reference("moe_experts", "activation quantisation is off (set_activation_quant)", explicit=True)
        return moe_experts_ref(x, ids, weights, w1, w3, w2, s1, s3, s2, fmt, limit, shared)
    why = kernels_off_reason() or experts_gap(d, x.dtype, w1, s1, s3, s2, fmt)
    if why is not None:
        need_reference("moe_experts", why)
        return moe_experts_ref(x, ids, weights, w1, w3, w2, s1, s3, s2, fmt, limit, shared)
    shared_why = shared_gap(I, shared)
    if shared_why is not None:  # the routed experts on the kernels, the shared expert's reference added
        need_reference("moe_experts", shared_why)
    fused = shared is not None and shared_why is None
    sh = {}
    if fused:
        sh = dict(shared_w1=sh_w1, shared_w1_scale=sh_s1, shared_w3=sh_w3, shared_w3_scale=sh_s3, shared_w2=sh_w2,
                  shared_w2_scale=sh_s2)
    C = _ext.ext(x.device)
    xc = x.contiguous()
    out = torch.empty_like(xc)
    if T:
        work = torch.empty(C.moe_workspace_bytes(T=T, d=d, inter=I, E=E, k=k, shared=fused), dtype=torch.uint8,
                           device=x.device)
        C.moe_experts(x=xc, ids=ids.contiguous(), weights=weights.float().contiguous(), w1=w1.contiguous(),
                      w1_scale=s1.contiguous(), w3=w3.contiguous(), w3_scale=s3.contiguous(), w2=w2.contiguous(),
                      w2_scale=s2.contiguous(), out=out, workspace=work, limit=float(limit),
                      stream_max_t=int(STREAM_MAX_T) if T >= STREAM_MIN_T.get(fmt, 1) else 0,
                      prefill_min_t=int(PREFILL_MIN_T if fmt == "fp8" else PREFILL_MXFP4_MIN_T if PREFILL_MIN_T else 0),
                      stream_balance_max_t=int(STREAM_BALANCE_MAX_T.get(fmt, 0)),
                      **{n: t.contiguous() for n, t in sh.items()})
    if shared is not None and not fused:
        out = (out.float() + shared_expert_ref(x, shared, limit)).to(x.dtype)
    return out


@_moe_experts.register_fake
def _(x, ids, weights, w1, w3, w2, s1, s3, s2, fmt, limit, sh_w1, sh_w3, sh_w2, sh_s1, sh_s3, sh_s2):
    return torch.empty_like(x)


def moe_gate_experts_ref(x, gate_weight, bias, k: int, route_scale: float, score_func: str, hash_ids, w1, w3, w2,
                         s1, s3, s2, fmt: str, limit: float, shared=None):
    """Router + experts: logits = x gate_weight^T in fp32, moe_route_ref, moe_experts_ref."""
    logits = F.linear(x.float(), gate_weight.float())
    w, ids = moe_route_ref(logits, bias, k, route_scale, score_func, hash_ids)
    return moe_experts_ref(x, ids, w, w1, w3, w2, s1, s3, s2, fmt, limit, shared), w, ids


@op("moe_gate_experts")
def _moe_gate_experts(x: torch.Tensor, gate_weight: torch.Tensor, bias: Optional[torch.Tensor], k: int,
                      route_scale: float, score_func: str, hash_ids: Optional[torch.Tensor], w1: torch.Tensor,
                      w3: torch.Tensor, w2: torch.Tensor, s1: Optional[torch.Tensor], s3: Optional[torch.Tensor],
                      s2: Optional[torch.Tensor], fmt: str, limit: float, sh_w1: Optional[torch.Tensor],
                      sh_w3: Optional[torch.Tensor], sh_w2: Optional[torch.Tensor], sh_s1: Optional[torch.Tensor],
                      sh_s3: Optional[torch.Tensor],
                      sh_s2: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shared = None if sh_w1 is None else (sh_w1, sh_w3, sh_w2, sh_s1, sh_s3, sh_s2)
    return moe_gate_experts_ref(x, gate_weight, bias, k, route_scale, score_func, hash_ids, w1, w3, w2, s1, s3, s2,
                                fmt, limit, shared)


def gate_fused_gap(x, gate_weight, k: int, w1, s1, s3, s2, fmt: str, shared) -> Optional[str]:
    """Why the fused router cannot serve this call on CUDA (None: it can)."""
    T, d = x.shape
    E = w1.shape[0]
    if T > min(int(GATE_FUSED_MAX_T), 256):
        return f"T = {T} > GATE_FUSED_MAX_T"
    if gate_weight.dtype != torch.float32:
        return "the gate weight is not fp32"
    return (route_gap(E, k) or experts_gap(d, x.dtype, w1, s1, s3, s2, fmt) or shared_gap(w1.shape[1], shared)
            or (None if activation_quant() else "activation quantisation is off"))


@_moe_gate_experts.register_kernel("cuda")
def _(x, gate_weight, bias, k, route_scale, score_func, hash_ids, w1, w3, w2, s1, s3, s2, fmt, limit, sh_w1, sh_w3,
      sh_w2, sh_s1, sh_s3, sh_s2):
    shared = None if sh_w1 is None else (sh_w1, sh_w3, sh_w2, sh_s1, sh_s3, sh_s2)
    why = kernels_off_reason() or gate_fused_gap(x, gate_weight, k, w1, s1, s3, s2, fmt, shared)
    if why is not None:  # the unfused ops (each with its own kernel or policy)
        logits = F.linear(x.float(), gate_weight.float())
        w, ids = torch.ops.deepfuse.moe_route(logits, bias, k, float(route_scale), score_func, hash_ids)
        out = torch.ops.deepfuse.moe_experts(x, ids, w, w1, w3, w2, s1, s3, s2, fmt, float(limit), sh_w1, sh_w3,
                                             sh_w2, sh_s1, sh_s3, sh_s2)
        return out, w, ids
    T, d = x.shape
    E, I = w1.shape[0], w1.shape[1]
    sh = {}
    if shared is not None:
        sh = dict(shared_w1=sh_w1, shared_w1_scale=sh_s1, shared_w3=sh_w3, shared_w3_scale=sh_s3, shared_w2=sh_w2,
                  shared_w2_scale=sh_s2)
    C = _ext.ext(x.device)
    xc = x.contiguous()
    out = torch.empty_like(xc)
    w = torch.empty(T, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=x.device)
    if T:
        work = torch.empty(C.moe_workspace_bytes(T=T, d=d, inter=I, E=E, k=k, shared=shared is not None),
                           dtype=torch.uint8, device=x.device)
        C.moe_gate_experts(x=xc, gate_weight=gate_weight.contiguous(),
                           gate_bias=None if bias is None else bias.float().contiguous(),
                           hash_ids=None if hash_ids is None else hash_ids.contiguous(),
                           route_scale=float(route_scale), score_func=score_func, ids=ids, weights=w,
                           w1=w1.contiguous(), w1_scale=s1.contiguous(), w3=w3.contiguous(), w3_scale=s3.contiguous(),
                           w2=w2.contiguous(), w2_scale=s2.contiguous(), out=out, workspace=work, limit=float(limit),
                           stream_max_t=int(STREAM_MAX_T) if T >= STREAM_MIN_T.get(fmt, 1) else 0,
                           prefill_min_t=0, stream_balance_max_t=int(STREAM_BALANCE_MAX_T.get(fmt, 0)),
                           **{n: t.contiguous() for n, t in sh.items()})
    return out, w, ids


@_moe_gate_experts.register_fake
def _(x, gate_weight, bias, k, route_scale, score_func, hash_ids, w1, w3, w2, s1, s3, s2, fmt, limit, sh_w1, sh_w3,
      sh_w2, sh_s1, sh_s3, sh_s2):
    T = x.shape[0]
    return (torch.empty_like(x), x.new_empty(T, k, dtype=torch.float32), x.new_empty(T, k, dtype=torch.int64))


def _check_experts(op, x, w1, w3, w2, s1, s3, s2, fmt, shared):
    d = x.shape[1]
    check_choice(op, "fmt", fmt, ("dense", "fp8", "mxfp4"))
    if w1.dim() != 3:
        raise ValueError(f"deepfuse: {op}: w1 must be [E, I, {'d/2' if fmt == 'mxfp4' else 'd'}], got {list(w1.shape)}")
    E, I = w1.shape[0], w1.shape[1]
    if E < 1:
        raise ValueError(f"deepfuse: {op}: w1 has no experts (shape {list(w1.shape)})")
    for name, w, s, (N, K) in (("w1", w1, s1, (I, d)), ("w3", w3, s3, (I, d)), ("w2", w2, s2, (d, I))):
        if w.dim() != 3 or w.shape[0] != E:
            raise ValueError(f"deepfuse: {op}: {name} must be [{E}, ...], got {list(w.shape)}")
        check_weight(op, w[0], None if s is None else s[0], fmt, N, K, name=f"{name}[e]")
        if s is not None and fmt != "dense" and s.shape[0] != E:
            raise ValueError(f"deepfuse: {op}: {name} scale must have {E} experts, got {list(s.shape)}")
        if w.device != x.device:
            raise ValueError(f"deepfuse: {op}: {name} is on {w.device}, x on {x.device}")


def _shared_args(op, x, shared):
    """shared (w1, w3, w2, s1, s3, s2) checked -> the six op arguments (scales None when dense)."""
    d = x.shape[1]
    sh = (None,) * 6
    if shared is not None:
        if len(shared) != 6:
            raise ValueError(f"deepfuse: {op}: shared must be (w1, w3, w2, s1, s3, s2), got {len(shared)} items")
        sw1, sw3, sw2, ss1, ss3, ss2 = shared
        Is = sw1.shape[0] if sw1.dim() == 2 else -1
        sfmt = _weight_fmt(sw1)
        for name, w, s, (N, K) in (("shared w1", sw1, ss1, (Is, d)), ("shared w3", sw3, ss3, (Is, d)),
                                   ("shared w2", sw2, ss2, (d, Is))):
            check_weight(op, w, s if sfmt == "fp8" else None, sfmt, N, K, name=name)
            if w.device != x.device:
                raise ValueError(f"deepfuse: {op}: {name} is on {w.device}, x on {x.device}")
        sh = (sw1, sw3, sw2) + ((ss1, ss3, ss2) if sfmt == "fp8" else (None, None, None))
    return sh


# ----------------------------------------------------------------------------- public API
def moe_route(logits: torch.Tensor, k: int, *, bias: Optional[torch.Tensor] = None, route_scale: float = 1.0,
              score_func: str = "sqrtsoftplus", hash_ids: Optional[torch.Tensor] = None):
    """Router: logits [T, E] -> (weights fp32 [T, k], expert ids int64 [T, k])."""
    op = "moe_route"
    check_tensor(op, "logits", logits, dtypes=_FLOATS, ndim=2)
    T, E = logits.shape
    check_int(op, "k", k, lo=1, hi=E)
    check_choice(op, "score_func", score_func, SCORE_FUNCS)
    if bias is not None:
        check_tensor(op, "bias", bias, dtypes=_FLOATS, shape=(E,), device=logits.device)
    if hash_ids is not None:
        check_tensor(op, "hash_ids", hash_ids, dtypes=(torch.int32, torch.int64), shape=(T, k), device=logits.device)
    return torch.ops.deepfuse.moe_route(logits, bias, k, float(route_scale), score_func, hash_ids)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) (no clamps when limit <= 0)."""
    op = "swiglu"
    check_tensor(op, "gate", gate, dtypes=_FLOATS)
    check_tensor(op, "up", up, dtypes=(gate.dtype,), shape=tuple(gate.shape), device=gate.device)
    return torch.ops.deepfuse.swiglu(gate, up, float(limit))


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
                w2: torch.Tensor, *, s1=None, s3=None, s2=None, fmt: str = "dense", limit: float = 0.0,
                shared: Optional[tuple] = None):
    """Routed experts: x [T, d], ids/weights [T, k] -> sum of weighted expert outputs [T, d].

    shared = (w1 [I, d], w3 [I, d], w2 [d, I], s1, s3, s2): a shared expert every token takes with
    weight 1 (fp8 block-scaled, or dense with scales None); on the GPU it runs as one more
    expert inside the fused kernels."""
    op = "moe_experts"
    check_tensor(op, "x", x, dtypes=_FLOATS, ndim=2)
    T, d = x.shape
    check_tensor(op, "ids", ids, dtypes=(torch.int32, torch.int64), ndim=2, device=x.device)
    k = ids.shape[1]
    check_tensor(op, "ids", ids, shape=(T, k))
    check_tensor(op, "weights", weights, dtypes=_FLOATS, shape=(T, k), device=x.device)
    _check_experts(op, x, w1, w3, w2, s1, s3, s2, fmt, shared)
    scales = (s1, s3, s2) if fmt != "dense" else (None, None, None)
    sh = _shared_args(op, x, shared)
    return torch.ops.deepfuse.moe_experts(x, ids, weights, w1, w3, w2, *scales, fmt, float(limit), *sh)


def moe_gate_experts(x: torch.Tensor, gate_weight: torch.Tensor, k: int, w1: torch.Tensor, w3: torch.Tensor,
                     w2: torch.Tensor, *, bias: Optional[torch.Tensor] = None, route_scale: float = 1.0,
                     score_func: str = "sqrtsoftplus", hash_ids: Optional[torch.Tensor] = None, s1=None, s3=None,
                     s2=None, fmt: str = "dense", limit: float = 0.0, shared: Optional[tuple] = None):
    """Router + routed experts: logits = x gate_weight^T (fp32, gate_weight [E, d]), then moe_route
    (k, bias, route_scale, score_func, hash_ids) and moe_experts (the same arguments as there)
    -> (out [T, d] of x's dtype, weights fp32 [T, k], ids int64 [T, k]). On CUDA at T <=
    GATE_FUSED_MAX_T the router runs fused into the experts' launches."""
    op = "moe_gate_experts"
    check_tensor(op, "x", x, dtypes=_FLOATS, ndim=2)
    T, d = x.shape
    check_tensor(op, "gate_weight", gate_weight, dtypes=_FLOATS, ndim=2, device=x.device)
    E = gate_weight.shape[0]
    check_tensor(op, "gate_weight", gate_weight, shape=(E, d))
    check_int(op, "k", k, lo=1, hi=E)
    check_choice(op, "score_func", score_func, SCORE_FUNCS)
    if bias is not None:
        check_tensor(op, "bias", bias, dtypes=_FLOATS, shape=(E,), device=x.device)
    if hash_ids is not None:
        check_tensor(op, "hash_ids", hash_ids, dtypes=(torch.int32, torch.int64), shape=(T, k), device=x.device)
    if w1.dim() != 3 or w1.shape[0] != E:
        raise ValueError(f"deepfuse: {op}: w1 must be [{E}, ...] (the gate's experts), got {list(w1.shape)}")
    _check_experts(op, x, w1, w3, w2, s1, s3, s2, fmt, shared)
    scales = (s1, s3, s2) if fmt != "dense" else (None, None, None)
    sh = _shared_args(op, x, shared)
    return torch.ops.deepfuse.moe_gate_experts(x, gate_weight, bias, k, float(route_scale), score_func, hash_ids, w1,
                                               w3, w2, *scales, fmt, float(limit), *sh)
