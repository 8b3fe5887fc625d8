"""Public ops. Each is a torch.library custom op (namespace `deepfuse`) with a CUDA kernel,
a CPU path (the pure-torch reference that defines its semantics) and a fake for tracing.

On CUDA no op runs its torch reference silently: a call its kernel cannot serve raises
NoKernelError naming the argument, unless the reference is allowed (allow_reference(), or a
model's own choice); allowed calls warn once per op and are counted (reference_calls()).
See ops/_fallback.py. swiglu has no kernel by design (elementwise torch on every device).
"""
from deepfuse.ops._fallback import (
    NoKernelError,
    ReferenceWarning,
    allow_reference,
    reference_calls,
    reset_reference_calls,
)
from deepfuse.ops.cast import (
    fp8_block_cast,
    fp8_block_dequant,
    fp8_per_token_cast,
    fp8_per_token_dequant,
    mxfp8_cast,
    mxfp8_dequant,
    pack_ue8m0,
    unpack_ue8m0,
)
from deepfuse.ops.topk import topk, topk_slots
from deepfuse.ops.kvcache import (
    indexer_key_dequant,
    indexer_key_store,
    kv_dequant,
    kv_store,
    swa_store,
    window_gather,
    window_restore,
)

from deepfuse.ops.attention import sparse_attention, sparse_attention_paged
from deepfuse.ops.compressor import compress_pool, compress_store, state_store
from deepfuse.ops.indexer import indexer_logits_paged, indexer_scores
from deepfuse.ops.linear import (grouped_linear, grouped_linear_mx, mxfp4_cast, mxfp4_dequant, quant_linear,
                                 set_activation_quant)
from deepfuse.ops.mhc import hc_head, hc_post, hc_pre
from deepfuse.ops.moe import moe_experts, moe_route, swiglu
from deepfuse.ops.kvcache import RowTarget
from deepfuse.ops.norm import norm_rope, norm_rope_store, rms_norm
from deepfuse.ops.rope import rope
from deepfuse.ops.engram import engram_gate, engram_hash, engram_lookup

__all__ = [
    "allow_reference",
    "reference_calls",
    "reset_reference_calls",
    "NoKernelError",
    "ReferenceWarning",
    "fp8_per_token_cast",
    "fp8_per_token_dequant",
    "mxfp8_cast",
    "mxfp8_dequant",
    "fp8_block_cast",
    "fp8_block_dequant",
    "pack_ue8m0",
    "unpack_ue8m0",
    "topk",
    "kv_store",
    "swa_store",
    "indexer_key_store",
    "window_gather",
    "window_restore",
    "kv_dequant",
    "indexer_key_dequant",
    # model-graph ops
    "rms_norm",
    "rope",
    "norm_rope",
    "norm_rope_store",
    "RowTarget",
    "topk_slots",
    "hc_pre",
    "hc_post",
    "hc_head",
    "sparse_attention",
    "sparse_attention_paged",
    "indexer_scores",
    "compress_pool",
    "compress_store",
    "state_store",
    "indexer_logits_paged",
    "quant_linear",
    "set_activation_quant",
    "grouped_linear",
    "grouped_linear_mx",
    "mxfp4_cast",
    "mxfp4_dequant",
    "moe_route",
    "moe_experts",
    "swiglu",
]
