"""DeepSeek-V4's presets: the published Flash and Pro shapes (for planning and FLOP counts) and a CPU-sized model
with every attention kind."""

from __future__ import annotations

from typing import Any

from ..common.config import DEEPSEEK_V3_VOCAB
from .config import CSA, HCA, SLIDING, V4Config


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


PRESETS: dict[str, V4Config] = {
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

# deepseek-ai/DeepSeek-V4's config.json: FP8 e4m3 in 128x128 blocks with e8m0 (power-of-two) scales on the
# linears; Flash's routed experts FP4 e2m1 with an e8m0 scale per 32 columns (its `expert_dtype`; Pro's
# config.json has none: FP8 like the rest)
_V4_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
           "weight_block_size": [128, 128]}  # fmt: skip
RELEASE_QUANTIZATION: dict[str, dict[str, Any]] = {
    "deepseek-v4-flash": {"quantization_config": _V4_FP8, "expert_dtype": "fp4"},
    "deepseek-v4-pro": {"quantization_config": _V4_FP8},
}
