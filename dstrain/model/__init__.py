"""DeepSeek-V3/V2 model: plain single-device PyTorch (no torch.distributed here; see dstrain.parallel)."""

from .config import ModelConfig
from .flops import flops_per_token, param_counts
from .loading import build_model, from_pretrained, parse_dtype, save_pretrained
from .model import DeepSeekLM, ModelOutput, combine_losses, kernel_paths
from .presets import PRESETS, get_config
from .v4_config import V4Config

__all__ = [
    "PRESETS",
    "DeepSeekLM",
    "ModelConfig",
    "ModelOutput",
    "V4Config",
    "build_model",
    "combine_losses",
    "flops_per_token",
    "from_pretrained",
    "get_config",
    "kernel_paths",
    "param_counts",
    "parse_dtype",
    "save_pretrained",
]
