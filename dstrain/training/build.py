"""The model the trainer hands to DeepSpeed, in the training layout: built fresh, or loaded from a Hugging Face
folder so that no rank holds more of it than it trains.

- ZeRO-3: built under DeepSpeed's partitioned init (each module's weights are split across ranks as soon as
  it is constructed), then each rank copies in its own flat partition of every tensor, reading only the rows
  that partition covers; a fresh model is initialised one gathered module at a time, as `build_model` would.
- Pipeline / tensor / expert parallel: built on the meta device, parallelised there, and only what this rank
  keeps gets memory; each rank reads its stages' layers and its TP/EP slices.
- ZeRO-0/1/2 data parallel keeps the whole model on every rank by design; the model is read once per rank.
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
from dstrain.model import DeepSeekLM, ModelConfig, build_model
from dstrain.model.loading import (
    check_folder,
    fill_from_hf,
    fresh_init_,
    local_tensors,
    materialize,
    warn_fresh_mtp,
)
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
    reader = HFReader(folder, cfg) if folder is not None else None
    with PeakRSS() as peak, contextlib.ExitStack() as stack:
        if reader is not None:
            stack.enter_context(reader)
        if plan.stage == 3 and reader is not None:  # partitioned from the start: no rank holds it whole
            model = _zero3_from_hf(cfg, reader, plan.ds, seed)
        elif plan.stage == 3:
            model = _zero3_fresh(cfg, plan.ds, seed, device)
        elif reader is not None:
            with torch.device("meta"):  # this rank's tensors get memory once parallelised
                model = DeepSeekLM(cfg)
        else:
            model = build_model(cfg, device=device, dtype=torch.float32, seed=seed)
        dsa_stage = plan.opts.model.dsa_stage if cfg.sparse_attention else None
        apply_finetune_options(model, plan.opts.lora, seed, dsa_stage)
        built = Built(model, model) if plan.stage == 3 else _parallel(model, plan, rank, device, objective)
        if reader is None:
            return built
        if plan.stage != 3:
            if not plan.dims.model_parallel:
                materialize(model, device)
            fill_from_hf(model, reader, seed)
            init_adapters(model, seed)
        built.load = {"bytes_read": reader.bytes_read, "checkpoint_bytes": reader.total_bytes}
    built.load["peak_rss_growth"] = peak.growth
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
def _zero3_fresh(cfg: ModelConfig, ds: dict[str, Any], seed: int, device: torch.device) -> DeepSeekLM:
    """Built under DeepSpeed's partitioned init, then initialised one whole module at a time (gathered, set
    by rank 0, partitioned again) in the order of `build_model(cfg, seed=seed)`: the same values in fp32;
    in bf16 the partitions are bf16 from the start, so the values are sampled in bf16."""
    import deepspeed

    with deepspeed.zero.Init(config_dict_or_path=ds):  # its dtype argument picks bf16 on CPU (0.19.8)
        model = DeepSeekLM(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)

    def gather(module: nn.Module) -> Any:
        return deepspeed.zero.GatheredParameters(list(module.parameters(recurse=False)), modifier_rank=0)

    model.init_weights(gen, gather=gather)
    return model


@torch.no_grad()
def _zero3_from_hf(cfg: ModelConfig, reader: HFReader, ds: dict[str, Any], seed: int) -> DeepSeekLM:
    import deepspeed
    import torch.distributed as tdist
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum

    NVME = OffloadDeviceEnum.nvme  # noqa: N806

    with deepspeed.zero.Init(config_dict_or_path=ds):
        model = DeepSeekLM(cfg)
    missing = check_folder(reader, cfg)
    for name, t in local_tensors(model):
        if not hasattr(t, "ds_id"):  # the expert bias: a buffer, replicated
            t.copy_(reader.read(name)) if name not in missing else t.zero_()
            continue
        part = t.ds_tensor
        if (
            getattr(t, "ds_secondary_tensor", None) is not None
            or getattr(part, "final_location", None) == NVME
        ):
            # hierarchical partitions or NVMe offload: let DeepSpeed spread one rank's whole copy
            with deepspeed.zero.GatheredParameters([t], modifier_rank=0):
                if tdist.get_rank() == 0:
                    if name in missing:
                        fresh_init_(name, t.data, cfg.initializer_range, seed)
                    else:
                        t.data.copy_(reader.read(name))
            continue
        start = tdist.get_rank(group=t.ds_process_group) * part.numel()
        if name in missing:
            fresh_init_(name, part.data, cfg.initializer_range, seed, part=str(start))
        else:
            part.data.copy_(reader.read_flat(name, start, start + part.numel()))
    warn_fresh_mtp(reader.path, cfg, missing)
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
