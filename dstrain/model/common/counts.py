"""The parameter count every family's causal LM shares: its blocks, the embedding and head, the MTP layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def lm_param_counts(
    cfg: Any, block: Callable[[Any, int], tuple[int, int]], top: int, mtp_extra: int, include_mtp: bool
) -> dict[str, int]:
    """{"total", "active", "embedding"}: `block(cfg, i)` -> (total, active) of block i (MTP blocks after the main
    ones), `top` the parameters outside blocks besides embedding and head (final norm, ...), `mtp_extra` each MTP
    layer's own (its projections and norms). `embedding` (a lookup, no FLOPs) is listed apart; the head's matmul
    is active even when tied, and each MTP layer runs the head again."""
    d, v = cfg.hidden_size, cfg.vocab_size
    total = active = top
    for i in range(cfg.num_hidden_layers):
        t, a = block(cfg, i)
        total, active = total + t, active + a
    head = 0 if cfg.tie_word_embeddings else v * d
    total, active = total + head, active + v * d
    if include_mtp:
        for k in range(cfg.num_nextn_predict_layers):
            t, a = block(cfg, cfg.num_hidden_layers + k)
            total, active = total + t + mtp_extra, active + a + mtp_extra + v * d
    return {"total": total + v * d, "active": active, "embedding": v * d}


def ffn_params(cfg: Any, moe: bool, shared_experts: int) -> tuple[int, int]:
    """(total, active per token) parameters of a block's SwiGLU feed-forward: dense (`intermediate_size`), or an
    MoE layer's routed experts (`num_experts_per_tok` of them active), its `shared_experts` and its router."""
    d = cfg.hidden_size
    if not moe:
        ffn = 3 * d * cfg.intermediate_size
        return ffn, ffn
    expert = 3 * d * cfg.moe_intermediate_size
    fixed = shared_experts * expert + cfg.n_routed_experts * d
    return fixed + cfg.n_routed_experts * expert, fixed + cfg.num_experts_per_tok * expert
