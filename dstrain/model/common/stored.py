"""A frozen base kept as its checkpoint stores it (`--base_precision stored`): a LoRA fine-tune of an FP8, FP4 or
INT4 release holds each quantized weight as the file's own codes and scales (hf/quant.py's forms), dequantized
when a layer needs it (its forward, and the input gradient in backward) and dropped after: the working set is
one layer's weights (all its experts at once for the routed experts), never a dense copy of the model.

Every part is a uint8 buffer holding the part's bytes (a view, reinterpreted on use): DeepSpeed casts floating
parameters and buffers to the engine's dtype and hands parameters to ZeRO, and neither touches a non-persistent
integer buffer. So the stored weights are in no optimizer, no ZeRO partition, no checkpoint (a resume reads the
folder again: checkpoint/store.py checks it is the same folder) and no gradient reduction.

The dequantized value is the one a dense load computes (fp32, then the layer's dtype), so a stored-base run
computes bit for bit what the dequantized-base run does on one process.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn


class Source(NamedTuple):
    """Where a stored weight's parts come from in the folder (`fill_stored`), and which part of them it holds."""

    key: str
    """The dstrain key."""
    half: int | None = None
    """Of fused experts' gate_up_proj: 0 gate, 1 up."""
    experts: tuple[int, int] | None = None
    """Of routed experts: the range [start, stop) held."""
    cut: tuple[int, int, int] | None = None
    """A tensor-parallel slice (dim, rank, size) of a matrix: its block rows or columns."""


