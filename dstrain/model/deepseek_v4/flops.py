"""Parameter and FLOP counts of DeepSeek-V4 from a config alone."""

from __future__ import annotations

from ..common.counts import ffn_params, lm_param_counts
from .config import CSA, SLIDING, V4Config


def _compressor_params(cfg: V4Config, dim: int, rate: int, overlap: bool) -> int:
    """kv and gate projections (two `dim` halves when windows overlap), the position bias, the norm."""
    width = 2 * dim if overlap else dim
    return 2 * cfg.hidden_size * width + rate * width + dim


def _block_params(cfg: V4Config, layer_idx: int) -> tuple[int, int]:
    """(total, active per token) parameters of one V4 block: as transformers' DeepseekV4DecoderLayer has them
    (the expert bias and a hash layer's token table are buffers, not parameters)."""
    d, h, hd, n = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_mult
    attn = d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * hd  # q_a, q_a_norm, q_b
    attn += d * hd + hd  # kv_proj, kv_norm: one head, the key is the value
    attn += cfg.o_lora_rank * h * hd + d * cfg.o_groups * cfg.o_lora_rank + h  # grouped o_a, o_b, sinks
    kind = cfg.attention_type(layer_idx)
    if kind != SLIDING:
        attn += _compressor_params(cfg, hd, cfg.compress_rate(layer_idx), overlap=kind == CSA)
    if kind == CSA:  # the lightning indexer: its own overlapping compressor, queries, head weights
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        attn += _compressor_params(cfg, di, cfg.compress_rates[CSA], overlap=True)
        attn += cfg.q_lora_rank * hi * di + d * hi
    mix = (2 + n) * n
    hc = 2 * (mix * n * d + mix + 3)  # attention's and FFN's mHC: fn, base, scale
    common = attn + hc + 2 * d  # + the two sublayer norms
    total, active = ffn_params(cfg, moe=True, shared_experts=1)  # every layer routes (hash or learned)
    return common + total, common + active


def param_counts(cfg: V4Config, include_mtp: bool = True) -> dict[str, int]:
    """param_counts of DeepSeek-V4: transformers' DeepseekV4ForCausalLM parameter for parameter, plus the MTP
    layers it does not build (each: a block, e_proj and h_proj, enorm/hnorm/norm, its own HC head)."""
    d, n = cfg.hidden_size, cfg.hc_mult
    hc_head = n * n * d + n + 1  # hc_fn, hc_base, hc_scale
    return lm_param_counts(cfg, _block_params, hc_head + d, 2 * d * d + 3 * d + hc_head, include_mtp)


def _mean_min(seq_len: int, per: int, cap: float) -> float:
    """The mean over t in [0, T) of min((t + 1) / per, cap): the keys a query sees that grow by one every
    `per` positions up to `cap`."""
    grow = cap * per  # the position where the cap is reached
    if seq_len <= grow:
        return (seq_len + 1) / (2 * per)
    return (grow * (cap + 1 / per) / 2 + (seq_len - grow) * cap) / seq_len


def flops_per_token(cfg: V4Config, seq_len: int, include_mtp: bool = False, sparse: bool = True) -> float:
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
