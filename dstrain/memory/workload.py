"""What the memory estimate depends on (estimate.py, and each family's layer sizes: shapes.py): the model, the
layout, the ZeRO settings, the batch shape and what trains, from a resolved run plan."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dstrain.model import ModelConfig
from dstrain.parallel import ParallelDims

from .stored import StoredBase, planned_base

if TYPE_CHECKING:
    from dstrain.config.plan import RunPlan


@dataclass(frozen=True)
class Workload:
    """What the estimate depends on: the model, the layout, the ZeRO settings and the batch shape."""

    model: ModelConfig
    dims: ParallelDims
    stage: int
    precision: str
    """'fp32' or 'bf16'."""
    micro_batch: int
    seq_len: int
    grad_accum: int = 1
    checkpointing: str = "none"
    zero: dict[str, Any] = field(default_factory=dict)
    """The DeepSpeed config's zero_optimization section (DeepSpeed's defaults fill what it leaves out)."""
    device: str = "cuda"
    pp_partition: str = "parameters"
    dsa_stage: str = "sparse"
    """Sparse attention's stage (dense, sparse or frozen): what the indexers and the attention keep."""
    optimizer: str = "adamw"
    """adamw: two fp32 moments per parameter; muon: one momentum buffer for the hidden matrices (AdamW's two
    for the embedding, the head and the vectors), and each matrix gathered whole in fp32 while it steps."""
    trainable: float = 1.0
    """The share of the model's elements that train (LoRA: its adapters, and the routers / MTP if they train):
    gradients, optimizer states and the step scale with it; the frozen base weights are held (and ZeRO-3
    partitions them) but get neither. Taken as spread over the layers like the parameters."""
    stored: StoredBase | None = None
    """A stored base (--base_precision stored): the frozen weights of these kinds are held as their release
    stores them (codes + scales, no parameter) and dequantized one layer at a time."""

    @classmethod
    def of(cls, plan: RunPlan) -> Workload:
        o = plan.opts
        return cls(
            model=plan.model,
            dims=plan.dims,
            stage=plan.stage,
            precision=plan.precision,
            micro_batch=o.layout.micro_batch_size,
            seq_len=o.data.seq_len,
            grad_accum=o.layout.gradient_accumulation_steps,
            checkpointing=o.model.activation_checkpointing,
            zero=dict(plan.ds.get("zero_optimization") or {}),
            device=plan.device_type,
            pp_partition=o.layout.pp_partition,
            dsa_stage=o.model.dsa_stage,
            optimizer=o.optimizer.optimizer,
            trainable=plan.trains[0] / plan.trains[1] if o.lora.lora_r > 0 else 1.0,
            stored=planned_base(plan) if plan.stored_base else None,
        )

    def replace(self, **changes: Any) -> Workload:
        return dataclasses.replace(self, **changes)
