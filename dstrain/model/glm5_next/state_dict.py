"""GLM-5.3-Flash checkpoint folders: the key table (load and export use it both ways), the reader's view of a
config, the vision tower carried along, config.json.

On disk (as transformers' `save_pretrained` writes it, its conversion mapping reversed): the text model under
`model.language_model.` (the vision tower `model.visual.*` beside it in a multimodal folder, copied byte for
byte on export), or under `model.` in a flat text-only folder (read and written back so), the head
`lm_head.weight`; per layer the mHC tensors `hc_attn_fn`/`_base`/`_scale` and `hc_ffn_*`, one tensor per routed
expert and projection (`mlp.experts.E.{gate,up,down}_proj.weight`), KDA's three short convolutions and its
forget gate's tensors directly under `self_attn.`. The MTP layer is layer `num_hidden_layers` (`enorm`, `hnorm`, `eh_proj`,
`shared_head.norm`, the block's own tensors; copies of the embedding and head, if a folder has them, are not
read and not written, as GLM-5's). In memory: experts fused 3-D, mHC as `attn_hc.fn` ..., MTP under `mtp.K.`.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Iterator

import torch

from ..common.family import kda_hybrid_peft_keys
from ..common.layers import may_start_fresh
from ..hf import HFReader, Target, checkpoint_files, split_experts, write_config_files
from ..hf.files import SafetensorsFile
from .config import Glm5NextConfig

NESTED, FLAT, HEAD = "model.language_model.", "model.", "lm_head.weight"
GLOBAL = {"embed_tokens.weight": "embed_tokens.weight", "norm.weight": "norm.weight"}
# per-expert projection on disk -> the fused tensor and its half (None: down_proj)
EXPERT_PARTS: dict[str, tuple[str, int | None]] = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
}
HC = {f"hc_{s}_{p}": f"{s}_hc.{p}" for s in ("attn", "ffn") for p in ("fn", "base", "scale")}
HC_INV = {v: k for k, v in HC.items()}
MTP_KEYS = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
            "shared_head.norm.weight": "shared_head_norm.weight"}  # fmt: skip
MTP_KEYS_INV = {v: k for k, v in MTP_KEYS.items()}
MTP_SHARED = {"embed_tokens.weight": "embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_FUSED = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)")
# fp32 whatever the weights' dtype (transformers' _keep_in_fp32_modules_strict): the expert bias (balancing
# steps would round away), KDA's decay parameters and convolutions, the mHC biases and scales
_FP32 = re.compile(r"\.(e_score_correction_bias|A_log|dt_bias|[qkv]_conv1d\.weight|[a-z]+_hc\.(base|scale))$")


def keeps_fp32(key: str) -> bool:
    return _FP32.search(key) is not None


def text_prefix(cfg: Glm5NextConfig) -> str:
    """Where the folder holds the text model: as the folder it came from (`open_folder` notes it), else
    transformers' layout (`model.language_model.`, which its Glm5NextForConditionalGeneration reads)."""
    return (cfg.hf_source or {}).get("prefix", NESTED)


def _block_target(rest: str, prefix: str, cfg: Glm5NextConfig, layer: int, hf_key: str) -> Target:
    """A block's tensor (`rest` under `...layers.L.`) -> its dstrain Target under `prefix`."""
    if rest in HC:
        return Target(prefix + HC[rest])
    e = _EXPERT.fullmatch(rest)
    if e:
        if not cfg.is_moe_layer(layer):
            raise KeyError(hf_key)
        fused, half = EXPERT_PARTS[e.group(2)]
        return Target(f"{prefix}mlp.experts.{fused}", expert=int(e.group(1)), half=half)
    return Target(prefix + rest)


def hf_to_dstrain(hf_key: str, cfg: Glm5NextConfig) -> Target:
    """Where the folder's tensor lives in dstrain; KeyError for one the config does not describe."""
    if hf_key == HEAD:
        return Target("lm_head.weight")
    prefix = text_prefix(cfg)
    if not hf_key.startswith(prefix):
        raise KeyError(hf_key)
    key = hf_key[len(prefix) :]
    if key in GLOBAL:
        return Target(GLOBAL[key])
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
    if not m:
        raise KeyError(hf_key)
    layer, rest, n = int(m.group(1)), m.group(2), cfg.num_hidden_layers
    if layer < n:
        return _block_target(rest, f"layers.{layer}.", cfg, layer, hf_key)
    k = layer - n
    if k >= cfg.num_nextn_predict_layers:
        raise KeyError(hf_key)
    if rest in MTP_SHARED:
        return Target(MTP_SHARED[rest], shared=True)
    if rest in MTP_KEYS:
        return Target(f"mtp.{k}.{MTP_KEYS[rest]}")
    return _block_target(rest, f"mtp.{k}.block.", cfg, layer, hf_key)


