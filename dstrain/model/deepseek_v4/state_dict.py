"""DeepSeek-V4 checkpoint folders: the key table of both on-disk styles, streaming save, reading (dequantized).

In memory dstrain names V4 tensors as transformers' `DeepseekV4ForCausalLM` does, less its `model.` prefix
(fused experts `mlp.experts.gate_up_proj` (E, 2I, D) and `down_proj` (E, D, I)), plus the MTP modules
`mtp.K.*` that transformers does not build. On disk there are two styles of names:
- "deepseek", the published checkpoints': `embed.weight`, `head.weight`, `hc_head_fn`,
  `layers.N.attn.wkv.weight`, per-expert `layers.N.ffn.experts.E.w1.weight`, `layers.N.hc_attn_fn`, `mtp.K.*`;
  FP8/FP4 weights as `X.weight` beside an e8m0 `X.scale` (hf/quant.py QUANTIZED).
- "transformers", what its `save_pretrained` writes: the DeepSeek layer names under `model.`, except
  `model.embed_tokens.weight` and `model.hc_head.hc_fn` (transformers' renames are anchored at the start of a
  key) and the main kv norm as `attn.norm` (its `.norm.` -> `.kv_norm.` rename reversed).
MTP modules are in DeepSeek's names in both (transformers ignores `mtp.*` when it loads a folder).
A folder's style is told from its keys; write a folder back in the style it came in for identical files.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch

from ..common.family import fused_expert_peft_keys
from ..common.layers import is_hash_table, may_start_fresh
from ..hf import (
    DEFAULT_SHARD_BYTES,
    HFReader,
    Target,
    checkpoint_files,
    save_hf_tensors,
    split_experts,
    write_config_files,
)
from .config import V4Config

# Model-level tensors: dstrain key -> (deepseek, transformers) file key.
_GLOBAL_ROWS: dict[str, tuple[str, str]] = {
    "embed_tokens.weight": ("embed.weight", "model.embed_tokens.weight"),
    "lm_head.weight": ("head.weight", "head.weight"),
    "norm.weight": ("norm.weight", "model.norm.weight"),
    "hc_head.hc_fn": ("hc_head_fn", "model.hc_head.hc_fn"),
    "hc_head.hc_base": ("hc_head_base", "model.hc_head.hc_base"),
    "hc_head.hc_scale": ("hc_head_scale", "model.hc_head.hc_scale"),
}
# Inside a layer (after `layers.N.`; an MTP block's after `mtp.K.block.`): dstrain -> (deepseek, transformers).
_LAYER_ROWS: dict[str, tuple[str, str]] = {
    "self_attn.kv_norm.weight": ("attn.kv_norm.weight", "attn.norm.weight"),
    **{
        ds: (file, file)
        for ds, file in {
            "input_layernorm.weight": "attn_norm.weight",
            "post_attention_layernorm.weight": "ffn_norm.weight",
            "attn_hc.fn": "hc_attn_fn",
            "attn_hc.base": "hc_attn_base",
            "attn_hc.scale": "hc_attn_scale",
            "ffn_hc.fn": "hc_ffn_fn",
            "ffn_hc.base": "hc_ffn_base",
            "ffn_hc.scale": "hc_ffn_scale",
            "self_attn.sinks": "attn.attn_sink",
            "self_attn.q_a_proj.weight": "attn.wq_a.weight",
            "self_attn.q_a_norm.weight": "attn.q_norm.weight",
            "self_attn.q_b_proj.weight": "attn.wq_b.weight",
            "self_attn.kv_proj.weight": "attn.wkv.weight",
            "self_attn.o_a_proj.weight": "attn.wo_a.weight",
            "self_attn.o_b_proj.weight": "attn.wo_b.weight",
            "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
            "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
            "self_attn.compressor.position_bias": "attn.compressor.ape",
            "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
            "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
            "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
            "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
            "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
            "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
            "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
            "mlp.gate.weight": "ffn.gate.weight",
            "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
            "mlp.gate.tid2eid": "ffn.gate.tid2eid",
            "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
            "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
            "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
        }.items()
    },
}
# An MTP module's own tensors (after `mtp.K.`), the same in both styles: dstrain -> file.
MTP_KEYS: dict[str, str] = {
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "norm.weight": "norm.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_MTP_INV = {v: k for k, v in MTP_KEYS.items()}
# Per-expert projection on disk (`ffn.experts.E.w1.weight`) -> (fused tensor in a layer, half of gate_up_proj).
EXPERT_PARTS: dict[str, tuple[str, int | None]] = {
    "w1": ("mlp.experts.gate_up_proj", 0),
    "w3": ("mlp.experts.gate_up_proj", 1),
    "w2": ("mlp.experts.down_proj", None),
}
# Fused tensor -> its per-expert projections, in the order they are written.
_FUSED = {f: [p for p, (g, _) in EXPERT_PARTS.items() if g == f] for f, _ in EXPERT_PARTS.values()}
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")
_MTP = re.compile(r"mtp\.(\d+)\.(.+)")


class Style(NamedTuple):
    """One way of naming V4 tensors on disk."""

    model_keys: dict[str, str]
    """Model-level tensors: dstrain key -> file key."""
    layer: str
    """A main layer's prefix, `{}` its index."""
    layer_keys: dict[str, str]
    """Inside a layer: dstrain -> file (fused experts: EXPERT_PARTS)."""


