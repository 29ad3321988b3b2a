"""Presets: a CPU-sized model with every feature, one for a GPU, and the published shapes (for planning and
FLOP counts); `get_config` resolves a preset name, a Hugging Face folder or a config (ModelConfig, V4Config)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any

from .config import DEEPSEEK_V3_VOCAB, ModelConfig
from .v4_config import CSA, HCA, SLIDING, V4Config


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


def _deepseek_v4(**kw: Any) -> V4Config:
    """deepseek-ai/DeepSeek-V4-Flash's config.json; Pro's by the changes."""
    base = dict(
        vocab_size=DEEPSEEK_V3_VOCAB,
        hidden_size=4096,
        moe_intermediate_size=2048,
        num_hidden_layers=43,
        num_attention_heads=64,
        head_dim=512,
        q_lora_rank=1024,
        qk_rope_head_dim=64,
        n_routed_experts=256,
        num_experts_per_tok=6,
        routed_scaling_factor=1.5,
        rope_theta=10000,
        compress_rope_theta=160000,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        layer_types=[SLIDING, SLIDING] + [CSA, HCA] * 20 + [CSA],
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 40,
        mtp_layer_types=[SLIDING],
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        swiglu_limit=10.0,
        sliding_window=128,
        o_groups=8,
        o_lora_rank=1024,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        num_nextn_predict_layers=1,
        max_position_embeddings=1048576,
    )
    base.update(kw)
    return V4Config(**base)


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
PRESETS: dict[str, ModelConfig | V4Config] = {
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
    "deepseek-v4-flash": _deepseek_v4(),
    "deepseek-v4-pro": _deepseek_v4(
        hidden_size=7168,
        moe_intermediate_size=3072,
        num_hidden_layers=61,
        num_attention_heads=128,
        q_lora_rank=1536,
        n_routed_experts=384,
        routed_scaling_factor=2.5,
        layer_types=[HCA, HCA] + [CSA, HCA] * 29 + [CSA],
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 58,
        o_groups=16,
        index_topk=1024,
    ),
    # DeepSeek-V4 on a CPU: every attention type (sliding, CSA with top-k 4 of a row's 16 compressed entries at
    # 64 tokens, HCA at rate 16 so rows of 64 tokens have entries), a hash layer, 2 residual streams, MTP
    "tiny-v4": V4Config(
        vocab_size=DEEPSEEK_V3_VOCAB,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        n_routed_experts=8,
        num_experts_per_tok=2,
        layer_types=[SLIDING, CSA, HCA, CSA],
        compress_rates={CSA: 4, HCA: 16},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        hc_mult=2,
        sliding_window=16,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=8,
        index_head_dim=16,
        index_topk=4,
        num_nextn_predict_layers=1,
        max_position_embeddings=4096,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 256,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
}


def get_config(spec: str | os.PathLike | ModelConfig | V4Config) -> ModelConfig | V4Config:
    """A preset name, a Hugging Face checkpoint folder (its config.json: a V4Config for model_type
    deepseek_v4), or a ModelConfig or V4Config (returned as is)."""
    if isinstance(spec, (ModelConfig, V4Config)):
        return spec
    spec = str(spec)
    if spec in PRESETS:
        return copy.deepcopy(PRESETS[spec])
    if os.path.isdir(spec):
        return config_class(spec).from_folder(spec)
    raise ValueError(f"model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint folder")


def config_class(folder: str | os.PathLike) -> type[ModelConfig] | type[V4Config]:
    """The config class that reads a checkpoint folder's config.json (by its model_type)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return ModelConfig  # its from_folder says what is wrong
    return V4Config if model_type == V4Config.model_type else ModelConfig


def config_from_hf_dict(d: dict[str, Any]) -> ModelConfig | V4Config:
    """A config.json's dict read by the class of its model_type (a run checkpoint's own config.json)."""
    cls = V4Config if d.get("model_type") == V4Config.model_type else ModelConfig
    return cls.from_hf_dict(d)
