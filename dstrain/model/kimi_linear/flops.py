"""Parameter and FLOP counts of Kimi Linear from a config alone (the published shapes are never instantiated)."""

from __future__ import annotations

from ..common.counts import ffn_params, lm_param_counts
from ..common.kda import kda_flops_per_token, kda_params
from ..common.mla import mla_params
from .config import KimiLinearConfig


def _block_params(cfg: KimiLinearConfig, layer_idx: int) -> tuple[int, int]:
    d = cfg.hidden_size
    common = (kda_params(cfg) if cfg.is_kda_layer(layer_idx) else mla_params(cfg)) + 2 * d
    total, active = ffn_params(cfg, cfg.is_moe_layer(layer_idx), cfg.n_shared_experts)
    return common + total, common + active


def param_counts(cfg: KimiLinearConfig, include_mtp: bool = True) -> dict[str, int]:
    """{"total", "active", "embedding"}, as `common.counts.lm_param_counts` counts them (no MTP layers)."""
    return lm_param_counts(cfg, _block_params, cfg.hidden_size, 0, include_mtp)


def flops_per_token(
    cfg: KimiLinearConfig, seq_len: int, include_mtp: bool = False, sparse: bool = True
) -> float:
    """Training FLOPs per token: 6 x active matmul parameters, plus causal attention in the MLA layers (6 x T/2
    x heads x (qk_head_dim + v_head_dim)) and KDA's state work in the KDA layers (common.kda.kda_flops_per_token)."""
    mla = sum(not cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers))
    kda = cfg.num_hidden_layers - mla
    attn = 6 * (seq_len / 2) * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * mla
    return 6 * param_counts(cfg)["active"] + kda_flops_per_token(cfg, seq_len) * kda + attn
