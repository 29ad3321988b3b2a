"""The batch contract between the data pipeline, the model and the trainer.

A batch is a dict of LongTensors (B, T): `input_ids`; `labels`, unshifted (position t's label is the token
at t, predicted from t-1), IGNORE_INDEX where nothing is to be learned; `position_ids`, restarting at 0 at
every packed document, so that nothing attends or predicts across documents, and PAD_POSITION where a row
holds no token (the padding after its last document): such positions are no target, and no router counts them
(the balance loss and the expert loads are over the row's tokens).
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100
"""A label that is not a target (the Hugging Face / PyTorch cross-entropy convention)."""
PAD_POSITION = -1
"""The position id of padding: no token (it attends within the row's last document, and nothing reads it)."""


def real_tokens(position_ids: torch.Tensor | None) -> torch.Tensor | None:
    """(B, T) bool of the positions that hold a token (None without position ids: every one does)."""
    return None if position_ids is None else position_ids != PAD_POSITION


def real_pairs(
    position_ids: torch.Tensor | None, b: int, t: int, k: int, device: torch.device
) -> torch.Tensor:
    """(B, t) bool: MTP depth k's positions that hold a token and whose token k ahead (its input) is one too;
    past the end of the row there is none (`position_ids` may run past t: a sequence-parallel halo)."""
    if position_ids is None:
        position_ids = torch.arange(t, device=device).expand(b, t)
    real = position_ids != PAD_POSITION
    ahead = real[:, k : k + t]
    ahead = torch.nn.functional.pad(ahead, (0, t - ahead.shape[1]), value=False)
    return real[:, :t] & ahead


def target_mask(labels: torch.Tensor, position_ids: torch.Tensor | None, shift: int) -> torch.Tensor:
    """(B, T-shift) bool: position t predicts labels[t+shift] inside its own document."""
    valid = labels[:, shift:] != IGNORE_INDEX
    if position_ids is not None:
        valid = valid & (position_ids[:, shift:] == position_ids[:, :-shift] + shift)
    return valid


def sequence_halo(mtp_depth: int) -> int:
    """Tokens after a sequence-parallel slice its positions need: targets up to MTP's deepest shift."""
    return mtp_depth + 1


def sequence_shard(
    batch: dict[str, torch.Tensor], rank: int, size: int, halo: int
) -> dict[str, torch.Tensor]:
    """Sequence-parallel rank `rank` of `size`'s part of a batch: its contiguous seq_len / size tokens of every
    row plus the `halo` tokens after them (its last positions' targets and MTP's look-ahead inputs), padded at
    the end of a row with non-targets. Position ids are made explicit (the model gathers them to mask whole
    rows)."""
    ids = batch["input_ids"]
    b, t = ids.shape
    if t % size:
        raise ValueError(f"sequence length {t} is not divisible by --sp {size}")
    c = t // size
    pos = batch.get("position_ids")
    if pos is None:
        pos = torch.arange(t, device=ids.device).expand(b, t)
    fill = {"input_ids": 0, "labels": IGNORE_INDEX, "position_ids": PAD_POSITION}
    out = {}
    for key, x in (("input_ids", ids), ("labels", batch["labels"]), ("position_ids", pos)):
        part = x[:, rank * c : (rank + 1) * c + halo]
        out[key] = torch.nn.functional.pad(part, (0, c + halo - part.shape[1]), value=fill[key])
    return out
