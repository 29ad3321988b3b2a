"""The layers both families build from: RMSNorm, the SwiGLU MLP (dense layers, shared experts), the router
and the routed experts as fused 3-D weights, the sequence-wise balance loss and the aux-loss-free expert bias."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .experts import routed_experts
from .kernels import Linear
from .qat import qat_experts

EXPERT_BIAS = "e_score_correction_bias"


def is_expert_bias(name: str) -> bool:
    """The aux-loss-free balancing bias: a buffer, saved with the weights and always kept in fp32."""
    return name.rpartition(".")[2] == EXPERT_BIAS


HASH_TABLE = "tid2eid"  # DeepSeek-V4's hash layers: each token's experts, a fixed table


def is_hash_table(name: str) -> bool:
    """A hash layer's token -> experts table: a buffer saved with the weights, never trained."""
    return name.rpartition(".")[2] == HASH_TABLE


ROUTER_BUFFERS = (
    EXPERT_BIAS,
    HASH_TABLE,
)  # a router's buffers that are weights (saved, loaded, shared by LoRA)


def may_start_fresh(key: str) -> bool:
    """A tensor a checkpoint folder may lack, started fresh instead: the MTP modules (transformers'
    save_pretrained drops them) and the expert bias (folders of routers without one)."""
    return key.startswith("mtp.") or is_expert_bias(key)


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


class Router(nn.Module):
    """Top-k expert selection. V3: sigmoid scores, `e_score_correction_bias` added for selection only,
    groups ranked by the sum of their top-2 scores. V2: softmax, greedy or groups ranked by their max."""

    # Kept fp32 under bf16 training, where bias steps of γ ~ 1e-3 would round away: `_apply` below covers
    # `.to()` casts; DeepSpeed's zero.Init, which casts buffers itself, reads this transformers-style list.
    _keep_in_fp32_modules_strict = [EXPERT_BIAS]

    def __init__(self, cfg: Any) -> None:
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

    def __init__(self, cfg: Any, limit: float | None = None) -> None:
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))
        self.limit = limit

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        qat = self._modules.get("qat")  # QAT (model/quantized.py): the weights as the export quantizes them
        if qat is not None:
            gate_up, down = qat_experts(qat, self.gate_up_proj, self.down_proj)
            return routed_experts(x, idx, weights, gate_up.to(x.dtype), down.to(x.dtype), limit=self.limit)
        return routed_experts(x, idx, weights, self.gate_up_proj, self.down_proj, limit=self.limit)


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


class MoE(nn.Module):
    """A DeepSeekMoE layer: the router, the fine-grained routed experts and the shared experts (any family's
    config with the DeepSeek-V3 MoE fields)."""

    seq_parallel: Any = None  # see DeepSeekLM

    def __init__(self, cfg: Any) -> None:
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
