"""Kimi Linear checkpoint folders: the key table (load and export use it both ways), the reader's view of a
config, config.json.

On disk (Moonshot's published layout, which transformers' `save_pretrained` writes back): `model.` before the
layers, a MoE layer's feed-forward under `block_sparse_moe.` with one tensor per routed expert and projection
(`experts.E.w1` gate, `w3` up, `w2` down), KDA's three short convolutions and its forget gate's tensors directly
under `self_attn.`. A dense layer's MLP is `mlp.` in Moonshot's files and `block_sparse_moe.` in those
transformers writes (it renames every `.mlp.` back): both are read, and a folder is written back with the
prefix it came with. In memory, experts are fused 3-D tensors under `mlp.experts`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator

import torch

from ..common.family import kda_hybrid_peft_keys
from ..common.layers import may_start_fresh
from ..hf import HFReader, Target, checkpoint_files, split_experts, write_config_files
from .config import KimiLinearConfig

GLOBAL_KEYS: dict[str, str] = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
GLOBAL_INV = {v: k for k, v in GLOBAL_KEYS.items()}
MOE, DENSE_MLP = "block_sparse_moe.", "mlp."
# per-expert projection on disk -> half of the fused gate_up_proj (None: down_proj)
EXPERT_PARTS: dict[str, tuple[str, int | None]] = {
    "w1": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", None),
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
_FUSED = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)")
# held and saved in fp32 whatever the weights' dtype: the expert bias (balancing steps would round away) and
# KDA's decay parameters (exponentiated)
_FP32 = re.compile(r"\.(e_score_correction_bias|A_log|dt_bias)$")


def keeps_fp32(key: str) -> bool:
    return _FP32.search(key) is not None


def dense_prefix(keys: Iterable[str], cfg: KimiLinearConfig) -> str:
    """How a folder names its dense layers' MLP: `mlp.` (Moonshot's) or `block_sparse_moe.` (transformers')."""
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    if dense and f"model.layers.{dense[0]}.{MOE}gate_proj.weight" in set(keys):
        return MOE
    return DENSE_MLP


def source_dense_prefix(cfg: KimiLinearConfig) -> str:
    """The dense layers' prefix to write: the folder's the model came from; else the one that goes with its
    config.json's form (a run checkpoint keeps only the config: transformers writes `mlp_layer_types`, which
    Moonshot's files lack); else Moonshot's."""
    source = cfg.hf_source or {}
    if "dense_prefix" in source:
        return source["dense_prefix"]
    return MOE if "mlp_layer_types" in (source.get("config") or {}) else DENSE_MLP


def hf_to_dstrain(hf_key: str, cfg: KimiLinearConfig) -> Target:
    """Where the folder's tensor lives in dstrain; KeyError for one the config does not describe."""
    if hf_key in GLOBAL_KEYS:
        return Target(GLOBAL_KEYS[hf_key])
    m = _LAYER.fullmatch(hf_key)
    if not m or int(m.group(1)) >= cfg.num_hidden_layers:
        raise KeyError(hf_key)
    layer, rest = int(m.group(1)), m.group(2)
    prefix = f"layers.{layer}."
    e = _EXPERT.fullmatch(rest)
    if e:
        if not cfg.is_moe_layer(layer):
            raise KeyError(hf_key)
        fused, half = EXPERT_PARTS[e.group(2)]
        return Target(f"{prefix}mlp.experts.{fused}", expert=int(e.group(1)), half=half)
    if rest.startswith(MOE):
        return Target(prefix + DENSE_MLP + rest.removeprefix(MOE))
    if rest.startswith(DENSE_MLP) and cfg.is_moe_layer(layer):
        raise KeyError(hf_key)  # a MoE layer's tensors are block_sparse_moe's in every folder
    return Target(prefix + rest)


def dstrain_to_hf(key: str, cfg: KimiLinearConfig, dense: str = DENSE_MLP) -> list[str]:
    """The folder keys a dstrain tensor is written as (a fused tensor: every expert's, in expert order);
    `dense`: the dense layers' MLP prefix."""
    if key in GLOBAL_INV:
        return [] if key == "lm_head.weight" and cfg.tie_word_embeddings else [GLOBAL_INV[key]]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
    if not m:
        raise KeyError(key)
    layer, rest = int(m.group(1)), m.group(2)
    prefix = f"model.layers.{layer}."
    f = _FUSED.fullmatch(rest)
    if f:
        parts = [p for p, (fused, _) in EXPERT_PARTS.items() if fused == f.group(1)]
        return [f"{prefix}{MOE}experts.{e}.{p}.weight" for e in range(cfg.n_routed_experts) for p in parts]
    if rest.startswith(DENSE_MLP):
        mlp = MOE if cfg.is_moe_layer(layer) else dense
        return [prefix + mlp + rest.removeprefix(DENSE_MLP)]
    return [prefix + rest]


def to_hf(
    tensors: Iterable[tuple[str, torch.Tensor]], cfg: KimiLinearConfig, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """dstrain (key, tensor) pairs -> the folder's (key, tensor) pairs, streaming: fused experts split per
    expert, floating tensors cast to `dtype` (`keeps_fp32` ones written fp32), dense MLPs under the prefix of
    the folder the config came from."""
    dense = source_dense_prefix(cfg)
    for key, t in tensors:
        names = dstrain_to_hf(key, cfg, dense)
        if dtype is not None and t.is_floating_point():
            t = t.to(torch.float32 if keeps_fp32(key) else dtype)
        parts = split_experts(t, key, cfg.moe_intermediate_size) if len(names) > 1 else [t] * len(names)
        yield from zip(names, parts, strict=True)


class KimiKeys:
    """The reader's view of a config's names (hf.KeyTable)."""

    prefix = ""

    def __init__(self, cfg: KimiLinearConfig) -> None:
        self.cfg, self.experts = cfg, cfg.n_routed_experts

    def to_dstrain(self, hf_key: str) -> Target:
        return hf_to_dstrain(hf_key, self.cfg)

    def may_start_fresh(self, key: str) -> bool:
        return may_start_fresh(key)

    def packed_bits(self) -> int:
        raise ValueError("Kimi Linear folders with packed integer weights are not read")


def open_folder(
    path: str | os.PathLike, cfg: KimiLinearConfig, allow_unsafe_pickle: bool = False
) -> HFReader:
    """A reader of a Kimi Linear folder; its dense layers' prefix is remembered in `cfg.hf_source`, where
    `to_hf` finds it."""
    if cfg.hf_source is not None:
        cfg.hf_source["dense_prefix"] = dense_prefix(checkpoint_files(path, allow_unsafe_pickle), cfg)
    return HFReader(path, KimiKeys(cfg), allow_unsafe_pickle)


def write_config(
    cfg: KimiLinearConfig, path: str | os.PathLike, dtype: torch.dtype, generation: dict | None = None
) -> None:
    """config.json (the config's source form, the weights declared as `dtype`, dequantized) and
    generation_config.json (`generation`, else the config's special token ids)."""
    write_config_files(path, cfg.to_hf_dict(), dtype, generation, cfg)


def peft_keys(key: str, cfg: KimiLinearConfig) -> list[str]:
    """The names transformers' model gives dstrain tensor `key` (PEFT adapter folders' names)."""
    return kda_hybrid_peft_keys(key, cfg.n_routed_experts, "model.")
