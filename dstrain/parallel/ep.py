"""Expert parallelism: each rank of an EP group keeps n_routed_experts / ep of every MoE layer's routed experts
and tokens travel to their experts' ranks by all-to-all (and back, weighted, after the expert FFN).

The router, shared experts and everything else stay replicated across the EP group (they see different data
there, so their gradients are reduced over the whole data-parallel group as usual); each expert's gradient
already sums the tokens of every EP rank and is then reduced over the expert-data-parallel group only.
DeepSpeed's ZeRO-1/2 optimizer partitions and reduces expert parameters over that group when they are marked
(`allreduce = False`, `group_name`) and the engine sees a DeepSpeed MoE module: `ExpertParallelExperts`
is one in type only (its own forward, no DeepSpeed gate or dispatcher).
"""

from __future__ import annotations

from typing import Any

import torch
from deepspeed.moe.layer import MoE as _DeepSpeedMoE
from torch import nn

from dstrain.model.common.experts import Adapters, combine, group_by_expert, grouped_swiglu
from dstrain.model.common.layers import Experts
from dstrain.model.common.lora import EXPERT_ADAPTERS, LoRAExperts, qat_expert_weights
from dstrain.model.common.stored import StoredExperts

from .comm import all_to_all, exchange_counts
from .dims import Groups


def group_name(ep: int) -> str:
    """DeepSpeed's name for the expert groups of this EP size."""
    return f"ep_size_{ep}"


class ExpertParallelExperts(_DeepSpeedMoE):
    """This rank's experts of one MoE layer, and their LoRA adapters when the layer has them."""

    def __init__(self, experts: Experts, g: Groups) -> None:
        nn.Module.__init__(self)  # not DeepSpeed's MoE.__init__: no gate, no experts of its own
        ep, rank = g.dims.ep, g.ep_rank
        self.num_experts = experts.gate_up_proj.shape[0]
        self.num_local_experts = self.num_experts // ep
        self.first = rank * self.num_local_experts
        self.ep_size, self.ep_group = ep, g.ep
        self.expert_group_name = group_name(ep)
        self.lora = isinstance(experts, LoRAExperts)
        self.limit = experts.limit  # DeepSeek-V4's SwiGLU clamp
        if self.lora:
            self.r, self.alpha, self.scale = experts.r, experts.alpha, experts.scale
        base: tuple[str, ...] = ("gate_up_proj", "down_proj")
        if isinstance(experts.gate_up_proj, StoredExperts):  # a stored base: this rank's experts' codes only
            self.gate_up_proj = experts.gate_up_proj.local(self.first, self.num_local_experts)
            self.down_proj, base = None, ()
        qat = experts._modules.get("qat")  # QAT: the quantizers of this rank's experts
        if qat is not None:
            self.qat = nn.ModuleDict(
                {k: q.experts(self.first, self.num_local_experts) for k, q in qat.items()}
            )
        for name in (*base, *(EXPERT_ADAPTERS if self.lora else ())):
            full = getattr(experts, name)
            local = full.detach()[self.first : self.first + self.num_local_experts].clone()
            param = nn.Parameter(local, requires_grad=full.requires_grad)
            param.allreduce = False
            param.group_name = self.expert_group_name
            param.ep_shard = (0, rank, ep)
            setattr(self, name, param)

    reset_adapter = LoRAExperts.reset_adapter  # init_adapters: this rank's slice of the whole adapters

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """The engine calls this on DeepSpeed MoE modules; dstrain has made the groups already."""

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        n, k = idx.shape
        ep, local = self.ep_size, self.num_local_experts
        order, ends = group_by_expert(idx, self.num_experts)  # by global expert, hence by destination rank
        counts = torch.diff(ends, prepend=ends.new_zeros(1)).to(torch.int64).view(ep, local)
        recv_counts = exchange_counts(counts, self.ep_group)  # (source rank, local expert)
        # The layer's one host exchange: all_to_all needs its split sizes as Python ints.
        send, recv = torch.stack([counts.sum(1), recv_counts.sum(1)]).tolist()
        xs = all_to_all(x[order // k], send, recv, self.ep_group)
        # Received rows come grouped by source rank, then by local expert: regroup them by expert.
        expert_of_row = torch.arange(local, device=x.device).repeat(ep)
        expert_of_row = expert_of_row.repeat_interleave(recv_counts.flatten(), output_size=sum(recv))
        by_expert = expert_of_row.argsort(stable=True)
        offs = recv_counts.sum(0).cumsum(0).to(torch.int32)
        ys = grouped_swiglu(xs[by_expert], offs, *self._weights(x.dtype), self.limit)
        ys = torch.empty_like(ys).index_copy(0, by_expert, ys)
        ys = all_to_all(ys, recv, send, self.ep_group)
        return combine(ys, order, weights)

    def _weights(self, dtype: torch.dtype) -> tuple[Any, Any, Adapters | None, float]:
        """(gate_up, down, adapters, scale) for grouped_swiglu: under QAT the merged weights fake-quantized."""
        qat = self._modules.get("qat")
        if qat is not None:
            gate_up, down = qat_expert_weights(self, qat, self.scale if self.lora else None)
            return gate_up.to(dtype), down.to(dtype), None, 0.0
        adapters = Adapters(*(getattr(self, n) for n in EXPERT_ADAPTERS)) if self.lora else None
        return self.gate_up_proj, self.down_proj, adapters, self.scale if self.lora else 0.0


def apply_expert_parallel(model: nn.Module, g: Groups) -> None:
    if g.dims.ep == 1:
        return
    for module in list(model.modules()):
        if isinstance(getattr(module, "experts", None), Experts):  # an MoE layer of any family
            module.experts = ExpertParallelExperts(module.experts, g)


def create_deepspeed_expert_groups(g: Groups, mpu: object) -> None:
    """DeepSpeed's expert groups (its ZeRO optimizer reduces expert gradients over them), checked to be
    exactly dstrain's EP/EDP groups."""
    from deepspeed.utils import groups

    name = group_name(g.dims.ep)
    groups.mpu = mpu
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_data_and_model_parallel(g.dims.ep, mpu)
    theirs = {
        "ep": list(groups._get_expert_parallel_group_ranks(name)),
        "edp": list(groups._get_expert_data_parallel_group_ranks(name)),
    }
    for kind, ranks in theirs.items():
        if ranks != g.ranks[kind]:
            raise RuntimeError(f"DeepSpeed's {kind} group {ranks} differs from dstrain's {g.ranks[kind]}")
