"""Tiny random GLM-5.3-Flash checkpoints written by transformers' own `save_pretrained` (the oracle): the
multimodal folder (`text_config`, a one-block vision tower), every layer kind (KDA + dense MLP, DSA with its
own indexer + MoE, DSA sharing the previous layer's selection + MoE, KDA + MoE), every weight random (norms,
convolutions, the decay parameters, the mHC tensors, the k-pool compression, the expert bias)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

KDA, DSA = "linear_attention", "indexed_attention"
TEXT = dict(
    vocab_size=96, hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=0,
    qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1,
    index_topk=8, index_head_dim=16, index_n_heads=8, index_kpool=4, layer_types=[KDA, DSA, DSA, KDA],
    indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    linear_num_heads=2, linear_head_dim=16, hc_mult=4, hc_sinkhorn_iters=20, pad_token_id=0,
)  # fmt: skip
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=48,
              projection_intermediate_size=32, patch_size=2, spatial_merge_size=2, temporal_patch_size=1)  # fmt: skip


def glm_model(seed: int = 0, **text) -> Glm5NextForConditionalGeneration:  # noqa: ANN003
    torch.manual_seed(seed)
    cfg = Glm5NextConfig(text_config={**TEXT, **text}, vision_config=VISION)
    model = Glm5NextForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(("A_log", "hc.base", "compress_ape", "k_norm.bias")):
                p.normal_(0, 0.3)
            elif name.endswith("dt_bias"):
                p.uniform_(math.log(1e-3), math.log(1e-1))
            elif name.endswith("hc.scale"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(("hc.fn", "compress_gate")) or "conv1d" in name:
                p.normal_(0, 0.3)
            elif "experts" in name or name.endswith("gate.weight"):
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return model


@pytest.fixture(scope="session")
def glm_folder(tmp_path_factory):  # noqa: ANN001, ANN201
    """A multimodal folder transformers wrote (text model under model.language_model., vision under model.visual.)."""
    path = tmp_path_factory.mktemp("glm5_next")
    glm_model().save_pretrained(path)
    return path
