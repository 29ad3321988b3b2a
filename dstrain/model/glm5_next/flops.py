"""Parameter and FLOP counts of GLM-5.3-Flash from a config alone (the published shape is never instantiated)."""

from __future__ import annotations

from ..common.counts import ffn_params, lm_param_counts
from ..common.kda import kda_flops_per_token, kda_params
from ..common.mla import mla_params
from .config import Glm5NextConfig


def _indexer_params(cfg: Glm5NextConfig) -> int:
    """wq_b, wk, k_norm (weight and bias), weights_proj, the k-pool compression's position bias and gate."""
    d, hi, di = cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim
    return cfg.q_lora_rank * hi * di + d * di + 2 * di + d * hi + cfg.index_kpool * di + di * d


def _block_params(cfg: Glm5NextConfig, layer_idx: int) -> tuple[int, int]:
    """(total, active per token) of one block, as transformers' Glm5NextTextDecoderLayer has them (the expert
    bias is a buffer) plus, for MTP blocks, their own indexer."""
    d, n = cfg.hidden_size, cfg.hc_mult
    if cfg.is_kda_layer(layer_idx):
        attn = kda_params(cfg)
    else:
        attn = mla_params(cfg) + (_indexer_params(cfg) if cfg.has_indexer(layer_idx) else 0)
    mix = (2 + n) * n
    common = attn + 2 * (mix * n * d + mix + 3) + 2 * d  # + both mHC (fn, base, scale) and the two norms
    total, active = ffn_params(cfg, cfg.is_moe_layer(layer_idx), cfg.n_shared_experts)
    return common + total, common + active


def param_counts(cfg: Glm5NextConfig, include_mtp: bool = True) -> dict[str, int]:
    """{"total", "active", "embedding"} (common.counts.lm_param_counts): the final norm; each MTP layer adds
    eh_proj, enorm, hnorm and its head norm to its block. The vision tower is not counted."""
    d = cfg.hidden_size
    return lm_param_counts(cfg, _block_params, d, 2 * d * d + 3 * d, include_mtp)


def flops_per_token(
    cfg: Glm5NextConfig, seq_len: int, include_mtp: bool = False, sparse: bool = True
) -> float:
    """Training FLOPs per token: 6 x active matmul parameters; per DSA layer 6 x keys x heads x (qk_head_dim +
    v_head_dim) over the keys a query attends (causal: T/2 on average, with `sparse` at most index_topk +
    index_kpool / 2 of them), and per full indexer 6 x pools x index heads x (index_head_dim + 1) over the T/2
    / kpool pools a query scores; per KDA layer its state's read, decay and write and its chunks' pairwise
    scores (common.kda.kda_flops_per_token)."""
    layers = range(cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if include_mtp else 0))
    dense_keys = seq_len / 2
    keys = min(dense_keys, cfg.index_topk + cfg.index_kpool / 2) if sparse else dense_keys
    kda = kda_flops_per_token(cfg, seq_len)
    extra = 0.0
    for i in layers:
        if cfg.is_kda_layer(i):
            extra += kda
            continue
        extra += 6 * keys * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
        if cfg.has_indexer(i):
            extra += 6 * (dense_keys / cfg.index_kpool) * cfg.index_n_heads * (cfg.index_head_dim + 1)
    return 6 * param_counts(cfg, include_mtp=include_mtp)["active"] + extra
