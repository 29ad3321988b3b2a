"""Where a model's weights come from: a Hugging Face folder, or fresh values; `Weights` is the one source a
build reads, whatever the layout.

A fresh tensor starts at Normal(0, initializer_range) for matrices, ones for norms, zeros for biases and the
expert bias. Each tensor draws from its own generator, seeded by the run's seed and the tensor's name (a stack
of routed experts: one generator per expert), so any part of any tensor can be computed on its own. A pipeline
stage, a tensor- or expert-parallel slice and a ZeRO-3 partition all start from exactly the values one process
starts from, and no rank builds the whole model or talks to another to get them. `FreshWeights` answers the
same questions as a folder's `HFReader` (a tensor, a slice of it, a flat range of it), and `Weights` answers
them from the folder where it holds the tensor and fresh where it lacks it (MTP modules transformers does not
save, an expert bias): the code that loads a checkpoint into any layout also initialises one.
"""

from __future__ import annotations

import logging
import math
import os
import zlib
from collections.abc import Sequence
from functools import cached_property, partial
from typing import Any

import torch
from torch import nn

from .common.layers import ROUTER_BUFFERS, is_expert_bias, is_hash_table
from .common.lora import is_lora_key
from .hf import HFReader, flat_range
from .registry import family_of, on_meta

log = logging.getLogger(__name__)


def local_tensors(model: nn.Module, adapters: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The weights a checkpoint holds: parameters, the expert bias and V4's hash tables; LoRA adapters only
    when asked (a Hugging Face folder has none)."""
    out = [(n, p) for n, p in model.named_parameters() if adapters or not is_lora_key(n)]
    return out + [(n, b) for n, b in model.named_buffers() if n.rpartition(".")[2] in ROUTER_BUFFERS]


def shard_of(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(dim, rank, size) of a tensor- or expert-parallel slice, None for a whole tensor."""
    return getattr(t, "tp_shard", None) or getattr(t, "ep_shard", None)


def held_device(model: nn.Module) -> torch.device:
    """Where this rank's part of `model` lives (cpu when it holds none)."""
    return next((t.device for _, t in local_tensors(model) if not t.is_meta), torch.device("cpu"))


def copy_into(t: torch.Tensor, source: Any, name: str) -> None:
    """`t`: the whole tensor `name`, or its `tp_shard`/`ep_shard` slice, read from `source` (only that slice)."""
    shard = shard_of(t)
    if shard is None:
        t.copy_(source.read(name))
    else:
        dim, rank, _ = shard
        part = t.shape[dim]
        t.copy_(source.read(name, dim, rank * part, (rank + 1) * part))


def _starts_at(name: str) -> float | None:
    """The constant a tensor starts at, None for the random matrices (V4's as transformers starts them: the
    sinks, compressor position biases and mHC biases at 0, the mHC scales at 1; GLM-5.3-Flash's k-pool
    position bias at 0)."""
    last = name.rpartition(".")[2]
    if is_expert_bias(name) or last in (
        "bias",
        "sinks",
        "position_bias",
        "base",
        "hc_base",
        "index_kpool_compress_ape",
    ):
        return 0.0
    if name.endswith("norm.weight") or last in ("scale", "hc_scale"):
        return 1.0
    return None


class FreshWeights:
    """The fresh values of the tensors of the model `cfg` describes, by name, whole or in parts, in fp32 on
    `device`. `bytes_drawn` counts the fp32 bytes generated."""

    def __init__(self, cfg: Any, seed: int, device: torch.device | str = "cpu") -> None:
        self.cfg, self.seed, self.device = cfg, seed, torch.device(device)
        self.std = cfg.initializer_range
        self.bytes_drawn = 0

    @cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's whole shape (any layout's slices are parts of these), from a model on meta: built on
        the first read, so a folder that lacks nothing never pays for it."""
        return model_shapes(self.cfg)

    def full_shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """Tensor `name`, or its [start:stop) slice along `dim`. Only a stack of experts is drawn in parts (one
        expert at a time); a slice of any other tensor is cut from the whole, drawn here and dropped."""
        shape = self.shapes[name]
        stop = shape[dim] if dim is not None and stop is None else stop
        const = _starts_at(name)
        if const is not None:
            out_shape = list(shape)
            if dim is not None:
                out_shape[dim] = stop - start
            return torch.full(out_shape, const, device=self.device)
        if is_hash_table(name):  # a fixed random table: each token's k distinct experts
            gen = torch.Generator(device=self.device).manual_seed(self._seed(name))
            experts = torch.rand(shape[0], self.cfg.n_routed_experts, generator=gen, device=self.device)
            return experts.argsort(dim=-1)[:, : shape[1]].float()
        if len(shape) == 3 and dim == 0:  # the routed experts this part covers
            return torch.stack([self._draw(f"{name}#{e}", shape[1:]) for e in range(start, stop)])
        if len(shape) == 3:
            whole = torch.stack([self._draw(f"{name}#{e}", shape[1:]) for e in range(shape[0])])
        else:
            whole = self._draw(name, shape)
        return whole if dim is None else whole.narrow(dim, start, stop - start).contiguous()

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the flattened tensor (a ZeRO-3 partition), zero-padded past its end."""
        return flat_range(
            partial(self.read, name), self.shapes[name], start, stop, torch.float32, self.device
        )

    def _seed(self, key: str) -> int:
        return (self.seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63

    def _draw(self, key: str, shape: Sequence[int]) -> torch.Tensor:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self._seed(key))
        self.bytes_drawn += math.prod(shape) * 4
        return torch.empty(tuple(shape), device=self.device).normal_(0.0, self.std, generator=gen)


