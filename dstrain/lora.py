"""LoRA for dstrain's own model (no peft at training time), merging, and PEFT-format adapter folders.

An adapted projection keeps its base `.weight` under the same name, so checkpoints and the HF key table are
unchanged; the adapter adds `lora_A` (r, in) and `lora_B` (out, r) beside it. Only `nn.Linear` modules can be
adapted: the routed experts (fused 3-D tensors) and the router are not linears and are refused by name.
"""

from __future__ import annotations

import json
import math
import os
import re
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dstrain.model.config import ModelConfig
from dstrain.model.hf import dstrain_to_hf
from dstrain.model.kernels import Linear, linear
from dstrain.model.model import DeepSeekLM, Experts, Router

LORA_JSON = "lora.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
LORA_SUFFIXES = (".lora_A", ".lora_B")
# transformers 5 fused DeepSeek's routed experts; peft 0.21 "converts" every LoRA target whose leaf name is one
# of these (even from an explicit regex, which it reduces to leaf names) onto the fused expert parameters.
PEFT_REMAPPED_LEAVES = ("gate_proj", "up_proj", "down_proj")


class LoRALinear(Linear):
    """A Linear plus a trainable low-rank update: y = W x + b + (alpha / r) · B A x."""

    def __init__(
        self, base: nn.Linear, r: int, alpha: float, generator: torch.Generator | None = None
    ) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        # The same Parameter objects: names, ties and any references elsewhere stay valid.
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.r, self.alpha, self.scale = r, alpha, alpha / r
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, device=w.device, dtype=w.dtype))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, r, device=w.device, dtype=w.dtype))
        if not w.is_meta:
            self.reset_adapter(generator)

    @torch.no_grad()
    def reset_adapter(self, generator: torch.Generator | None = None) -> None:
        """A as nn.Linear initialises a weight, B zero: the adapted layer starts equal to the base."""
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5), generator=generator)
        self.lora_B.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias) + linear(linear(x, self.lora_A), self.lora_B) * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, alpha={self.alpha}"


def _plain_linear(m: nn.Linear) -> Linear:
    out = Linear.__new__(Linear)
    nn.Module.__init__(out)
    out.in_features, out.out_features = m.in_features, m.out_features
    out.weight = m.weight
    out.register_parameter("bias", m.bias)
    return out


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def match_targets(model: nn.Module, targets: list[str]) -> list[str]:
    """Names of the Linear modules `targets` select: a target matches a module whose dotted name has it as a
    component (the module itself, or anything inside a module of that name)."""
    if not targets:
        raise ValueError("no LoRA targets given")
    modules = dict(model.named_modules())
    chosen: set[str] = set()
    for t in targets:
        named = [m for n, m in modules.items() if n.rpartition(".")[2] == t]
        if any(isinstance(m, Experts) for m in named):
            raise ValueError(
                f"{t!r} are the routed experts: fused 3-D parameters, not nn.Linear, so LoRA cannot adapt them"
            )
        if any(isinstance(m, Router) for m in named):
            raise ValueError(f"{t!r} is the MoE router, not an nn.Linear (train it with --train_router)")
        hits = {n for n, m in modules.items() if isinstance(m, nn.Linear) and t in n.split(".")}
        if not hits:
            kinds = sorted({type(m).__name__ for m in named})
            if kinds:
                raise ValueError(f"{t!r} ({'/'.join(kinds)}) is not an nn.Linear: LoRA adapts linears only")
            raise ValueError(f"{t!r} matches no module of this model")
        chosen |= hits
    return sorted(chosen, key=list(modules).index)


def apply_lora(model: DeepSeekLM, r: int, alpha: float, targets: list[str], seed: int = 0) -> list[str]:
    """Replace the targeted Linears by LoRALinear (base weight kept, same name); returns their module names.
    Only the adapters require grad afterwards; A is initialised from `seed` alone, identically on every rank."""
    if r <= 0:
        raise ValueError(f"LoRA rank r={r}: must be > 0")
    if alpha <= 0:
        raise ValueError(f"LoRA alpha={alpha}: must be > 0")
    names = match_targets(model, targets)
    for name in names:
        if isinstance(model.get_submodule(name), LoRALinear):
            raise ValueError(f"{name} already has a LoRA adapter")
        if name == "lm_head" and model.config.tie_word_embeddings:
            raise ValueError(
                "lm_head is tied to embed_tokens: a LoRA on it would untie them; drop the target"
            )
    for p in model.parameters():
        p.requires_grad = False
    for name in names:
        base = model.get_submodule(name)
        _replace(model, name, LoRALinear(base, r, alpha, _adapter_generator(name, seed, base.weight)))
    model.lora_settings = {"r": r, "alpha": alpha, "targets": list(targets), "modules": names}
    return names


