"""Parameter and FLOP counts from a config alone (the published shapes are never instantiated)."""

from __future__ import annotations

import os

from .config import ModelConfig
from .presets import get_config
from .v4_config import CSA, SLIDING, V4Config


def _attention_params(cfg: ModelConfig) -> int:
    d, h = cfg.hidden_size, cfg.num_attention_heads
    if cfg.q_lora_rank is None:
        q = d * h * cfg.qk_head_dim
    else:
        q = d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim
    kv = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    kv += cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv + h * cfg.v_head_dim * d


def _indexer_params(cfg: ModelConfig) -> int:
    heads, dim = cfg.index_n_heads, cfg.index_head_dim
    return cfg.q_lora_rank * heads * dim + cfg.hidden_size * (dim + heads) + 2 * dim


def _block_params(cfg: ModelConfig, layer_idx: int) -> tuple[int, int]:
    """(total, active per token) parameters of one block."""
    d = cfg.hidden_size
    common = _attention_params(cfg) + 2 * d
    if cfg.has_indexer(layer_idx):
        common += _indexer_params(cfg)
    if not cfg.is_moe_layer(layer_idx):
        ffn = 3 * d * cfg.intermediate_size
        return common + ffn, common + ffn
    expert = 3 * d * cfg.moe_intermediate_size
    shared = cfg.n_shared_experts * expert
    router = cfg.n_routed_experts * d
    total = common + shared + router + cfg.n_routed_experts * expert
    active = common + shared + router + cfg.num_experts_per_tok * expert
    return total, active


def param_counts(
    config: str | os.PathLike | ModelConfig | V4Config, include_mtp: bool = True
) -> dict[str, int]:
    """Total and per-token active parameter counts; `embedding` (a lookup, no FLOPs) is listed apart."""
    cfg = get_config(config)
    if isinstance(cfg, V4Config):
        return _v4_param_counts(cfg, include_mtp)
    d, v = cfg.hidden_size, cfg.vocab_size
    total = active = d  # final norm
    for i in range(cfg.num_hidden_layers):
        t, a = _block_params(cfg, i)
        total, active = total + t, active + a
    head = 0 if cfg.tie_word_embeddings else v * d
    total, active = total + head, active + v * d  # the head's matmul runs even when tied
    if include_mtp:
        for k in range(cfg.num_nextn_predict_layers):
            t, a = _block_params(cfg, cfg.num_hidden_layers + k)
            extra = 3 * d + 2 * d * d
            total, active = total + t + extra, active + a + extra + v * d
    return {"total": total + v * d, "active": active, "embedding": v * d}


def _v4_compressor_params(cfg: V4Config, dim: int, rate: int, overlap: bool) -> int:
    """kv and gate projections (two `dim` halves when windows overlap), the position bias, the norm."""
    width = 2 * dim if overlap else dim
    return 2 * cfg.hidden_size * width + rate * width + dim


def _v4_block_params(cfg: V4Config, layer_idx: int) -> tuple[int, int]:
    """(total, active per token) parameters of one V4 block: as transformers' DeepseekV4DecoderLayer has them
    (the expert bias and a hash layer's token table are buffers, not parameters)."""
    d, h, hd, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    attn = d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * hd  # q_a, q_a_norm, q_b
    attn += d * hd + hd  # kv_proj, kv_norm: one head, the key is the value
    attn += cfg.o_lora_rank * h * hd + d * cfg.o_groups * cfg.o_lora_rank + h  # grouped o_a, o_b, sinks
    kind = cfg.attention_type(layer_idx)
    if kind != SLIDING:
        attn += _v4_compressor_params(cfg, hd, cfg.compress_rate(layer_idx), overlap=kind == CSA)
    if kind == CSA:  # the lightning indexer: its own overlapping compressor, queries, head weights
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        attn += _v4_compressor_params(cfg, di, cfg.compress_rates[CSA], overlap=True)
        attn += cfg.q_lora_rank * hi * di + d * hi
    mix = (2 + n) * n
    hc = 2 * (mix * n * d + mix + 3)  # attention's and FFN's mHC: fn, base, scale
    common = attn + hc + 2 * d  # + the two sublayer norms
    expert = 3 * d * cfg.moe_intermediate_size
    shared_and_gate = expert + cfg.n_routed_experts * d
    total = common + shared_and_gate + cfg.n_routed_experts * expert
    active = common + shared_and_gate + cfg.num_experts_per_tok * expert
    return total, active


