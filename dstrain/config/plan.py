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
from dstrain.data.sources import check_local_sources
from dstrain.errors import ConfigError
from dstrain.model import ModelConfig, family_of, get_config
from dstrain.model.build import trainable_counts
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
    lr_origin: str = "given"
    """Where --lr (and --min_lr) came from: "given" (flag, recipe or the DeepSpeed file), or the default."""
    trains: tuple[int, int, tuple[str, ...]] = (1, 1, ())
    """(elements that train, all elements, LoRA-adapted module names): `model.build.trainable_counts`."""
    stored_base: bool = False
    """The frozen weights the folder stores quantized are held in that form (--base_precision)."""
    qat: bool = False
    """The weights that train and that the folder stores quantized train fake-quantized (--qat)."""

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
    changes = opts.model.config_overrides()
    if opts.lora.lora_r > 0:
        # LoRA leaves the base model as it came, so the adapters serve alone (vLLM, peft): the expert bias is a
        # base-model buffer, kept unless --moe_bias_update_speed asks for it to move
        changes.setdefault("bias_update_speed", 0.0)
    if opts.objective.objective == "dpo":
        # DPO moves the policy only as far as the preference asks: no load balancing (the routers are frozen,
        # so the balance loss could only bend the hidden states) and no MTP loss on rejected completions
        for name in ("bias_update_speed", "aux_loss_alpha", "mtp_loss_weight"):
            changes.setdefault(name, 0.0)
    return base.replace(**changes)


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
    opts, lr_origin = default_lr(opts)
    defaulted = opts.schedule.lr
    opts = adopt(opts, user.ds)
    lr_origin = lr_origin if opts.schedule.lr == defaulted else "given"  # the DeepSpeed file's own lr
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
    mtp_notes: tuple[str, ...] = ()
    if folder is not None and model is None:
        cfg, mtp_notes = _mtp_of_folder(opts, cfg, folder, check_model_folder(folder, cfg))
    opts, cfg = _sparse_attention_stage(opts, cfg, folder)
    notes = user.notes + mtp_notes
    check_local_sources(opts.data)
    if opts.objective.objective == "dpo":
        opts = _dpo_reference(opts, cfg)
    opts = _family_lora_targets(opts, cfg)
    lora = opts.lora
    try:  # on a meta-device copy: a target matching nothing is one line before anything exists
        trains = trainable_counts(cfg, lora, opts.model.dsa_stage)
    except ValueError as exc:
        raise ConfigError(f"--lora_targets {lora.lora_targets}: {exc}") from None
    if lora.lora_r % 8 and "experts" in lora.targets:  # experts.py: r is a grouped GEMM's inner size
        notes += (
            f"--lora_r {lora.lora_r}: the routed experts' adapters run one GEMM per expert with a host sync "
            "per MoE layer; a multiple of 8 keeps them in grouped GEMMs",
        )
    quantized = folder is not None and folder_is_quantized(folder, cfg)  # the files' headers, read once
    stored, why = _base_precision(opts, folder, quantized, cfg, dims)
    qat, qat_why = _qat(opts, quantized and has_weights(folder), dims)  # a config.json alone trains nothing
    if (stored or qat) and dims.tp > 1 and has_weights(folder):
        _check_tp_blocks(opts, folder, cfg, dims, stored, qat)
    return RunPlan(
        opts, cfg, ds, dims, stage, precision, offload, device_type, folder, notes + why + qat_why, None,
        lr_origin, trains, stored, qat,
    )  # fmt: skip


def _qat(opts: Options, quantized: bool, dims: ParallelDims) -> tuple[bool, tuple[str, ...]]:
    """--qat resolved: (train the folder's quantized weights fake-quantized, the line saying so)."""
    asked = opts.lora.qat
    if asked == "off":
        return False, ()
    if not quantized:
        if asked == "on":
            raise ConfigError(
                f"--qat on: needs a --model folder with quantized weights; {opts.model.model} has none"
            )
        return False, ()
    return True, (
        f"QAT on (--qat {asked}): the weights the export quantizes train as it quantizes them, gradients straight "
        "through, so the exported model computes what trained (--qat off for a bf16 export)",
    )


