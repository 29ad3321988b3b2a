"""The model families dstrain trains, and what picks one: a preset's name, a folder's config.json `model_type`, a
config's class. docs/interfaces.md ("Model families") says what a new family adds and how it joins here."""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch
from torch import nn

from . import deepseek_v3, deepseek_v4, glm5_next, kimi_linear
from .common.family import Family

# The default family reads any other model_type (Kimi-K2's, multimodal wrappers'), or says what is wrong.
DEFAULT = deepseek_v3.FAMILY
FAMILIES: dict[str, Family] = {
    f.name: f for f in (deepseek_v3.FAMILY, deepseek_v4.FAMILY, kimi_linear.FAMILY, glm5_next.FAMILY)
}
PRESETS: dict[str, Any] = {name: cfg for f in FAMILIES.values() for name, cfg in f.presets.items()}
assert len(PRESETS) == sum(len(f.presets) for f in FAMILIES.values()), "a preset name used twice"


def family_of(cfg: Any) -> Family:
    """The family of a config (of one of the families' config classes)."""
    for family in FAMILIES.values():
        if isinstance(cfg, family.config):
            return family
    raise TypeError(f"{type(cfg).__name__} is no model family's config")


def model_class(cfg: Any) -> type[nn.Module]:
    """The model a config describes."""
    return family_of(cfg).model


# torch.nn.init's fills, which on the meta device run as Python references that import torch._dynamo (2.5 s of
# every process that builds a model): skipped there, where there is nothing to fill
_FILLS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
          "trunc_normal_", "ones_", "zeros_", "constant_")  # fmt: skip


def on_meta(cfg: Any) -> nn.Module:
    """The model a config describes on the meta device: shapes and structure, no memory, no values."""
    saved = {name: getattr(nn.init, name) for name in _FILLS}
    try:
        for name in _FILLS:
            setattr(nn.init, name, _unfilled)
        with torch.device("meta"):
            return model_class(cfg)(cfg)
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _unfilled(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


def family_for_type(model_type: str | None) -> Family:
    """The family that reads a config.json of this model_type."""
    return next((f for f in FAMILIES.values() if model_type in f.model_types), DEFAULT)


def config_class(folder: str | os.PathLike) -> type:
    """The config class that reads a checkpoint folder's config.json (by its model_type)."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return DEFAULT.config  # its from_folder says what is wrong
    return family_for_type(model_type).config


def config_from_hf_dict(d: dict[str, Any]) -> Any:
    """A config.json's dict read by the class of its model_type (a run checkpoint's own config.json)."""
    return family_for_type(d.get("model_type")).config.from_hf_dict(d)


def get_config(spec: Any) -> Any:
    """A preset name, a Hugging Face checkpoint folder (its config.json, read by its family's class), or a config
    of one of the families (returned as is)."""
    if any(isinstance(spec, f.config) for f in FAMILIES.values()):
        return spec
    spec = str(spec)
    if spec in PRESETS:
        return copy.deepcopy(PRESETS[spec])
    if os.path.isdir(spec):
        return config_class(spec).from_folder(spec)
    raise ValueError(f"model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint folder")


def param_counts(config: Any, include_mtp: bool = True) -> dict[str, int]:
    """Total and per-token active parameter counts of a preset, folder or config (its family's count)."""
    cfg = get_config(config)
    return family_of(cfg).param_counts(cfg, include_mtp)


def flops_per_token(config: Any, seq_len: int, include_mtp: bool = False, sparse: bool = True) -> float:
    """Training FLOPs per token of a preset, folder or config at rows of `seq_len` (its family's count)."""
    cfg = get_config(config)
    return family_of(cfg).flops_per_token(cfg, seq_len, include_mtp, sparse)
