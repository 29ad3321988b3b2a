"""What trains in a fine-tune: LoRA adapters on the chosen linears (the module transform is
`dstrain.model.common.lora`), and the router weights and MTP modules trainable or frozen explicitly."""

from __future__ import annotations

from dstrain.config.options import LoRAOptions
from dstrain.errors import ConfigError
from dstrain.model import DeepSeekLM
from dstrain.model.common.lora import apply_lora, set_trainable


def apply_finetune_options(
    model: DeepSeekLM, lora: LoRAOptions, seed: int, dsa_stage: str | None = None
) -> list[str]:
    """LoRA (lora_r > 0) on `lora_targets`, then the router weights and the MTP modules made trainable or
    frozen (train_router, train_mtp), then the sparse-attention stage's freezing: the dense warm-up trains the
    lightning indexers alone, the frozen stage everything but them. The expert bias is a buffer, governed by
    --moe_bias_update_speed alone. Returns the adapted module names ([] without LoRA)."""
    names: list[str] = []
    if lora.lora_r > 0 and lora.train_router and "gate" in lora.targets:
        raise ConfigError(
            f"--lora_targets {lora.lora_targets} adapts the routers (gate) and --train_router trains them in "
            "full: choose one"
        )
    if lora.lora_r > 0:
        try:
            names = apply_lora(model, lora.lora_r, lora.lora_alpha, lora.targets, seed=seed)
        except ValueError as exc:
            raise ConfigError(f"--lora_targets {lora.lora_targets}: {exc}") from None
    set_trainable(model, bool(lora.train_router), bool(lora.train_mtp), dsa_stage)
    if names:
        model.lora_settings.update(
            train_router=bool(lora.train_router),
            train_mtp=bool(lora.train_mtp),
            bias_update_speed=float(model.config.bias_update_speed),
        )
    return names
