"""What autograd keeps for backward, as the memory estimate's activations are tested against it."""

from __future__ import annotations

import torch
from torch import nn


def saved_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the unique storages a training forward of `model` on `ids` (labels: the ids) saves for backward,
    its parameters' storages apart (each storage once: views of one tensor count once)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(x: torch.Tensor) -> torch.Tensor:
        storage = x.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(input_ids=ids, labels=ids)
    return sum(seen.values())
