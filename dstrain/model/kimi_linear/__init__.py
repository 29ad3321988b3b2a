"""Kimi Linear (Moonshot's `kimi_linear`): KDA layers (common/kda.py) interleaved with NoPE MLA, V3-style MoE.
config.py, presets.py, attention.py (NoPE MLA), model.py, state_dict.py (the key table), flops.py.

GLM-5.3-Flash (`glm5_next`) is a family of its own (`glm5_next/`), not a variant of this one: it shares KDA,
MLA and the MoE through common/, but its blocks carry V4's mHC streams, its MLA layers DSA over k-pools with
shared indexers, and it has MTP and a vision tower: a different block, key table and config.json."""

from ..common.family import Family, kda_hybrid_heads, kda_hybrid_sizes
from . import flops
from .config import KimiLinearConfig
from .model import KimiLinearLM
from .presets import PRESETS
from .state_dict import keeps_fp32, open_folder, peft_keys, to_hf, write_config

FAMILY = Family(
    name="kimi_linear",
    config=KimiLinearConfig,
    model=KimiLinearLM,
    model_types=(KimiLinearConfig.model_type,),
    presets=PRESETS,
    open_folder=open_folder,
    to_hf=to_hf,
    write_config=write_config,
    keeps_fp32=keeps_fp32,
    param_counts=flops.param_counts,
    flops_per_token=flops.flops_per_token,
    checkpointing=KimiLinearLM.CHECKPOINTING,
    tp_sizes=kda_hybrid_sizes,
    peft_keys=peft_keys,
    serving_adapters=False,  # no serving engine defines Kimi Linear LoRA yet: the form peft loads
    head_counts=kda_hybrid_heads,
    # KDA's q, k, v projections and MLA's (q_proj: no query compression) key/value up-projection, both
    # layers' output, the shared experts
    lora_targets=("q_proj", "k_proj", "v_proj", "kv_b_proj", "o_proj", "shared_experts"),
)

__all__ = ["FAMILY", "KimiLinearConfig", "KimiLinearLM"]
