"""Tiny random DeepSeek-V4 models written by transformers itself: the parity oracle for dstrain's V4."""

from __future__ import annotations

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

# Every attention kind (sliding, CSA with top-k below the compressed length, HCA), a hash layer, hc_mult 2,
# a window shorter than the rows the tests run (T ~ 37-40: not a multiple of 4 or 8), >= 8 indexer heads
# (relu makes all of 2^-H heads zero on an entry: fewer heads tie at the top-k boundary).
V4_SHAPE = dict(
    vocab_size=64,
    hidden_size=32,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    head_dim=16,
    q_lora_rank=12,
    qk_rope_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    o_groups=2,
    o_lora_rank=8,
    index_n_heads=8,
    index_head_dim=8,
    index_topk=3,
    sliding_window=6,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    num_hash_layers=1,
    hc_mult=2,
    max_position_embeddings=1024,
    rope_scaling={
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)


def v4_config(**overrides) -> DeepseekV4Config:
    return DeepseekV4Config(**{**V4_SHAPE, **overrides})


@torch.no_grad()
def randomize_v4(model: DeepseekV4ForCausalLM, seed: int = 0, std: float = 0.2) -> DeepseekV4ForCausalLM:
    """Every parameter N(0, std) (norm weights 1 + N(0, std)); the buffers transformers initialises to a
    constant drawn too: `tid2eid` distinct random experts per token, `e_score_correction_bias` random. The HC
    weights `fn` keep a small scale (Sinkhorn's 20 iterations converge at init-like scales only)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g) * std
        if name.endswith("norm.weight"):
            p.copy_(1 + noise)
        elif name.endswith(".fn") or name.endswith("hc_fn"):
            p.copy_(noise * 0.1)
        else:
            p.copy_(noise)
    cfg = model.config
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            rows = [
                torch.randperm(cfg.n_routed_experts, generator=g)[: b.shape[1]] for _ in range(b.shape[0])
            ]
            b.copy_(torch.stack(rows))
        elif name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


def tiny_v4(seed: int = 0, **overrides) -> DeepseekV4ForCausalLM:
    """A randomised fp32 transformers V4 model of `V4_SHAPE` (with overrides), in eval mode."""
    torch.manual_seed(seed)
    return randomize_v4(DeepseekV4ForCausalLM(v4_config(**overrides)), seed).eval()
