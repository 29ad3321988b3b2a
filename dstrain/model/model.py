"""DeepSeek-V3/V2 causal LM as plain single-device PyTorch: MLA, DeepSeekMoE, multi-token prediction.

Module names mirror the Hugging Face layout (minus the `model.` prefix) so the key table in `hf.py` stays small;
routed experts are fused 3-D tensors so every rank touches every expert parameter (no ZeRO-3 hang), and they
run as grouped GEMMs with no host sync (experts.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dstrain.batch import real_pairs, real_tokens, sequence_halo, target_mask

from .attention import (
    AttentionLayout,
    apply_rope,
    attend,
    attention_layout,
    attention_path,
    rope_cos_sin,
    rope_frequencies,
    softmax_scale,
)
from .config import ModelConfig
from .dsa import Indexer, SparseControls, SparseSettings, sparse_attention
from .experts import routed_experts
from .kernels import Linear
from .loss import Head

EXPERT_BIAS = "e_score_correction_bias"


def is_expert_bias(name: str) -> bool:
    """The aux-loss-free balancing bias: a buffer, saved with the weights and always kept in fp32."""
    return name.rpartition(".")[2] == EXPERT_BIAS


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    """SwiGLU FFN: the dense layers and the shared experts; `limit`: DeepSeek-V4's clamp (gate at most
    `limit`, up within +-`limit`)."""

    def __init__(self, dim: int, hidden: int, limit: float | None = None) -> None:
        super().__init__()
        self.gate_proj = Linear(dim, hidden, bias=False)
        self.up_proj = Linear(dim, hidden, bias=False)
        self.down_proj = Linear(hidden, dim, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.down_proj(F.silu(gate) * up)


class MLA(nn.Module):
    """Multi-head latent attention with decoupled rotary keys (one rotary key head shared by all heads); with
    DeepSeek Sparse Attention (dsa.py), each query attends only to the keys its layer's indexer chose."""

    seq_parallel: Any = None  # see DeepSeekLM
    # Tensor parallelism: sums a tensor over the ranks holding the other heads (the indexer's target needs
    # every head's attention).
    head_sum: Any = None

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        h, d = cfg.num_attention_heads, cfg.hidden_size
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(d, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(d, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
            self.q_b_proj = Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = Linear(h * cfg.v_head_dim, d, bias=cfg.attention_bias)
        self.scale = softmax_scale(cfg)
        self.indexer = Indexer(cfg) if cfg.has_indexer(layer_idx) else None
        self.sparse = (
            SparseSettings(layer_idx, cfg.indexer_source(layer_idx)) if cfg.sparse_attention else None
        )

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layout: AttentionLayout
    ) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        qr = None
        if cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            qr = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(qr)
        # Heads are read off the projection by reshape, so `tp` can split q_b/kv_b columns by whole heads.
        q = q.view(b, t, -1, cfg.qk_head_dim)
        q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        kv_latent, k_rope = self.kv_a_proj_with_mqa(x).split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_latent)).view(
            b, t, -1, cfg.qk_nope_head_dim + cfg.v_head_dim
        )
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        cos, sin = rope
        q_rope = apply_rope(q_rope, cos, sin, cfg.rope_interleave)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin, cfg.rope_interleave)
        heads = q.shape[2]
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, heads, -1)], dim=-1)
        sp = self.seq_parallel
        if self.sparse is not None:
            measure = self.sparse.loss or not self.training
            out = sparse_attention(self.sparse, self.indexer, x, qr, q, k, v, self.scale, rope, layout,
                                   cfg.index_topk, sp, self.head_sum, measure)  # fmt: skip
        else:
            out = sp.attend(q, k, v, self.scale, layout) if sp else attend(q, k, v, self.scale, layout)
        return self.o_proj(out.reshape(b, t, -1))


