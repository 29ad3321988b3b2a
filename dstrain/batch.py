"""The batch contract between the data pipeline, the model and the trainer.

A batch is a dict of LongTensors (B, T): `input_ids`; `labels`, unshifted (position t's label is the token
at t, predicted from t-1), IGNORE_INDEX where nothing is to be learned; `position_ids`, restarting at 0 at
every packed document, so that nothing attends or predicts across documents.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
"""A label that is not a target (the Hugging Face / PyTorch cross-entropy convention)."""


def target_mask(labels: torch.Tensor, position_ids: torch.Tensor | None, shift: int) -> torch.Tensor:
    """(B, T-shift) bool: position t predicts labels[t+shift] inside its own document."""
    valid = labels[:, shift:] != IGNORE_INDEX
    if position_ids is not None:
        valid = valid & (position_ids[:, shift:] == position_ids[:, :-shift] + shift)
    return valid