def _v4_param_counts(cfg: V4Config, include_mtp: bool) -> dict[str, int]:
    """param_counts of DeepSeek-V4: transformers' DeepseekV4ForCausalLM parameter for parameter, plus the MTP
    layers it does not build (each: a block, e_proj and h_proj, enorm/hnorm/norm, its own HC head)."""
    d, v, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    hc_head = n * n * d + n + 1  # hc_fn, hc_base, hc_scale
    total = active = hc_head + d  # + the final norm
    for i in range(cfg.num_hidden_layers):
        t, a = _v4_block_params(cfg, i)
        total, active = total + t, active + a
    head = 0 if cfg.tie_word_embeddings else v * d
    total, active = total + head, active + v * d  # the head's matmul runs even when tied
    if include_mtp:
        for k in range(cfg.num_nextn_predict_layers):
            t, a = _v4_block_params(cfg, cfg.num_hidden_layers + k)
            extra = 2 * d * d + 3 * d + hc_head
            total, active = total + t + extra, active + a + extra + v * d
    return {"total": total + v * d, "active": active, "embedding": v * d}


def attended_keys(cfg: ModelConfig, seq_len: int, sparse: bool = True) -> float:
    """Keys a query attends to, averaged over the T positions of a row: T/2 causal; with sparse attention
    min(t, index_topk) for the query at t."""
    k = cfg.index_topk if sparse and cfg.sparse_attention else None
    if k is None or seq_len <= k:
        return seq_len / 2
    return (k * (k + 1) / 2 + (seq_len - k) * k) / seq_len


def flops_per_token(
    config: str | os.PathLike | ModelConfig | V4Config,
    seq_len: int,
    include_mtp: bool = False,
    sparse: bool = True,
) -> float:
    """Training FLOPs per token: 6 x active matmul parameters (embedding lookup excluded) plus attention,
    6 x keys x heads x (qk_head_dim + v_head_dim) per layer with `attended_keys` keys (the chosen ones under
    sparse attention, unless `sparse` is off: the dense warm-up), plus each lightning indexer's scores over
    every causal key, 6 x (T/2) x index heads x (index_head_dim + 1). MTP depth is excluded unless asked, like
    DeepSeek's published 250 GFLOPs/token for V3 at 4K."""
    cfg = get_config(config)
    if isinstance(cfg, V4Config):
        return _v4_flops_per_token(cfg, seq_len, include_mtp, sparse)
    layers = range(cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if include_mtp else 0))
    active = param_counts(cfg, include_mtp=include_mtp)["active"]
    keys = attended_keys(cfg, seq_len, sparse)
    attn = 6 * keys * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim) * len(layers)
    indexers = sum(cfg.has_indexer(i) for i in layers)
    index = 6 * (seq_len / 2) * cfg.index_n_heads * (cfg.index_head_dim + 1) * indexers
    return 6 * active + attn + index


def _mean_min(seq_len: int, per: int, cap: float) -> float:
    """The mean over t in [0, T) of min((t + 1) / per, cap): the keys a query sees that grow by one every
    `per` positions up to `cap`."""
    grow = cap * per  # the position where the cap is reached
    if seq_len <= grow:
        return (seq_len + 1) / (2 * per)
    return (grow * (cap + 1 / per) / 2 + (seq_len - grow) * cap) / seq_len


def _v4_flops_per_token(cfg: V4Config, seq_len: int, include_mtp: bool, sparse: bool) -> float:
    """DeepSeek-V4's: 6 x active matmul parameters, plus per layer 6 x keys x heads x 2 head_dim (q.k and p.v
    over one shared key=value head) with the window's keys plus the compressed entries a query sees (CSA: its
    indexer's top index_topk, all of them when not `sparse`; HCA: every causal one), plus each CSA indexer's
    scores over every causal entry, 6 x entries x index heads x (index_head_dim + 1)."""
    layers = range(cfg.num_hidden_layers + (cfg.num_nextn_predict_layers if include_mtp else 0))
    active = param_counts(cfg, include_mtp=include_mtp)["active"]
    window = _mean_min(seq_len, 1, cfg.sliding_window)
    attn = index = 0.0
    for i in layers:
        kind, rate = cfg.attention_type(i), cfg.compress_rate(i)
        entries = _mean_min(seq_len, rate, seq_len) if rate else 0.0
        if kind == CSA:
            index += 6 * entries * cfg.index_n_heads * (cfg.index_head_dim + 1)
            if sparse:
                entries = _mean_min(seq_len, rate, cfg.index_topk)
        attn += 6 * (window + entries) * cfg.num_attention_heads * 2 * cfg.head_dim
    return 6 * active + attn + index
