"""The DeepSeek-V3 family: DeepSeek-V2, V2-Lite, V3/R1, V3.2 and GLM-5 (DeepSeek Sparse Attention), Kimi-K2 and
Kimi-K2.5's text model. config.py (variants by model_type), presets.py, attention.py (MLA, V3.2's indexer),
model.py, state_dict.py (the Hugging Face key table), flops.py."""

from ..common.family import Family
from ..common.layers import is_expert_bias
from . import flops
from .config import VARIANTS, ModelConfig
from .model import DeepSeekLM
from .presets import PRESETS, RELEASE_QUANTIZATION
from .state_dict import dstrain_to_hf, open_v3, tensors_beside, to_hf, write_hf_config

FAMILY = Family(
    name="deepseek_v3",
    config=ModelConfig,
    model=DeepSeekLM,
    model_types=tuple(VARIANTS),
    presets=PRESETS,
    open_folder=open_v3,
    to_hf=to_hf,
    write_config=write_hf_config,
    keeps_fp32=is_expert_bias,
    param_counts=flops.param_counts,
    flops_per_token=flops.flops_per_token,
    checkpointing=DeepSeekLM.CHECKPOINTING,
    copied_tensors=tensors_beside,
    # MLA's up-projections and output, the shared experts' linears (the MTP blocks' too)
    lora_targets=("q_b_proj", "kv_b_proj", "o_proj", "shared_experts"),
    release_quantization=RELEASE_QUANTIZATION,
    peft_keys=dstrain_to_hf,  # transformers' DeepseekV3 names its tensors as the checkpoints do
)

__all__ = ["FAMILY", "DeepSeekLM", "ModelConfig"]
