"""Kimi Linear presets: `tiny-kimi-linear` for the tests and the docs, and the published 48B-A3B shapes."""

from __future__ import annotations

from ..common.config import DEEPSEEK_V3_VOCAB
from .config import KDA, MLA, KimiLinearConfig

# Moonshot's Kimi-Linear-48B-A3B config.json (Base and Instruct share it): 27 layers, MLA at layers 4, 8, ...,
# 24 and 27 (1-indexed), KDA elsewhere.
KIMI_LINEAR_48B = {
    "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": 163840,
    "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 27, "num_attention_heads": 32,
    "num_key_value_heads": 32, "head_dim": 72, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "rope_scaling": None, "tie_word_embeddings": False, "model_max_length": 1048576, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
    "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024,
    "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 2.446,
    "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "num_nextn_predict_layers": 0, "bos_token_id": 163584, "eos_token_id": 163586,
    "pad_token_id": 163839,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
    },
}  # fmt: skip

PRESETS: dict[str, KimiLinearConfig] = {
    # every layer kind in 4 layers (KDA + dense, KDA + MoE, MLA + MoE, KDA + MoE), the real vocabulary size of
    # the DeepSeek-V3 tokenizer the tiny presets share (the byte tokenizer's ids fit too)
    "tiny-kimi-linear": KimiLinearConfig(
        vocab_size=DEEPSEEK_V3_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=2.446,
        linear_head_dim=16,
        linear_num_heads=4,
        layer_types=[KDA, KDA, MLA, KDA],
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    ),  # fmt: skip
    "kimi-linear-48b-a3b": KimiLinearConfig.from_hf_dict(KIMI_LINEAR_48B),
}
