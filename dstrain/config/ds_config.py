"""DeepSpeed config: load, fill the "auto" fields dstrain owns from its options, validate, before anything
is allocated. dstrain's options are the one source of truth for batch sizes, clipping, precision and the
optimizer/scheduler settings: the file's explicit values have become options already where the user set no
flag (ds_file.adopt), so an explicit value that still differs contradicts a flag and is an error naming both.
`plan.prepare` calls this once per run; nothing downstream reads the raw JSON."""

from __future__ import annotations

import copy
import difflib
import json
import os
import typing
from pathlib import Path
from typing import Any

from dstrain.atomic import write_json
from dstrain.errors import ConfigError
from dstrain.parallel import ParallelDims

from .ds_file import (
    AUTO,
    DS_SCHEDULER_TYPES,
    OWN_SECTION,
    TORCH_COMPILE_OK,
    TYPO_CUTOFF,
    UserFile,
    is_comment,
    optimizer_type,
)
from .ds_file import fmt_value as _fmt
from .options import LayoutOptions, OptimizerOptions, ScheduleOptions

# ds_configs/ at the repository root, shipped inside the package (a link in a checkout, files in a wheel)
SHIPPED_DIR = Path(__file__).parent / "ds_configs"
RESOLVED = "ds_config.resolved.json"
OPTIMIZER_PARAMS = {"lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode", "foreach", "fused"}
# DeepSpeed's Muon section (runtime/engine.py _muon_param_groups): the shared lr, each half's own, Muon's
# momentum and Newton-Schulz form, AdamW's betas and eps, per-head orthogonalisation
MUON_PARAMS = {
    "lr",
    "muon_lr",
    "adam_lr",
    "betas",
    "eps",
    "weight_decay",
    "momentum",
    "ns_method",
    "per_head_muon",
}
SCHEDULER_PARAMS = {
    "WarmupCosineLR": {
        "total_num_steps",
        "warmup_num_steps",
        "warmup_min_ratio",
        "cos_min_ratio",
        "warmup_type",
    },
    "WarmupDecayLR": {"total_num_steps", "warmup_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_type"},
    "WarmupLR": {"warmup_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_type"},
}
BF16_KEYS = {
    "enabled",
    "immediate_grad_update",
    "check_grad_overflow",
    "bf16_master_weights_and_grads",
    "bf16_optimizer_states",
}


def config_path(spec: str | None) -> Path:
    """A JSON path, or the name of a shipped config (zero3 -> ds_configs/zero3.json)."""
    spec = spec or os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") or "zero1"
    for cand in (Path(spec), SHIPPED_DIR / spec, SHIPPED_DIR / f"{spec}.json"):
        if cand.is_file():
            return cand
    shipped = ", ".join(sorted(p.stem for p in SHIPPED_DIR.glob("*.json")))
    raise ConfigError(f"--config {spec}: no such file (shipped configs: {shipped})")


def load_ds_config(spec: str | None) -> tuple[Path, dict[str, Any]]:
    path = config_path(spec)
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a JSON object")
    return path, raw


def _own(section: dict[str, Any], key: str, value: Any, flag: str, where: str) -> None:
    """Fill an owned key: 'auto'/absent -> value; an explicit different value -> error naming both."""
    have = section.get(key, AUTO)
    if have == AUTO:
        section[key] = value
        return
    same = have == value
    if isinstance(value, float) or isinstance(have, float):
        try:
            same = abs(float(have) - float(value)) <= 1e-12 * max(1.0, abs(float(value)))
        except (TypeError, ValueError):
            same = False
    if isinstance(value, list) and isinstance(have, list):
        same = len(have) == len(value) and all(abs(float(a) - float(b)) <= 1e-12 for a, b in zip(have, value))
    if not same:
        raise ConfigError(f"ds_config {where}{key}={_fmt(have)} conflicts with {flag}")


