"""dstrain's training options: one dataclass, documented field by field, settable by flag and by recipe.

Every field's docstring (the string literal under it) is its `--help` text. The data options are the data
package's own `DataOptions` fields, composed into the same parser, never duplicated here. Precedence:
dataclass default < recipe file (`--recipe x.toml`) < command-line flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from dstrain.fields import base_type, converter, field_docs

from .errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


@dataclass
class TrainOptions:
    model: str = "tiny"
    """Model: a preset name (tiny, small, deepseek-v2-lite, deepseek-v2, deepseek-v3) or a Hugging Face
    checkpoint folder (config.json + safetensors), whose weights are loaded."""
    config: str | None = None
    """DeepSpeed config: a JSON path or a shipped name (zero1, zero2, zero3, zero3_offload). Default: the
    accelerate launcher's config if launched by `accelerate launch`, else zero1."""
    pp: int | None = None
    """Pipeline-parallel stages (default: the DeepSpeed config's pipeline.stages, else 1). Needs ZeRO-1."""
    tp: int | None = None
    """Tensor-parallel ranks: heads, dense and shared-expert MLPs split Megatron-style (default: the config's
    tensor_parallel.tp_size, else 1). Needs ZeRO-1/2. Data-parallel size = world / (pp x tp)."""
    ep: int | None = None
    """Expert-parallel ranks: routed experts sharded, tokens dispatched by all-to-all; divides the
    data-parallel size (default: the config's expert_parallel.ep_size, else 1). Needs ZeRO-1/2."""
    pp_partition: str = "parameters"
    """How blocks are split into pipeline stages: 'parameters' (balanced parameter counts), 'uniform', or the
    first block index of every stage after the first, e.g. '4' or '3,6,9'."""
    micro_batch_size: int = 4
    """Rows per micro batch per data-parallel rank (train_micro_batch_size_per_gpu)."""
    gradient_accumulation_steps: int = 1
    """Micro batches per rank per optimizer step. Global batch = micro_batch_size x this x data-parallel ranks."""
    max_steps: int = 50
    """Optimizer steps to run (in total, counting the steps of a resumed checkpoint). 0: load the model and
    write a checkpoint without training."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr: float | None = None
    """Learning rate at the end of the decay; default lr / 10."""
    warmup_steps: int = 5
    """Linear warmup steps: step k (1-based) of the warmup uses lr * k / warmup_steps."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup, from lr down to min_lr at max_steps."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices only (not norms, biases or the expert bias)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient 2-norm to this (DeepSpeed gradient_clipping); 0 turns clipping off."""
    seed: int = 1234
    """Seed for the model's initialisation and every rank's python/numpy/torch RNGs."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Training precision. bf16: bf16 weights and activations, fp32 master weights and optimizer states.
    auto: bf16 on a GPU that supports it, fp32 on CPU (or whatever the DeepSpeed config's bf16.enabled says)."""
    output_dir: str | None = None
    """Where checkpoints, metrics.jsonl and the resolved DeepSpeed config go. Default: runs/MODEL-TIMESTAMP."""
    resume: str | None = None
    """'auto': continue the newest complete checkpoint in output_dir (fresh start if none). A path (a
    checkpoint folder, or a folder holding checkpoints): continue exactly that, an error if it is unusable."""
    save_every: int = 500
    """Save a checkpoint every N optimizer steps (0: only at the end). The last step is always saved."""
    keep_last: int = 3
    """Keep the newest N complete checkpoints and delete older ones (0: keep all)."""
    activation_checkpointing: bool = False
    """Recompute each transformer block in backward instead of storing its activations."""
    moe_bias_update_speed: float | None = None
    """gamma: step of the aux-loss-free expert-bias update per optimizer step (default: the model config's)."""
    moe_aux_loss_alpha: float | None = None
    """alpha: weight of the sequence-wise balance loss (default: the model config's)."""
    mtp_loss_weight: float | None = None
    """lambda: weight of the multi-token-prediction loss (default: the model config's)."""
    nan_policy: Literal["stop", "skip"] = "stop"
    """On a NaN/Inf loss: stop before the update, naming the step; or skip that step's update and go on."""
    log_every: int = 5
    """Plain log line every N steps when stdout is not a terminal (a progress bar otherwise)."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device for MFU. Default: a table of known GPUs; on CPU a short matmul measurement."""
    wandb_project: str | None = None
    """Log metrics to this Weights & Biases project (rank 0 only)."""
    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    """wandb mode; 'offline' needs no network (sync later with `wandb sync`)."""
    wandb_run_name: str | None = None
    """wandb run name (default: the output_dir's name)."""
    debug: bool = False
    """Show tracebacks and DeepSpeed's own info logs."""
    local_rank: int = field(default=-1, metadata={"hidden": True})
    """Set by the `deepspeed` launcher; dstrain reads LOCAL_RANK from the environment instead."""
    lora_r: int = 0
    """LoRA rank: > 0 trains low-rank adapters on --lora_targets with every base weight frozen; 0 is a full
    fine-tune."""
    lora_alpha: float = 16.0
    """LoRA alpha: the adapter's update is scaled by lora_alpha / lora_r."""
    lora_targets: str = "q_b_proj,kv_b_proj,o_proj,shared_experts"
    """Comma-separated module names (as in Hugging Face checkpoints) to adapt under LoRA: a name selects the
    linears of that name or inside a module of that name (shared_experts = its gate/up/down_proj; o_proj
    includes the MTP blocks). The routed experts and the router are not linears and cannot be named."""
    train_router: bool = True
    """Train the MoE routers' weights (also under LoRA, where they are otherwise frozen). The expert bias is
    governed by --moe_bias_update_speed alone."""
    train_mtp: bool = True
    """Train the multi-token-prediction modules (under LoRA: their own weights in full, except adapted base
    weights); --no-train_mtp freezes them."""


# Data defaults that differ for training from the data package's own (a CPU-sized default run).
DATA_DEFAULTS: dict[str, Any] = {"seq_len": 64}


@dataclass
class Options:
    train: TrainOptions
    data: Any  # dstrain.data.DataOptions
    explicit: set[str] = field(default_factory=set)
    """Names set by a flag or by the recipe (not left at their default)."""


def _coerce(cls: type, name: str, value: Any, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    tp, choices, optional = base_type(hints[name])
    if value is None and optional:
        return None
    try:
        if tp is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        if tp is int and isinstance(value, bool):
            raise ValueError
        out = converter(tp, name)(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source} {name}={value!r}: expected {getattr(tp, '__name__', tp)}") from exc
    if choices is not None and out not in choices:
        raise ConfigError(f"{source} {name}={value!r}: choose from {', '.join(map(str, choices))}")
    return out


def _data_options_cls() -> type:
    try:
        from dstrain.data import DataOptions
    except ImportError:
        from dstrain.data.options import DataOptions
    return DataOptions


def build_parser(data_cls: type | None = None) -> argparse.ArgumentParser:
    data_cls = data_cls or _data_options_cls()
    parser = argparse.ArgumentParser(
        prog="dstrain train",
        description="Train a DeepSeek-style MoE model with DeepSpeed. Flags override --recipe entries.",
        # SUPPRESS: only flags actually given reach the namespace, so they can override the recipe.
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--recipe", help="TOML file of option = value entries (flags override it)")
    for title, cls in (("training", TrainOptions), ("data", data_cls)):
        group = parser.add_argument_group(f"{title} options")
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if title == "data" and f.name in _train_names():
                continue
            tp, choices, _ = base_type(hints[f.name])
            default = f.default if f.default is not dataclasses.MISSING else None
            if title == "data":
                default = DATA_DEFAULTS.get(f.name, default)
            helptext = docs.get(f.name, "").replace("%", "%%")
            if f.metadata.get("hidden"):
                helptext = argparse.SUPPRESS
            elif default is not None:
                helptext += f" (default: {default})"
            kw: dict[str, Any] = {"dest": f.name, "help": helptext}
            if tp is bool:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = converter(tp, f.name)
                kw["metavar"] = f.name.upper()
                if choices:
                    kw["choices"] = choices
                    kw["metavar"] = "{" + ",".join(map(str, choices)) + "}"
            group.add_argument(f"--{f.name}", **kw)
    return parser


def _train_names() -> set[str]:
    return {f.name for f in dataclasses.fields(TrainOptions)}


def load_recipe(path: str) -> dict[str, Any]:
    """A flat TOML table of option = value. Tables ([train], [data]) are merged flat for readability."""
    if not os.path.isfile(path):
        raise ConfigError(f"--recipe {path}: no such file")
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--recipe {path}: not valid TOML ({exc})") from exc
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            for k, v in value.items():
                flat[k] = v
        else:
            flat[key] = value
    return flat


def parse_options(argv: list[str], data_cls: type | None = None) -> Options:
    """Flags (and the recipe they name) -> validated Options. Raises ConfigError; --help exits."""
    data_cls = data_cls or _data_options_cls()
    parser = build_parser(data_cls)
    parser.error = _raise_config_error  # type: ignore[method-assign]
    ns = vars(parser.parse_args(argv))
    recipe_path = ns.pop("recipe", None)
    values: dict[str, Any] = {}
    known = _train_names() | {f.name for f in dataclasses.fields(data_cls)}
    if recipe_path:
        for key, value in load_recipe(recipe_path).items():
            if key not in known:
                raise ConfigError(f"recipe {recipe_path}: unknown option {key!r}")
            values[key] = (value, f"recipe {recipe_path}:")
    for key, value in ns.items():
        values[key] = (value, "--")
    train_kw: dict[str, Any] = {}
    data_kw: dict[str, Any] = {k: v for k, v in DATA_DEFAULTS.items() if k not in values}
    for key, (value, source) in values.items():
        if key in _train_names():
            train_kw[key] = _coerce(TrainOptions, key, value, source)
        else:
            data_kw[key] = _coerce(data_cls, key, value, source)
    try:
        data = data_cls(**data_kw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"data options: {exc}") from exc
    opts = Options(train=TrainOptions(**train_kw), data=data, explicit=set(values))
    validate_options(opts)
    return opts


def _raise_config_error(message: str) -> typing.NoReturn:
    raise ConfigError(message)


def validate_options(opts: Options) -> None:
    t = opts.train
    positive = ("micro_batch_size", "gradient_accumulation_steps", "lr", "log_every")
    for name in positive:
        if getattr(t, name) <= 0:
            raise ConfigError(f"--{name} {getattr(t, name)}: must be > 0")
    non_negative = (
        "max_steps",
        "warmup_steps",
        "save_every",
        "keep_last",
        "clip_grad",
        "weight_decay",
        "adam_eps",
    )
    for name in non_negative:
        if getattr(t, name) < 0:
            raise ConfigError(f"--{name} {getattr(t, name)}: must be >= 0")
    for name in ("moe_bias_update_speed", "moe_aux_loss_alpha", "mtp_loss_weight", "peak_tflops"):
        if getattr(t, name) is not None and getattr(t, name) < 0:
            raise ConfigError(f"--{name} {getattr(t, name)}: must be >= 0")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(t, name) < 1.0:
            raise ConfigError(f"--{name} {getattr(t, name)}: must be in [0, 1)")
    if t.min_lr is not None and not 0.0 <= t.min_lr <= t.lr:
        raise ConfigError(f"--min_lr {t.min_lr}: must be between 0 and --lr {t.lr}")
    seq_len = getattr(opts.data, "seq_len", None)
    if seq_len is not None and seq_len < 2:
        raise ConfigError(f"--seq_len {seq_len}: must be >= 2 (a row needs an input and a target)")
    if t.lora_r < 0 or (t.lora_r > 0 and t.lora_alpha <= 0):
        raise ConfigError(
            f"--lora_r {t.lora_r} --lora_alpha {t.lora_alpha}: need lora_r >= 0 and lora_alpha > 0"
        )
    if t.resume is not None and t.resume != "auto" and not t.resume:
        raise ConfigError("--resume: give 'auto' or a checkpoint path")


def min_lr(t: TrainOptions) -> float:
    return t.lr / 10 if t.min_lr is None else t.min_lr
