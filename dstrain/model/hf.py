"""Hugging Face checkpoint format: the key table, and streaming load/save of safetensors folders.

On disk we use the official DeepSeek layout (what transformers' `save_pretrained` also writes): one key per
routed expert and projection, MTP modules as `model.layers.{num_hidden_layers + k}.*` with their own copies of
the shared embedding and head (except GLM-5's, which have none); the text model of a multimodal checkpoint
(Kimi-K2.5) under its prefix (`language_model.`). In memory, experts are fused 3-D tensors and MTP modules
share the embedding and head; this table is the only place that knows both.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import ModelConfig
from .model import is_expert_bias

if TYPE_CHECKING:
    from .reader import SafetensorsFile

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

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 1024**3


class Target:
    """Where one HF tensor lives in dstrain: a key, and optionally (expert, half) inside a fused tensor."""

    __slots__ = ("key", "expert", "half", "shared")

    def __init__(
        self, key: str, expert: int | None = None, half: int | None = None, shared: bool = False
    ) -> None:
        self.key, self.expert, self.half, self.shared = key, expert, half, shared


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


def _split_fused(t: torch.Tensor, name: str, cfg: ModelConfig) -> list[torch.Tensor]:
    """Per-expert HF tensors of one fused tensor, in the order `dstrain_to_hf` lists their keys."""
    if name.endswith("gate_up_proj"):
        i = cfg.moe_intermediate_size
        return [part for e in range(t.shape[0]) for part in (t[e, :i], t[e, i:])]
    return list(t.unbind(0))


def to_hf(
    tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """dstrain (key, tensor) pairs -> (HF key, tensor) pairs, streaming: fused experts split per expert, the
    MTP layers' copies of the shared embedding and head emitted when the shared tensor passes by, floating
    tensors cast to `dtype` (the expert bias stays fp32). A key with no place in `cfg` is a KeyError."""
    depth = cfg.num_nextn_predict_layers if cfg.family.mtp_head_copies else 0  # GLM-5's MTP layers have none
    mtp_prefixes = [f"{cfg.hf_prefix}model.layers.{cfg.num_hidden_layers + k}." for k in range(depth)]
    copies = {ds: [p + hf for p in mtp_prefixes] for hf, ds in MTP_SHARED_KEYS.items()}
    if cfg.tie_word_embeddings:  # the head is the embedding: its MTP copies come with it
        copies["embed_tokens.weight"] += copies.pop("lm_head.weight")
        copies["lm_head.weight"] = []
    for key, t in tensors:
        names = dstrain_to_hf(key, cfg)
        if dtype is not None and t.is_floating_point() and not is_expert_bias(key):
            t = t.to(dtype)
        parts = _split_fused(t, key, cfg) if len(names) > 1 else [t] * len(names)
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


# --------------------------------------------------------------------------- files
def checkpoint_files(path: str | os.PathLike, allow_unsafe_pickle: bool = False) -> dict[str, str]:
    """HF key -> safetensors file holding it; {} for a pickle-only folder when `allow_unsafe_pickle`."""
    path = str(path)
    index = os.path.join(path, SAFE_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    single = os.path.join(path, SAFE_WEIGHTS)
    if os.path.isfile(single):
        with safe_open(single, "pt") as f:
            return {k: single for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    bins = _pickle_files(path)
    if bins and not allow_unsafe_pickle:
        raise ValueError(
            f"{path} holds only pickle weights ({bins[0]}): dstrain loads safetensors; convert them (in Python, "
            "from_pretrained(..., allow_unsafe_pickle=True) reads them if you trust the files)"
        )
    if bins:
        return {}
    raise ValueError(f"{path}: no {SAFE_WEIGHTS} or {SAFE_INDEX}")


def _pickle_files(path: str) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.endswith(".bin"))


def save_hf_tensors(
    tensors: Iterator[tuple[str, torch.Tensor]],
    path: str | os.PathLike,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    copied: Sequence[tuple[str, SafetensorsFile]] = (),
) -> list[str]:
    """Write (key, tensor) pairs as safetensors shards; an index is written when there is more than one.
    `copied`: (key, the file it is in) of tensors copied byte for byte (a multimodal checkpoint's vision
    tower: not the model's, never read as tensors), in shards of their own after the model's."""
    from .reader import write_raw  # here: reader imports this module

    path = str(path)
    os.makedirs(path, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    tmp_names: list[str] = []
    weight_map: dict[str, int] = {}
    total = 0

    def flush() -> None:
        name = f"_shard{len(tmp_names)}.tmp"
        save_file(shards[-1], os.path.join(path, name), metadata={"format": "pt"})
        tmp_names.append(name)
        shards[-1] = {}

    for key, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        # contiguous clone: views of fused tensors must not share storage in the file
        shards[-1][key] = t.detach().to("cpu").contiguous().clone()
        weight_map[key] = len(tmp_names)
        size += nbytes
        total += nbytes
    if shards[-1] or not tmp_names:
        flush()
    for group in _by_size(copied, max_shard_bytes):  # copied tensors: shards of their own
        name = f"_shard{len(tmp_names)}.tmp"
        total += write_raw(os.path.join(path, name), group)
        weight_map.update(dict.fromkeys((k for k, _ in group), len(tmp_names)))
        tmp_names.append(name)
    n = len(tmp_names)
    if n == 1:
        names = [SAFE_WEIGHTS]
    else:
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for tmp, name in zip(tmp_names, names, strict=True):
        os.replace(os.path.join(path, tmp), os.path.join(path, name))
    if n > 1:
        index = {
            "metadata": {"total_size": total},
            "weight_map": {k: names[i] for k, i in sorted(weight_map.items())},
        }
        with open(os.path.join(path, SAFE_INDEX), "w") as f:
            json.dump(index, f, indent=2)
    return names


def _by_size(
    copied: Sequence[tuple[str, SafetensorsFile]], max_bytes: int
) -> Iterator[list[tuple[str, SafetensorsFile]]]:
    """`copied` in consecutive groups of at most `max_bytes` (a larger tensor alone)."""
    group: list[tuple[str, SafetensorsFile]] = []
    size = 0
    for key, src in copied:
        if group and size + src.nbytes(key) > max_bytes:
            yield group
            group, size = [], 0
        group.append((key, src))
        size += src.nbytes(key)
    if group:
        yield group