def _check_keys(section: dict[str, Any], allowed: set[str], where: str) -> None:
    for key in section:
        if key not in allowed:
            near = difflib.get_close_matches(key, sorted(allowed), n=1, cutoff=TYPO_CUTOFF)
            hint = f"did you mean {near[0]!r}?" if near else f"allowed: {', '.join(sorted(allowed))}"
            raise ConfigError(f"ds_config {where}{key}: unknown key ({hint})")


def resolve_precision(precision: str, raw: dict[str, Any], device_type: str) -> str:
    """--precision (auto, fp32, bf16) and the config's bf16 section -> 'fp32' or 'bf16'."""
    bf16 = raw.get("bf16", raw.get("bfloat16", {})).get("enabled", AUTO)
    if (raw.get("fp16") or {}).get("enabled") not in (None, False, AUTO):
        raise ConfigError(
            "ds_config fp16.enabled=true: dstrain trains in bf16 or fp32, not fp16 (fp16 needs dynamic loss "
            "scaling, which its global-batch loss and NaN policy do not implement); use bf16 on Ampere or newer "
            "GPUs, --precision fp32 on V100 / T4"
        )
    if precision == "auto":
        if bf16 in (True, False):
            return "bf16" if bf16 else "fp32"
        return "bf16" if native_bf16(device_type) else "fp32"
    if bf16 not in (AUTO, precision == "bf16"):
        raise ConfigError(f"ds_config bf16.enabled={_fmt(bf16)} conflicts with --precision {precision}")
    return precision


def native_bf16(device_type: str) -> bool:
    """Whether `device_type` computes in bf16 natively: a CUDA GPU that has it (not emulated); GPUs planned for
    from a machine without one (`dstrain plan`) are taken to be current ones, which all have it."""
    if device_type != "cuda":
        return False
    import torch

    if not torch.cuda.is_available():
        return True
    return torch.cuda.is_bf16_supported(including_emulation=False)


def resolve_ds_config(
    user: UserFile,
    dims: ParallelDims,
    layout: LayoutOptions,
    optimizer: OptimizerOptions,
    schedule: ScheduleOptions,
    *,
    precision: str,
    device_type: str,
    hidden_size: int,
) -> dict[str, Any]:
    """-> the config deepspeed.initialize gets for `dims` on `device_type` ('cuda' or 'cpu'), holding
    DeepSpeed's keys only. Raises ConfigError naming the offending key and value."""
    ds = copy.deepcopy(user.ds)
    zero = ds.setdefault("zero_optimization", {})
    stage = zero_stage(ds)
    _write_layout(ds, dims)

    mbs, ga = layout.micro_batch_size, layout.gradient_accumulation_steps
    _own(ds, "train_micro_batch_size_per_gpu", mbs, f"--micro_batch_size {mbs}", "")
    _own(ds, "gradient_accumulation_steps", ga, f"--gradient_accumulation_steps {ga}", "")
    want = mbs * ga * dims.dp
    if ds.get("train_batch_size", AUTO) not in (AUTO, want):
        raise ConfigError(
            f"ds_config train_batch_size={_fmt(ds['train_batch_size'])} != --micro_batch_size {mbs}"
            f" x --gradient_accumulation_steps {ga} x {dims.dp} data-parallel ranks = {want}"
        )
    ds["train_batch_size"] = want
    clip = optimizer.clip_grad
    _own(ds, "gradient_clipping", float(clip), f"--clip_grad {clip}", "")

    bf16 = ds.pop("bfloat16", None) or ds.setdefault("bf16", {})
    ds["bf16"] = bf16
    _check_keys(bf16, BF16_KEYS, "bf16.")
    bf16["enabled"] = precision == "bf16"
    ds.setdefault("fp16", {})["enabled"] = False

    offload_opt = offloaded(zero, "offload_optimizer")
    if offloaded(zero, "offload_param") and stage != 3:
        raise ConfigError(f"ds_config zero_optimization.offload_param needs stage 3 (stage={stage})")
    if offload_opt and stage == 0:
        raise ConfigError("ds_config zero_optimization.offload_optimizer needs stage >= 1 (stage=0)")
    _resolve_optimizer(ds, optimizer, schedule, offload_opt, dims)
    _resolve_scheduler(ds, schedule)
    _resolve_zero_autos(zero, hidden_size, device_type)
    # dstrain prints its own progress; DeepSpeed's every-10-steps lines would interleave with it.
    if ds.get("steps_per_print", AUTO) == AUTO:
        ds["steps_per_print"] = 2**31 - 1
    _validate_with_deepspeed(ds)
    # dstrain compiles each block itself (--compile, which the section's torch.compile keys set: ds_file.adopt);
    # DeepSpeed 0.19's section configures DeepCompile, which only engine.compile() runs and dstrain refuses,
    # and it refuses the older torch.compile keys.
    ds.pop("compile", None)
    _check_monitors(ds)
    leftover = _find_auto(ds)
    if leftover:
        raise ConfigError(f"ds_config {leftover}='auto': dstrain does not fill this setting; give a value")
    return ds


