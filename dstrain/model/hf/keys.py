"""How a family's names meet a folder's: where a folder tensor lives in dstrain (`Target`), what the reader must
know of a model (`KeyTable`), and the per-expert layout every DeepSeek folder shares (fused experts in memory,
one tensor per expert and projection on disk)."""

from __future__ import annotations

from typing import Protocol

import torch


class Target:
    """Where one HF tensor lives in dstrain: a key, and optionally (expert, half) inside a fused tensor; `shared`:
    a copy of a tensor the model holds once (MTP's copies of the embedding and head), not read."""

    __slots__ = ("key", "expert", "half", "shared")

    def __init__(
        self, key: str, expert: int | None = None, half: int | None = None, shared: bool = False
    ) -> None:
        self.key, self.expert, self.half, self.shared = key, expert, half, shared


class KeyTable(Protocol):
    """A family's names for one config: what the reader needs to know of the model."""

    prefix: str | tuple[str, ...]
    """The text model's prefix inside a multimodal checkpoint ("" for a text model's own), or its prefixes (a
    folder whose head lies outside the text model's prefix): keys starting with none are `others`."""
    experts: int
    """Routed experts in each fused tensor (`*experts.gate_up_proj` / `*experts.down_proj`)."""

    def to_dstrain(self, hf_key: str) -> Target:
        """Where the folder's tensor lives in dstrain; KeyError for one the config does not describe."""

    def may_start_fresh(self, key: str) -> bool:
        """Whether the dstrain tensor `key` may be missing from a folder (started fresh instead)."""

    def packed_bits(self) -> int:
        """The width of compressed-tensors' packed integers (ValueError where the config declares none)."""


def split_experts(t: torch.Tensor, name: str, intermediate: int) -> list[torch.Tensor]:
    """Per-expert tensors of the fused tensor `name` (E, 2I, D) gate_up_proj: each expert's gate then up rows
    (`intermediate` = I); (E, D, I) down_proj: each expert's), in the order the families list their keys."""
    if name.endswith("gate_up_proj"):
        return [part for e in range(t.shape[0]) for part in (t[e, :intermediate], t[e, intermediate:])]
    return list(t.unbind(0))