def _base_precision(
    opts: Options, folder: str | None, quantized: bool, cfg: Any, dims: ParallelDims
) -> tuple[bool, tuple[str, ...]]:
    """--base_precision resolved: (hold the frozen quantized weights stored, the line saying so). A folder
    with only its config.json (`dstrain plan`) is quantized when the config says so."""
    asked = opts.lora.base_precision
    if asked == "stored" and not quantized:
        raise ConfigError(
            "--base_precision stored: needs a --model folder with quantized weights (FP8, FP4 or INT4); "
            f"{opts.model.model} has none"
        )
    if asked == "stored" and opts.lora.lora_r == 0:
        raise ConfigError("--base_precision stored: a full fine-tune trains every weight; add --lora_r")
    stored = quantized and opts.lora.lora_r > 0 and asked != "bf16"
    if not quantized:
        return False, ()
    if stored:
        return True, (
            "frozen base: the folder's quantized weights kept as stored (--base_precision stored, the default "
            "under LoRA: the same values in their stored bytes; bf16 dequantizes them)",
        )
    return False, ("frozen base: the folder's quantized weights dequantized into the run's precision",)


def _check_tp_blocks(
    opts: Options, folder: str, cfg: Any, dims: ParallelDims, stored: bool, qat: bool
) -> None:
    """The tensor-parallel split of every stored weight (and of every quantizer's scales under QAT) takes whole
    blocks (FP8's 128 x 128 scales, INT4's groups): tried on a meta-device model, before anything is allocated."""
    from dstrain.model.build import finetune_on_meta
    from dstrain.model.quantized import apply_qat, store_base
    from dstrain.model.sources import open_folder
    from dstrain.parallel.dims import Groups
    from dstrain.parallel.tp import apply_tensor_parallel

    model, _ = finetune_on_meta(cfg, opts.lora, opts.model.dsa_stage)
    with open_folder(folder, cfg) as reader:
        if stored:
            store_base(model, reader)
        if qat:
            apply_qat(model, reader)
    try:
        apply_tensor_parallel(model, Groups(dims, 0, 0, 0, 0, 0, 0))
    except ValueError as exc:
        held = " and ".join(f for f, on in (("--base_precision stored", stored), ("QAT", qat)) if on)
        raise ConfigError(
            f"--tp {dims.tp} with {held}: {exc}; --base_precision bf16 --qat off splits it"
        ) from None


def has_weights(path: str) -> bool:
    from dstrain.model.hf import checkpoint_files

    try:
        return bool(checkpoint_files(path))
    except ValueError:
        return False


def folder_is_quantized(path: str, cfg: ModelConfig) -> bool:
    """Whether the folder stores any of the model's weights quantized (its files' headers; a folder of
    config.json alone: its quantization_config)."""
    from dstrain.model.sources import open_folder

    if not has_weights(path):
        return "quantization_config" in getattr(cfg, "extra", {})
    with open_folder(path, cfg) as reader:
        return any(reader.stored_form(k) for k in reader.sources)


def _family_lora_targets(opts: Options, cfg: Any) -> Options:
    """--lora_targets not given: the model family's default (their names differ: V4 has no kv_b_proj)."""
    if "lora_targets" in opts.given or opts.lora.lora_r <= 0:
        return opts
    family = family_of(cfg)
    if not family.lora_targets:
        raise ConfigError(
            f"--lora_targets: {family.name} has no default LoRA targets; name the modules to adapt"
        )
    lora = dataclasses.replace(opts.lora, lora_targets=",".join(family.lora_targets))
    return dataclasses.replace(opts, lora=lora)


# The learning rates a run gets where no flag, recipe or DeepSpeed file sets one: the built-in demo's for a
# preset; for a fine-tune of a folder, DeepSeek-V3's SFT (its report, section 5.1: cosine from 5e-6 to 1e-6),
# and under LoRA ten times that ("LoRA Without Regret", Schulman et al. 2025: LoRA's best lr is about 10x full
# fine-tuning's); DPO: TRL's DPOConfig default (1e-6), ten times that under LoRA. The demo's 3e-3 on a pretrained model collapses its routing within a few steps.
DEFAULT_LRS = {
    "preset default": (3e-3, None),
    "full fine-tune default (DeepSeek-V3's SFT)": (5e-6, 1e-6),
    "LoRA fine-tune default (10x full fine-tuning's)": (5e-5, 5e-6),
    "full DPO default (TRL's)": (1e-6, None),
    "LoRA DPO default (10x full DPO's)": (1e-5, None),
}


