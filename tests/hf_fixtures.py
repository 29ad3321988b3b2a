"""Tiny random Hugging Face DeepSeek checkpoints written by transformers itself, for parity tests."""

from __future__ import annotations

import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}


def v3_config(**overrides) -> DeepseekV3Config:
    kw = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        v_head_dim=12,
        qk_nope_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        max_position_embeddings=128,
        rope_parameters=dict(YARN),
    )
    kw.update(overrides)
    return DeepseekV3Config(**kw)


def v2_config(**overrides) -> DeepseekV2Config:
    kw = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        v_head_dim=12,
        qk_nope_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=2,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.5,
        first_k_dense_replace=1,
        max_position_embeddings=128,
        rope_parameters=dict(YARN),
    )
    kw.update(overrides)
    return DeepseekV2Config(**kw)


def make_hf_model(config, seed: int = 0, random_bias: bool = True):
    """A transformers DeepSeek model with every weight random (norms and expert bias too)."""
    torch.manual_seed(seed)
    cls = DeepseekV3ForCausalLM if config.model_type == "deepseek_v3" else DeepseekV2ForCausalLM
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "experts" in name or name.endswith("gate.weight"):
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias") and random_bias:
                b.copy_(0.3 * torch.randn_like(b))
    return model