class Router(nn.Module):
    """Top-k expert selection. V3: sigmoid scores, `e_score_correction_bias` added for selection only,
    groups ranked by the sum of their top-2 scores. V2: softmax, greedy or groups ranked by their max."""

    # Kept fp32 under bf16 training, where bias steps of γ ~ 1e-3 would round away: `_apply` below covers
    # `.to()` casts; DeepSpeed's zero.Init, which casts buffers itself, reads this transformers-style list.
    _keep_in_fp32_modules_strict = [EXPERT_BIAS]

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if cfg.uses_expert_bias:
            self.register_buffer(EXPERT_BIAS, torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        else:
            self.e_score_correction_bias = None

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - torch's signature
        # `.to(bf16)`/`.half()` (and DeepSpeed's bf16 cast) must not round the balancing bias: keep it fp32.
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        new = self.e_score_correction_bias
        if bias is not None and new is not None and new.dtype != torch.float32:
            self.e_score_correction_bias = bias.to(device=new.device, dtype=torch.float32)
        return self

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(N, D) -> (N, E) fp32: routing is decided in fp32 whatever the training precision."""
        return F.linear(x.float(), self.weight.float())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (N, D) -> scores (N, E) fp32, expert indices (N, k), combine weights (N, k) fp32."""
        cfg = self.cfg
        logits = self.logits(x)
        if cfg.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        choice = scores.detach()
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias
        if cfg.n_group > 1 and cfg.topk_method != "greedy":
            grouped = choice.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
            if cfg.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            else:
                group_scores = grouped.max(dim=-1).values
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1, sorted=False).indices, True)
            fill = float("-inf") if cfg.topk_method == "noaux_tc" else 0.0
            choice = grouped.masked_fill(~keep.unsqueeze(-1), fill).flatten(1)
        idx = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, idx, weights * cfg.routed_scaling_factor


class Experts(nn.Module):
    """Routed experts as fused 3-D weights: gate_up_proj (E, 2I, D) [gate rows, then up rows], down_proj (E, D, I),
    run as grouped GEMMs (experts.py); `limit`: DeepSeek-V4's SwiGLU clamp (MLP)."""

    def __init__(self, cfg: ModelConfig, limit: float | None = None) -> None:
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        self.limit = limit

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return routed_experts(x, idx, weights, self.gate_up_proj, self.down_proj, limit=self.limit)


