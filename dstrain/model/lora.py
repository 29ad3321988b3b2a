"""LoRA as a module transform of dstrain's own model (no peft at training time): adapters, their init, merging.

An adapted projection keeps its base `.weight` under the same name, so checkpoints and the HF key table are
unchanged; the adapter adds `lora_A` (r, in) and `lora_B` (out, r) beside it. Only `nn.Linear` modules can be
adapted: the routed experts (fused 3-D tensors) and the router are not linears and are refused by name.
Freezing the rest and the fine-tuning options live in `dstrain.training.finetune`; `lora.json` and PEFT
adapter folders in `dstrain.checkpoint.lora`.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from .kernels import Linear, linear
from .model import DeepSeekLM, Experts, Router

LORA_SUFFIXES = (".lora_A", ".lora_B")


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
