"""Parameter and FLOP counts of Kimi Linear from a config alone (the published shapes are never instantiated)."""

from __future__ import annotations

from ..common.counts import lm_param_counts
from ..common.mla import mla_params
from .config import KimiLinearConfig


def _kda_params(cfg: KimiLinearConfig) -> int:
    """q, k, v, o projections, three short convolutions, the forget gate (two low-rank factors, A_log, dt_bias),
    beta, the output gate's two factors and the gated norm."""
    d, h, dk = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim
    inner = h * dk
    return (
        4 * d * inner
        + 3 * inner * cfg.linear_conv_kernel_dim
        + 2 * (d * dk + dk * inner)
        + h
        + inner
        + d * h
        + dk
    )


def _block_params(cfg: KimiLinearConfig, layer_idx: int) -> tuple[int, int]:
    d = cfg.hidden_size
    common = (_kda_params(cfg) if cfg.is_kda_layer(layer_idx) else mla_params(cfg)) + 2 * d
    if not cfg.is_moe_layer(layer_idx):
        ffn = 3 * d * cfg.intermediate_size
        return common + ffn, common + ffn
    expert = 3 * d * cfg.moe_intermediate_size
    fixed = common + cfg.n_shared_experts * expert + cfg.n_routed_experts * d
    return fixed + cfg.n_routed_experts * expert, fixed + cfg.num_experts_per_tok * expert


def param_counts(cfg: KimiLinearConfig, include_mtp: bool = True) -> dict[str, int]:
    """{"total", "active", "embedding"}, as `common.counts.lm_param_counts` counts them (no MTP layers)."""
    return lm_param_counts(cfg, _block_params, cfg.hidden_size, 0, include_mtp)


def flops_per_token(
    cfg: KimiLinearConfig, seq_len: int, include_mtp: bool = False, sparse: bool = True
) -> float:
    """Training FLOPs per token: 6 x active matmul parameters, plus causal attention in the MLA layers (6 x T/2
    x heads x (qk_head_dim + v_head_dim)) and KDA's state work in the KDA layers: per token and head, the
    state's read, decay and write (about 3 d_k d_v multiply-adds) and within its chunk of C the pairwise
    q.k and k.k decayed scores (2 C/2 d_k) and their products with values (C/2 d_v), times 6 for forward and
    backward."""
    from ..common.kda import CHUNK

    mla = sum(not cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers))
    kda = cfg.num_hidden_layers - mla
    attn = 6 * (seq_len / 2) * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * mla
    dk = cfg.linear_head_dim
    c = min(CHUNK, seq_len)
    state = 3 * dk * dk + c * dk + (c / 2) * dk
    return 6 * param_counts(cfg)["active"] + 6 * cfg.linear_num_heads * state * kda + attn
