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


def with_host_copy(moved: torch.Tensor, host: torch.Tensor) -> None:
    """Remember the CPU batch's copy of a tensor the trainer moved to its device: what is decided from the
    batch's values on the host (the attention layout) reads it instead of the device's copy (a host sync)."""
    moved.dstrain_host_copy = host


def host_copy(t: torch.Tensor | None) -> torch.Tensor | None:
    """`t` itself on the CPU, else the CPU copy `with_host_copy` remembered for it, or None."""
    if t is not None and t.device.type == "cpu":
        return t
    return getattr(t, "dstrain_host_copy", None)


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`; to a GPU through pinned memory: torch's blocking copy from the host waits for
    everything queued on the device (a host sync), a pinned non-blocking one does not."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A CPU batch on `device` (host_to_device); position ids moved to a GPU keep their CPU copy for the
    attention layout (with_host_copy: no device read)."""
    moved = {k: host_to_device(v, device) for k, v in batch.items()}
    if "position_ids" in moved and device.type == "cuda":
        with_host_copy(moved["position_ids"], batch["position_ids"])
    return moved


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
    # other per-token keys (a preference batch's `documents`) are sliced alike, filled with -1
    others = [(k, v) for k, v in batch.items() if k not in fill]
    for key, x in (("input_ids", ids), ("labels", batch["labels"]), ("position_ids", pos), *others):
        part = x[:, rank * c : (rank + 1) * c + halo]
        out[key] = torch.nn.functional.pad(part, (0, c + halo - part.shape[1]), value=fill.get(key, -1))
    return out


def document_index(labels: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """(B, T) int64: each token's document, numbered in row-major order over the batch among the documents
    that hold a target; -1 on padding and on documents without one. A preference batch
    (dstrain/data/preference.py) holds each pair's two documents side by side, chosen first: document k is
    pair k // 2's chosen (k even) or rejected (k odd) completion."""
    b, t = labels.shape
    pos = position_ids if position_ids is not None else torch.arange(t, device=labels.device).expand(b, t)
    real = pos != PAD_POSITION
    raw = ((pos == 0).flatten().cumsum(0) - 1).view(b, t)
    raw = torch.where(real, raw, -1)
    n = int(raw.max()) + 1
    targets = (labels != IGNORE_INDEX) & real & (raw >= 0)
    counts = torch.zeros(max(n, 1), dtype=torch.int64, device=labels.device)
    counts.index_add_(0, raw[targets], torch.ones_like(raw[targets]))
    keep = counts > 0
    renumbered = keep.cumsum(0) - 1
    safe = raw.clamp(min=0)
    return torch.where((raw >= 0) & keep[safe], renumbered[safe], -1)
