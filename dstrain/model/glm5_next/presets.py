"""GLM-5.3-Flash presets: `tiny-glm5-next` for the tests and the docs, and the published shape (transformers'
Glm5NextTextConfig defaults: 45 layers, KDA:DSA 3:1, 288 routed experts, one MTP layer)."""

from __future__ import annotations

from ..common.config import DEEPSEEK_V3_VOCAB
from .config import DSA, KDA, Glm5NextConfig

PRESETS: dict[str, Glm5NextConfig] = {
    # every layer kind in 4 layers (KDA + dense, DSA full + MoE, DSA shared + MoE, KDA + MoE) and an MTP
    # layer, the real vocabulary size of the DeepSeek-V3 tokenizer the tiny presets share
    "tiny-glm5-next": Glm5NextConfig(
        vocab_size=DEEPSEEK_V3_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_topk=16,
        index_head_dim=16,
        index_n_heads=4,
        index_kpool=4,
        linear_head_dim=16,
        linear_num_heads=4,
        hc_mult=2,
        hc_sinkhorn_iters=5,
        layer_types=[KDA, DSA, DSA, KDA],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        indexer_types=["full", "full", "shared", "full"],
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    ),
    "glm-5.3-flash": Glm5NextConfig(),
}
