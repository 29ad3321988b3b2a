"""LoRA in checkpoints and adapter folders: `lora.json` (the settings a checkpoint was trained with), and
PEFT-format adapter folders (adapter_config.json + adapter_model.safetensors, Hugging Face key names)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dstrain.atomic import write_json
from dstrain.model.config import ModelConfig
from dstrain.model.hf import dstrain_to_hf
from dstrain.model.lora import lora_state
from dstrain.model.model import DeepSeekLM

LORA_JSON = "lora.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# transformers 5 fused DeepSeek's routed experts; peft 0.21 "converts" every LoRA target whose leaf name is one
# of these (even from an explicit regex, which it reduces to leaf names) onto the fused expert parameters.
PEFT_REMAPPED_LEAVES = ("gate_proj", "up_proj", "down_proj")


def save_lora_settings(model: nn.Module, checkpoint_dir: str | os.PathLike, rank: int) -> None:
    """Write `lora.json` (r, alpha, targets, adapted modules, what else trained) into a checkpoint folder, from
    rank 0, before its COMPLETE marker. A no-op for a model without LoRA. `model`: the engine's module."""
    settings = getattr(model, "lora_settings", None)
    if rank != 0 or not settings:
        return
    write_json(Path(checkpoint_dir) / LORA_JSON, settings, indent=2)


def load_lora_settings(checkpoint_dir: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(checkpoint_dir) / LORA_JSON
    return json.loads(path.read_text()) if path.is_file() else None


# ------------------------------------------------------------------ PEFT adapter folders
def hf_module_name(module: str, cfg: ModelConfig) -> str:
    """dstrain module path -> the HF module path (`layers.0.self_attn.o_proj` -> `model.layers.0...`)."""
    keys = dstrain_to_hf(f"{module}.weight", cfg)
    if len(keys) != 1:
        raise ValueError(f"{module} has no single Hugging Face counterpart")
    return keys[0].removesuffix(".weight")


def peft_remapped(hf_modules: list[str]) -> list[str]:
    return [m for m in hf_modules if m.rpartition(".")[2] in PEFT_REMAPPED_LEAVES]


def write_peft_adapter(
    adapters: dict[str, torch.Tensor],
    settings: dict[str, Any],
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    base_model_name_or_path: str,
) -> list[str]:
    """A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors, HF key names) from dstrain adapter
    tensors. MTP adapters are left out: transformers builds no MTP modules to load them into. Returns the HF
    module paths adapted."""
    from safetensors.torch import save_file

    modules = sorted({k.rpartition(".")[0] for k in adapters})
    n = cfg.num_hidden_layers
    keep = [m for m in modules if not m.startswith("mtp.")]
    hf = {m: hf_module_name(m, cfg) for m in keep}
    bad = peft_remapped(list(hf.values()))
    if bad:
        raise ValueError(
            f"peft 0.21 on transformers 5 re-targets LoRA on {'/'.join(PEFT_REMAPPED_LEAVES)} (here {len(bad)} "
            f"modules, e.g. {bad[0]}) onto the routed experts, so this adapter would load wrong: export merged "
            "weights, or fine-tune without the MLP / shared_experts targets"
        )
    if not keep:
        raise ValueError(f"no adapters outside the MTP layers (model.layers.{n}+) to write")
    tensors = {}
    for m in keep:
        for part in ("lora_A", "lora_B"):
            tensors[f"base_model.model.{hf[m]}.{part}.weight"] = adapters[f"{m}.{part}"].contiguous().clone()
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    paths = sorted(hf.values())
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": int(settings["r"]),
        "lora_alpha": float(settings["alpha"]),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        # The exact module paths, never bare names: a bare name would match modules dstrain did not adapt.
        "target_modules": "(" + "|".join(re.escape(p) for p in paths) + ")",
    }
    write_json(Path(out_dir) / ADAPTER_CONFIG, config, indent=2)
    return paths


def save_peft_adapter(
    model: DeepSeekLM, out_dir: str | os.PathLike, base_model_name_or_path: str
) -> list[str]:
    """The model's adapters as a PEFT folder that `PeftModel.from_pretrained` loads onto the HF base model."""
    settings = getattr(model, "lora_settings", None)
    if not settings:
        raise ValueError("the model has no LoRA adapters")
    return write_peft_adapter(lora_state(model), settings, model.config, out_dir, base_model_name_or_path)
