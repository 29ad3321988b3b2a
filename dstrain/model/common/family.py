"""What a model family is to the rest of dstrain: the record each family folder fills (its `FAMILY`) and
`dstrain.model.registry` lists. Building, loading, saving, exporting and planning a run ask the family through
this record, never by testing a config's class."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn


def heads_and_mlp_sizes(cfg: Any) -> dict[str, int]:
    """What tensor parallelism splits in a V3-style model (MLA's heads, the dense MLP's and the shared
    experts' hidden sizes), by the name a refusal gives each."""
    sizes = {"num_attention_heads": cfg.num_attention_heads, "intermediate_size": cfg.intermediate_size}
    if cfg.n_shared_experts:
        sizes["moe_intermediate_size x n_shared_experts"] = cfg.moe_intermediate_size * cfg.n_shared_experts
    return sizes


def kda_hybrid_sizes(cfg: Any) -> dict[str, int]:
    """A KDA hybrid's (Kimi Linear, GLM-5.3-Flash) split sizes: MLA's heads and the MLPs as V3's, and KDA's heads
    (a tensor-parallel rank keeps whole heads of both kinds)."""
    return {**heads_and_mlp_sizes(cfg), "linear_num_heads": cfg.linear_num_heads}


def kda_hybrid_heads(cfg: Any) -> dict[str, int]:
    """A KDA hybrid's head counts (what sequence parallelism splits): MLA's and KDA's."""
    return {"num_attention_heads": cfg.num_attention_heads, "linear_num_heads": cfg.linear_num_heads}


def fused_expert_peft_keys(module: str, leaf: str, n_experts: int, prefix: str = "model.") -> list[str]:
    """transformers' fused routed experts (`<module>.gate_up_proj` / `.down_proj`, module ending `.experts`) as
    PEFT adapter folders name them: one key per expert and projection, under `prefix`."""
    projs = ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",)
    return [f"{prefix}{module}.{e}.{p}.weight" for e in range(n_experts) for p in projs]


def kda_hybrid_peft_keys(key: str, n_experts: int, prefix: str) -> list[str]:
    """The names transformers' model of a KDA hybrid (Kimi Linear, GLM-5.3-Flash) gives dstrain tensor `key`:
    dstrain's under `prefix`, but a KDA layer's forget-gate projections under its `forget_gate` module; fused
    routed experts one key per expert and projection (as PEFT adapter folders write them)."""
    module, _, leaf = key.rpartition(".")
    if leaf in ("gate_up_proj", "down_proj") and module.endswith(".experts"):
        return fused_expert_peft_keys(module, leaf, n_experts, prefix)
    layer, attn, rest = key.partition(".self_attn.")
    if attn and rest.startswith(("f_a_proj.", "f_b_proj.")):
        return [f"{prefix}{layer}.self_attn.forget_gate.{rest}"]
    return [f"{prefix}{key}"]


@dataclass(frozen=True)
class Family:
    name: str
    """The family's folder, e.g. "deepseek_v3"."""
    config: type
    """Its config class: `from_folder(path)`, `from_hf_dict(d)`, `to_hf_dict()`, transformers' field names."""
    model: type[nn.Module]
    """Its model, built from a config (on any device, meta included)."""
    model_types: tuple[str, ...]
    """The config.json `model_type` values it reads (the registry's default family reads any other)."""
    presets: Mapping[str, Any]
    """Preset name -> config."""
    open_folder: Callable[..., Any]
    """(path, cfg, allow_unsafe_pickle=False) -> an `hf.HFReader` of a checkpoint folder of the model `cfg`."""
    to_hf: Callable[..., Iterator]
    """(dstrain (key, tensor) pairs, cfg, dtype or None) -> the folder's (key, tensor) pairs, streaming: the key
    table in the export direction, floating tensors cast to dtype (`keeps_fp32` ones kept fp32)."""
    write_config: Callable[..., None]
    """(cfg, path, dtype, generation or None): config.json declaring the weights' dtype, generation_config.json."""
    keeps_fp32: Callable[[str], bool]
    """Whether a dstrain tensor is held and saved in fp32 whatever the weights' dtype."""
    param_counts: Callable[..., dict]
    """(cfg, include_mtp=True) -> {"total", "active", "embedding"} parameter counts."""
    flops_per_token: Callable[..., float]
    """(cfg, seq_len, include_mtp=False, sparse=True) -> training FLOPs per token."""
    checkpointing: tuple[str, ...]
    """The --activation_checkpointing modes its model takes."""
    copied_tensors: Callable[..., Any] = field(default=lambda cfg, source: contextlib.nullcontext([]))
    """(cfg, source folder) -> a context giving the (key, SafetensorsFile) pairs an export copies byte for byte
    from the folder the model came from (a multimodal checkpoint's vision tower); [] by default."""
    unsupported: Mapping[str, str] = field(default_factory=dict)
    """What it does not do yet -> the one-line reason a run that asks for it is refused: "tp", "pp", "ep",
    "sp" (tensor, pipeline, expert, sequence parallelism), "adapter_only" (exporting LoRA adapters alone),
    "memory_estimate" (`dstrain plan`), "dpo" (`--objective dpo`)."""
    lora_targets: tuple[str, ...] = ()
    """The default --lora_targets: the module names (as in its checkpoints) a LoRA fine-tune adapts when the
    run names none; () for none, and a LoRA run must then name them."""
    peft_keys: Callable[[str, Any], list[str]] | None = None
    """(dstrain key, cfg) -> the names transformers' model of the family gives that tensor (fused experts: each
    expert's, one key per expert and projection), as PEFT adapter folders name what they adapt or carry whole;
    ValueError for a module LoRA has no PEFT form for; None where `adapter_only` is unsupported."""
    serving_adapters: bool = True
    """Whether serving engines load its LoRA adapters (the per-expert serving folder `--adapter_only` writes);
    else the folder is written in the form peft loads onto transformers' model (checkpoint/lora.py)."""
    splits_heads: bool = True
    """Sequence parallelism splits the attention heads over the ranks (they must divide the head counts)."""
    head_counts: Callable[[Any], dict[str, int]] = field(
        default=lambda cfg: {"num_attention_heads": cfg.num_attention_heads}
    )
    """(cfg) -> the head counts of its attention kinds, by name: what sequence parallelism splits."""
    tp_sizes: Callable[[Any], dict[str, int]] = heads_and_mlp_sizes
    """(cfg) -> the sizes tensor parallelism splits, by name: --tp must divide each."""
    release_quantization: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Preset name -> the config.json quantization keys (`quantization_config`, V4's `expert_dtype`) of the
    release the preset describes, where that release ships its weights quantized: how `dstrain plan` sizes a
    stored base (--base_precision) for a preset, which has no folder to read them from."""

    def refuse(self, feature: str, what: str) -> None:
        """ValueError `what: <why>` when the family does not do `feature` (see `unsupported`)."""
        if feature in self.unsupported:
            raise ValueError(f"{what}: {self.unsupported[feature]}")
