"""The resolved run: options, model config, DeepSpeed config and parallel layout, decided once.

`prepare(opts, world, device_type)` does everything that needs no process group and allocates nothing: the DeepSpeed JSON
is read and its "auto" fields filled, the model config built with the options' overrides, the layout checked
against the model and the ZeRO stage, a `--model` folder's headers checked against its config. Every later
component (the trainer, the builders, checkpoints, tests, benchmarks) reads this `RunPlan` and derives
nothing from the raw JSON again.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from dstrain import dist
from dstrain.errors import ConfigError
from dstrain.model import ModelConfig, family_of, get_config
from dstrain.parallel import ParallelDims

from .ds_config import (
    finalize_paths,
    layout_sections,
    load_ds_config,
    offloaded,
    resolve_ds_config,
    resolve_layout,
    resolve_precision,
    write_resolved,
    zero_stage,
)
from .ds_file import AUTO, UserFile, adopt, check_top_level, split_layout
from .options import Options


@dataclass(frozen=True)
class RunPlan:
    opts: Options
    """The options, by section."""
    model: ModelConfig
    """The model config that trains: the preset's or the folder's, with the options' overrides."""
    ds: dict[str, Any]
    """What deepspeed.initialize gets: DeepSpeed's own keys only, every "auto" filled."""
    dims: ParallelDims
    """The parallel layout."""
    stage: int
    """ZeRO stage."""
    precision: str
    """'fp32' or 'bf16' (bf16 weights and activations, fp32 master weights)."""
    offload: bool
    """Optimizer states and step on the CPU (ZeRO offload_optimizer)."""
    device_type: str
    """'cuda' or 'cpu': the machine the run is resolved for."""
    model_folder: str | None = None
    """The Hugging Face folder --model names, whose weights are loaded; None for a preset (built fresh)."""
    notes: tuple[str, ...] = ()
    """Lines to show the user at start (deprecated config forms, ...)."""
    output_dir: str | None = None
    """The run folder; set by `with_output_dir` once the ranks agree on it."""

    @property
    def global_batch_rows(self) -> int:
        """Rows per optimizer step over all data-parallel ranks (DeepSpeed counts each sequence-parallel
        rank's slice as a row of its own)."""
        return int(self.ds["train_batch_size"]) // self.dims.sp

    def with_output_dir(self, output_dir: str) -> RunPlan:
        """The plan writing under `output_dir` (DeepSpeed monitors with an "auto" output path go there)."""
        ds = copy.deepcopy(self.ds)
        finalize_paths(ds, output_dir)
        return dataclasses.replace(self, ds=ds, output_dir=output_dir)

    def write_resolved(self) -> str:
        """ds_config.resolved.json in the run folder: the DeepSpeed config as it runs, with dstrain's layout
        sections (a valid --config for the same run)."""
        assert self.output_dir is not None, "with_output_dir first"
        return write_resolved({**self.ds, **layout_sections(self.dims)}, self.output_dir)


def model_config(opts: Options, base: ModelConfig | None = None) -> ModelConfig:
    """The model config that trains: `base` (default: the --model preset or folder's) with the overrides."""
    if base is None:
        try:
            base = get_config(opts.model.model)
        except ValueError as exc:
            raise ConfigError(f"--model {opts.model.model}: {exc}") from None
    return base.replace(**opts.model.config_overrides())


