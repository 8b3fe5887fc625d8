"""deepfuse: fused, ahead-of-time compiled kernels for DeepSeek V4-class inference."""
from deepfuse._version import __version__
from deepfuse._ext import has_cuda_kernels, built_archs
from deepfuse import ops

__all__ = ["__version__", "has_cuda_kernels", "built_archs", "ops"]