def _adapter_generator(name: str, seed: int, like: torch.Tensor) -> torch.Generator | None:
    """One generator per adapted module, seeded by its name: the same A on every rank and in every layout."""
    if like.is_meta:
        return None
    return torch.Generator(device=like.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def init_adapters(model: nn.Module, seed: int) -> None:
    """(Re)initialise the adapters of a model whose LoRA modules were made on the meta device, then given
    memory (the parallel loading path); other pipeline stages' adapters stay on meta."""
    for name, m in lora_modules(model).items():
        if not m.lora_A.is_meta:
            m.reset_adapter(_adapter_generator(name, seed, m.lora_A))


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors, by state-dict key (`<module>.lora_A`, `<module>.lora_B`), detached."""
    return {k: v.detach() for k, v in model.state_dict().items() if k.endswith(LORA_SUFFIXES)}


def merged_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale · B A, computed in fp32 and returned in W's dtype."""
    return (weight.float() + scale * (b.float() @ a.float())).to(weight.dtype)


@torch.no_grad()
def merge_lora(model: nn.Module) -> list[str]:
    """Fold every adapter into its base weight in place and restore plain Linears; returns the merged names."""
    merged = lora_modules(model)
    for name, m in merged.items():
        m.weight.data.copy_(merged_weight(m.weight, m.lora_A, m.lora_B, m.scale))
        _replace(model, name, _plain_linear(m))
    if hasattr(model, "lora_settings"):
        del model.lora_settings
    return list(merged)


def apply_finetune_options(model: DeepSeekLM, t: Any) -> list[str]:
    """The fine-tuning options of `TrainOptions`: LoRA (lora_r > 0) on `lora_targets`, then the router weights
    and the MTP modules made trainable or frozen explicitly (train_router, train_mtp). The expert bias is a
    buffer, governed by --moe_bias_update_speed alone. Returns the adapted module names ([] without LoRA)."""
    from dstrain.training.errors import ConfigError

    names: list[str] = []
    if t.lora_r > 0:
        targets = [s.strip() for s in t.lora_targets.split(",") if s.strip()]
        try:
            names = apply_lora(model, t.lora_r, t.lora_alpha, targets, seed=t.seed)
        except ValueError as exc:
            raise ConfigError(f"--lora_targets {t.lora_targets}: {exc}") from None
    adapted = {id(m.weight) for m in lora_modules(model).values()}
    for p in model.mtp.parameters():
        if id(p) not in adapted:  # a LoRA base weight stays frozen whatever train_mtp says
            p.requires_grad = t.train_mtp
    for router in model.routers():
        router.weight.requires_grad = t.train_router
    if names:
        model.lora_settings.update(
            train_router=bool(t.train_router),
            train_mtp=bool(t.train_mtp),
            bias_update_speed=float(model.config.bias_update_speed),
        )
    return names


# ------------------------------------------------------------------ checkpoints
def save_lora_settings(model: nn.Module, checkpoint_dir: str | os.PathLike, rank: int) -> None:
    """Write `lora.json` (r, alpha, targets, adapted modules, what else trained) into a checkpoint folder, from
    rank 0, before its COMPLETE marker. A no-op for a model without LoRA. `model`: the engine's module."""
    settings = getattr(model, "lora_settings", None)
    if rank != 0 or not settings:
        return
    path = Path(checkpoint_dir) / LORA_JSON
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(settings, indent=2))
    os.replace(tmp, path)


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
    with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    return paths


def save_peft_adapter(
    model: DeepSeekLM, out_dir: str | os.PathLike, base_model_name_or_path: str
) -> list[str]:
    """The model's adapters as a PEFT folder that `PeftModel.from_pretrained` loads onto the HF base model."""
    settings = getattr(model, "lora_settings", None)
    if not settings:
        raise ValueError("the model has no LoRA adapters")
    return write_peft_adapter(lora_state(model), settings, model.config, out_dir, base_model_name_or_path)
