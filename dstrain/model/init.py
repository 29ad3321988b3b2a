"""How a fresh model starts: Normal(0, initializer_range) for matrices, ones for norms, zeros for biases and
the expert bias.

Each tensor draws from its own generator, seeded by the run's seed and the tensor's name (a stack of routed
experts: one generator per expert), so any part of any tensor can be computed on its own. A pipeline stage, a
tensor- or expert-parallel slice and a ZeRO-3 partition all start from exactly the values one process starts
from, and no rank builds the whole model or talks to another to get them. `FreshWeights` answers the same
questions as `HFReader` (a tensor, a slice of it, a flat range of it), so the code that loads a checkpoint
into any layout also initialises one.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from functools import cached_property, partial

import torch
from torch import nn

from .config import ModelConfig
from .lora import is_lora_key
from .model import DeepSeekLM, is_expert_bias
from .reader import HFReader, flat_range
from .v4 import DeepSeekV4LM, is_hash_table
from .v4_config import V4Config


def model_class(cfg: ModelConfig | V4Config) -> type[nn.Module]:
    """The model a config describes: DeepSeek-V4's, or the V2/V3-shaped one."""
    return DeepSeekV4LM if isinstance(cfg, V4Config) else DeepSeekLM


def local_tensors(model: nn.Module, adapters: bool = False) -> list[tuple[str, torch.Tensor]]:
    """The weights a checkpoint holds: parameters, the expert bias and V4's hash tables; LoRA adapters only
    when asked (a Hugging Face folder has none)."""
    out = [(n, p) for n, p in model.named_parameters() if adapters or not is_lora_key(n)]
    return out + [(n, b) for n, b in model.named_buffers() if is_expert_bias(n) or is_hash_table(n)]


def shard_of(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(dim, rank, size) of a tensor- or expert-parallel slice, None for a whole tensor."""
    return getattr(t, "tp_shard", None) or getattr(t, "ep_shard", None)


def held_device(model: nn.Module) -> torch.device:
    """Where this rank's part of `model` lives (cpu when it holds none)."""
    return next((t.device for _, t in local_tensors(model) if not t.is_meta), torch.device("cpu"))


def copy_into(t: torch.Tensor, source: HFReader | FreshWeights, name: str) -> None:
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
    sinks, compressor position biases and mHC biases at 0, the mHC scales at 1)."""
    last = name.rpartition(".")[2]
    if is_expert_bias(name) or last in ("bias", "sinks", "position_bias", "base", "hc_base"):
        return 0.0
    if name.endswith("norm.weight") or last in ("scale", "hc_scale"):
        return 1.0
    return None


class FreshWeights:
    """The fresh values of the tensors of the model `cfg` describes, by name, whole or in parts, in fp32 on
    `device`. `bytes_drawn` counts the fp32 bytes generated."""

    def __init__(self, cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> None:
        self.cfg, self.seed, self.device = cfg, seed, torch.device(device)
        self.std = cfg.initializer_range
        self.bytes_drawn = 0

    @cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor's whole shape (any layout's slices are parts of these), from a model on meta: built on
        the first read, so a folder that lacks nothing never pays for it."""
        with torch.device("meta"):
            return {n: tuple(t.shape) for n, t in local_tensors(model_class(self.cfg)(self.cfg))}

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


@torch.no_grad()
def fill(
    model: nn.Module, fresh: FreshWeights, folder: HFReader | None = None, missing: Sequence[str] = ()
) -> FreshWeights:
    """Give every tensor `model` holds (not on meta: another pipeline stage's; a `tp_shard`/`ep_shard` slice:
    its part) its value from `folder`, or its fresh value where there is no folder or the folder lacks it
    (`missing`). -> `fresh`, for its `bytes_drawn`."""
    for name, t in local_tensors(model):
        if not t.is_meta:
            copy_into(t, fresh if folder is None or name in missing else folder, name)
    return fresh


def init_weights(model: DeepSeekLM, seed: int | None = None) -> FreshWeights:
    """Every tensor `model` holds at its fresh value (see `fill`). seed None draws one from torch's global
    generator. -> the source, for its `bytes_drawn`."""
    if seed is None:
        seed = int(torch.randint(2**62, ()))
    return fill(model, FreshWeights(model.config, seed, held_device(model)))
