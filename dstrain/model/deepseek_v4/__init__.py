"""DeepSeek-V4: config.py (both config.json forms), presets.py, attention.py (sliding, CSA and HCA attention,
the CSA indexer), model.py (its mHC: common/mhc.py), state_dict.py (both key styles), flops.py."""

from ..common.family import Family
from . import flops
from .config import V4Config, tp_sizes
from .model import DeepSeekV4LM
from .presets import PRESETS, RELEASE_QUANTIZATION
from .state_dict import keeps_fp32, open_v4, peft_keys, to_hf, write_v4_config

FAMILY = Family(
    name="deepseek_v4",
    config=V4Config,
    model=DeepSeekV4LM,
    model_types=(V4Config.model_type,),
    presets=PRESETS,
    open_folder=open_v4,
    to_hf=to_hf,
    write_config=write_v4_config,
    keeps_fp32=keeps_fp32,
    param_counts=flops.param_counts,
    flops_per_token=flops.flops_per_token,
    checkpointing=DeepSeekV4LM.CHECKPOINTING,
    # V3's default, in V4's attention: the query up-projection (the CSA indexer's q_b_proj included), the one
    # key=value projection (the compressors' included), the grouped low-rank output, the shared experts
    lora_targets=("q_b_proj", "kv_proj", "o_a_proj", "o_b_proj", "shared_experts"),
    tp_sizes=tp_sizes,
    splits_heads=False,  # one shared key=value head: the queries' heads stay whole on every rank
    release_quantization=RELEASE_QUANTIZATION,
    peft_keys=peft_keys,
    serving_adapters=False,  # vLLM and SGLang define no DeepSeek-V4 LoRA yet: the form peft loads
)

__all__ = ["FAMILY", "DeepSeekV4LM", "V4Config"]
