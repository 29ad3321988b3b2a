"""Tiny random Kimi Linear checkpoints written by transformers' own `save_pretrained` (the oracle): every layer
kind (KDA + dense MLP, KDA + MoE, MLA + MoE), every weight random (norms, convolutions, the decay parameters
at the spread fla's init gives them, the expert bias)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM

SHAPE = dict(
    vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
    v_head_dim=12, qk_nope_head_dim=16, num_experts=8, num_experts_per_token=3, num_expert_group=2, topk_group=1,
    first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    linear_attn_config={"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4,
                        "kda_layers": [1, 2, 4], "full_attn_layers": [3]},
)  # fmt: skip


def kimi_model(seed: int = 0, **overrides) -> KimiLinearForCausalLM:  # noqa: ANN003
    torch.manual_seed(seed)
    model = KimiLinearForCausalLM(KimiLinearConfig(**{**SHAPE, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            elif name.endswith("dt_bias"):
                p.uniform_(math.log(1e-3), math.log(1e-1))
            elif "conv1d" in name:
                p.normal_(0, 0.3)
            elif "experts" in name or name.endswith("gate.weight"):
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return model


@pytest.fixture(scope="session")
def kimi_folder(tmp_path_factory):  # noqa: ANN001, ANN201
    """A folder transformers wrote (its names: dense MLPs under block_sparse_moe.)."""
    path = tmp_path_factory.mktemp("kimi_linear")
    kimi_model().save_pretrained(path)
    return path
