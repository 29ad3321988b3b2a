"""dstrain's training options: one dataclass per section, each field documented, settable by flag and by recipe.

Every field's docstring (the string literal under it) is its `--help` text, and every field is a flag of the
same name (`--lr`, `--pp`, ...): the sections only group them, for `--help` and for the components that own
them (the optimizer gets `OptimizerOptions`, the checkpoint store `CheckpointOptions`, ...). The data options
are the data package's own `DataOptions`, composed into the same parser, never duplicated here. Each section
validates itself (`ConfigError`, a `ValueError`). Precedence: default < recipe file (`--recipe x.toml`) < flag.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from dstrain.cmdline import ArgumentParser
from dstrain.data import DataOptions
from dstrain.errors import ConfigError
from dstrain.fields import add_flags, base_type, converter

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def _check(section: Any, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()) -> None:
    for name in positive:
        if getattr(section, name) <= 0:
            raise ConfigError(f"--{name} {getattr(section, name)}: must be > 0")
    for name in non_negative:
        value = getattr(section, name)
        if value is not None and value < 0:
            raise ConfigError(f"--{name} {value}: must be >= 0")


@dataclass
class ModelOptions:
    model: str = "tiny"
    """Model: a preset name (tiny, tiny-dsa, small, deepseek-v2-lite, deepseek-v2, deepseek-v3, deepseek-v3.2,
    glm-5) or a Hugging Face
    checkpoint folder (config.json + safetensors), whose weights are loaded."""
    moe_bias_update_speed: float | None = None
    """gamma: step of the aux-loss-free expert-bias update per optimizer step (default: the model config's; 0
    under LoRA, which keeps the base model, the expert bias included, as loaded so the adapters serve alone)."""
    moe_aux_loss_alpha: float | None = None
    """alpha: weight of the sequence-wise balance loss (default: the model config's)."""
    mtp_loss_weight: float | None = None
    """lambda: weight of the multi-token-prediction loss (default: the model config's)."""
    activation_checkpointing: Literal["none", "full", "attention", "mlp", "mhc"] = field(
        default="none", metadata={"bare": "full", "negated": "none"}
    )
    """Recompute in backward instead of storing: 'full' each transformer block; 'attention' only the attention
    sublayers; 'mlp' only the MLP / MoE sublayers; 'mhc' (DeepSeek-V4) only each hyper-connection's weights
    (its fp32 norm, projection and Sinkhorn iterations); 'none' stores everything. A bare
    --activation_checkpointing is 'full', --no-activation_checkpointing 'none'."""
    dsa_stage: Literal["auto", "dense", "sparse", "frozen"] = "auto"
    """Sparse attention (DeepSeek-V3.2, GLM-5): 'dense' is DeepSeek's warm-up (dense attention, every weight
    but the lightning indexers frozen, only the indexer loss trains); 'sparse' attends to the chosen keys and
    trains everything, the indexers by the KL over their chosen keys (DeepSeek's sparse training); 'frozen'
    attends to the chosen keys with the indexers frozen (what GLM-5 does in RL). auto: 'sparse' for a model
    built fresh; for a checkpoint, what its makers did after pre-training: 'sparse' for DeepSeek-V3.2 (its
    report: post-training uses sparse attention as the sparse pre-training stage did), 'frozen' for GLM-5 (the
    one rule its report states, for RL); 'frozen' under LoRA, which keeps the base model as loaded."""
    indexer_loss_coef: float = 0.01
    """Weight of the indexers' KL loss (a mean over the step's queries that hold a token, summed over layers;
    Megatron-LM's dsa_indexer_loss_coeff, 0.01 in its tests). Only the indexers learn from it; it enters the
    global gradient norm that clipping uses."""
    compile: bool = False
    """Compile each transformer block with torch.compile (regional compilation: inductor, on CPU and GPU);
    the first step, which compiles, is timed and printed."""

    def __post_init__(self) -> None:
        _check(self, non_negative=("moe_bias_update_speed", "moe_aux_loss_alpha", "mtp_loss_weight",
                                   "indexer_loss_coef"))  # fmt: skip

    def config_overrides(self) -> dict[str, float]:
        """The model-config fields these options set (those given)."""
        changes = {
            "bias_update_speed": self.moe_bias_update_speed,
            "aux_loss_alpha": self.moe_aux_loss_alpha,
            "mtp_loss_weight": self.mtp_loss_weight,
        }
        return {k: v for k, v in changes.items() if v is not None}


@dataclass
class LayoutOptions:
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
    sp: int | None = None
    """Sequence-parallel (Ulysses) ranks: each holds seq_len / sp tokens of every row, attention runs over
    the whole sequence with heads split by all-to-all. They share one data rank and count as data-parallel
    ranks for ZeRO (default: the config's sequence_parallel_size, else 1). Not with --pp or --tp."""
    pp_partition: str = "parameters"
    """How blocks are split into pipeline stages: 'parameters' (balanced parameter counts), 'uniform', or the
    first block index of every stage after the first, e.g. '4' or '3,6,9'."""
    micro_batch_size: int = 4
    """Rows per micro batch per data-parallel rank (train_micro_batch_size_per_gpu)."""
    gradient_accumulation_steps: int = 1
    """Micro batches per rank per optimizer step. Global batch = micro_batch_size x this x data-parallel ranks."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Training precision. bf16: bf16 weights and activations, fp32 master weights and optimizer states.
    auto: bf16 on a GPU that supports it, fp32 on CPU (or whatever the DeepSpeed config's bf16.enabled says)."""

    def __post_init__(self) -> None:
        _check(self, positive=("micro_batch_size", "gradient_accumulation_steps"))


@dataclass
class OptimizerOptions:
    optimizer: Literal["adamw", "muon"] = "adamw"
    """adamw: AdamW on every parameter. muon: Muon on the hidden matrices (per expert on the routed experts,
    gate and up apart), AdamW on the embedding, the LM head, norms and biases (Moonlight's split; the table of
    which parameter gets which is printed at start and written to the run folder as optimizer_groups.txt)."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not norms, biases or the expert bias); Muon's
    matrices decay at the same rate (Moonlight)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Clip the global gradient 2-norm to this (DeepSpeed gradient_clipping); 0 turns clipping off."""
    muon_momentum: float = 0.95
    """Muon's momentum (M <- momentum * M + G)."""
    muon_nesterov: bool = True
    """Muon orthogonalises G + momentum * M (Nesterov) instead of M."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations per Muon update."""
    muon_scale: Literal["rms", "spectral"] = "rms"
    """Factor on each orthogonalised (A, B) block. rms: 0.2 * sqrt(max(A, B)) (Moonlight: the update's RMS
    matches AdamW's, so --lr and --weight_decay carry over); spectral: sqrt(max(1, A / B)) (Keller Jordan's and
    DeepSpeed's Muon, whose learning rate is in spectral-norm units, about 0.02; a DeepSpeed file with
    optimizer.type Muon means this)."""
    muon_lr: float | None = None
    """Peak learning rate of the Muon matrices, on the same schedule (default: --lr)."""
    muon_per_head: bool = False
    """Orthogonalise MLA's query and key-value up-projections (q_b_proj or q_proj, kv_b_proj) and the
    indexer's wq_b per head ("Muon split", GLM-5's recipe; DeepSpeed's per_head_muon)."""
    muon_adapters: bool = True
    """With LoRA: Muon steps each adapter factor as a matrix (per expert for the experts'); false: AdamW."""

    def __post_init__(self) -> None:
        _check(self, non_negative=("weight_decay", "adam_eps", "clip_grad"), positive=("muon_ns_steps",))
        for name in ("adam_beta1", "adam_beta2", "muon_momentum"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"--{name} {getattr(self, name)}: must be in [0, 1)")
        if self.muon_lr is not None and self.muon_lr <= 0:
            raise ConfigError(f"--muon_lr {self.muon_lr}: must be > 0")


@dataclass
class ScheduleOptions:
    max_steps: int = 50
    """Optimizer steps to run (in total, counting the steps of a resumed checkpoint). 0: load the model and
    write a checkpoint without training."""
    epochs: float | None = None
    """Passes over the training data instead of --max_steps: the run counts one pass's packed rows up front
    (reading and tokenizing it all), prints the steps that makes (epochs x rows / global batch rows, rounded
    up) and sizes the schedule to them; it resumes mid-epoch like any run."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr: float | None = None
    """Learning rate at the end of the decay."""
    warmup_steps: int = 5
    """Linear warmup steps: step k (1-based) of the warmup uses lr * k / warmup_steps."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup, from lr down to min_lr at max_steps."""

    def __post_init__(self) -> None:
        _check(self, positive=("lr",), non_negative=("max_steps", "warmup_steps"))
        if self.epochs is not None and self.epochs <= 0:
            raise ConfigError(f"--epochs {self.epochs}: must be > 0")
        if self.min_lr is None:
            self.min_lr = self.lr / 10
        if not 0.0 <= self.min_lr <= self.lr:
            raise ConfigError(f"--min_lr {self.min_lr}: must be between 0 and --lr {self.lr}")


@dataclass
class CheckpointOptions:
    output_dir: str | None = None
    """Where checkpoints, metrics.jsonl and the resolved DeepSpeed config go. Default: runs/MODEL-TIMESTAMP."""
    resume: str | None = None
    """'auto': continue the newest complete checkpoint in output_dir (fresh start if none). A path (a
    checkpoint folder, or a folder holding checkpoints): continue exactly that, an error if it is unusable."""
    save_every: int = 500
    """Save a checkpoint every N optimizer steps (0: only at the end). The last step is always saved."""
    keep_last: int = 3
    """Keep the newest N complete checkpoints and delete older ones (0: keep all)."""
    save_moments: bool = True
    """Also save AdamW's two moments layout-free (beside the weights), so that a checkpoint resumes on another
    layout with its optimizer state. --no-save_moments: each save writes 1 x the fp32 model there instead of
    3 x, and the checkpoint resumes on its own layout only (DeepSpeed's files hold the moments for that)."""

    def __post_init__(self) -> None:
        _check(self, non_negative=("save_every", "keep_last"))
        if self.resume is not None and not self.resume:
            raise ConfigError("--resume: give 'auto' or a checkpoint path")


@dataclass
class LoggingOptions:
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
    tensorboard: bool = True
    """Write every metric (training, eval, expert load balance) as TensorBoard events under
    OUTPUT_DIR/tensorboard (rank 0): `tensorboard --logdir OUTPUT_DIR`."""
    plots: bool = True
    """At the end of the run, write PNG plots into OUTPUT_DIR/plots (also `dstrain plot OUTPUT_DIR`)."""
    profile_steps: str | None = None
    """A:B: record a torch profiler trace (CPU and CUDA kernels, memory) of optimizer steps A to B into
    OUTPUT_DIR/profile/ (Chrome/Perfetto JSON: open it in https://ui.perfetto.dev or chrome://tracing)."""
    profile_ranks: str = "0"
    """Comma-separated global ranks that record --profile_steps, or 'all'."""

    def __post_init__(self) -> None:
        _check(self, positive=("log_every",), non_negative=("peak_tflops",))
        _ = self.profile_window, self.profiled(0)  # parsed now: a bad value fails before the run starts

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """--profile_steps as (first, last) optimizer step, or None."""
        if self.profile_steps is None:
            return None
        try:
            first, last = (int(x) for x in self.profile_steps.split(":"))
        except ValueError:
            first = last = -1
        if not 1 <= first <= last:
            raise ConfigError(f"--profile_steps {self.profile_steps}: give A:B with 1 <= A <= B (steps)")
        return first, last

    def profiled(self, rank: int) -> bool:
        """Whether `rank` records the --profile_steps trace."""
        if self.profile_ranks == "all":
            return True
        try:
            ranks = {int(x) for x in self.profile_ranks.split(",")}
        except ValueError:
            raise ConfigError(f"--profile_ranks {self.profile_ranks}: give 'all' or ranks like 0,4") from None
        return rank in ranks


@dataclass
class EvalOptions:
    eval_every: int = 0
    """Evaluate on the eval set (--eval_data or --eval_split) every N optimizer steps and at the end; 0: at the
    end only. Eval loss excludes the balance loss and never touches the expert bias or its load counts."""

    def __post_init__(self) -> None:
        _check(self, non_negative=("eval_every",))


@dataclass
class LoRAOptions:
    lora_r: int = 0
    """LoRA rank: > 0 trains low-rank adapters on --lora_targets with every base weight frozen; 0 is a full
    fine-tune."""
    lora_alpha: float = 16.0
    """LoRA alpha: the adapter's update is scaled by lora_alpha / lora_r."""
    lora_targets: str = "q_b_proj,kv_b_proj,o_proj,shared_experts"
    """Comma-separated module names (as in Hugging Face checkpoints) to adapt under LoRA: a name selects the
    linears of that name or inside a module of that name (shared_experts = its gate/up/down_proj; o_proj
    includes the MTP blocks); `experts` adapts every routed expert's gate/up/down (per expert its own A and
    B), `gate` the routers (not together with --train_router). Default: the model family's (DeepSeek-V3
    and V2: q_b_proj,kv_b_proj,o_proj,shared_experts; DeepSeek-V4:
    q_b_proj,kv_proj,o_a_proj,o_b_proj,shared_experts)."""
    train_router: bool | None = None
    """Train the MoE routers' weights. Default: yes in a full fine-tune, no under LoRA (every base weight
    frozen); --train_router opts in under LoRA. The expert bias is governed by --moe_bias_update_speed alone."""
    train_mtp: bool | None = None
    """Train the multi-token-prediction modules. Default: yes in a full fine-tune, no under LoRA (frozen whole,
    the adapters on their linears included); --train_mtp opts in under LoRA: their own weights in full and
    their adapters."""
    base_precision: Literal["auto", "stored", "bf16"] = "auto"
    """How a quantized --model folder's frozen weights are held under LoRA: `stored`, as the files store them
    (FP8 blocks, V4's FP4 experts, INT4 experts: codes and scales, dequantized layer by layer when used; half
    of bf16's bytes for FP8, about a quarter for FP4/INT4, the same computation); `bf16`, dequantized once
    into the run's precision. Default (auto): stored for a quantized folder under LoRA (nothing is lost: the
    frozen base computes the same values, in a fraction of the memory), else dequantized."""
    qat: Literal["auto", "on", "off"] = "auto"
    """Quantization-aware training of a quantized --model folder: the weights the export writes in the folder's
    form (what trains, or the merge of LoRA's adapters into it) are used in the forward as that export quantizes
    them (its blocks, rounding and scales), with the gradient passed straight through. Default (auto): on for a
    quantized folder, whose export writes its own form by default, so the exported model computes what
    trained; --qat off when the export is to be bf16 (`dstrain export --dtype bfloat16`)."""

    def __post_init__(self) -> None:
        if self.lora_r < 0 or (self.lora_r > 0 and self.lora_alpha <= 0):
            raise ConfigError(
                f"--lora_r {self.lora_r} --lora_alpha {self.lora_alpha}: need lora_r >= 0 and lora_alpha > 0"
            )
        full = self.lora_r == 0
        self.train_router = full if self.train_router is None else self.train_router
        self.train_mtp = full if self.train_mtp is None else self.train_mtp

    @property
    def targets(self) -> list[str]:
        return [s.strip() for s in self.lora_targets.split(",") if s.strip()]


@dataclass
class RunOptions:
    seed: int = 1234
    """Seed for the model's initialisation and every rank's python/numpy/torch RNGs."""
    nan_policy: Literal["stop", "skip"] = "stop"
    """On a NaN/Inf loss: stop before the update, naming the step; or skip that step's update and go on."""
    time_limit: float | None = None
    """Minutes this job may run: before they are up (room left for a step and a save), write a complete
    checkpoint and exit with code 75, as on SIGTERM/SIGUSR1; continue with --resume auto."""
    collective_timeout: float = 600.0
    """Seconds any collective (all-reduce, barrier, broadcast...) may wait for the other ranks: when a rank dies
    or hangs, the others give up within about this plus 5 s and exit instead of waiting until the allocation
    ends: with code 76 and a line naming it (on GPUs, torch's NCCL watchdog may abort them first, see docs/training.md).
    It must exceed the longest wait of a healthy run (a save or model load other ranks wait for)."""
    local_rank: int = field(default=-1, metadata={"hidden": True})
    """Set by the `deepspeed` launcher; dstrain reads LOCAL_RANK from the environment instead."""

    def __post_init__(self) -> None:
        if self.time_limit is not None and self.time_limit <= 0:
            raise ConfigError(f"--time_limit {self.time_limit}: must be > 0 minutes")
        if not 0 < self.collective_timeout < float("inf"):
            raise ConfigError(
                f"--collective_timeout {self.collective_timeout}: must be a positive number of seconds"
            )


@dataclass
class ObjectiveOptions:
    objective: Literal["sft", "dpo"] = "sft"
    """sft: the mean cross-entropy of the target tokens (pretraining text, chats, instructions). dpo: Direct
    Preference Optimization on preference pairs (`chosen`/`rejected` data; the reference: --dpo_reference), with
    the routers, the expert bias, the balance loss and MTP off by default (docs/training.md)."""
    dpo_beta: float = 0.1
    """beta of --objective dpo: how far the policy may move from the reference (TRL's default, 0.1); with
    --dpo_loss ipo its tau."""
    dpo_loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """sigmoid: DPO's -log sigmoid(beta * margin); ipo: IPO's squared (margin / tokens - 1 / (2 beta)), per-token
    log-ratios as in TRL, the other loss of TRL's DPOTrainer that needs nothing beyond the pairs and does not
    push the margin without bound on pairs it already ranks right (overfits less on small or noisy sets)."""

    dpo_reference: Literal["auto", "adapters", "precomputed"] = "auto"
    """The reference model of --objective dpo. adapters: the model with its LoRA adapters off, a forward per
    micro batch (needs --lora_r > 0); precomputed: the initial model's log-probabilities of every completion,
    from a first pass over the data before the first update, kept in the run folder (dpo_reference.safetensors)
    for resumes on any layout. auto: adapters under LoRA, else precomputed."""

    def __post_init__(self) -> None:
        _check(self, positive=("dpo_beta",))


# Section name -> its dataclass, in --help order. `data` is the data package's own.
SECTIONS: dict[str, type] = {
    "model": ModelOptions,
    "layout": LayoutOptions,
    "optimizer": OptimizerOptions,
    "schedule": ScheduleOptions,
    "checkpoint": CheckpointOptions,
    "logging": LoggingOptions,
    "eval": EvalOptions,
    "lora": LoRAOptions,
    "objective": ObjectiveOptions,
    "run": RunOptions,
    "data": DataOptions,
}


# Data defaults that differ for training from the data package's own (a CPU-sized default run).
@dataclass
class Options:
    model: ModelOptions = field(default_factory=ModelOptions)
    layout: LayoutOptions = field(default_factory=LayoutOptions)
    optimizer: OptimizerOptions = field(default_factory=OptimizerOptions)
    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    logging: LoggingOptions = field(default_factory=LoggingOptions)
    eval: EvalOptions = field(default_factory=EvalOptions)
    lora: LoRAOptions = field(default_factory=LoRAOptions)
    objective: ObjectiveOptions = field(default_factory=ObjectiveOptions)
    run: RunOptions = field(default_factory=RunOptions)
    data: DataOptions = field(default_factory=DataOptions)
    given: frozenset[str] = frozenset()
    """The options the user set (flag or recipe): a DeepSpeed file's explicit value yields only to these."""

    def __post_init__(self) -> None:
        if self.eval.eval_every and not self.data.evaluates:
            raise ConfigError(
                f"--eval_every {self.eval.eval_every}: give the eval set (--eval_data or --eval_split)"
            )

    @property
    def debug(self) -> bool:
        """--debug, read by the command-line policy (dstrain.cli)."""
        return self.logging.debug

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}