STYLES: dict[str, Style] = {
    name: Style(
        {ds: files[i] for ds, files in _GLOBAL_ROWS.items()},
        layer,
        {ds: files[i] for ds, files in _LAYER_ROWS.items()},
    )
    for i, (name, layer) in enumerate((("deepseek", "layers.{}."), ("transformers", "model.layers.{}.")))
}
_INVERSE = {
    name: ({v: k for k, v in s.model_keys.items()}, {v: k for k, v in s.layer_keys.items()})
    for name, s in STYLES.items()
}
_LAYER_RE = {
    name: re.compile(re.escape(s.layer).replace(r"\{\}", r"(\d+)") + "(.+)") for name, s in STYLES.items()
}
# An MTP block is written in DeepSeek's layer names in either style.
_MTP_STYLE = "deepseek"

# Tensors DeepSeek keeps in fp32 whatever the weights' dtype: the mHC weights, attention sinks, compressor
# position biases, the router's expert bias.
_FP32 = re.compile(r"(^|\.)(attn_hc|ffn_hc|hc_head)\.\w+|\.(sinks|position_bias|e_score_correction_bias)")


def keeps_fp32(key: str) -> bool:
    """Whether the dstrain tensor `key` is one DeepSeek stores in fp32 (written so whatever the dtype)."""
    return _FP32.search(key) is not None


def key_style(keys: Iterable[str]) -> str:
    """The style ("deepseek" or "transformers") of a folder's tensor names, from its embedding's name."""
    keys = set(keys)
    found = [name for name, s in STYLES.items() if s.model_keys["embed_tokens.weight"] in keys]
    if len(found) != 1:
        raise ValueError(
            "not a DeepSeek-V4 checkpoint: no embed.weight (DeepSeek's names) or model.embed_tokens.weight "
            "(transformers')"
        )
    return found[0]


def v4_to_dstrain(
    hf_key: str, style: str, num_hidden_layers: int, num_mtp_layers: int | None = None
) -> Target:
    """Where the file tensor `hf_key` of a `style` folder lives in dstrain (a per-expert weight: its expert and
    half of the fused tensor). A key with no place (a layer past `num_hidden_layers`, an MTP module past
    `num_mtp_layers` when given, an unknown name) is a KeyError."""
    model_inv, layer_inv = _INVERSE[style]
    if hf_key in model_inv:
        return Target(model_inv[hf_key])
    m = _MTP.fullmatch(hf_key)
    if m:
        k, rest = int(m.group(1)), m.group(2)
        if num_mtp_layers is not None and k >= num_mtp_layers:
            raise KeyError(hf_key)
        if rest in _MTP_INV:
            return Target(f"mtp.{k}.{_MTP_INV[rest]}")
        return _in_layer(hf_key, rest, f"mtp.{k}.block.", _INVERSE[_MTP_STYLE][1])
    m = _LAYER_RE[style].fullmatch(hf_key)
    if not m or int(m.group(1)) >= num_hidden_layers:
        raise KeyError(hf_key)
    return _in_layer(hf_key, m.group(2), f"layers.{int(m.group(1))}.", layer_inv)