def dstrain_to_hf(key: str, cfg: Glm5NextConfig) -> list[str]:
    """The folder keys a dstrain tensor is written as (a fused tensor: every expert's, in expert order)."""
    if key == "lm_head.weight":
        return [] if cfg.tie_word_embeddings else [HEAD]
    prefix = text_prefix(cfg)
    if key in GLOBAL.values():
        return [prefix + key]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", key) or re.fullmatch(r"mtp\.(\d+)\.(.+)", key)
    if not m:
        raise KeyError(key)
    layer, rest = int(m.group(1)), m.group(2)
    if key.startswith("mtp."):
        layer += cfg.num_hidden_layers
        if rest in MTP_KEYS_INV:
            return [f"{prefix}layers.{layer}.{MTP_KEYS_INV[rest]}"]
        if not rest.startswith("block."):
            raise KeyError(key)
        rest = rest.removeprefix("block.")
    at = f"{prefix}layers.{layer}."
    if rest in HC_INV:
        return [at + HC_INV[rest]]
    f = _FUSED.fullmatch(rest)
    if f:
        parts = [p for p, (fused, _) in EXPERT_PARTS.items() if fused == f.group(1)]
        return [f"{at}mlp.experts.{e}.{p}.weight" for e in range(cfg.n_routed_experts) for p in parts]
    return [at + rest]


def to_hf(
    tensors: Iterable[tuple[str, torch.Tensor]], cfg: Glm5NextConfig, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """dstrain (key, tensor) pairs -> the folder's (key, tensor) pairs, streaming: fused experts split per
    expert, floating tensors cast to `dtype` (`keeps_fp32` ones written fp32)."""
    for key, t in tensors:
        names = dstrain_to_hf(key, cfg)
        if dtype is not None and t.is_floating_point():
            t = t.to(torch.float32 if keeps_fp32(key) else dtype)
        parts = split_experts(t, key, cfg.moe_intermediate_size) if len(names) > 1 else [t] * len(names)
        yield from zip(names, parts, strict=True)


class Glm5Keys:
    """The reader's view of a config's names (hf.KeyTable): the text model's keys and the head; the rest of a
    multimodal folder (the vision tower) is `others`, copied on export."""

    def __init__(self, cfg: Glm5NextConfig) -> None:
        self.cfg, self.experts = cfg, cfg.n_routed_experts
        self.prefix = (text_prefix(cfg), HEAD)

    def to_dstrain(self, hf_key: str) -> Target:
        return hf_to_dstrain(hf_key, self.cfg)

    def may_start_fresh(self, key: str) -> bool:
        return may_start_fresh(key)

    def packed_bits(self) -> int:
        raise ValueError("GLM-5.3-Flash folders with packed integer weights are not read")


def open_folder(path: str | os.PathLike, cfg: Glm5NextConfig, allow_unsafe_pickle: bool = False) -> HFReader:
    """A reader of a GLM-5.3-Flash folder; where it holds the text model (`model.language_model.` or flat
    `model.`) is noted in `cfg.hf_source`, where the key table and `to_hf` find it."""
    files = checkpoint_files(path, allow_unsafe_pickle)
    nested = any(k.startswith(NESTED) for k in files) or not any(
        k.startswith(FLAT + "layers.") for k in files
    )
    if cfg.hf_source is None:
        cfg.hf_source = {}
    cfg.hf_source["prefix"] = NESTED if nested else FLAT
    return HFReader(path, Glm5Keys(cfg), allow_unsafe_pickle)


@contextlib.contextmanager
def vision_tensors(
    cfg: Glm5NextConfig, source: str | os.PathLike | None
) -> Iterator[list[tuple[str, SafetensorsFile]]]:
    """A multimodal folder's tensors outside the text model (the vision tower), each with the file of `source`
    (the folder the model came from) holding it, for the export to copy byte for byte; [] where the config.json
    declares no vision tower."""
    if not isinstance(((cfg.hf_source or {}).get("config") or {}).get("vision_config"), dict):
        yield []
        return
    if not source or not os.path.isdir(source):
        raise ValueError(
            f"a glm5_next folder's vision tower is copied from the folder its text model came from, and "
            f"{source!r} is not one"
        )
    with open_folder(source, cfg) as reader:
        yield reader.others_in_files()


def write_config(
    cfg: Glm5NextConfig, path: str | os.PathLike, dtype: torch.dtype, generation: dict | None = None
) -> None:
    """config.json (the config's source form, the weights declared as `dtype`, dequantized) and
    generation_config.json (`generation`, else the config's special token ids)."""
    write_config_files(path, cfg.to_hf_dict(), dtype, generation, cfg)


def peft_keys(key: str, cfg: Glm5NextConfig) -> list[str]:
    """The names transformers' model gives dstrain tensor `key` (PEFT adapter folders' names)."""
    return kda_hybrid_peft_keys(key, cfg.n_routed_experts, NESTED)
