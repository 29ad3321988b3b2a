"""What a model's forward returns, and which kernels it runs (both families)."""

from __future__ import annotations

from typing import Any

import torch

from .attention import attention_path
from .dsa import kernel_path as dsa_kernel_path
from .experts import grouped_mm_ok
from .kernels import compute_dtype


class ModelOutput(dict):
    """The forward's results, as a dict with attribute access: ZeRO-3's hooks find tensors inside dicts (not
    inside dataclasses). Fields: logits, loss, lm_loss_sum, lm_tokens, mtp_loss_sum, mtp_tokens, aux_loss,
    expert_load, mtp_hits (in eval mode: positions where MTP depth 1's top-1 token is the target, the draft
    acceptance of speculative decoding), indexer_stats (sparse attention: fp64 [KL sum, queries, recall sum,
    queries counted for recall] over the indexers of this forward, dsa.PassResult), lm_token_loss ((B, T')
    fp32 per-position cross-entropy, with `token_losses=True`); an unset field reads as None."""

    FIELDS = (
        "logits",
        "loss",
        "lm_loss_sum",
        "lm_tokens",
        "mtp_loss_sum",
        "mtp_tokens",
        "aux_loss",
        "expert_load",
        "mtp_hits",
        "indexer_stats",
        "lm_token_loss",
    )

    def __getattr__(self, name: str):  # noqa: ANN204
        if name in ModelOutput.FIELDS:
            return self.get(name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value) -> None:  # noqa: ANN001
        if name not in ModelOutput.FIELDS:
            raise AttributeError(f"ModelOutput has no field {name!r}")
        self[name] = value


def kernel_paths(cfg: Any, device: torch.device, dtype: torch.dtype) -> dict[str, str]:
    """Which kernels the model runs on `device` at `dtype`: attention on plain and on packed rows, the routed
    experts' GEMMs, DeepSeek Sparse Attention's (what `dstrain env` and a run's first lines show)."""
    compute = compute_dtype(torch.empty((), dtype=dtype, device=device)) if device.type == "cpu" else dtype
    own = getattr(cfg, "attention_kernel", None)  # a family with one kernel everywhere (DeepSeek-V4's)
    paths = (
        {"attention": own}
        if own
        else {
            "attention": attention_path(device, dtype, packed=False),
            "attention, packed rows": attention_path(device, dtype, packed=True),
        }
    )
    if getattr(cfg, "sparse_attention", False) and not own:
        paths["sparse attention"] = dsa_kernel_path(device, dtype)
    if cfg.is_moe:
        fast = grouped_mm_ok(compute, device, cfg.hidden_size, cfg.moe_intermediate_size)
        paths["experts"] = "grouped GEMM" if fast else "a GEMM per expert (offsets read once per layer)"
    if compute != dtype:
        paths["compute dtype"] = f"{str(compute).removeprefix('torch.')} (this CPU has no native bf16)"
    return paths
