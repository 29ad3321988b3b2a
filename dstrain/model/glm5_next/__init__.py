"""GLM-5.3-Flash (Zhipu's `glm5_next`), the text model: KDA layers interleaved 3:1 with DSA layers (NoPE MLA with
a lightning indexer over k-pools, selections shared across layers), DeepSeek-V4's mHC streams, V3-style MoE
with clamped SwiGLU, MTP. config.py, presets.py, indexer.py (the k-pool indexer), attention.py (the DSA layer),
model.py, state_dict.py (the key table; the vision tower copied through `copied_tensors`), flops.py.

Where its parts live: a folder of its own, as planned in kimi_linear/__init__.py, assembling shared parts —
KDA (common/kda.py, whose bounded forget gate is GLM's), MLA's projections (common/mla.py), the MoE, router and
balance loss (common/layers.py), DSA's stages, top-k and KL rule (common/dsa.py), the losses. Two parts are
GLM's own and stay here: the k-pool indexer (indexer.py) and the DSA layer. DeepSeek-V4's mHC moved to
common/mhc.py (a family imports no other family's modules: tests/test_imports.py)."""

from ..common.family import Family, kda_hybrid_heads, kda_hybrid_sizes
from . import flops
from .config import Glm5NextConfig
from .model import Glm5NextLM
from .presets import PRESETS
from .state_dict import keeps_fp32, open_folder, peft_keys, to_hf, vision_tensors, write_config

FAMILY = Family(
    name="glm5_next",
    config=Glm5NextConfig,
    model=Glm5NextLM,
    model_types=("glm5_next", "glm5_next_text"),
    presets=PRESETS,
    open_folder=open_folder,
    to_hf=to_hf,
    write_config=write_config,
    keeps_fp32=keeps_fp32,
    param_counts=flops.param_counts,
    flops_per_token=flops.flops_per_token,
    checkpointing=Glm5NextLM.CHECKPOINTING,
    copied_tensors=vision_tensors,
    peft_keys=peft_keys,
    serving_adapters=False,  # no serving engine defines GLM-5.3-Flash LoRA yet: the form peft loads
    tp_sizes=kda_hybrid_sizes,
    head_counts=kda_hybrid_heads,
    # KDA's q, k, v projections, MLA's query and key/value up-projections, both layers' output, the shared
    # experts (the MTP block's too)
    lora_targets=("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "o_proj", "shared_experts"),
)

__all__ = ["FAMILY", "Glm5NextConfig", "Glm5NextLM"]
