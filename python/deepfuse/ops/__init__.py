"""Public ops. Each is a torch.library custom op (namespace `deepfuse`) with a CUDA kernel,
a CPU path (the pure-torch reference that defines its semantics) and a fake for tracing."""
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
from deepfuse.ops.topk import topk

__all__ = [
    "fp8_per_token_cast",
    "fp8_per_token_dequant",
    "mxfp8_cast",
    "mxfp8_dequant",
    "fp8_block_cast",
    "fp8_block_dequant",
    "pack_ue8m0",
    "unpack_ue8m0",
    "topk",
]