def model_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor's whole shape in the model `cfg` describes (any layout's slices are parts of these), from a
    model on meta: no memory."""
    return {n: tuple(t.shape) for n, t in local_tensors(on_meta(cfg))}


def open_folder(path: str | os.PathLike, cfg: Any, allow_unsafe_pickle: bool = False) -> HFReader:
    """The reader of a checkpoint folder of the model `cfg` describes (its family's names)."""
    return family_of(cfg).open_folder(str(path), cfg, allow_unsafe_pickle)


def check_folder(reader: HFReader, cfg: Any) -> list[str]:
    """Every tensor the model `cfg` describes is in the folder with its shape (from the files' headers, nothing
    read). -> the keys that may start fresh (MTP modules, the expert bias); anything else is a ValueError."""
    shapes = model_shapes(cfg)
    missing = reader.check(list(shapes))
    for name, shape in shapes.items():
        if name not in missing and reader.full_shape(name) != shape:
            raise ValueError(
                f"{reader.path}: {name} has shape {reader.full_shape(name)}, the config implies {shape}"
            )
    return missing


class Weights:
    """The weights a build reads: the folder's (checked against the config up front) where it holds a tensor,
    fresh values (`FreshWeights`) for what it lacks or for everything without a folder. Used as a context
    (closes the folder's files). `stats`: fp32 bytes drawn fresh, and bytes read of the folder's total."""

    def __init__(
        self,
        cfg: Any,
        seed: int,
        device: torch.device | str = "cpu",
        folder: str | os.PathLike | None = None,
        allow_unsafe_pickle: bool = False,
    ) -> None:
        self.cfg, self.fresh = cfg, FreshWeights(cfg, seed, device)
        self.reader = open_folder(folder, cfg, allow_unsafe_pickle) if folder is not None else None
        self.missing: set[str] = set()
        if self.reader is not None:
            try:
                self.missing = set(check_folder(self.reader, cfg))
            except ValueError:
                self.reader.close()
                raise
            if any(k.startswith("mtp.") for k in self.missing):  # a run turns MTP off first (config/plan.py)
                log.warning(
                    "%s has no MTP weights (num_nextn_predict_layers=%d): MTP modules are initialised fresh",
                    self.reader.path,
                    cfg.num_nextn_predict_layers,
                )

    def source(self, name: str) -> HFReader | FreshWeights:
        """Where tensor `name` comes from."""
        return self.fresh if self.reader is None or name in self.missing else self.reader

    def read(
        self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        return self.source(name).read(name, dim, start, stop)

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.source(name).read_flat(name, start, stop)

    @property
    def stats(self) -> dict[str, int]:
        out = {"bytes_drawn": self.fresh.bytes_drawn}
        if self.reader is not None:
            out |= {"bytes_read": self.reader.bytes_read, "checkpoint_bytes": self.reader.total_bytes}
        return out

    def check_shared_copies(self, model: nn.Module) -> None:
        """The folder's MTP copies of the embedding and head equal the tensors the model shares (a warning if
        not: dstrain ties them)."""
        if self.reader is None:
            return
        state = model.state_dict()
        for hf_key, t in self.reader.read_shared_copies().items():
            key = self.reader.shared[hf_key]
            if not torch.equal(t.to(state[key].dtype), state[key]):
                log.warning(
                    "%s differs from %s; dstrain ties MTP embedding/head to the main ones", hf_key, key
                )

    def __enter__(self) -> Weights:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.reader is not None:
            self.reader.close()


@torch.no_grad()
def fill(model: nn.Module, weights: Weights | FreshWeights) -> None:
    """Give every tensor `model` holds (not on meta: another pipeline stage's; a `tp_shard`/`ep_shard` slice:
    its part) its value from `weights`."""
    for name, t in local_tensors(model):
        if not t.is_meta:
            copy_into(t, weights, name)


def init_weights(model: nn.Module, seed: int | None = None) -> FreshWeights:
    """Every tensor `model` holds at its fresh value (see `fill`). seed None draws one from torch's global
    generator. -> the source, for its `bytes_drawn`."""
    if seed is None:
        seed = int(torch.randint(2**62, ()))
    fresh = FreshWeights(model.config, seed, held_device(model))
    fill(model, fresh)
    return fresh