def _section_of() -> dict[str, str]:
    """Flag name -> section name (every flag names exactly one field)."""
    return {f.name: section for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def _coerce(cls: type, name: str, value: Any, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    tp, choices, optional = base_type(hints[name])
    if value is None and optional:
        return None
    meta = {f.name: f.metadata for f in dataclasses.fields(cls)}[name]
    if isinstance(value, bool) and "bare" in meta:  # a recipe's true / false for an option with modes
        return meta["bare"] if value else meta["negated"]
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


# Other tools' names for options that mean the same here (Hugging Face TrainingArguments, TRL, LLaMA-Factory),
# accepted as flags and recipe keys: a command line or recipe brought from them needs no translating.
ALIASES: dict[str, tuple[str, ...]] = {
    "model": ("model_name_or_path",),
    "config": ("deepspeed",),
    "micro_batch_size": ("per_device_train_batch_size",),
    "adam_eps": ("adam_epsilon",),
    "clip_grad": ("max_grad_norm",),
    "epochs": ("num_train_epochs",),
    "lr": ("learning_rate",),
    "lr_schedule": ("lr_scheduler_type",),
    "save_every": ("save_steps",),
    "log_every": ("logging_steps",),
    "eval_every": ("eval_steps",),
    "lora_r": ("lora_rank",),
    "lora_targets": ("lora_target",),
    "dpo_beta": ("pref_beta",),
}
# Their names for what dstrain means differently (or has not): refused, with the flag to use instead.
NEAR_FLAGS: dict[str, str] = {
    "--max_seq_length": "use --seq_len (rows of that many tokens: samples are packed into them)",
    "--max_length": "use --seq_len (rows of that many tokens: samples are packed into them)",
    "--cutoff_len": "use --seq_len (rows of that many tokens: samples are packed into them)",
    "--warmup_ratio": "use --warmup_steps (a number of steps)",
    "--bf16": "use --precision bf16",
    "--gradient_checkpointing": "use --activation_checkpointing",
    "--beta": "use --dpo_beta",
    "--loss_type": "use --dpo_loss (sigmoid or ipo)",
    "--lora_dropout": "dstrain's LoRA has no dropout: leave it out",
}
# What the help shows as the default where the run decides it (dstrain.config.plan)
SHOWN_DEFAULTS = {
    "lr": "by the run: 3e-3 for a preset (pretraining); a --model folder's fine-tune 5e-6, under LoRA 5e-5; "
    "DPO 1e-6, under LoRA 1e-5 (the run's first line says which)",
    "min_lr": "by the run: lr / 10, or 1e-6 for a folder's fine-tune (5e-6 under LoRA)",
    "lora_targets": "the model family's (above)",
}


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="dstrain train",
        description="Train a DeepSeek-style MoE model with DeepSpeed. Flags override --recipe entries.",
        near_flags=NEAR_FLAGS,
    )
    parser.add_argument("--recipe", help="TOML file of option = value entries (flags override it)")
    for title, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{title} options")
        add_flags(group, cls, SHOWN_DEFAULTS, ALIASES)
    return parser


def load_recipe(path: str) -> dict[str, Any]:
    """A TOML table of option = value. Tables ([model], [data], any name) are merged flat for readability."""
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
            flat.update(value)
        else:
            flat[key] = value
    return flat


def parse_options(argv: list[str]) -> Options:
    """Flags (and the recipe they name) -> validated Options. Raises ConfigError; --help exits."""
    ns = vars(build_parser().parse_args(argv))
    recipe_path = ns.pop("recipe")
    section_of = _section_of()
    values: dict[str, tuple[Any, str]] = {}
    if recipe_path:
        canonical = {alias: name for name, names in ALIASES.items() for alias in names}
        for key, value in load_recipe(recipe_path).items():
            key = canonical.get(key, key)
            if key not in section_of:
                raise ConfigError(f"recipe {recipe_path}: unknown option {key!r}")
            values[key] = (value, f"recipe {recipe_path}:")
    for key, value in ns.items():
        values[key] = (value, "--")
    kwargs: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, (value, source) in values.items():
        section = section_of[key]
        kwargs[section][key] = _coerce(SECTIONS[section], key, value, source)
    sections = {}
    for name, cls in SECTIONS.items():
        try:
            sections[name] = cls(**kwargs[name])
        except ConfigError:
            raise
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{name} options: {exc}") from exc
    if "epochs" in values and "max_steps" in values:
        raise ConfigError("--epochs and --max_steps: give one (--epochs sets the steps)")
    return Options(**sections, given=frozenset(values))