class MoE(nn.Module):
    seq_parallel: Any = None  # see DeepSeekLM

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts
            else None
        )

    def forward(
        self, x: torch.Tensor, real: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> output, sequence-balance loss (mean over rows), expert load (E,) of this call. `real` (B, T) bool:
        the positions holding a token (None: all); padding is computed but counted nowhere."""
        b, t, d = x.shape
        cfg = self.cfg
        scores, idx, weights = self.gate(x.reshape(-1, d))
        out = self.experts(x.reshape(-1, d), idx, weights).view(b, t, d)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        normed = scores / scores.sum(dim=-1, keepdim=True) if cfg.scoring_func == "sigmoid" else scores
        aux, load = sequence_balance(normed.view(b, t, -1), idx.view(b, t, -1), real, self.seq_parallel)
        return out, aux, load


def sequence_balance(
    normed: torch.Tensor, idx: torch.Tensor, real: torch.Tensor | None, sp: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-wise balance loss (DeepSeek-V3 eqs. 17-20), the mean over rows of sum_i f_i * P_i with
    f_i = E/(k T) * (tokens routed to i) and P_i the mean normalised affinity, T the row's tokens; and the
    expert load (E,) of the call. normed (B, T, E) affinities summing to 1 per token, idx (B, T, k); `real`
    (B, T) bool the positions holding a token (None: all): padding counts nowhere."""
    b, t, e = normed.shape
    k = idx.shape[-1]
    real = torch.ones(b, t, dtype=torch.bool, device=normed.device) if real is None else real
    counted = real.repeat_interleave(k, 1).float()
    load_per_row = torch.zeros(b, e, device=normed.device).scatter_add_(1, idx.reshape(b, t * k), counted)
    # Sequence parallel: f of the whole rows, P of this rank's tokens; the mean over the group of
    # sum_i f_i * P_i(local) is the rows' loss, and DeepSpeed averages the group's gradients.
    here = real.sum(dim=1, keepdim=True).float()  # (B, 1) tokens of each row on this rank
    row = (sp.sum(here) if sp else here).clamp(min=1)
    f = (sp.sum(load_per_row) if sp else load_per_row) * (e / k) / row
    p = (normed * real[..., None]).sum(dim=1) * ((sp.size if sp else 1) / row)
    return (f * p).sum(dim=1).mean(), load_per_row.sum(0)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.recompute: str | None = None  # 'attention' or 'mlp': that sublayer is recomputed in backward

    def forward(self, x, rope, layout):  # noqa: ANN001 - called through checkpoint()
        x = x + self._sublayer("attention", self._attention, x, rope, layout)
        if isinstance(self.mlp, MoE):
            out, aux, load = self._sublayer("mlp", self._moe, x, layout.real)
            return x + out, aux, load
        return x + self._sublayer("mlp", self._ffn, x), None, None

    def _sublayer(self, name: str, fn, *args):  # noqa: ANN001, ANN202
        if self.recompute == name and self.training:
            if name == "mlp" and isinstance(self.mlp, MoE) and torch.compiler.is_compiling():
                return _eager_checkpoint(fn, *args)
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def _attention(self, x, rope, layout):  # noqa: ANN001, ANN202
        return self.self_attn(self.input_layernorm(x), rope, layout)

    def _ffn(self, x):  # noqa: ANN001, ANN202
        return self.mlp(self.post_attention_layernorm(x))

    def _moe(self, x, real):  # noqa: ANN001, ANN202 - real: the positions holding a token
        return self.mlp(self.post_attention_layernorm(x), real)


@torch.compiler.disable
def _eager_checkpoint(fn, *args):  # noqa: ANN001, ANN202
    """A recomputed MoE sublayer inside a compiled block runs eagerly: traced by torch.compile (2.13) within
    activation checkpointing, the routing weights' gradient from the experts was dropped when the balance
    loss also used the router's scores (measured: the router's gradient held the balance loss's share only)."""
    return checkpoint(fn, *args, use_reentrant=False)


class MTPLayer(nn.Module):
    """Depth-k multi-token prediction: combine the previous depth's hidden state with the embedding of the
    token k ahead, run one block, predict with the shared head (its own final norm)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = Block(cfg, layer_idx)
        self.shared_head_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class ModelOutput(dict):
    """The forward's results, as a dict with attribute access: ZeRO-3's hooks find tensors inside dicts (not
    inside dataclasses). Fields: logits, loss, lm_loss_sum, lm_tokens, mtp_loss_sum, mtp_tokens, aux_loss,
    expert_load, mtp_hits (in eval mode: positions where MTP depth 1's top-1 token is the target, the draft
    acceptance of speculative decoding), indexer_stats (sparse attention: fp64 [KL sum, queries, recall sum,
    queries counted for recall] over the indexers of this forward, dsa.PassResult); an unset field reads as
    None."""

    FIELDS = (
        "logits",
        "loss",
        "lm_loss_sum",
        "lm_tokens",
        "mtp_loss_sum",
        "mtp_tokens",
        "aux_loss",
        "expert_load",
        "mtp_hits",
        "indexer_stats",
    )

    def __getattr__(self, name: str):  # noqa: ANN204
        if name in ModelOutput.FIELDS:
            return self.get(name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value) -> None:  # noqa: ANN001
        if name not in ModelOutput.FIELDS:
            raise AttributeError(f"ModelOutput has no field {name!r}")
        self[name] = value


def kernel_paths(cfg: Any, device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """Which kernels the model runs on `device` at `dtype`: attention on plain and on packed rows, the routed
    experts' GEMMs (what `dstrain env` and a run's first lines show)."""
    from .experts import grouped_mm_ok
    from .kernels import compute_dtype

    compute = compute_dtype(torch.empty((), dtype=dtype, device=device)) if device.type == "cpu" else dtype
    own = getattr(cfg, "attention_kernel", None)  # a family with one kernel everywhere (DeepSeek-V4's)
    paths = (
        {"attention": own}
        if own
        else {
            "attention": attention_path(device, dtype, packed=False),
            "attention, packed rows": attention_path(device, dtype, packed=True),
        }
    )
    if cfg.is_moe:
        fast = grouped_mm_ok(compute, device, cfg.hidden_size, cfg.moe_intermediate_size)
        paths["experts"] = "grouped GEMM" if fast else "a GEMM per expert (offsets read once per layer)"
    if compute != dtype:
        paths["compute dtype"] = f"{str(compute).removeprefix('torch.')} (this CPU has no native bf16)"
    return paths


def ce_sum(
    head: nn.Module, h: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, hits: bool = False
) -> tuple[torch.Tensor, ...]:
    """(sum of token cross-entropies over valid positions[, with `hits` the valid positions whose top-1
    token is the target], their count); the (tokens x vocab) logits are never kept (loss.Head). A head
    replaced by a LoRA adapter computes plain logits."""
    h, valid = h.flatten(0, -2), valid.flatten()
    targets = torch.where(valid, targets.flatten(), 0)
    if isinstance(head, Head):
        if hits:
            return *head(h, targets, valid, hits=True), valid.sum()
        return head(h, targets, valid), valid.sum()
    logits = head(h).float()
    ce = (F.cross_entropy(logits, targets, reduction="none") * valid).sum()
    if hits:
        return ce, ((logits.argmax(-1) == targets) & valid).sum(), valid.sum()
    return ce, valid.sum()


def target_rows(t: int, labels: torch.Tensor, shift: int) -> int:
    """Positions predicting labels[i + shift]: all t when labels run on past them (a sequence-parallel
    slice's halo), else the first t - shift."""
    return min(t, labels.shape[1] - shift)


def mtp_depth_loss(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor | None,
    k: int,
    training: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """MTP depth k's summed cross-entropy of `hidden` (B, T, D, normed: position i predicts labels[i + k + 1])
    -> (sum, target count, depth 1's top-1 hits in evaluation (its draft acceptance) or None)."""
    shift = k + 1
    n = target_rows(hidden.shape[1], labels, shift)
    if n <= 0:
        return hidden.new_zeros((), dtype=torch.float32), labels.new_zeros(()), None
    hits = k == 1 and not training
    s, *rest, c = ce_sum(
        head,
        hidden[:, :n],
        labels[:, shift : shift + n],
        target_mask(labels, position_ids, shift)[:, :n],
        hits,
    )
    return s, c, rest[0] if hits else None


@torch.no_grad()
def update_expert_bias(routers: list[nn.Module], load: torch.Tensor, gamma: float) -> None:
    """Aux-loss-free balancing: bias_i += γ·sign(mean(load) − load_i), one row of `load` per router (counted
    over every token of the step on every rank); a router without a bias (V2 routing) is skipped."""
    if gamma == 0:
        return
    for router, layer_load in zip(routers, load, strict=True):
        if router.e_score_correction_bias is not None:
            layer_load = layer_load.float().to(router.e_score_correction_bias.device)
            router.e_score_correction_bias.add_(gamma * torch.sign(layer_load.mean() - layer_load))


def combine_losses(lm, mtp, aux, alpha: float, lam: float):  # noqa: ANN001, ANN201 - tensors or floats
    """The training objective from its parts: `lm` the token-mean LM loss, `mtp` the mean over depths of the
    token-mean MTP losses (or None), `aux` the sequence-balance loss (or None): lm + λ·mtp + α·aux."""
    loss = lm
    if lam and mtp is not None:
        loss = loss + lam * mtp
    if alpha and aux is not None:
        loss = loss + alpha * aux
    return loss


class DeepSeekLM(SparseControls, nn.Module):
    # Sequence parallelism (dstrain.parallel.sp) sets this on the model, its MLA and MoE layers: then each
    # rank's input_ids / position_ids / labels are its slice of every row plus `halo` tokens after it
    # (`dstrain.batch.sequence_shard`): the targets of its last positions and MTP's look-ahead inputs.
    seq_parallel: Any = None
    # Sparse attention's indexer figures are the whole rows', alike on every sequence-parallel rank.
    indexer_figures_per_slice = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Head(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        n = cfg.num_hidden_layers
        self.mtp = nn.ModuleList(MTPLayer(cfg, n + k) for k in range(cfg.num_nextn_predict_layers))
        self.moe_layer_ids = [i for i in range(n + len(self.mtp)) if cfg.is_moe_layer(i)]
        self.activation_checkpointing = "none"
        self._rope_cache: dict[torch.device, tuple[torch.Tensor, float]] = {}

    # -------------------------------------------------------------- ties and balancing
    def tie_weights(self) -> None:
        """Re-tie after anything that replaces Parameters (`to_empty` from the meta device does)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def routers(self) -> list[Router]:
        return [b.mlp.gate for b in self.blocks() if isinstance(b.mlp, MoE)]

    def update_expert_bias(self, load: torch.Tensor) -> None:
        """Aux-loss-free balancing of every MoE layer's router (`update_expert_bias`)."""
        update_expert_bias(self.routers(), load, self.config.bias_update_speed)

    def set_activation_checkpointing(self, mode: str | bool) -> None:
        """'full' (or True): every block recomputed in backward; 'attention' / 'mlp': only that sublayer of
        every block; 'none' (or False): nothing recomputed."""
        mode = {True: "full", False: "none"}.get(mode, mode)
        if mode not in ("none", "full", "attention", "mlp"):
            raise ValueError(f"activation checkpointing {mode!r}: choose none, full, attention or mlp")
        self.activation_checkpointing = mode
        for block in self.blocks():
            block.recompute = mode if mode in ("attention", "mlp") else None

    def indexers(self) -> list[nn.Module]:
        """Every lightning indexer (DeepSeek Sparse Attention's full layers)."""
        return [b.self_attn.indexer for b in self.blocks() if b.self_attn.indexer is not None]

    def blocks(self) -> list[Block]:
        """Every transformer block: the main model's, then the MTP modules'."""
        return [*self.layers, *(m.block for m in self.mtp)]

    def compile_blocks(self, **options) -> None:  # noqa: ANN003 - torch.compile's
        """Regional compilation (torchtitan's): each transformer block compiled on its own, in place (names and
        state dict unchanged), blocks of one kind sharing a graph, and the head's loss chunks; the rest of the
        model stays eager."""
        for block in self.blocks():
            block.compile(**options)
        if isinstance(self.lm_head, Head):
            self.lm_head.compile_loss(**options)

    # -------------------------------------------------------------- forward
    def _rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dev = position_ids.device
        if dev not in self._rope_cache:
            inv_freq, factor = rope_frequencies(self.config)
            self._rope_cache[dev] = (inv_freq.to(dev), factor)
        inv_freq, factor = self._rope_cache[dev]
        return rope_cos_sin(position_ids, inv_freq, factor)

    def _ce_sum(
        self, h: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor, hits: bool = False
    ) -> tuple[torch.Tensor, ...]:
        return ce_sum(self.lm_head, h, targets, valid, hits)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_logits: bool | None = None,
    ) -> ModelOutput:
        """input_ids (B, T); position_ids (B, T) restarting at 0 per packed document; labels (B, T) unshifted,
        -100 = not a target. Logits are returned when there are no labels (or when asked)."""
        b, t = input_ids.shape
        if self.seq_parallel is not None:
            t -= self.halo  # this rank's tokens; the halo only feeds targets and look-ahead inputs
            position_ids = (
                position_ids
                if position_ids is not None
                else torch.arange(t + self.halo, device=input_ids.device).expand(b, -1)
            )
        local_pos = position_ids[:, :t] if position_ids is not None else None
        rope, layout = self.rope_and_layout(local_pos, b, t, input_ids.device)
        h = self.embed_tokens(input_ids[:, :t])
        aux, loads = None, []
        for block in self.layers:
            h, block_aux, load = self.run_block(block, h, rope, layout)
            if block_aux is not None:
                aux = block_aux if aux is None else aux + block_aux
                loads.append(load)

        # Input of MTP depth k at position i is token i+k; the last k positions of a row have none (masked
        # targets).
        def ahead(k: int) -> torch.Tensor:
            ids = input_ids[:, k : k + t]
            return self.embed_tokens(F.pad(ids, (0, t - ids.shape[1])))

        main_loads = torch.stack(loads) if loads else None
        return self.finish(h, ahead, rope, layout, position_ids, labels, aux, main_loads, return_logits)

    def rope_and_layout(
        self, position_ids: torch.Tensor | None, b: int, t: int, device: torch.device
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], AttentionLayout]:
        pos = position_ids if position_ids is not None else torch.arange(t, device=device).expand(b, t)
        sp = self.seq_parallel
        whole = sp.gather(pos) if sp else position_ids  # the mask spans whole rows
        layout = attention_layout(whole, b, t * (sp.size if sp else 1), device)
        layout.real = real_tokens(position_ids)  # this rank's tokens (padding: no token)
        return self._rope(pos), layout

    def pipeline_context(self, position_ids: torch.Tensor, input_ids: torch.Tensor | None) -> tuple:
        """What a pipeline stage's blocks and `finish` read besides the hidden states: (rope, layout)."""
        b, t = position_ids.shape
        return self.rope_and_layout(position_ids, b, t, position_ids.device)

    def streams_of(self, embedded: torch.Tensor) -> torch.Tensor:
        """The residual stream at the bottom (one: the embedding itself; DeepSeek-V4 has several)."""
        return embedded

    @property
    def halo(self) -> int:
        return sequence_halo(len(self.mtp))

    def run_block(
        self, block: Block, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layout: AttentionLayout
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One block (recomputed in backward under activation checkpointing) -> (h, its MoE balance loss,
        its expert load), the last two None for a dense block."""
        if self.activation_checkpointing == "full" and self.training:
            return checkpoint(block, h, rope, layout, use_reentrant=False)
        return block(h, rope, layout)

    def finish(
        self,
        h: torch.Tensor,
        ahead,  # noqa: ANN001 - k -> embeddings of the tokens k ahead (B, T, D)
        rope: tuple[torch.Tensor, torch.Tensor],
        layout: AttentionLayout,
        position_ids: torch.Tensor | None,
        labels: torch.Tensor | None,
        aux: torch.Tensor | None,
        loads: torch.Tensor | None,
        return_logits: bool | None = None,
    ) -> ModelOutput:
        """Final norm, head, losses and the MTP depths, from the last block's output `h`, the summed balance
        loss `aux` and the (main MoE layers, E) expert `loads` of the blocks before (the pipeline's last stage
        calls this too)."""
        cfg = self.config
        t = h.shape[1]
        main_hidden = self.norm(h)
        out = ModelOutput()
        if return_logits or (return_logits is None and labels is None):
            out.logits = self.lm_head(main_hidden)
        run_mtp = labels is not None and len(self.mtp) > 0
        if labels is not None:
            n = target_rows(t, labels, 1)
            out.lm_loss_sum, out.lm_tokens = self._ce_sum(
                main_hidden[:, :n], labels[:, 1 : 1 + n], target_mask(labels, position_ids, 1)[:, :n]
            )
        mtp_loads = []
        if run_mtp:
            sums, counts = [], []
            prev = main_hidden
            for k, mtp in enumerate(self.mtp, start=1):
                x = mtp.eh_proj(torch.cat([mtp.enorm(ahead(k)), mtp.hnorm(prev)], dim=-1))
                # a position whose look-ahead token is padding holds no pair: its router counts nothing
                depth = dataclasses.replace(layout, real=real_pairs(position_ids, h.shape[0], t, k, h.device))
                prev, block_aux, load = self.run_block(mtp.block, x, rope, depth)
                if block_aux is not None:
                    aux = block_aux if aux is None else aux + block_aux
                    mtp_loads.append(load)
                s, c, hits = mtp_depth_loss(
                    self.lm_head, mtp.shared_head_norm(prev), labels, position_ids, k, self.training
                )
                if hits is not None:
                    out.mtp_hits = hits
                sums.append(s)
                counts.append(c)
            out.mtp_loss_sum, out.mtp_tokens = torch.stack(sums), torch.stack(counts)
        if layout.stats:
            out.indexer_stats = torch.stack(list(layout.stats.values())).sum(0)
        if aux is not None:
            out.aux_loss = aux
            rows = ([loads] if loads is not None else []) + ([torch.stack(mtp_loads)] if mtp_loads else [])
            out.expert_load = torch.cat(rows).detach()
        if labels is not None:
            lm = out.lm_loss_sum / out.lm_tokens.clamp(min=1)
            mtp = (out.mtp_loss_sum / out.mtp_tokens.clamp(min=1)).mean() if run_mtp else None
            out.loss = combine_losses(lm, mtp, out.aux_loss, cfg.aux_loss_alpha, cfg.mtp_loss_weight)
        return out
