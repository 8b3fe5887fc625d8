"""deepfuse.models: the DeepSeek V4 model graph on deepfuse ops.

    from deepfuse import models
    model = models.load("/path/to/DeepSeek-V4-Flash", device="cuda", dtype=torch.bfloat16)
    logits = model(input_ids)                      # [B, T, vocab] fp32, one full forward
    # incremental decoding, batching and sampling: deepfuse.engine.LLM(model)
    model = models.tiny.load()                     # small random checkpoint, built on first use
"""
from . import tiny
from .config import ConfigError, RopeParams, V4Config
from .loader import CheckpointError, load
from .model import V4Model

__all__ = ["load", "tiny", "V4Config", "V4Model", "RopeParams", "ConfigError", "CheckpointError"]
