"""The DeepSeek-V3 family's presets: a CPU-sized model with every feature (and one with sparse attention), one for
a GPU, and the published shapes (for planning and FLOP counts)."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..common.config import DEEPSEEK_V3_VOCAB
from .config import ModelConfig


def _deepseek_v3(**kw: Any) -> ModelConfig:
    base = dict(
        model_type="deepseek_v3",
        vocab_size=DEEPSEEK_V3_VOCAB,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        first_k_dense_replace=3,
        max_position_embeddings=163840,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        num_nextn_predict_layers=1,
    )
    base.update(kw)
    return ModelConfig(**base)


def _deepseek_v2(**kw: Any) -> ModelConfig:
    base = dict(
        model_type="deepseek_v2",
        vocab_size=102400,
        hidden_size=5120,
        intermediate_size=12288,
        moe_intermediate_size=1536,
        num_hidden_layers=60,
        num_attention_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=160,
        n_shared_experts=2,
        num_experts_per_tok=6,
        n_group=8,
        topk_group=3,
        topk_method="group_limited_greedy",
        scoring_func="softmax",
        norm_topk_prob=False,
        routed_scaling_factor=16.0,
        first_k_dense_replace=1,
        max_position_embeddings=163840,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
        num_nextn_predict_layers=0,
        bos_token_id=100000,
        eos_token_id=100001,
    )
    base.update(kw)
    return ModelConfig(**base)


# Trains on a CPU in seconds; the real DeepSeek-V3 vocabulary so the shipped tokenizer works unchanged.
_TINY = ModelConfig(
    vocab_size=DEEPSEEK_V3_VOCAB,
    hidden_size=64,
    intermediate_size=192,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    num_nextn_predict_layers=1,
)
PRESETS: dict[str, ModelConfig] = {
    "tiny": _TINY,
    # ~100M parameters in all (about a third active per token).
    "small": ModelConfig(
        vocab_size=DEEPSEEK_V3_VOCAB,
        hidden_size=384,
        intermediate_size=1024,
        moe_intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=6,
        q_lora_rank=192,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        num_nextn_predict_layers=1,
    ),
    "deepseek-v2-lite": _deepseek_v2(
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        q_lora_rank=None,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
        routed_scaling_factor=1.0,
    ),
    "deepseek-v2": _deepseek_v2(),
    "deepseek-v3": _deepseek_v3(),
    # the text model of moonshotai/Kimi-K2.5 (a Kimi-K2: DeepSeek-V3's architecture, 384 experts, 64 heads,
    # 256K context; 1T parameters, 32B active)
    "kimi-k2.5": _deepseek_v3(
        vocab_size=163840,
        num_attention_heads=64,
        n_routed_experts=384,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.827,
        first_k_dense_replace=1,
        max_position_embeddings=262144,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        num_nextn_predict_layers=0,
        bos_token_id=163584,
        eos_token_id=163585,
        pad_token_id=163839,
    ),
    # V3 with DeepSeek Sparse Attention (deepseek-ai/DeepSeek-V3.2's config.json)
    "deepseek-v3.2": _deepseek_v3(
        model_type="deepseek_v32", index_topk=2048, index_n_heads=64, index_head_dim=128
    ),
    # zai-org/GLM-5's config.json (every layer with its own indexer)
    "glm-5": ModelConfig(
        model_type="glm_moe_dsa",
        vocab_size=154880,
        hidden_size=6144,
        intermediate_size=12288,
        moe_intermediate_size=2048,
        num_hidden_layers=78,
        num_attention_heads=64,
        q_lora_rank=2048,
        kv_lora_rank=512,
        qk_nope_head_dim=192,
        qk_rope_head_dim=64,
        v_head_dim=256,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=3,
        max_position_embeddings=202752,
        rms_norm_eps=1e-5,
        rope_theta=1000000.0,
        num_nextn_predict_layers=1,
        index_topk=2048,
        index_n_heads=32,
        index_head_dim=128,
        indexer_rope_interleave=True,
        eos_token_id=154820,
        pad_token_id=154820,
    ),
    # `tiny` with sparse attention: each query attends 16 keys (the default rows of 64 tokens are longer); 16
    # indexer heads, so that index scores rarely tie exactly (where top-k's choice is arbitrary in transformers)
    "tiny-dsa": dataclasses.replace(
        _TINY, model_type="deepseek_v32", index_topk=16, index_n_heads=16, index_head_dim=16
    ),
}

# DeepSeek's FP8 (deepseek-ai/DeepSeek-V3's config.json): e4m3 codes, one fp32 inverse scale per 128x128 block,
# on every linear of the decoder layers and MTP (the routers, the embedding, the head and the norms stay bf16)
_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# moonshotai/Kimi-K2.5's text_config: compressed-tensors INT4, symmetric groups of 32 columns, bf16 scales, on
# the routed experts only (attention, shared experts, the dense FFN and the head stay bf16)
_KIMI_INT4 = {
    "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                      "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32,
                                  "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                                  "symmetric": True, "type": "int"}}},
    "format": "pack-quantized", "kv_cache_scheme": None, "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}  # fmt: skip
# The quantization keys of the releases the presets describe (Family.release_quantization): DeepSeek-V3/R1 and
# V3.2 ship FP8, GLM-5 as zai-org/GLM-5-FP8 (DeepSeek's form), Kimi-K2.5 INT4 experts.
RELEASE_QUANTIZATION: dict[str, dict[str, Any]] = {
    "deepseek-v3": {"quantization_config": _FP8},
    "deepseek-v3.2": {"quantization_config": _FP8},
    "glm-5": {"quantization_config": _FP8},
    "kimi-k2.5": {"quantization_config": _KIMI_INT4},
}