def default_lr(opts: Options) -> tuple[Options, str]:
    """`opts` with the default lr (and min_lr) for its kind of run where none was given -> (opts, its origin)."""
    if "lr" in opts.given:
        return opts, "given"
    if not os.path.isdir(opts.model.model):
        origin = "preset default"
    elif opts.objective.objective == "dpo":
        origin = "LoRA DPO default (10x full DPO's)" if opts.lora.lora_r > 0 else "full DPO default (TRL's)"
    else:
        origin = (
            "LoRA fine-tune default (10x full fine-tuning's)"
            if opts.lora.lora_r > 0
            else "full fine-tune default (DeepSeek-V3's SFT)"
        )
    lr, min_lr = DEFAULT_LRS[origin]
    changes = {"lr": lr}
    if "min_lr" not in opts.given:
        changes["min_lr"] = min_lr  # None: lr / 10
    return dataclasses.replace(opts, schedule=dataclasses.replace(opts.schedule, **changes)), origin


def _dpo_reference(opts: Options, cfg: Any) -> Options:
    """--objective dpo's reference resolved ('auto': the adapters-off model under LoRA, else the precomputed
    log-probabilities of the initial model), the routers and MTP frozen unless asked; the family must support
    DPO (every layout does)."""
    try:
        family_of(cfg).refuse("dpo", "--objective dpo")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    ref = opts.objective.dpo_reference
    if ref == "adapters" and opts.lora.lora_r == 0:
        raise ConfigError(
            "--dpo_reference adapters needs --lora_r > 0 (the reference is the model with its adapters off); "
            "a full fine-tune uses --dpo_reference precomputed"
        )
    if ref == "auto":
        ref = "adapters" if opts.lora.lora_r > 0 else "precomputed"
    # a full fine-tune too keeps the routers and the MTP modules as they are unless asked (LoRA's defaults)
    frozen = {k: False for k in ("train_router", "train_mtp") if k not in opts.given}
    return dataclasses.replace(
        opts,
        objective=dataclasses.replace(opts.objective, dpo_reference=ref),
        lora=dataclasses.replace(opts.lora, **frozen),
    )


def _sparse_attention_stage(
    opts: Options, cfg: ModelConfig, folder: str | None
) -> tuple[Options, ModelConfig]:
    """--dsa_stage resolved ('auto': sparse for a fresh model; for a checkpoint its variant's fine-tuning stage,
    frozen under LoRA); the dense warm-up keeps the experts' balancing bias as it is (everything but the
    indexers is frozen)."""
    stage = opts.model.dsa_stage
    if not cfg.sparse_attention:
        if "dsa_stage" in opts.given or "indexer_loss_coef" in opts.given:
            raise ConfigError(f"--dsa_stage / --indexer_loss_coef: {cfg.model_type} has no sparse attention")
        return opts, cfg
    if stage == "auto":  # LoRA keeps the base model as loaded, its indexers included
        stage = "sparse" if folder is None else "frozen" if opts.lora.lora_r > 0 else cfg.finetune_dsa_stage
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


def check_model_folder(path: str, cfg: ModelConfig) -> list[str]:
    """A folder that does not fit its own config.json is a one-line error here, before any process group or
    allocation (headers only: nothing is read). -> the tensors it lacks that may start fresh."""
    from dstrain.model.sources import check_folder, open_folder

    try:
        with open_folder(path, cfg) as reader:
            return check_folder(reader, cfg)
    except ValueError as exc:
        raise ConfigError(f"--model {path}: {exc}") from None


def _mtp_of_folder(opts: Options, cfg: Any, folder: str, missing: list[str]) -> tuple[Any, tuple[str, ...]]:
    """A folder without MTP weights (transformers' save_pretrained drops them) fine-tunes without MTP unless
    --train_mtp or --mtp_loss_weight asks for fresh MTP modules: an untrained module's loss would enter the
    objective and its gradient reach shared weights and adapters, and the export would ship it. -> (config,
    notes)."""
    depth = cfg.num_nextn_predict_layers
    if not depth or not any(k.startswith("mtp.") for k in missing):
        return cfg, ()
    if {"train_mtp", "mtp_loss_weight"} & opts.given:
        return cfg, (f"{folder} has no MTP weights: its {depth} MTP module(s) start fresh and train",)
    return cfg.replace(num_nextn_predict_layers=0), (
        f"{folder} has no MTP weights: MTP is off for this run (not trained, not exported; its config's "
        f"num_nextn_predict_layers={depth} is not carried over); --train_mtp trains fresh MTP modules",
    )
