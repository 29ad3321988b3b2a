"""The model the trainer hands to DeepSpeed, in the training layout: built fresh, or loaded from a Hugging Face
folder so that no rank holds more of it than it trains.

- ZeRO-3: built under DeepSpeed's partitioned init (each module's weights are split across ranks as soon as
  it is constructed), then each rank copies in its own flat partition of every tensor, reading only the rows
  that partition covers.
- Pipeline / tensor / expert parallel: built on the meta device, parallelised there, and only what this rank
  keeps gets memory; each rank reads its stages' layers and its TP/EP slices.
- ZeRO-0/1/2 data parallel keeps the whole model on every rank by design; the model is read once per rank.

Every path reads one source, `dstrain.model.sources.Weights`: the folder's tensors where it has them, fresh
values where it lacks them or for a fresh model (each tensor from a generator of its own, so every layout
starts from one process's values).
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from dstrain.config.plan import RunPlan
from dstrain.model import DeepSeekLM
from dstrain.model.build import materialize
from dstrain.model.common.lora import init_adapters
from dstrain.model.common.stored import stored_weights
from dstrain.model.quantized import apply_qat, fill_stored, store_base
from dstrain.model.registry import model_class, on_meta
from dstrain.model.sources import Weights, fill, local_tensors
from dstrain.parallel.pipe import Objective

from .finetune import apply_finetune_options


@dataclass
class Built:
    model: DeepSeekLM  # the single-device view: other pipeline stages' layers stay on meta
    module: nn.Module  # what deepspeed.initialize gets
    mpu: Any = None
    groups: Any = None
    load: dict[str, Any] = field(default_factory=dict)  # loading figures, empty when built fresh


def build_for_training(plan: RunPlan, rank: int, device: torch.device, objective: Objective) -> Built:
    """The model of `plan` on this rank: the --model preset built fresh, or its folder loaded; LoRA and the
    frozen parts applied; parallelised. `objective`: the loss a pipeline's last stage computes."""
    built = _build(plan, rank, device, objective)
    if plan.dims.sp > 1:  # sequence parallelism changes no weight: hooks only, on any of the paths above
        from dstrain.parallel import build_groups
        from dstrain.parallel.sp import apply_sequence_parallel

        apply_sequence_parallel(built.model, built.groups or build_groups(plan.dims, rank))
    return built


def _build(plan: RunPlan, rank: int, device: torch.device, objective: Objective) -> Built:
    cfg, seed = plan.model, plan.opts.run.seed
    # ZeRO-3 builds under DeepSpeed's partitioned init, which allocates every parameter; a stored base's frozen
    # weights are no parameters: the model is built on meta, the stored parts partitioned by dstrain, the rest
    # (adapters, norms, routers, embedding and head) whole until the engine partitions it
    partitioned_init = plan.stage == 3 and not plan.stored_base
    with PeakRSS() as peak, Weights(cfg, seed, device, folder=plan.model_folder) as weights:
        model = _zero3(cfg, weights, plan.ds) if partitioned_init else on_meta(cfg)
        dsa_stage = plan.opts.model.dsa_stage if cfg.sparse_attention else None
        apply_finetune_options(model, plan.opts.lora, seed, dsa_stage)
        if plan.stored_base:  # the frozen quantized weights as the files hold them (model/quantized.py)
            store_base(model, weights.reader)
        if plan.qat:  # what trains, fake-quantized as the export will write it (model/quantized.py)
            apply_qat(model, weights.reader)
        if (
            plan.stage == 3 and plan.stored_base
        ):  # ZeRO-3 runs without PP/TP/EP: it partitions over every rank
            for _, w in stored_weights(model):
                w.partition(tdist.group.WORLD, tdist.get_rank(), tdist.get_world_size())
        built = Built(model, model) if plan.stage == 3 else _parallel(model, plan, rank, device, objective)
        if not partitioned_init:
            if not plan.dims.model_parallel:
                materialize(model, device)
            fill(model, weights)
            init_adapters(model, seed)
        if plan.stored_base:
            fill_stored(model, weights.reader)
    built.load = {**weights.stats, "peak_rss_growth": peak.growth}
    if plan.stored_base:  # this rank's stored bytes, and what the same weights take dequantized
        held = [w for _, w in stored_weights(built.model) if not w.is_meta]
        itemsize = 2 if plan.precision == "bf16" else 4
        built.load["stored_bytes"] = sum(w.nbytes for w in held)
        share = [math.prod(w.shape) // (w.size if w.group is not None else 1) for w in held]
        built.load["dequantized_bytes"] = sum(share) * itemsize
    return built


def _parallel(
    model: DeepSeekLM, plan: RunPlan, rank: int, device: torch.device, objective: Objective
) -> Built:
    if not plan.dims.model_parallel:
        return Built(model, model)
    from dstrain.parallel import build_groups
    from dstrain.parallel.apply import parallelize

    groups = build_groups(plan.dims, rank)
    module, mpu = parallelize(
        model,
        plan.dims,
        groups,
        partition=plan.opts.layout.pp_partition,
        seed=plan.opts.run.seed,
        objective=objective,
        device=device,
    )
    return Built(model, module, mpu, groups)


@torch.no_grad()
def _zero3(cfg: Any, weights: Weights, ds: dict[str, Any]) -> DeepSeekLM:
    """Built under DeepSpeed's partitioned init; then each rank copies in its own flat partition of every
    tensor from `weights`, reading only the rows that partition covers."""
    import deepspeed
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    NVME = OffloadDeviceEnum.nvme  # noqa: N806

    with deepspeed.zero.Init(config_dict_or_path=ds):  # its dtype argument picks bf16 on CPU (0.19.8)
        model = model_class(cfg)(cfg)
    for name, t in local_tensors(model):
        if not hasattr(t, "ds_id"):  # the expert bias: a buffer, replicated
            t.copy_(weights.read(name))
            continue
        part = t.ds_tensor
        if (
            getattr(t, "ds_secondary_tensor", None) is not None
            or getattr(part, "final_location", None) == NVME
        ):
            # hierarchical partitions or NVMe offload: let DeepSpeed spread one rank's whole copy
            with deepspeed.zero.GatheredParameters([t], modifier_rank=0):
                if tdist.get_rank() == 0:
                    t.data.copy_(weights.read(name))
            continue
        start = tdist.get_rank(group=t.ds_process_group) * part.numel()
        part.data.copy_(weights.read_flat(name, start, start + part.numel()))
    return model


class PeakRSS:
    """Peak resident memory of this process while the block runs, above what it held when it started
    (sampled every 5 ms from /proc; 0 where /proc is missing)."""

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
