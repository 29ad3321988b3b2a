"""Configuration values every family shares."""

from __future__ import annotations

import json
import os
from typing import Any

# Vocabulary size of the DeepSeek-V3 tokenizer as the published configs declare it (128K BPE + specials,
# padded); the tiny presets use it so the real tokenizer's ids always fit.
DEEPSEEK_V3_VOCAB = 129280

# Fields that training adds on top of the architecture. Only aux_loss_alpha has a config.json form (DeepSeek's
# own configs carry it): it is read from there and written back as what trained.
TRAINING_FIELDS = ("aux_loss_alpha", "bias_update_speed", "mtp_loss_weight")


def config_from_folder(cls: Any, path: str | os.PathLike) -> Any:
    """`cls.from_hf_dict` of a checkpoint folder's config.json, the folder kept in `hf_source["folder"]` (what
    save_pretrained copies a vision tower from)."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"{path}: no config.json (expected a Hugging Face checkpoint folder)")
    with open(cfg_file) as f:
        cfg = cls.from_hf_dict(json.load(f))
    cfg.hf_source["folder"] = os.path.abspath(path)
    return cfg
