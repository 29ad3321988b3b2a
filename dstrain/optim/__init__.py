"""The optimizers: AdamW (DeepSpeed's configured optimizer) or Muon with AdamW beside it (muon.py), and which
parameter each steps (groups.py). Below checkpoint/: the layout-free checkpoint reads each parameter's state
keys from here."""

from __future__ import annotations

import torch

ADAMW_STATE = ("exp_avg", "exp_avg_sq")
MUON_STATE = ("momentum_buffer",)


def state_keys(p: torch.Tensor) -> tuple[str, ...]:
    """The optimizer state tensors a trained parameter has (its group tags it; AdamW's when untagged)."""
    return getattr(p, "optimizer_state", ADAMW_STATE)
