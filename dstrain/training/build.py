"""The model the trainer hands to DeepSpeed, in the training layout: built fresh, or loaded from a Hugging Face
folder so that no rank holds more of it than it trains.

- ZeRO-3: built under DeepSpeed's partitioned init (each module's weights are split across ranks as soon as
  it is constructed), then each rank copies in its own flat partition of every tensor, reading only the rows
  that partition covers.
- Pipeline / tensor / expert parallel: built on the meta device, parallelised there, and only what this rank
  keeps gets memory; each rank reads its stages' layers and its TP/EP slices.
- ZeRO-0/1/2 data parallel keeps the whole model on every rank by design; the model is read once per rank.

A fresh model takes the same paths, with `FreshWeights` (dstrain.model.init) in place of the folder: each
tensor's values come from a generator of its own, so every layout starts from one process's values.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dstrain.config.plan import RunPlan
from dstrain.model import DeepSeekLM, ModelConfig
from dstrain.model.init import FreshWeights, init_weights, local_tensors, model_class
from dstrain.model.loading import check_folder, fill_from_hf, materialize, open_folder, warn_fresh_mtp
from dstrain.model.lora import init_adapters
from dstrain.model.reader import HFReader
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
    cfg, seed, folder = plan.model, plan.opts.run.seed, plan.model_folder
    reader = open_folder(folder, cfg) if folder is not None else None
    with PeakRSS() as peak, contextlib.ExitStack() as stack:
        if reader is not None:
            stack.enter_context(reader)
        if plan.stage == 3:  # partitioned from the start: no rank holds it whole
            model, fresh = _zero3(cfg, reader, plan.ds, seed, device)
        else:
            with torch.device("meta"):  # this rank's tensors get memory once parallelised
                model = model_class(cfg)(cfg)
        dsa_stage = plan.opts.model.dsa_stage if cfg.sparse_attention else None
        apply_finetune_options(model, plan.opts.lora, seed, dsa_stage)
        built = Built(model, model) if plan.stage == 3 else _parallel(model, plan, rank, device, objective)
        if plan.stage != 3:
            if not plan.dims.model_parallel:
                materialize(model, device)
            fresh = fill_from_hf(model, reader, seed) if reader is not None else init_weights(model, seed)
            init_adapters(model, seed)
    built.load = {"bytes_drawn": fresh.bytes_drawn, "peak_rss_growth": peak.growth}
    if reader is not None:
        built.load |= {"bytes_read": reader.bytes_read, "checkpoint_bytes": reader.total_bytes}
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
def _zero3(
    cfg: ModelConfig, reader: HFReader | None, ds: dict[str, Any], seed: int, device: torch.device
) -> tuple[DeepSeekLM, FreshWeights]:
    """Built under DeepSpeed's partitioned init; then each rank copies in its own flat partition of every
    tensor, reading only the rows that partition covers, from the folder or (what the folder lacks, everything
    for a fresh model) from the fresh values."""
    import deepspeed
    import torch.distributed as tdist
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    NVME = OffloadDeviceEnum.nvme  # noqa: N806

    with deepspeed.zero.Init(config_dict_or_path=ds):  # its dtype argument picks bf16 on CPU (0.19.8)
        model = model_class(cfg)(cfg)
    missing = check_folder(reader, cfg) if reader is not None else None
    fresh = FreshWeights(cfg, seed, device)
    for name, t in local_tensors(model):
        source = fresh if reader is None or name in missing else reader
        if not hasattr(t, "ds_id"):  # the expert bias: a buffer, replicated
            t.copy_(source.read(name))
            continue
        part = t.ds_tensor
        if (
            getattr(t, "ds_secondary_tensor", None) is not None
            or getattr(part, "final_location", None) == NVME
        ):
            # hierarchical partitions or NVMe offload: let DeepSpeed spread one rank's whole copy
            with deepspeed.zero.GatheredParameters([t], modifier_rank=0):
                if tdist.get_rank() == 0:
                    t.data.copy_(source.read(name))
            continue
        start = tdist.get_rank(group=t.ds_process_group) * part.numel()
        part.data.copy_(source.read_flat(name, start, start + part.numel()))
    if reader is not None:
        warn_fresh_mtp(reader.path, cfg, missing)
    return model, fresh


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
