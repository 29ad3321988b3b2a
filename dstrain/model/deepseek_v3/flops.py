"""Parameter and FLOP counts of the DeepSeek-V3 family from a config alone (the published shapes are never
instantiated)."""

from __future__ import annotations

from ..common.counts import ffn_params, lm_param_counts
from ..common.mla import mla_params
from .config import ModelConfig


def _indexer_params(cfg: ModelConfig) -> int:
    heads, dim = cfg.index_n_heads, cfg.index_head_dim
    return cfg.q_lora_rank * heads * dim + cfg.hidden_size * (dim + heads) + 2 * dim


def _block_params(cfg: ModelConfig, layer_idx: int) -> tuple[int, int]:
    """(total, active per token) parameters of one block."""
    d = cfg.hidden_size
    common = mla_params(cfg) + 2 * d
    if cfg.has_indexer(layer_idx):
        common += _indexer_params(cfg)
    total, active = ffn_params(cfg, cfg.is_moe_layer(layer_idx), cfg.n_shared_experts)
    return common + total, common + active


def param_counts(cfg: ModelConfig, include_mtp: bool = True) -> dict[str, int]:
    """Total and per-token active parameter counts; `embedding` (a lookup, no FLOPs) is listed apart. Each MTP
    layer adds enorm, hnorm, its final norm and eh_proj (2D x D) to its block."""
    d = cfg.hidden_size
    return lm_param_counts(cfg, _block_params, d, 3 * d + 2 * d * d, include_mtp)


def attended_keys(cfg: ModelConfig, seq_len: int, sparse: bool = True) -> float:
    """Keys a query attends to, averaged over the T positions of a row: T/2 causal; with sparse attention
    min(t, index_topk) for the query at t."""
    k = cfg.index_topk if sparse and cfg.sparse_attention else None
    if k is None or seq_len <= k:
        return seq_len / 2
    return (k * (k + 1) / 2 + (seq_len - k) * k) / seq_len


def flops_per_token(cfg: ModelConfig, seq_len: int, include_mtp: bool = False, sparse: bool = True) -> float:
    """Training FLOPs per token: 6 x active matmul parameters (embedding lookup excluded) plus attention,
    6 x keys x heads x (qk_head_dim + v_head_dim) per layer with `attended_keys` keys (the chosen ones under
    sparse attention, unless `sparse` is off: the dense warm-up), plus each lightning indexer's scores over
    every causal key, 6 x (T/2) x index heads x (index_head_dim + 1). MTP depth is excluded unless asked, like
    DeepSeek's published 250 GFLOPs/token for V3 at 4K."""
    layers = range(cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if include_mtp else 0))
    active = param_counts(cfg, include_mtp=include_mtp)["active"]
    keys = attended_keys(cfg, seq_len, sparse)
    attn = 6 * keys * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * len(layers)
    indexers = sum(cfg.has_indexer(i) for i in layers)
    index = 6 * (seq_len / 2) * cfg.index_n_heads * (cfg.index_head_dim + 1) * indexers
    return 6 * active + attn + index
