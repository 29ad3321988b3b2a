"""The DeepSeek-V3 family's Hugging Face names: the key table (load and export use it both ways), the reader's
view of a config (`V3Keys`), config.json, and a multimodal checkpoint's tensors that are not the text model's.

On disk we use the official DeepSeek layout (what transformers' `save_pretrained` also writes): one key per
routed expert and projection, MTP modules as `model.layers.{num_hidden_layers + k}.*` with their own copies of
the shared embedding and head (except GLM-5's, which have none); the text model of a multimodal checkpoint
(Kimi-K2.5) under its prefix (`language_model.`). In memory, experts are fused 3-D tensors and MTP modules
share the embedding and head; this table is the only place that knows both.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator

import torch

from ..common.layers import is_expert_bias, may_start_fresh
from ..hf import HFReader, SafetensorsFile, Target, split_experts
from .config import ModelConfig

# HF key (after `model.` for per-layer keys) -> dstrain key. Per-layer keys not listed map unchanged.
GLOBAL_KEYS: dict[str, str] = {
    "model.embed_tokens.weight": "embed_tokens.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# Inside an MTP layer `model.layers.{L+k}.`: module-specific keys; anything else is the block.
MTP_KEYS: dict[str, str] = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "shared_head.norm.weight": "shared_head_norm.weight",
}
# MTP copies of tensors the model shares with the main model.
MTP_SHARED_KEYS: dict[str, str] = {
    "embed_tokens.weight": "embed_tokens.weight",
    "shared_head.head.weight": "lm_head.weight",
}
# Per-expert projection -> (fused tensor, which half of gate_up_proj: 0 gate, 1 up, None whole).
EXPERT_PARTS: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
}
GLOBAL_KEYS_INV = {v: k for k, v in GLOBAL_KEYS.items()}
MTP_KEYS_INV = {v: k for k, v in MTP_KEYS.items()}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_FUSED = re.compile(r"(.*mlp\.experts)\.(gate_up_proj|down_proj)")


def hf_to_dstrain(hf_key: str, cfg: ModelConfig) -> Target:
    prefix = cfg.hf_prefix
    if not hf_key.startswith(prefix):
        raise KeyError(hf_key)
    hf_key = hf_key[len(prefix) :]
    if hf_key in GLOBAL_KEYS:
        return Target(GLOBAL_KEYS[hf_key])
    m = _LAYER.fullmatch(hf_key)
    if not m:
        raise KeyError(hf_key)
    layer, rest = int(m.group(1)), m.group(2)
    if layer < cfg.num_hidden_layers:
        prefix = f"layers.{layer}."
    else:
        k = layer - cfg.num_hidden_layers
        if k >= cfg.num_nextn_predict_layers:
            raise KeyError(hf_key)
        if rest in MTP_SHARED_KEYS:
            return Target(MTP_SHARED_KEYS[rest], shared=True)
        if rest in MTP_KEYS:
            return Target(f"mtp.{k}.{MTP_KEYS[rest]}")
        prefix = f"mtp.{k}.block."
    e = _EXPERT.fullmatch(rest)
    if e:
        fused, half = EXPERT_PARTS[e.group(2)]
        return Target(f"{prefix}mlp.experts.{fused}", expert=int(e.group(1)), half=half)
    return Target(prefix + rest)


def dstrain_to_hf(key: str, cfg: ModelConfig) -> list[str]:
    """The HF keys a dstrain tensor is written as (several for fused experts, in expert order)."""
    return [cfg.hf_prefix + k for k in _dstrain_to_hf(key, cfg)]


def _dstrain_to_hf(key: str, cfg: ModelConfig) -> list[str]:
    if key in GLOBAL_KEYS_INV:
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            return []
        return [GLOBAL_KEYS_INV[key]]
    if key.startswith("layers."):
        layer, rest = key[len("layers.") :].split(".", 1)
        prefix = f"model.layers.{layer}."
    elif key.startswith("mtp."):
        k, rest = key[len("mtp.") :].split(".", 1)
        prefix = f"model.layers.{cfg.num_hidden_layers + int(k)}."
        if rest in MTP_KEYS_INV:
            return [prefix + MTP_KEYS_INV[rest]]
        if not rest.startswith("block."):
            raise KeyError(key)
        rest = rest[len("block.") :]
    else:
        raise KeyError(key)
    f = _FUSED.fullmatch(rest)
    if f:
        parts = [p for p, (fused, _) in EXPERT_PARTS.items() if fused == f.group(2)]
        return [f"{prefix}{f.group(1)}.{e}.{p}.weight" for e in range(cfg.n_routed_experts) for p in parts]
    return [prefix + rest]


def to_hf(
    tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """dstrain (key, tensor) pairs -> (HF key, tensor) pairs, streaming: fused experts split per expert, the
    MTP layers' copies of the shared embedding and head emitted when the shared tensor passes by, floating
    tensors cast to `dtype` (the expert bias stays fp32). A key with no place in `cfg` is a KeyError."""
    depth = cfg.num_nextn_predict_layers if cfg.variant.mtp_head_copies else 0  # GLM-5's MTP layers have none
    mtp_prefixes = [f"{cfg.hf_prefix}model.layers.{cfg.num_hidden_layers + k}." for k in range(depth)]
    copies = {ds: [p + hf for p in mtp_prefixes] for hf, ds in MTP_SHARED_KEYS.items()}
    if cfg.tie_word_embeddings:  # the head is the embedding: its MTP copies come with it
        copies["embed_tokens.weight"] += copies.pop("lm_head.weight")
        copies["lm_head.weight"] = []
    for key, t in tensors:
        names = dstrain_to_hf(key, cfg)
        if dtype is not None and t.is_floating_point() and not is_expert_bias(key):
            t = t.to(dtype)
        parts = split_experts(t, key, cfg.moe_intermediate_size) if len(names) > 1 else [t] * len(names)
        extra = copies.get(key, [])
        yield from zip(names + extra, parts + [t] * len(extra), strict=True)


def write_hf_config(
    cfg: ModelConfig, path: str | os.PathLike, dtype: torch.dtype, generation: dict | None = None
) -> None:
    """config.json (the model's HF config, weights declared as `dtype`, dequantized) and
    generation_config.json (`generation`, else the config's special token ids)."""
    hf_cfg = cfg.to_hf_dict()
    # a multimodal checkpoint's text model declares its own (Kimi-K2.5's INT4 experts: text_config's)
    levels = [hf_cfg, hf_cfg[cfg.wrapper.text_config]] if cfg.wrapper else [hf_cfg]
    for level in levels:
        level.pop("quantization_config", None)  # weights are written dequantized
        level["dtype"] = str(dtype).removeprefix("torch.")
        if "torch_dtype" in level:  # older readers look for this name
            level["torch_dtype"] = level["dtype"]
    if generation is None:
        ids = ("bos_token_id", "eos_token_id", "pad_token_id")
        generation = {k: getattr(cfg, k) for k in ids if getattr(cfg, k) is not None}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2, sort_keys=True)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(generation, f, indent=2)


def from_hf(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF tensors -> dstrain state dict (fused experts stacked; MTP copies of shared tensors dropped)."""
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, dict[tuple[int, int | None], torch.Tensor]] = {}
    for hf_key, t in hf_state.items():
        tgt = hf_to_dstrain(hf_key, cfg)
        if tgt.shared:
            continue
        if tgt.expert is None:
            out[tgt.key] = t
        else:
            pieces.setdefault(tgt.key, {})[(tgt.expert, tgt.half)] = t
    for key, parts in pieces.items():
        experts = sorted({e for e, _ in parts})
        if key.endswith("gate_up_proj"):
            out[key] = torch.stack([torch.cat([parts[(e, 0)], parts[(e, 1)]]) for e in experts])
        else:
            out[key] = torch.stack([parts[(e, None)] for e in experts])
    return out


class V3Keys:
    """The reader's view of a config's names (hf.KeyTable)."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg, self.prefix, self.experts = cfg, cfg.hf_prefix, cfg.n_routed_experts

    def to_dstrain(self, hf_key: str) -> Target:
        return hf_to_dstrain(hf_key, self.cfg)

    def may_start_fresh(self, key: str) -> bool:
        return may_start_fresh(key)

    def packed_bits(self) -> int:
        """The width of compressed-tensors' packed integers, from the quantization_config (the text model's, or
        that of the multimodal checkpoint around it): what a packed weight's shape is, from the file headers."""
        cfg = self.cfg
        outer = (cfg.hf_source or {}).get("outer") or {}
        quant = cfg.extra.get("quantization_config") or outer.get("quantization_config") or {}
        bits = {g["weights"]["num_bits"] for g in quant.get("config_groups", {}).values() if g.get("weights")}
        if len(bits) != 1:
            found = ", ".join(map(str, sorted(bits))) or "none"
            raise ValueError(
                f"packed weights need one num_bits in config.json's quantization_config, found {found}"
            )
        return int(bits.pop())


def open_v3(path: str | os.PathLike, cfg: ModelConfig, allow_unsafe_pickle: bool = False) -> HFReader:
    """The reader of a folder of the model `cfg` describes."""
    return HFReader(path, V3Keys(cfg), allow_unsafe_pickle)


@contextlib.contextmanager
def tensors_beside(
    cfg: ModelConfig, source: str | os.PathLike | None
) -> Iterator[list[tuple[str, SafetensorsFile]]]:
    """The tensors of a multimodal checkpoint that are not its text model's (vision tower, projector), each
    with the file of `source`, the folder the text model came from, that holds it: for `save_hf_tensors` to
    copy byte for byte. [] for a text model's own checkpoint."""
    if cfg.wrapper is None:
        yield []
        return
    if not source or not os.path.isdir(source):
        kind = cfg.hf_source["outer"]["model_type"]
        raise ValueError(
            f"a {kind} folder's vision tower and projector are copied from the folder its text model came "
            f"from, and {source!r} is not one"
        )
    with open_v3(source, cfg) as reader:
        yield reader.others_in_files()
