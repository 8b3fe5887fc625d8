"""Random V4 models built straight on the device (no checkpoint): benchmark models at full
V4-Flash / V4-Pro widths with a chosen number of layers.

    from deepfuse.models import random as rnd
    cfg = rnd.flash_config(layers=["sliding_attention", "compressed_sparse_attention",
                                   "heavily_compressed_attention", "compressed_sparse_attention"])
    model = rnd.build(cfg, device="cuda", dtype=torch.bfloat16, quant="fp8")   # or "mxfp4" experts

Values come from models.tiny's initialiser (activations stay O(1)); linears other than the ones V4
keeps in bf16 are FP8 with 128 x 128 UE8M0 block scales, routed experts FP8 or MXFP4, as in
the released checkpoints. Weights are generated and quantised one tensor (one expert) at a
time on the device, so host memory stays small.
"""
from __future__ import annotations

from typing import Optional

import torch

from .config import CSA, HCA, SWA, V4Config
from .linear import Linear, slots
from .model import V4Model
from .moe import Experts
from .tiny import _DENSE_ONLY, _init



def flash_config(layers: Optional[list[str]] = None, *, pro: bool = False, **overrides) -> V4Config:
    """V4-Flash (or V4-Pro) widths with the given layer kinds (default: one of each kind and
    a second CSA, the first layer hash-routed) and one sliding-window MTP layer."""
    layers = layers or [SWA, CSA, HCA, CSA]
    d = dict(vocab_size=129280, hidden_size=7168 if pro else 4096, num_attention_heads=128 if pro else 64,
             n_routed_experts=384 if pro else 256, moe_intermediate_size=3072 if pro else 2048,
             num_experts_per_tok=6, q_lora_rank=1536 if pro else 1024, o_groups=16 if pro else 8)
    ratio = {SWA: 0, CSA: 4, HCA: 128}
    cfg = {"model_type": "deepseek_v4", "num_hidden_layers": len(layers), "head_dim": 512, "qk_rope_head_dim": 64,
           "compress_ratios": [ratio[t] for t in layers] + [0], "num_hash_layers": 1, "num_nextn_predict_layers": 1,
           "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                            "beta_fast": 32, "beta_slow": 1}, **d, **overrides}
    return V4Config.from_dict(cfg)


def _quantise(w: torch.Tensor, fmt: str):
    from deepfuse import ops

    if fmt == "fp8":
        q, s = ops.fp8_block_cast(w.float().contiguous(), (128, 128), scale_fmt="ue8m0")
        return q, s
    q, s = ops.mxfp4_cast(w.float())
    return q, s


@torch.no_grad()
def build(cfg: V4Config, *, device="cuda", dtype=torch.bfloat16, quant: Optional[str] = "fp8",
          expert_quant: Optional[str] = None, seed: int = 0) -> V4Model:
    """A random V4Model on `device`: quant "fp8" (FP8 block-scaled linears) or None (dense);
    expert_quant: "fp8" / "mxfp4" / None (default: quant)."""
    if quant not in (None, "fp8") or expert_quant not in (None, "fp8", "mxfp4"):
        raise ValueError(f"deepfuse: random.build: quant must be None / 'fp8', expert_quant None / 'fp8' / "
                         f"'mxfp4', got {quant!r}, {expert_quant!r}")
    expert_quant = expert_quant or quant
    device = torch.device(device)
    model = V4Model(cfg)
    model.dtype = dtype
    g = torch.Generator(device=device).manual_seed(seed)
    fill(model, cfg, g, device=device, dtype=dtype, quant=quant, expert_quant=expert_quant, dense_only=_DENSE_ONLY)
    check_filled(model, "random.build")
    return model.eval()


def fill(model, cfg, g: torch.Generator, *, device, dtype, quant: Optional[str], expert_quant: Optional[str],
         dense_only, visit=None) -> None:
    """Random values for every slot, Linear and Experts bank of `model` (models.tiny's init):
    linears FP8 block-scaled (quant "fp8") except those ending in `dense_only`, or dense;
    experts `expert_quant` ("fp8" / "mxfp4" / None: dense). `visit(prefix, module)` gets every
    other module (a model's own kinds of weights)."""
    for prefix, mod in model.named_modules():
        dot = prefix + "." if prefix else ""
        for name, kind in slots(mod).items():
            t = _init(dot + name, tuple(getattr(mod, name).shape), kind, g, cfg)
            setattr(mod, name, t.to(dtype) if kind == "act" else t)
        if isinstance(mod, Linear):
            w = _init(prefix + ".weight", (mod.out_features, mod.in_features), "act", g, cfg)
            if quant is None or any(prefix.endswith(s) for s in dense_only):
                mod.set_weight(w.to(dtype))
            else:
                mod.set_weight(*_quantise(w, "fp8"), "fp8")
        elif isinstance(mod, Experts):
            ws, ss = {}, {}
            for pname in ("w1", "w3", "w2"):
                N, K = mod.proj_shape(pname)
                parts, scales = [], []
                for _ in range(mod.num_experts):
                    w = torch.randn(N, K, generator=g, device=device) * K ** -0.5
                    if expert_quant is None:
                        parts.append(w.to(dtype))
                    else:
                        q, s = _quantise(w, expert_quant)
                        parts.append(q)
                        scales.append(s)
                ws[pname] = torch.stack(parts)
                if scales:
                    ss[pname] = torch.stack(scales)
            mod.set_weights(ws, ss, expert_quant or "dense")
        elif visit is not None:
            visit(prefix, mod)


def check_filled(model, who: str) -> None:
    for name, t in model.named_buffers():
        if t.is_meta:
            raise RuntimeError(f"deepfuse: {who} left {name} unset")