def zero_stage(ds: dict[str, Any]) -> int:
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)
    if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage <= 3:
        raise ConfigError(f"ds_config zero_optimization.stage={_fmt(stage)}: must be 0, 1, 2 or 3")
    return stage


OFFLOADS = ("offload_optimizer", "offload_param")


def offloaded(zero: dict[str, Any], section: str) -> bool:
    """Whether the zero_optimization section `zero` puts `section` (offload_optimizer: the optimizer states
    and step; offload_param: ZeRO-3's parameters) on the CPU or NVMe."""
    return ((zero or {}).get(section) or {}).get("device", "none") not in ("none", None)


def _pipeline_section(ds: dict[str, Any]) -> dict[str, Any]:
    pipe = ds.get("pipeline")
    if pipe is None:
        return {}
    if not isinstance(pipe, dict):
        raise ConfigError(f'ds_config pipeline={_fmt(pipe)}: expected an object like {{"stages": 2}}')
    _check_keys(pipe, {"stages", "partition", "activation_checkpoint_interval", "seed_layers"}, "pipeline.")
    return pipe


def resolve_layout(user: UserFile, layout: LayoutOptions, world_size: int) -> ParallelDims:
    """The parallel layout: pipeline.stages, the file's TP / EP sizes (ds_file.split_layout) and
    sequence_parallel_size, filled from --pp/--tp/--ep/--sp (the flag wins over "auto" or absence; an explicit
    different value is an error), checked to tile the world."""
    ds = user.ds
    if ds.get("moe"):
        raise ConfigError(f"ds_config moe={_fmt(ds['moe'])}: set --ep (or {OWN_SECTION}.ep_size) instead")
    found = {
        "pp": (_pipeline_section(ds).get("stages", AUTO), "pipeline.stages"),
        "tp": (user.tp, user.tp_key),
        "ep": (user.ep, user.ep_key),
        # DeepSpeed's Ulysses key, run by dstrain's own (MLA-aware) sequence parallelism
        "sp": (ds.get("sequence_parallel_size", AUTO), "sequence_parallel_size"),
    }
    sizes = {}
    for flag, (have, key) in found.items():
        value = getattr(layout, flag)
        if value is None:
            value = 1 if have == AUTO else have
        elif have not in (AUTO, value):
            raise ConfigError(f"ds_config {key}={_fmt(have)} conflicts with --{flag} {value}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"ds_config {key}={_fmt(value)}: must be a positive integer")
        sizes[flag] = value
    try:
        return ParallelDims(world_size, **sizes)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _write_layout(ds: dict[str, Any], dims: ParallelDims) -> None:
    """The layout in DeepSpeed's terms: its pipeline section (sequence parallelism is dstrain's own)."""
    ds.pop("sequence_parallel_size", None)
    pipe = _pipeline_section(ds)
    if pipe or dims.pp > 1:
        ds["pipeline"] = {**pipe, "stages": dims.pp}
    if dims.pp > 1:
        # Activations are whole tensors between stages (several of them need gradients).
        ds["pipeline"].update(pipe_partitioned=False, grad_partitioned=False)


def layout_sections(dims: ParallelDims) -> dict[str, Any]:
    """dstrain's own layout sections as a config file gives them: the resolved file holds them beside
    DeepSpeed's, so it can be given back as --config."""
    own = {OWN_SECTION: {"tp_size": dims.tp, "ep_size": dims.ep}}
    return {**own, "sequence_parallel_size": dims.sp} if dims.sp > 1 else own


def _resolve_optimizer(
    ds: dict[str, Any], t: OptimizerOptions, schedule: ScheduleOptions, offload_opt: bool, dims: ParallelDims
) -> None:
    opt = ds.setdefault("optimizer", {})
    _check_keys(opt, {"type", "params"}, "optimizer.")
    kind = opt.get("type", AUTO)
    if kind != AUTO and optimizer_type(kind) != t.optimizer:
        raise ConfigError(f"ds_config optimizer.type={kind} conflicts with --optimizer {t.optimizer}")
    if t.optimizer == "muon":
        _resolve_muon(ds, opt, t, schedule, offload_opt, dims)
        return
    opt["type"] = "AdamW"
    params = opt.setdefault("params", {})
    _check_keys(params, OPTIMIZER_PARAMS, "optimizer.params.")
    if params.get("adam_w_mode", True) is not True:
        raise ConfigError("ds_config optimizer.params.adam_w_mode=false: dstrain trains with AdamW")
    _own(params, "lr", float(schedule.lr), f"--lr {schedule.lr}", "optimizer.params.")
    _own(
        params,
        "betas",
        [t.adam_beta1, t.adam_beta2],
        f"--adam_beta1 {t.adam_beta1} --adam_beta2 {t.adam_beta2}",
        "optimizer.params.",
    )
    _own(params, "eps", float(t.adam_eps), f"--adam_eps {t.adam_eps}", "optimizer.params.")
    _own(
        params, "weight_decay", float(t.weight_decay), f"--weight_decay {t.weight_decay}", "optimizer.params."
    )
    # torch's AdamW wherever the optimizer steps, the CPU of an offload included: its fused kernel steps CPU
    # states as fast as DeepSpeed's CPU Adam (50M fp32 parameters: 40.7 against 42.8 ms, 34.4 against 34.6 on 2
    # threads; medians, AVX512 CPU), and gives the same losses, while DeepSpeed's op is C++ built at its first
    # use on each machine (a compiler at run time; ~100 CPU-s) and asks py-cpuinfo in a subprocess per engine.
    # torch_adam=false asks for DeepSpeed's (under offload, its CPU Adam).
    torch_adam = params.get("torch_adam", AUTO)
    if torch_adam != AUTO and not isinstance(torch_adam, bool):  # 0 and 1 are not JSON's false and true
        raise ConfigError(f'ds_config optimizer.params.torch_adam={torch_adam!r}: true, false or "auto"')
    params["torch_adam"] = torch_adam is not False
    # torch's fused AdamW kernel (CPU and CUDA): one pass over the states instead of a kernel per op (4.6x
    # faster than foreach on this project's CPU for 42M parameters).
    if params.get("fused", AUTO) == AUTO:
        if params["torch_adam"] and not params.get("foreach"):
            params["fused"] = True
        else:
            params.pop("fused", None)
    elif params["fused"] and not params["torch_adam"]:
        raise ConfigError(
            "ds_config optimizer.params.fused=true needs torch_adam (DeepSpeed's Adam is not torch's)"
        )


def muon_refusal(dims: ParallelDims, offload_optimizer: bool) -> str | None:
    """Why Muon cannot train in this layout, or None (the run and `dstrain plan`'s layout search ask)."""
    if dims.tp > 1:
        return (
            f"--optimizer muon with --tp {dims.tp}: Newton-Schulz needs each whole matrix and tensor "
            "parallelism splits them (use --ep/--pp/ZeRO instead)"
        )
    if offload_optimizer:
        return (
            "--optimizer muon with zero_optimization.offload_optimizer: Muon steps on the accelerator "
            "(its all-gathers and Newton-Schulz); turn offload_optimizer off"
        )
    return None


def _resolve_muon(
    ds: dict[str, Any],
    opt: dict[str, Any],
    t: OptimizerOptions,
    schedule: ScheduleOptions,
    offload_opt: bool,
    dims: ParallelDims,
) -> None:
    """The section records the run in DeepSpeed's Muon terms (so the resolved file given back as --config
    runs the same); dstrain's own optimizer (dstrain.optim.muon) is what trains, handed to DeepSpeed as a
    client optimizer, and the trainer strips this section from what deepspeed.initialize gets."""
    why = muon_refusal(dims, offload_opt)
    if why is not None:
        raise ConfigError(why)
    opt["type"] = "Muon"
    params = opt.setdefault("params", {})
    for key in OPTIMIZER_PARAMS - MUON_PARAMS:  # AdamW's own settings, left "auto" by a shared file
        if params.get(key) == AUTO:
            del params[key]
    _check_keys(params, MUON_PARAMS, "optimizer.params.")
    where = "optimizer.params."
    # DeepSpeed's meaning: lr is each half's unless adam_lr / muon_lr give that half its own
    lr, muon_lr = float(schedule.lr), float(t.muon_lr if t.muon_lr is not None else schedule.lr)
    adam_flag, muon_flag = f"--lr {schedule.lr}", f"--muon_lr {t.muon_lr if t.muon_lr is not None else lr}"
    if params.get("lr", AUTO) == AUTO:
        params["lr"] = lr
    else:
        if params.get("adam_lr", AUTO) == AUTO:
            _own(params, "lr", lr, adam_flag, where)
        if params.get("muon_lr", AUTO) == AUTO:
            _own(params, "lr", muon_lr, muon_flag, where)
    _own(params, "adam_lr", lr, adam_flag, where)
    _own(params, "muon_lr", muon_lr, muon_flag, where)
    betas = [t.adam_beta1, t.adam_beta2]
    _own(params, "betas", betas, f"--adam_beta1 {t.adam_beta1} --adam_beta2 {t.adam_beta2}", where)
    _own(params, "eps", float(t.adam_eps), f"--adam_eps {t.adam_eps}", where)
    _own(params, "weight_decay", float(t.weight_decay), f"--weight_decay {t.weight_decay}", where)
    _own(params, "momentum", float(t.muon_momentum), f"--muon_momentum {t.muon_momentum}", where)
    _own(params, "per_head_muon", t.muon_per_head, f"--muon_per_head {t.muon_per_head}", where)
    # DeepSpeed's two Newton-Schulz forms compute the same function (gram in fp16 on GPUs); dstrain runs the
    # standard iteration in fp32 for either.
    if params.get("ns_method", AUTO) not in (AUTO, "gram", "standard"):
        raise ConfigError(
            f"ds_config optimizer.params.ns_method={_fmt(params['ns_method'])}: gram or standard"
        )
    params.setdefault("ns_method", "standard")
    ds["zero_allow_untested_optimizer"] = True  # a client optimizer under ZeRO


def _resolve_scheduler(ds: dict[str, Any], t: ScheduleOptions) -> None:
    """dstrain builds the schedule itself (see schedule.py); this section only records it, and an explicit
    value here must agree with the flags."""
    sched = ds.get("scheduler")
    if sched is None:
        return
    _check_keys(sched, {"type", "params"}, "scheduler.")
    names = {v: k for k, v in DS_SCHEDULER_TYPES.items()}
    kind = sched.get("type", AUTO)
    if kind == AUTO:
        kind = names[t.lr_schedule]
    elif kind not in DS_SCHEDULER_TYPES:
        raise ConfigError(
            f"ds_config scheduler.type={kind}: choose from auto, {', '.join(DS_SCHEDULER_TYPES)}"
        )
    elif DS_SCHEDULER_TYPES[kind] != t.lr_schedule:
        raise ConfigError(f"ds_config scheduler.type={kind} conflicts with --lr_schedule {t.lr_schedule}")
    params = sched.setdefault("params", {})
    if sched.get("type", AUTO) == AUTO:
        # A type-agnostic section: keep the settings the chosen type has, drop the unset others.
        _check_keys(params, set().union(*SCHEDULER_PARAMS.values()), "scheduler.params.")
        for key in [k for k in params if k not in SCHEDULER_PARAMS[kind] and params[k] == AUTO]:
            del params[key]
    sched["type"] = kind
    _check_keys(params, SCHEDULER_PARAMS[kind], "scheduler.params.")
    low = t.min_lr
    values = {
        "total_num_steps": (t.max_steps, f"--max_steps {t.max_steps}"),
        "warmup_num_steps": (t.warmup_steps, f"--warmup_steps {t.warmup_steps}"),
        "warmup_min_ratio": (0.0, "dstrain's warmup (from 0)"),
        "cos_min_ratio": (low / t.lr, f"--min_lr {low} / --lr {t.lr}"),
        "warmup_min_lr": (0.0, "dstrain's warmup (from 0)"),
        "warmup_max_lr": (float(t.lr), f"--lr {t.lr}"),
        "warmup_type": ("linear", "dstrain's linear warmup"),
    }
    for key in SCHEDULER_PARAMS[kind]:
        value, flag = values[key]
        _own(params, key, value, flag, "scheduler.params.")
    if kind == "WarmupDecayLR" and low != 0:
        raise ConfigError(
            f"ds_config scheduler.type=WarmupDecayLR decays to 0, conflicts with --min_lr {low}"
        )


def _resolve_zero_autos(zero: dict[str, Any], hidden: int, device_type: str) -> None:
    # The Hugging Face integration's conventions for these "auto" sizes (so HF-style configs work unchanged),
    # with a floor of 16M elements: hidden^2 buckets of a small model would mean hundreds of tiny collectives.
    bucket = max(hidden * hidden, 2**24)
    autos = {
        "reduce_bucket_size": bucket,
        "stage3_prefetch_bucket_size": int(0.9 * bucket),
        "stage3_param_persistence_threshold": 10 * hidden,
    }
    for key, value in autos.items():
        if zero.get(key) == AUTO:
            zero[key] = value
    if zero.get("overlap_comm") == AUTO:
        # Reductions on a side stream, overlapping backward, on GPUs; gloo on CPU gains nothing from it.
        zero["overlap_comm"] = device_type == "cuda"
    for sec in ("offload_param", "offload_optimizer"):
        if isinstance(zero.get(sec), dict) and zero[sec].get("pin_memory") == AUTO:
            zero[sec]["pin_memory"] = device_type == "cuda"  # page-locked host memory serves GPU copies only


def _validate_with_deepspeed(ds: dict[str, Any]) -> None:
    """DeepSpeed 0.19's own pydantic models, for every section DeepSpeedConfig builds one from: a typo or a
    wrong type is a one-line error naming the key here, not a traceback from every rank in
    deepspeed.initialize. ("auto" values are left out: the check for unfilled ones names them better.)"""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.inference.config import WeightQuantConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig
    from pydantic import ValidationError

    models = {
        "zero_optimization": DeepSpeedZeroConfig,
        "bf16": DeepSpeedBF16Config,
        "fp16": DeepSpeedFP16Config,
        "compile": CompileConfig,
        "comms_logger": CommsLoggerConfig,
        "hybrid_engine": HybridEngineConfig,
        "weight_quantization": WeightQuantConfig,
        "tensorboard": TensorBoardConfig,
        "wandb": WandbConfig,
        "csv_monitor": CSVConfig,
        "comet": CometConfig,
        "timers.throughput": DeepSpeedThroughputTimerConfig,
    }
    for name, model in models.items():
        section: Any = ds
        for key in name.split("."):
            section = section.get(key, {}) if isinstance(section, dict) else section
        if not isinstance(section, dict):
            raise ConfigError(f"ds_config {name}={_fmt(section)}: expected an object")
        if name == "compile":
            # its torch.compile keys are dstrain's (ds_file.check_compile), not DeepSpeed 0.19's
            section = {k: v for k, v in section.items() if k not in TORCH_COMPILE_OK}
        _check_model_keys(section, model, name)
        try:
            model(**_without_autos(section))
        except ValidationError as exc:
            err = exc.errors()[0]
            loc = ".".join(str(p) for p in err.get("loc", ()))
            value = err.get("input")
            shown = f"={_fmt(value)}" if not isinstance(value, dict) else ""
            msg = " ".join(str(err.get("msg", "invalid")).split())
            raise ConfigError(f"ds_config {name}.{loc}{shown}: {msg}") from None


def _check_model_keys(section: dict[str, Any], model: Any, where: str) -> None:
    """A key the pydantic model does not have (by name or alias), in the section or a nested model's object,
    is an error naming it with the nearest setting, whatever its value ("auto" included: pydantic never sees
    those, and a typo'd "auto" would otherwise read as a setting dstrain does not fill)."""
    from pydantic import BaseModel

    fields = {}
    for name, info in model.model_fields.items():
        fields[name] = info
        if info.alias:
            fields[info.alias] = info
    for key, value in section.items():
        if is_comment(key):
            continue
        if key not in fields:
            near = difflib.get_close_matches(key, sorted(fields), n=1, cutoff=TYPO_CUTOFF)
            hint = (
                f" (did you mean {near[0]!r}?)" if near else f" (DeepSpeed's {where} section has no such key)"
            )
            raise ConfigError(f"ds_config {where}.{key}: unknown setting{hint}")
        annotation = fields[key].annotation
        models = [
            a
            for a in (annotation, *typing.get_args(annotation))
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        if isinstance(value, dict) and models:
            _check_model_keys(value, models[0], f"{where}.{key}")


def _without_autos(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_autos(v) for k, v in node.items() if v != AUTO}
    return node


MONITOR_AUTOS = {
    "tensorboard.output_path",
    "tensorboard.job_name",
    "csv_monitor.output_path",
    "csv_monitor.job_name",
}


def _check_monitors(ds: dict[str, Any]) -> None:
    import importlib.util

    needs = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}
    for key, package in needs.items():
        sec = ds.get(key)
        if isinstance(sec, dict) and sec.get("enabled") and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"ds_config {key}.enabled=true needs the {package} package (pip install {package})"
            )


def _find_auto(node: Any, path: str = "") -> str | None:
    if node == AUTO and path not in MONITOR_AUTOS:
        return path
    if isinstance(node, dict):
        for k, v in node.items():
            found = _find_auto(v, f"{path}.{k}" if path else k)
            if found:
                return found
    return None


def finalize_paths(ds: dict[str, Any], output_dir: str) -> None:
    """Monitor sections with output_path 'auto' write under output_dir."""
    for key in ("tensorboard", "csv_monitor"):
        sec = ds.get(key)
        if isinstance(sec, dict):
            if sec.get("output_path", AUTO) == AUTO:
                sec["output_path"] = os.path.join(output_dir, key)
            if sec.get("job_name", AUTO) == AUTO:
                sec["job_name"] = "dstrain"


def write_resolved(ds: dict[str, Any], output_dir: str) -> str:
    path = os.path.join(output_dir, RESOLVED)
    write_json(path, ds, indent=2, sort_keys=True)
    return path