def _in_layer(hf_key: str, rest: str, prefix: str, layer_inv: dict[str, str]) -> Target:
    e = _EXPERT.fullmatch(rest)
    if e:
        fused, half = EXPERT_PARTS[e.group(2)]
        return Target(prefix + fused, expert=int(e.group(1)), half=half)
    if rest not in layer_inv:
        raise KeyError(hf_key)
    return Target(prefix + layer_inv[rest])


def dstrain_to_v4(key: str, style: str, cfg: V4Config) -> list[str]:
    """The file keys the dstrain tensor `key` is written as in a `style` folder (several for fused experts: in
    expert order, w1 before w3). KeyError for a key with no place."""
    s = STYLES[style]
    if key in s.model_keys:
        return [s.model_keys[key]]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
    if m:
        prefix, rest, table = s.layer.format(m.group(1)), m.group(2), s.layer_keys
    else:
        m = _MTP.fullmatch(key)
        if not m:
            raise KeyError(key)
        prefix, rest = f"mtp.{m.group(1)}.", m.group(2)
        if rest in MTP_KEYS:
            return [prefix + MTP_KEYS[rest]]
        if not rest.startswith("block."):
            raise KeyError(key)
        rest, table = rest.removeprefix("block."), STYLES[_MTP_STYLE].layer_keys
    if rest in _FUSED:
        parts = _FUSED[rest]
        return [f"{prefix}ffn.experts.{e}.{p}.weight" for e in range(cfg.n_routed_experts) for p in parts]
    if rest not in table:
        raise KeyError(key)
    return [prefix + table[rest]]


def source_style(cfg: V4Config) -> str:
    """The key style to write: the folder's the model came from; else the one that goes with its config.json's
    form (a run checkpoint keeps only the config: transformers writes its config form with its key names,
    DeepSeek publishes its own of both); else DeepSeek's own."""
    source = cfg.hf_source or {}
    return source.get("key_style") or {"transformers": "transformers"}.get(source.get("form"), "deepseek")