def prepare(
    opts: Options, world: int | None = None, device_type: str | None = None, model: ModelConfig | None = None
) -> RunPlan:
    """Resolve the run for `world` ranks (default: what the launcher announced) on `device_type` ('cuda' or
    'cpu'; default: this machine's accelerator, which is then set up for this rank): the one place that
    decides what the target machine means for precision, pinning and overlap. `model` replaces the --model
    config (tests and benchmarks use their own shapes; `dstrain plan` a folder's config.json alone, whose
    weights are then not checked). Raises ConfigError."""
    world = dist.launcher_world_size() if world is None else world
    device_type = dist.pick_accelerator() if device_type is None else device_type
    path, raw = load_ds_config(opts.layout.config)
    check_top_level(raw, f"--config {path}")
    user = split_layout(raw)
    opts = adopt(opts, user.ds)
    dims = resolve_layout(user, opts.layout, world)
    opts = _accumulation_from_train_batch(opts, user, dims)
    cfg = model_config(opts, model)
    precision = resolve_precision(opts.layout.precision, user.ds, device_type)
    ds = resolve_ds_config(
        user,
        dims,
        opts.layout,
        opts.optimizer,
        opts.schedule,
        precision=precision,
        device_type=device_type,
        hidden_size=cfg.hidden_size,
    )
    stage = zero_stage(ds)
    offload = offloaded(ds["zero_optimization"], "offload_optimizer")
    if opts.run.nan_policy == "skip" and stage == 0:
        raise ConfigError(
            "--nan_policy skip needs zero_optimization.stage >= 1 (stage 0 cannot skip an update)"
        )
    if stage == 0 and precision == "bf16":
        # DeepSpeed's bf16 wrapper without ZeRO keeps the fp32 master weights and moments in flat buffers that
        # its own accessors do not reach: a checkpoint would hold bf16 weights and its first save fail.
        raise ConfigError(
            "zero_optimization.stage=0 with bf16: not supported (DeepSpeed's fp32 master copy there is not "
            "checkpointable); use --config zero1, the same training with the master copy partitioned"
        )
    try:
        dims.validate(cfg, stage, offload=offload)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if dims.sp > 1 and opts.data.seq_len % dims.sp:
        raise ConfigError(f"--sp {dims.sp} must divide --seq_len {opts.data.seq_len}")
    if dims.sp > 1 and opts.model.compile:
        raise ConfigError(f"--sp {dims.sp} with --compile: not supported yet (run eager)")
    mode, modes = opts.model.activation_checkpointing, family_of(cfg).checkpointing
    if mode not in modes:
        raise ConfigError(f"--activation_checkpointing {mode}: {cfg.model_type} takes {', '.join(modes)}")
    folder = opts.model.model if os.path.isdir(opts.model.model) else None
    if folder is not None and model is None:
        check_model_folder(folder, cfg)
    opts, cfg = _sparse_attention_stage(opts, cfg, folder)
    notes = user.notes
    lora = opts.lora
    if lora.lora_r % 8 and "experts" in lora.targets:  # experts.py: r is a grouped GEMM's inner size
        notes += (
            f"--lora_r {lora.lora_r}: the routed experts' adapters run one GEMM per expert with a host sync "
            "per MoE layer; a multiple of 8 keeps them in grouped GEMMs",
        )
    return RunPlan(opts, cfg, ds, dims, stage, precision, offload, device_type, folder, notes)


def _sparse_attention_stage(
    opts: Options, cfg: ModelConfig, folder: str | None
) -> tuple[Options, ModelConfig]:
    """--dsa_stage resolved ('auto': frozen for a checkpoint, sparse for a fresh model); the dense warm-up
    keeps the experts' balancing bias as it is (everything but the indexers is frozen)."""
    stage = opts.model.dsa_stage
    if not cfg.sparse_attention:
        if "dsa_stage" in opts.given or "indexer_loss_coef" in opts.given:
            raise ConfigError(f"--dsa_stage / --indexer_loss_coef: {cfg.model_type} has no sparse attention")
        return opts, cfg
    if stage == "auto":
        stage = "frozen" if folder is not None else "sparse"
    if stage == "dense":
        cfg = cfg.replace(bias_update_speed=0.0)
    return dataclasses.replace(opts, model=dataclasses.replace(opts.model, dsa_stage=stage)), cfg


def _accumulation_from_train_batch(opts: Options, user: UserFile, dims: ParallelDims) -> Options:
    """An explicit train_batch_size with accumulation set nowhere fixes the accumulation, as in the
    transformers integration: train_batch_size / (micro batch x data-parallel ranks)."""
    total = user.ds.get("train_batch_size", AUTO)
    layout = opts.layout
    if total == AUTO or "gradient_accumulation_steps" in opts.given:
        return opts
    if user.ds.get("gradient_accumulation_steps", AUTO) != AUTO:
        return opts
    per_step = layout.micro_batch_size * dims.dp
    if not isinstance(total, int) or total % per_step:
        raise ConfigError(
            f"ds_config train_batch_size={total} is not a multiple of --micro_batch_size "
            f"{layout.micro_batch_size} x {dims.dp} data-parallel ranks"
        )
    layout = dataclasses.replace(layout, gradient_accumulation_steps=total // per_step)
    return dataclasses.replace(opts, layout=layout)


def check_model_folder(path: str, cfg: ModelConfig) -> None:
    """A folder that does not fit its own config.json is a one-line error here, before any process group or
    allocation (headers only: nothing is read)."""
    from dstrain.model.sources import check_folder, open_folder

    try:
        with open_folder(path, cfg) as reader:
            check_folder(reader, cfg)
    except ValueError as exc:
        raise ConfigError(f"--model {path}: {exc}") from None