def cut_range(part: int, logical: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """The range of a part's `part` entries along a dim holding `logical` weight rows (or columns) that rank
    `rank` of `size` keeps: a whole number of the part's blocks (e.g. FP8 scales: 128 rows each). ValueError
    naming `what` when the slice would cut a block."""
    per = logical // part if part and logical % part == 0 else 0
    chunk = logical // size
    if logical % size or not per or chunk % per:
        block = -(-logical // part) if part else logical
        raise ValueError(
            f"{what}: {logical} over {size} ranks cuts its stored blocks of {block} (each rank's {logical / size:g} "
            "is no whole number of blocks)"
        )
    n = chunk // per
    return rank * n, (rank + 1) * n


class StoredWeight(nn.Module):
    """One weight (or a stack of experts' weights, leading dim E) as its file stores it, from `source`: `form`
    names its quantized form (hf.quant.QUANTIZED's marker), `fmt(parts, dtype, (rows, cols))` dequantizes it,
    given by the caller (model/quantized.py): this floor reads no checkpoint format."""

    def __init__(
        self, form: str, fmt: Any, parts: dict[str, torch.Tensor], shape: tuple[int, ...], source: Source
    ) -> None:
        super().__init__()
        self.form, self.fmt, self.shape, self.source = form, fmt, tuple(shape), source
        self.dtypes: dict[str, torch.dtype] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.group: Any = None  # partitioned (`partition`): this rank holds 1/size of each part's elements
        for name, t in parts.items():
            self.dtypes[name], self.shapes[name] = t.dtype, tuple(t.shape)
            octets = torch.empty(
                (*t.shape[:-1], t.shape[-1] * t.element_size()), dtype=torch.uint8, device=t.device
            )
            self.register_buffer(name, octets, persistent=False)

    def partition(self, group: Any, rank: int, size: int) -> None:
        """On meta: hold elements [rank * n, (rank + 1) * n) of each part flattened (n = its elements / size,
        rounded up; the last rank's zero-padded), gathered from the group when used (ZeRO-3's way with
        parameters, for the stored bytes)."""
        self.group, self.rank, self.size = group, rank, size
        for name, shape in self.shapes.items():
            n = -(-math.prod(shape) // size)
            self._buffers[name] = torch.empty(
                n * self.dtypes[name].itemsize, dtype=torch.uint8, device="meta"
            )

    dtype = torch.float32  # the dense weight's, as the model built on meta has it (LoRA adapters follow it)

    @property
    def device(self) -> torch.device:
        return next(iter(self._buffers.values())).device

    @property
    def is_meta(self) -> bool:
        return self.device.type == "meta"

    def part(self, name: str) -> torch.Tensor:
        held = self._buffers[name]
        if self.group is not None:  # partitioned: the whole part gathered (a collective)
            whole = held.new_empty(held.numel() * self.size)
            torch.distributed.all_gather(list(whole.chunk(self.size)), held, group=self.group)
            n = math.prod(self.shapes[name]) * self.dtypes[name].itemsize
            return whole[:n].view(self.dtypes[name]).view(self.shapes[name])
        return held.view(self.dtypes[name])

    def tp_slice(self, dim: int, rank: int, size: int) -> StoredWeight:
        """On meta: this weight's tensor-parallel slice along `dim` (0 rows, 1 columns), whole blocks of every
        part (ValueError where a block would be cut)."""
        shape = list(self.shape)
        shape[dim] //= size
        parts = {}
        for name, s in self.shapes.items():
            s = list(s)
            if name != "weight_shape":  # compressed-tensors' (rows, cols): rewritten on load
                lo, hi = cut_range(s[dim], self.shape[dim], rank, size, f"{self.source.key} ({name})")
                s[dim] = hi - lo
            parts[name] = torch.empty(s, dtype=self.dtypes[name], device="meta")
        return StoredWeight(
            self.form, self.fmt, parts, tuple(shape), self.source._replace(cut=(dim, rank, size))
        )

    def _cut(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This slice's share of part `name`, read whole."""
        dim, rank, size = self.source.cut
        if name == "weight_shape":
            return torch.tensor(self.shape, dtype=t.dtype)
        lo, hi = cut_range(t.shape[dim], self.shape[dim] * size, rank, size, self.source.key)
        return t.narrow(dim, lo, hi - lo)

    @torch.no_grad()
    def load(self, parts: dict[str, torch.Tensor]) -> None:
        """The parts as the files hold them (whole; of experts, the range held): a tensor-parallel slice cuts
        its part, a partitioned weight keeps its range of each."""
        for name, t in parts.items():
            if self.source.cut is not None:
                t = self._cut(name, t)
            if t.dtype != self.dtypes[name] or tuple(t.shape) != self.shapes[name]:
                raise ValueError(
                    f"{self.source[0]}: the folder's {name} is {t.dtype} {tuple(t.shape)}, the model holds "
                    f"{self.dtypes[name]} {self.shapes[name]}"
                )
            octets = t.contiguous().view(torch.uint8).flatten()
            held = self._buffers[name]
            if self.group is not None:
                octets = octets[self.rank * held.numel() : (self.rank + 1) * held.numel()]
                held.zero_()
                held[: octets.numel()].copy_(octets)
            else:
                held.view(-1).copy_(octets)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The dense weight in `dtype` (through fp32, as a dense load computes it)."""
        return self.dequantize_parts({p: self.part(p) for p in self.dtypes}, dtype)

    def dequantize_parts(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The dense weight of `parts` (this weight's, or a range of experts of them) in `dtype`, by the form's
        `fmt(parts, dtype, shape)` (model/quantized.py: Triton's kernels where they run, torch's path elsewhere,
        the same bits)."""
        return self.fmt(parts, dtype, self.shape[-2:])

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _StoredLinear.apply(x, self, bias)

    def extra_repr(self) -> str:
        return f"{self.form}, shape={self.shape}"


class _StoredLinear(torch.autograd.Function):
    """y = x W^T + b with W dequantized in forward and again in backward (for dx): nothing of W is saved."""

    @staticmethod
    def forward(ctx, x, stored, bias):  # noqa: ANN001, ANN205
        from .kernels import linear

        ctx.stored = stored
        ctx.save_for_backward(bias if bias is not None else x.new_empty(0))
        ctx.has_bias = bias is not None
        return linear(x, stored.dequantize(x.dtype), bias)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        from .kernels import linear

        (bias,) = ctx.saved_tensors
        w = ctx.stored.dequantize(dy.dtype)
        dx = linear(dy, w.t()) if ctx.needs_input_grad[0] else None
        db = (
            dy.reshape(-1, dy.shape[-1]).sum(0).to(bias.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]
            else None
        )
        return dx, None, db


# The dequantized experts a layer holds at once (fp32, the largest transient): a V3 layer's 256 experts are
# 44 GB, a group within this budget (6 experts of V3's, all of a small model's) is dequantized at a time.
EXPERT_CHUNK_BYTES = 1 << 30


class StoredExperts(nn.Module):
    """The routed experts' gate, up and down weights of one MoE layer (this rank's experts), stored; used
    `chunk` experts at a time (experts.py)."""

    def __init__(self, gate: StoredWeight, up: StoredWeight, down: StoredWeight) -> None:
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        e, i, d = gate.shape
        self.shape = (e, 2 * i, d)  # gate_up_proj's
        self.chunk = max(1, EXPERT_CHUNK_BYTES // (3 * i * d * 4))

    def weights(self, dtype: torch.dtype) -> Any:
        """(e0, e1) -> experts [e0, e1)'s (gate_up (n, 2I, D), down (n, D, I)) in `dtype`; the parts fetched
        once (a ZeRO-3 partition gathered once per call of this)."""
        held = [(w, {p: w.part(p) for p in w.dtypes}) for w in (self.gate, self.up, self.down)]

        def experts(e0: int, e1: int) -> tuple[torch.Tensor, torch.Tensor]:
            gate, up, down = (
                w.dequantize_parts({p: t[e0:e1] for p, t in parts.items()}, dtype) for w, parts in held
            )
            return torch.cat([gate, up], dim=-2), down

        return experts

    dtype = torch.float32

    @property
    def device(self) -> torch.device:
        return self.gate.device

    @property
    def is_meta(self) -> bool:
        return self.gate.is_meta

    def local(self, first: int, n: int) -> StoredExperts:
        """Experts [first, first + n) (an expert-parallel rank's), on meta: filled from the folder."""
        return StoredExperts(*(_sliced(w, first, n) for w in (self.gate, self.up, self.down)))


def _sliced(w: StoredWeight, first: int, n: int) -> StoredWeight:
    parts = {p: torch.empty((n, *s[1:]), dtype=w.dtypes[p], device="meta") for p, s in w.shapes.items()}
    start = w.source.experts[0] + first
    return StoredWeight(
        w.form, w.fmt, parts, (n, *w.shape[1:]), w.source._replace(experts=(start, start + n))
    )


def dense_weight(weight: Any, dtype: torch.dtype) -> torch.Tensor:
    """A weight as a tensor: a stored one dequantized into `dtype`, a tensor as it is."""
    return weight.dequantize(dtype) if isinstance(weight, StoredWeight) else weight


def stored_weights(model: nn.Module) -> Iterator[tuple[str, StoredWeight]]:
    for name, m in model.named_modules():
        if isinstance(m, StoredWeight):
            yield name, m