def to_v4_hf(
    items: Iterable[tuple[str, torch.Tensor]], cfg: V4Config, style: str, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """dstrain (key, tensor) pairs -> (file key, tensor) pairs of a `style` folder, streaming: fused experts
    split per expert; floating tensors cast to `dtype`, except those DeepSeek keeps in fp32 (`keeps_fp32`),
    which are written in fp32; integer ones (`tid2eid`) as they are."""
    for key, t in items:
        names = dstrain_to_v4(key, style, cfg)
        if is_hash_table(key):  # int64 on disk however it travelled (a run checkpoint's weights are fp32)
            t = t.to(torch.int64)
        elif dtype is not None and t.is_floating_point():
            t = t.to(torch.float32 if keeps_fp32(key) else dtype)
        parts = split_experts(t, key, cfg.moe_intermediate_size) if len(names) > 1 else [t]
        yield from zip(names, parts, strict=True)


def to_hf(
    items: Iterable[tuple[str, torch.Tensor]], cfg: V4Config, dtype: torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """`to_v4_hf` in the key style of the folder the config came from (`source_style`)."""
    return to_v4_hf(items, cfg, source_style(cfg), dtype)


# --------------------------------------------------------------------------- folders
class V4Keys:
    """The reader's view of a V4 config's names in one key style (hf.KeyTable)."""

    prefix = ""  # no multimodal wrapper

    def __init__(self, cfg: V4Config, style: str) -> None:
        self.cfg, self.style, self.experts = cfg, style, cfg.n_routed_experts

    def to_dstrain(self, hf_key: str) -> Target:
        cfg = self.cfg
        return v4_to_dstrain(hf_key, self.style, cfg.num_hidden_layers, cfg.num_nextn_predict_layers)

    def may_start_fresh(self, key: str) -> bool:
        return may_start_fresh(key)

    def packed_bits(self) -> int:
        raise ValueError("DeepSeek-V4 folders hold FP8/FP4 weights with scales, not packed integers")


def open_v4(path: str | os.PathLike, cfg: V4Config, allow_unsafe_pickle: bool = False) -> HFReader:
    """A reader (dstrain keys, slices, FP8/FP4 dequantized to fp32) of a V4 folder of either style; the style
    is remembered in `cfg.hf_source["key_style"]`, where `save_v4_folder` finds it."""
    style = key_style(checkpoint_files(path, allow_unsafe_pickle))
    if cfg.hf_source is not None:
        cfg.hf_source["key_style"] = style
    return HFReader(path, V4Keys(cfg, style), allow_unsafe_pickle)


def read_v4_folder(path: str | os.PathLike, cfg: V4Config | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a V4 folder (MTP modules included), by dstrain key: in the files' dtypes, quantized
    weights dequantized to fp32. `cfg` None: the folder's config.json. A tensor the config does not describe,
    or a fused tensor with experts missing, is a ValueError."""
    cfg = cfg or V4Config.from_folder(path)
    with open_v4(path, cfg) as reader:
        reader.check(list(reader.sources))
        return {key: reader.read(key) for key in reader.sources}


def save_v4_folder(
    state_items: Iterable[tuple[str, torch.Tensor]],
    cfg: V4Config,
    path: str | os.PathLike,
    style: str | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[str]:
    """Write dstrain (key, tensor) pairs as a V4 folder: safetensors in `style` (None: the style the config's
    folder came in, else "deepseek"), floating tensors in `dtype` (None: as they are; `keeps_fp32` ones in
    fp32 either way), dequantized; config.json and generation_config.json. -> the safetensors files."""
    if style is None:
        style = source_style(cfg)
    if style not in STYLES:
        raise ValueError(f"style={style!r}: expected one of {', '.join(STYLES)}")
    seen: list[torch.dtype] = []  # the weights' dtype, for config.json when `dtype` is None

    def noting(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for key, t in items:
            if not seen and t.is_floating_point() and not keeps_fp32(key):
                seen.append(t.dtype)
            yield key, t

    names = save_hf_tensors(to_v4_hf(noting(state_items), cfg, style, dtype), path, max_shard_bytes)
    write_v4_config(cfg, path, dtype or (seen[0] if seen else torch.float32))
    return names


def write_v4_config(
    cfg: V4Config, path: str | os.PathLike, dtype: torch.dtype, generation: dict | None = None
) -> None:
    """config.json in the config's source form (`cfg.to_hf_dict()`), declaring the weights `dtype` and
    dequantized (no `quantization_config` or `expert_dtype`: DeepSeek's inference reads the latter), and
    generation_config.json (`generation`, else the config's special token ids)."""
    write_config_files(
        path, cfg.to_hf_dict(), dtype, generation, cfg, dropped=("quantization_config", "expert_dtype")
    )


def peft_keys(key: str, cfg: V4Config) -> list[str]:
    """The names transformers' DeepseekV4ForCausalLM gives dstrain tensor `key` (its modules are dstrain's, under
    `model.`; fused experts: one key per expert and projection, as PEFT adapter folders write them)."""
    module, _, leaf = key.rpartition(".")
    if module.endswith("o_a_proj"):
        raise ValueError(
            f"{module}: DeepSeek-V4's grouped output projection has no PEFT form (peft's LoRA adds B A x over "
            "every group's input, not B A to each group's block); drop o_a_proj from --lora_targets or export merged"
        )
    if leaf in ("gate_up_proj", "down_proj") and module.endswith(".experts"):
        return fused_expert_peft_keys(module, leaf, cfg.n_routed_experts)
    return [f"model.{key}"]
