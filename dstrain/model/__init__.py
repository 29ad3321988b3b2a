"""The models dstrain trains, as plain single-device PyTorch (no torch.distributed here; see dstrain.parallel):
one folder per family (deepseek_v3: DeepSeek-V2/V3/V3.2, GLM-5, Kimi-K2; deepseek_v4), the layers they share
(common/), the Hugging Face checkpoint format (hf/), where weights come from (sources.py) and the registry that
picks a family (registry.py)."""

from .build import build_model, from_pretrained, parse_dtype, save_pretrained
from .common.loss import combine_losses
from .common.output import ModelOutput, kernel_paths
from .deepseek_v3 import DeepSeekLM, ModelConfig
from .deepseek_v4 import DeepSeekV4LM, V4Config
from .registry import PRESETS, family_of, flops_per_token, get_config, param_counts

__all__ = [
    "PRESETS",
    "DeepSeekLM",
    "DeepSeekV4LM",
    "ModelConfig",
    "ModelOutput",
    "V4Config",
    "build_model",
    "combine_losses",
    "family_of",
    "flops_per_token",
    "from_pretrained",
    "get_config",
    "kernel_paths",
    "param_counts",
    "parse_dtype",
    "save_pretrained",
]
