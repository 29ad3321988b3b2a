"""A DeepSpeed JSON file as users write it, read before ds_config.py resolves it.

- Top-level keys are checked against the ones DeepSpeed 0.19 reads (DeepSpeed itself ignores unknown keys, so a
  misspelled `zero_optimisation` would silently train ZeRO-0): a near miss of a valid key is a one-line error
  naming it; any other unknown key (`comms_config`, `monitor_config`: settings no DeepSpeed 0.19 reads, which
  templates still carry) is left out with one note. Keys starting with `_` are comments (LLaMA-Factory's
  `"_comment"`), at any depth: dropped without a word.
- The `compile` section: its torch.compile keys (DeepSpeed's before DeepCompile, e.g. axolotl's
  `{"disable": false, "backend": "inductor"}`) are read as --compile; DeepSpeed 0.19's own DeepCompile keys are
  validated and dstrain cannot run DeepCompile itself. The section never reaches DeepSpeed (ds_config.py).
- An explicit value in the file (not "auto") is the run's setting for the options the user did not set by flag
  or recipe (`adopt`): the file is the source of truth there. A flag that contradicts an explicit file value
  stays an error naming both (ds_config._own).
- `tensor_parallel` and `expert_parallel` have DeepSpeed's meaning (AutoTP, AutoEP): their sizes become
  dstrain's own TP / EP, and settings dstrain's implementation cannot honour are one-line errors. dstrain's own
  layout section is `"dstrain": {"tp_size": N, "ep_size": N}`; the old `tensor_parallel.tp_size` and
  `expert_parallel.ep_size` are still read, with a deprecation note.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any

from dstrain.errors import ConfigError

from .options import Options

AUTO = "auto"
"""A DeepSpeed value dstrain fills (the Hugging Face integration's convention)."""
OWN_SECTION = "dstrain"

# Every top-level key DeepSpeed 0.19.8's DeepSpeedConfig and the engine read (tests/config/test_ds_file.py
# checks this against what DeepSpeedConfig actually looks up).
DEEPSPEED_KEYS = frozenset(
    """activation_checkpointing aio amp autotuning bf16 bfloat16 checkpoint comet comms_logger
    communication_data_type compile compression_training csv_monitor curriculum_learning data_efficiency
    data_types dataloader_drop_last datastates_ckpt disable_allgather disable_python_gc dump_state eigenvalue
    elasticity expert_parallel flops_profiler fp16 gradient_accumulation_steps gradient_allreduce_op
    gradient_clipping gradient_predivide_factor graph_harvesting hybrid_engine log_level
    managed_gradient_accumulation memory_breakdown nebula optimizer pipeline prescale_gradients
    progressive_layer_drop quantize_training scheduler seq_parallel_communication_data_type
    sequence_parallel_size sparse_attention sparse_gradients steps_per_print tensor_parallel tensorboard timers
    torch_autocast train_batch_size train_micro_batch_size_per_gpu use_data_before_expert_parallelism
    vocabulary_size wall_clock_breakdown wandb weight_quantization zero_allow_untested_optimizer
    zero_force_ds_cpu_optimizer zero_optimization""".split()  # noqa: SIM905 - a list to read, not to scroll
)
# DeepSpeed scheduler names that a config's "scheduler.type" may use, and the dstrain shape each one means.
DS_SCHEDULER_TYPES = {"WarmupCosineLR": "cosine", "WarmupDecayLR": "linear", "WarmupLR": "constant"}
KNOWN_KEYS = DEEPSPEED_KEYS | {OWN_SECTION, "moe"}  # `moe` is refused with a pointer to --ep (ds_config.py)
# An unknown key at least this close to a known one (difflib's ratio) is a misspelling and refused: the
# misspellings users make score 0.85 and up (zero_optimisation 0.94, optimiser 0.89, train_micro_batch_size
# 0.85), the keys other projects' templates carry that DeepSpeed does not read 0.7 and below (comms_config 0.67
# against comms_logger, monitor_config 0.56).
TYPO_CUTOFF = 0.8

# The `compile` section's torch.compile keys (DeepSpeed's section before DeepCompile replaced it: torch.compile's
# own arguments, then enabled / backend / kwargs), with what dstrain's --compile runs (regional compilation
# with inductor's defaults). `disable` and `enabled` are the wish itself (ADOPTED).
TORCH_COMPILE_OK: dict[str, Any] = {
    "disable": (True, False),
    "enabled": (True, False),
    "backend": ("inductor",),
    "kwargs": ({},),
    "fullgraph": (False,),
    "dynamic": (None,),
    "mode": (None, "default"),
    "options": (None, {}),
}

# AutoTP (`tensor_parallel`) and AutoEP (`expert_parallel`) settings: the size key, and every other key with
# the values dstrain's own implementation matches (a callable: any value it accepts). Anything else is refused.
AUTOTP_OK: dict[str, Any] = {
    "dtype": lambda v: True,  # the training dtype comes from bf16 / --precision
    "tp_overlap_comm": (False,),
    "vocab_parallel_lm_head": (None, False),  # dstrain keeps the LM head whole
    "vocab_parallel_ce_backend": ("torch",),
    "tp": lambda v: isinstance(v, dict) and set(v) <= {"tp_size"},
    "injection_policy_tuple": (None,),
    "partition_config": (None,),
}
AUTOEP_OK: dict[str, Any] = {
    "enabled": (True, False),
    "preset_model": (None, "deepseek_v3", "deepseek_v2"),
    "use_grouped_mm": (True,),
    "disable_triton_grouped_mm": (True, False),
    "expert_tensor_parallel_size": (1,),
    "load_balance_coeff": (None,),  # dstrain balances with the expert bias and its own balance loss
    "comm_backend": ("comm",),
    "validate_folding_routing": (True, False),
    "async_split_plan": (False,),
    "moe_layer_pattern": lambda v: True,  # module discovery: dstrain knows its own modules
    "expert_pattern": lambda v: True,
    "router_pattern": lambda v: True,
    "shared_experts_pattern": lambda v: True,
    "shared_experts_gate_pattern": lambda v: True,
    "expert_w1": lambda v: True,
    "expert_w2": lambda v: True,
    "expert_w3": lambda v: True,
    "num_experts_attr": lambda v: True,
    "top_k_attr": lambda v: True,
    "has_shared_experts": lambda v: True,
    "expert_activation": (None, "silu"),
    "score_apply": (AUTO,),
    "combine_impl": (AUTO,),
    "row_weighting_impl": (AUTO,),
    "gate_up_impl": (AUTO, "separate", "fused"),
    # routing settings: the model config's are what trains; "auto" or the same value
    "top_k": (AUTO,),
    "score_func": (AUTO,),
    "route_norm": (AUTO, None),
    "route_scale": (1.0,),
    "routed_scaling_factor": (AUTO,),
    "num_expert_groups": (AUTO, None),
    "num_limited_groups": (AUTO, None),
    "comm_num_sm": lambda v: True,  # DeepEP tuning knobs, unused by dstrain's all-to-all
    "comm_qp_margin": lambda v: True,
    "comm_max_tokens_per_rank": lambda v: True,
}


# axis -> (DeepSpeed's section, its size key, what dstrain honours, what it is, the size it asks for)
DEEPSPEED_LAYOUT: dict[str, tuple[str, str, dict[str, Any], str, Any]] = {
    "tp": (
        "tensor_parallel",
        "autotp_size",
        AUTOTP_OK,
        "tensor parallelism (DeepSpeed AutoTP section)",
        lambda sec: sec.get("autotp_size", sec.get("tp", {}).get("tp_size", AUTO)),
    ),
    "ep": (
        "expert_parallel",
        "autoep_size",
        AUTOEP_OK,
        "expert parallelism (DeepSpeed AutoEP section)",
        lambda sec: sec.get("autoep_size", 1) if sec.get("enabled") else AUTO,
    ),
}


@dataclasses.dataclass(frozen=True)
class UserFile:
    """The file with dstrain's layout sections taken out: `ds` (DeepSpeed's keys only), the TP / EP sizes it
    asks for ("auto" when it does not say), where they came from, and notes to show the user."""

    ds: dict[str, Any]
    tp: Any = AUTO
    ep: Any = AUTO
    tp_key: str = f"{OWN_SECTION}.tp_size"
    ep_key: str = f"{OWN_SECTION}.ep_size"
    notes: tuple[str, ...] = ()


def fmt_value(v: Any) -> str:
    """A config value as an error message shows it: JSON for containers, booleans and null, else as is."""
    return json.dumps(v) if isinstance(v, (bool, list, dict)) or v is None else str(v)


def is_comment(key: str) -> bool:
    """Whether a config key is a comment: JSON has none, so templates write `"_comment": "..."`."""
    return key.startswith("_")


def check_top_level(raw: dict[str, Any], where: str) -> None:
    """A near miss of a key DeepSpeed reads is an error naming it (other unknown keys: split_layout's note)."""
    for key in unknown_keys(raw):
        near = difflib.get_close_matches(key, sorted(KNOWN_KEYS), n=1, cutoff=TYPO_CUTOFF)
        if near:
            raise ConfigError(
                f"{where}: unknown top-level key {key!r} (did you mean {near[0]!r}?); DeepSpeed would ignore it"
                " silently"
            )


def unknown_keys(raw: dict[str, Any]) -> list[str]:
    return [key for key in raw if key not in KNOWN_KEYS and not is_comment(key)]


def _without_comments(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _without_comments(v) for k, v in node.items() if not is_comment(k)}
    if isinstance(node, list):
        return [_without_comments(v) for v in node]
    return node


def _allowed(table: dict[str, Any], section: str, key: str, value: Any, why: str) -> None:
    rule = table.get(key)
    if rule is None:
        raise ConfigError(f"ds_config {section}.{key}: unknown {why} setting")
    ok = rule(value) if callable(rule) else value in rule
    if not ok:
        want = "" if callable(rule) else f" (dstrain runs it as {', '.join(fmt_value(v) for v in rule)})"
        raise ConfigError(
            f"ds_config {section}.{key}={fmt_value(value)}: dstrain's {why} cannot honour it{want}"
        )


def check_compile(sec: Any) -> None:
    """The `compile` section's torch.compile keys against what --compile runs; DeepCompile refused (its other
    keys are DeepSpeed's to validate: ds_config._validate_with_deepspeed)."""
    if not isinstance(sec, dict):
        raise ConfigError(f"ds_config compile={fmt_value(sec)}: expected an object")
    for key, value in sec.items():
        if key in TORCH_COMPILE_OK:
            _allowed(TORCH_COMPILE_OK, "compile", key, value, "--compile")
    if "disable" in sec and "enabled" in sec and sec["disable"] == sec["enabled"]:
        raise ConfigError(
            f"ds_config compile.disable={fmt_value(sec['disable'])} conflicts with"
            f" compile.enabled={fmt_value(sec['enabled'])}"
        )
    if sec.get("deepcompile") not in (None, False):
        # DeepCompile runs from engine.compile() with its own ZeRO passes; DeepSpeed would warn and run eager.
        raise ConfigError(
            f"ds_config compile.deepcompile={fmt_value(sec['deepcompile'])}: dstrain does not run DeepSpeed's"
            " DeepCompile; --compile compiles each transformer block with torch.compile"
        )


def split_layout(raw: dict[str, Any]) -> UserFile:
    """Take dstrain's layout out of the file, and its comments and the keys DeepSpeed does not read (see the
    top): `ds` is what ds_config.py resolves."""
    # DeepSpeed's sections are pydantic models that refuse any key they do not define, `_comment` included.
    raw = _without_comments(raw)
    unknown = unknown_keys(raw)
    dropped = {"tensor_parallel", "expert_parallel", OWN_SECTION, *unknown}
    ds = {k: v for k, v in raw.items() if k not in dropped}
    out: dict[str, Any] = {}
    notes: list[str] = []
    if unknown:
        notes.append(f"ds_config {', '.join(unknown)}: DeepSpeed 0.19 reads no such key; ignored")
    if "compile" in ds:
        check_compile(ds["compile"])
    own = raw.get(OWN_SECTION, {})
    if not isinstance(own, dict) or not set(own) <= {"tp_size", "ep_size"}:
        raise ConfigError(
            f'ds_config {OWN_SECTION}={fmt_value(own)}: expected {{"tp_size": N, "ep_size": N}}'
        )
    for axis in ("tp", "ep"):
        if f"{axis}_size" in own:
            out[axis], out[f"{axis}_key"] = own[f"{axis}_size"], f"{OWN_SECTION}.{axis}_size"

    def take(axis: str, value: Any, key: str) -> None:
        if axis in out and out[axis] != value:
            raise ConfigError(
                f"ds_config {key}={fmt_value(value)} conflicts with {out[f'{axis}_key']}={fmt_value(out[axis])}"
            )
        out[axis], out[f"{axis}_key"] = value, key

    for axis, (name, size_key, table, why, size_of) in DEEPSPEED_LAYOUT.items():
        sec = raw.get(name)
        if sec is None:
            continue
        if not isinstance(sec, dict):
            raise ConfigError(f"ds_config {name}={fmt_value(sec)}: expected an object")
        old = f"{axis}_size"
        if set(sec) == {old}:  # dstrain's own section before "dstrain" existed
            notes.append(f'ds_config {name}.{old} is deprecated: write "{OWN_SECTION}": {{"{old}": N}}')
            take(axis, sec[old], f"{name}.{old}")
            continue
        for key, value in sec.items():
            if key != size_key:
                _allowed(table, name, key, value, why)
        size = size_of(sec)
        if size not in (AUTO, 0):
            take(axis, size, f"{name}.{size_key}")
    return UserFile(ds=ds, notes=tuple(notes), **out)


def _get(d: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return AUTO
        d = d[key]
    return d


OPTIMIZER_TYPES = {"AdamW": "adamw", "Adam": "adamw", "Muon": "muon"}  # DeepSpeed's type -> --optimizer


def optimizer_type(kind: Any) -> str:
    """DeepSpeed's optimizer.type -> --optimizer, or a ConfigError naming the types dstrain runs."""
    if kind not in OPTIMIZER_TYPES:
        raise ConfigError(
            f"ds_config optimizer.type={fmt_value(kind)}: dstrain trains with AdamW or Muon (type AdamW, Muon or auto)"
        )
    return OPTIMIZER_TYPES[kind]


# File path -> (option section, option field, file value -> option value). Explicit file values become the
# option where the user did not set it.
ADOPTED: list[tuple[tuple[str, ...], str, str, Any]] = [
    (("train_micro_batch_size_per_gpu",), "layout", "micro_batch_size", int),
    (("gradient_accumulation_steps",), "layout", "gradient_accumulation_steps", int),
    (("gradient_clipping",), "optimizer", "clip_grad", float),
    (("optimizer", "params", "lr"), "schedule", "lr", float),
    (("scheduler", "params", "warmup_max_lr"), "schedule", "lr", float),
    (("optimizer", "params", "betas"), "optimizer", "adam_beta1", lambda v: float(v[0])),
    (("optimizer", "params", "betas"), "optimizer", "adam_beta2", lambda v: float(v[1])),
    (("optimizer", "params", "eps"), "optimizer", "adam_eps", float),
    (("optimizer", "params", "weight_decay"), "optimizer", "weight_decay", float),
    # DeepSpeed's Muon: adam_lr is the AdamW half's (the schedule's peak), muon_lr the Muon half's
    (("optimizer", "params", "adam_lr"), "schedule", "lr", float),
    (("optimizer", "params", "muon_lr"), "optimizer", "muon_lr", float),
    (("optimizer", "params", "momentum"), "optimizer", "muon_momentum", float),
    (("optimizer", "params", "per_head_muon"), "optimizer", "muon_per_head", bool),
    (("optimizer", "type"), "optimizer", "optimizer", optimizer_type),
    (("scheduler", "params", "warmup_num_steps"), "schedule", "warmup_steps", int),
    (("scheduler", "params", "total_num_steps"), "schedule", "max_steps", int),
    (("scheduler", "type"), "schedule", "lr_schedule", lambda v: DS_SCHEDULER_TYPES[v]),
    (("compile", "disable"), "model", "compile", lambda v: not v),  # check_compile: both are booleans
    (("compile", "enabled"), "model", "compile", bool),
]


def adopt(opts: Options, raw: dict[str, Any]) -> Options:
    """`opts` with the file's explicit values where the user gave no flag or recipe entry for them."""
    changes: dict[str, dict[str, Any]] = {}
    for path, section, name, convert in ADOPTED:
        value = _get(raw, path)
        if value == AUTO or name in opts.given:
            continue
        try:
            changes.setdefault(section, {})[name] = convert(value)
        except ConfigError:
            raise
        except (TypeError, ValueError, KeyError, IndexError):
            raise ConfigError(f"ds_config {'.'.join(path)}={fmt_value(value)}: not a valid {name}") from None
    if _get(raw, ("optimizer", "type")) == "Muon":  # read with DeepSpeed's meaning
        own = changes.setdefault("optimizer", {})
        if "muon_scale" not in opts.given:  # its update is scaled by sqrt(max(1, A / B))
            own["muon_scale"] = "spectral"
        lr = _get(raw, ("optimizer", "params", "lr"))
        if lr != AUTO and "muon_lr" not in opts.given and "muon_lr" not in own:
            own["muon_lr"] = float(lr)  # the shared lr is the Muon half's unless muon_lr
    schedule = changes.get("schedule", {})
    if "min_lr" not in opts.given:
        ratio = _get(raw, ("scheduler", "params", "cos_min_ratio"))
        lr = schedule.get("lr", opts.schedule.lr)
        if ratio != AUTO:
            schedule["min_lr"] = float(ratio) * lr
        elif schedule.get("lr_schedule") == "linear":  # WarmupDecayLR decays to 0
            schedule["min_lr"] = 0.0
        elif "lr" in schedule:
            schedule["min_lr"] = None  # the default follows the adopted lr
        if schedule:
            changes["schedule"] = schedule
    if not changes:
        return opts
    sections = {}
    for section, values in changes.items():
        try:
            sections[section] = dataclasses.replace(getattr(opts, section), **values)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"ds_config: {exc}") from None
    return dataclasses.replace(opts, **sections)
