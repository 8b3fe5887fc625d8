"""A random V4.1 model at any width (benchmarks and GPU tests): models.random's recipe applied
to a V4.1Model. Apart from models.v41 so that the graph module does not import the builders."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from deepfuse.ops import engram as E

from .random import check_filled, fill
from .tiny import _DENSE_ONLY_V41
from .v41 import EngramTable, V41Model
from .v41_config import V41Config


@torch.no_grad()
def random_model(cfg: V41Config, *, device="cuda", dtype=torch.bfloat16, quant: Optional[str] = "fp8",
                 expert_quant: Optional[str] = "mxfp4", seed: int = 0) -> V41Model:
    """A random V4.1 model built on `device` (models.random's recipe): linears FP8 with 128 x 128
    UE8M0 block scales (the kernels' format; the release's 32-blocks are dequantised at load) or
    dense (quant None), the released dense ones (_DENSE_ONLY_V41) in `dtype`; routed experts
    MXFP4 (the release's) / FP8 / dense; Engram tables random FP8 rows with UE8M0 scales placed
    by cfg.engram_placement ("host": pinned host memory when CUDA is present); the Engram token
    map id % 99092 (no tokenizer needed)."""
    if quant not in (None, "fp8") or expert_quant not in (None, "fp8", "mxfp4"):
        raise ValueError(f"deepfuse: v41_random.random_model: quant must be None / 'fp8', expert_quant None / 'fp8' / "
                         f"'mxfp4', got {quant!r}, {expert_quant!r}")
    device = torch.device(device)
    model = V41Model(cfg)
    model.dtype = dtype
    g = torch.Generator(device=device).manual_seed(seed)

    def engram(prefix, mod):
        if not isinstance(mod, EngramTable):
            return
        w = torch.empty(mod.rows, mod.dim, dtype=torch.float8_e4m3fn, device=device)
        s = torch.empty(mod.rows, mod.dim // E.SCALE_BLOCK, dtype=torch.uint8, device=device)
        for r0 in range(0, mod.rows, 1 << 20):  # bounded temporaries at large row counts
            r1 = min(mod.rows, r0 + (1 << 20))
            w[r0:r1] = (torch.randn(r1 - r0, mod.dim, generator=g, device=device) * 4).clamp(-448, 448).to(
                torch.float8_e4m3fn)
            s[r0:r1] = torch.randint(121, 126, (r1 - r0, mod.dim // E.SCALE_BLOCK), generator=g, device=device,
                                     dtype=torch.uint8)
        mod.place(w, s, device, cfg.engram_placement)

    fill(model, cfg, g, device=device, dtype=dtype, quant=quant, expert_quant=expert_quant,
         dense_only=_DENSE_ONLY_V41, visit=engram)
    C = cfg.engram_compressed_vocab_size
    model.set_token_map(np.arange(cfg.vocab_size, dtype=np.int64) % C, C)
    check_filled(model, "v41_random.random_model")
    return model.eval()
