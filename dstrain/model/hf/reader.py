"""Read a Hugging Face folder by dstrain key, whole or in slices, without loading the rest.

The folder is indexed up front (names and shapes only), so a wrong folder fails before any weight is read.
Then each rank asks for exactly what it holds: a tensor-parallel slice along one dimension, a range of experts,
or a flat range of elements (a ZeRO-3 partition); only those bytes are read from the files.
`bytes_read` counts what was actually read, which is how tests check that no rank read the whole model.
Quantized weights (quant.QUANTIZED) are dequantized to fp32 as they are read; a multimodal checkpoint's tensors
outside its text model are indexed, never read. What a key means is the family's (its `KeyTable`): this floor
knows files, not models.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from .files import FP8, SAFE_DTYPES, SafetensorsFile, checkpoint_files, pickle_files
from .keys import KeyTable
from .quant import QUANTIZED, Form, form_of


def flat_range(
    read: Callable[..., torch.Tensor],
    shape: Sequence[int],
    start: int,
    stop: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Elements [start, stop) of a flattened tensor of `shape`, zero-padded past its end, from
    `read(dim, start, stop)` of only the dim-0 rows the range touches (`read()`: a 0-d tensor whole)."""
    numel = math.prod(shape)
    row = numel // shape[0] if shape else 1
    end = min(stop, numel)
    if start >= end:
        return torch.zeros(stop - start, dtype=dtype, device=device)
    r0, r1 = start // row, -(-end // row)
    flat = read(0, r0, r1).reshape(-1) if shape else read().reshape(-1)
    flat = flat[start - r0 * row : end - r0 * row]
    if end < stop:
        flat = torch.cat([flat, flat.new_zeros(stop - end)])
    return flat


class HFReader:
    """dstrain key -> the HF tensors holding it (several for fused experts), read lazily."""

    def __init__(self, path: str | os.PathLike, keys: KeyTable, allow_unsafe_pickle: bool = False) -> None:
        """`keys`: the family's names for the model this folder should hold."""
        self.path, self.keys = str(path), keys
        prefix = keys.prefix
        self.bytes_read = 0
        self._handles: dict[str, Any] = {}
        self._pickled: dict[str, torch.Tensor] = {}
        self.files = checkpoint_files(self.path, allow_unsafe_pickle)
        if not self.files:  # pickle, allowed: memory-mapped, so still read on demand
            for name in pickle_files(self.path):
                file = os.path.join(self.path, name)
                # weights_only still refuses arbitrary objects: the flag only admits the pickle container.
                state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
                self._pickled.update(state)
                self.files.update(dict.fromkeys(state, file))
        # dstrain key -> {(expert, half): HF key}
        self.sources: dict[str, dict[tuple[int | None, int | None], str]] = {}
        self.shared: dict[str, str] = {}  # MTP copies of the embedding/head -> the dstrain key they copy
        self.unexpected: list[str] = []
        self.quantized: dict[str, dict[str, str]] = {}  # X.weight -> {part: HF key} of its quantized form
        # a multimodal checkpoint's tensors outside its text model (vision tower, projector): not read
        self.others: list[str] = []
        for hf_key in self.files:
            if not hf_key.startswith(prefix):
                self.others.append(hf_key)
                continue
            base, _, leaf = hf_key.rpartition(".")
            # a part of X.weight's quantized form (V4's `X.scale` only beside an X.weight: DeepSeek's mHC
            # scalars are `hc_attn_scale`, but a bare `.scale` is no quantization scale)
            if leaf.startswith("weight_") or (leaf == "scale" and f"{base}.weight" in self.files):
                self.quantized.setdefault(f"{base}.weight", {})[leaf] = hf_key
                if leaf not in QUANTIZED or "weight" in QUANTIZED[leaf].parts:
                    continue
                hf_key = f"{base}.weight"  # the form replaces X.weight: it stands for it
            try:
                tgt = keys.to_dstrain(hf_key)
            except KeyError:
                self.unexpected.append(hf_key)
                continue
            if tgt.shared:
                self.shared[hf_key] = tgt.key
            else:
                self.sources.setdefault(tgt.key, {})[(tgt.expert, tgt.half)] = hf_key
        # the model's bytes: MTP's copies are not read
        self.total_bytes = sum(self._nbytes(k) for parts in self.sources.values() for k in parts.values())

    # ------------------------------------------------------------------ index
    def check(self, keys: list[str]) -> list[str]:
        """Raise on a folder that does not fit the model `keys`; -> the keys it lacks that may start fresh
        (MTP modules, which transformers' save_pretrained drops, and the expert bias)."""
        p = self.path
        if self.unexpected:
            raise ValueError(
                f"{p}: {len(self.unexpected)} tensors the config does not describe, e.g. {self.unexpected[0]}"
            )
        for hf_key in self.quantized:  # each in a form dstrain reads
            self._form(hf_key)
        partial = [k for k in keys if k in self.sources and len(self.sources[k]) < self._pieces(k)]
        if partial:
            raise ValueError(f"{p}: some experts of {partial[0]} are missing from the checkpoint")
        missing = [k for k in keys if k not in self.sources]
        other = [k for k in missing if not self.keys.may_start_fresh(k)]
        if other:
            raise ValueError(f"{p}: {len(other)} tensors missing from the checkpoint, e.g. {other[0]}")
        return missing

    def _pieces(self, key: str) -> int:
        if key.endswith("experts.gate_up_proj"):
            return 2 * self.keys.experts
        if key.endswith("experts.down_proj"):
            return self.keys.experts
        return 1

    def full_shape(self, key: str) -> tuple[int, ...]:
        parts = self.sources[key]
        if (None, None) in parts:
            return self._shape(parts[(None, None)])
        if key.endswith("gate_up_proj"):
            rows, cols = self._shape(parts[(0, 0)])
            return (self.keys.experts, 2 * rows, cols)
        return (self.keys.experts, *self._shape(parts[(0, None)]))

    # ------------------------------------------------------------------ reading
    def read(self, key: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The dstrain tensor `key`, or its [start:stop) slice along `dim`, in the checkpoint's dtype (quantized
        weights, QUANTIZED, dequantized to fp32)."""
        parts = self.sources[key]
        if (None, None) in parts:
            return self._read_one(parts[(None, None)], dim, start, stop)
        # fused experts: dim 0 picks experts, which are separate HF tensors
        n = self.keys.experts
        lo, hi = (start, n if stop is None else stop) if dim == 0 else (0, n)
        experts = []
        for e in range(lo, hi):
            if key.endswith("gate_up_proj"):
                experts.append(torch.cat([self._read_one(parts[(e, 0)]), self._read_one(parts[(e, 1)])]))
            else:
                experts.append(self._read_one(parts[(e, None)]))
        out = torch.stack(experts)
        if dim not in (None, 0):
            out = out.narrow(dim, start, (out.shape[dim] if stop is None else stop) - start).contiguous()
        return out

    def stored_form(self, key: str) -> str | None:
        """The quantized form (its QUANTIZED marker) the folder stores dstrain weight `key` in; None: stored
        dense, or not in the folder."""
        hf_key = next(iter(self.sources.get(key, {}).values()), None)
        if hf_key is None or hf_key not in self.quantized:
            return None
        form = self._form(hf_key)
        return next(marker for marker, f in QUANTIZED.items() if f is form)

    def read_stored(
        self,
        key: str,
        half: int | None = None,
        start: int = 0,
        stop: int | None = None,
        only: tuple[str, ...] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The parts of quantized weight `key` as the files hold them (codes and scales, nothing dequantized):
        a plain weight's; of fused experts, experts [start, stop) of one `half` (0 gate, 1 up; down: None),
        each part stacked over them. `only`: those parts alone."""
        parts = self.sources[key]
        if (None, None) in parts:
            return self._raw_parts(parts[(None, None)], only)
        stop = self.keys.experts if stop is None else stop
        each = [self._raw_parts(parts[(e, half)], only) for e in range(start, stop)]
        return {p: torch.stack([x[p] for x in each]) for p in each[0]}

    def stored_layout(
        self, key: str, half: int | None = None
    ) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """`read_stored`'s parts (all experts) as (dtype, shape), from the files' headers: nothing read."""
        parts = self.sources[key]
        whole = (None, None) in parts
        hf_key = parts[(None, None)] if whole else parts[(0, half)]
        keys = {**self.quantized[hf_key], "weight": hf_key}
        form = self._form(hf_key)
        lead = () if whole else (self.keys.experts,)
        return {
            p: (self._raw_dtype(keys[p]), (*lead, *self._stored_shape(keys[p])))
            for p in (*form.parts, *form.optional)
            if p in keys
        }

    def _raw_parts(self, hf_key: str, only: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        keys = {**self.quantized[hf_key], "weight": hf_key}
        form = self._form(hf_key)
        names = [p for p in (*form.parts, *form.optional) if p in keys and (only is None or p in only)]
        return {p: self._raw(keys[p]) for p in names}

    def read_flat(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of the flattened tensor (a ZeRO-3 partition), zero-padded past its end.
        Reads only the dim-0 rows (or experts) the range touches."""
        return flat_range(partial(self.read, key), self.full_shape(key), start, stop, self._dtype(key))

    def others_in_files(self) -> list[tuple[str, SafetensorsFile]]:
        """The tensors outside the model (`others`), each with the file holding it: for copying as they are."""
        return [(k, self._handle(k)) for k in self.others]

    def read_shared_copies(self) -> dict[str, torch.Tensor]:
        """The MTP layers' own copies of the embedding and head, by HF key."""
        return {k: self._read_one(k) for k in self.shared}

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
        self._pickled.clear()

    def __enter__(self) -> HFReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ one HF tensor
    def _handle(self, hf_key: str) -> SafetensorsFile:
        file = self.files[hf_key]
        if file not in self._handles:
            self._handles[file] = SafetensorsFile(file)
        return self._handles[file]

    def _entry(self, hf_key: str) -> dict[str, Any]:
        handle = self._handle(hf_key)
        if hf_key not in handle.entries:
            raise ValueError(
                f"{self.path}: the index puts {hf_key} in {os.path.basename(handle.path)}, which lacks it"
            )
        return handle.entries[hf_key]

    def _shape(self, hf_key: str) -> tuple[int, ...]:
        packed = self.quantized.get(hf_key, {}).get("weight_packed")
        if packed is not None:  # from the headers: the words holding each row's integers
            rows, words = self._stored_shape(packed)
            try:
                return (rows, words * 32 // self.keys.packed_bits())
            except ValueError as exc:
                raise ValueError(f"{self.path}: {exc}") from None
        shape = self._stored_shape(hf_key)
        if "scale" in self.quantized.get(hf_key, {}) and self._raw_dtype(hf_key) == torch.int8:
            return (shape[0], 2 * shape[1])  # packed FP4: two values per byte
        return shape

    def _stored_shape(self, hf_key: str) -> tuple[int, ...]:
        if hf_key in self._pickled:
            return tuple(self._pickled[hf_key].shape)
        return tuple(self._entry(hf_key)["shape"])

    def _dtype(self, key: str) -> torch.dtype:
        hf_key = next(iter(self.sources[key].values()))
        return torch.float32 if hf_key in self.quantized else self._raw_dtype(hf_key)

    def _nbytes(self, hf_key: str) -> int:
        """Bytes of the tensors holding HF weight `hf_key` (its quantized form's parts too)."""
        keys = [*([hf_key] if hf_key in self.files else []), *self.quantized.get(hf_key, {}).values()]
        return sum(math.prod(self._stored_shape(k)) * self._raw_dtype(k).itemsize for k in keys)

    def _read_one(
        self, hf_key: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        parts = self.quantized.get(hf_key)
        if parts is None:
            if FP8 is not None and self._raw_dtype(hf_key) == FP8:
                raise ValueError(f"{self.path}: FP8 tensor {hf_key} has no weight_scale_inv or scale")
            return self._raw(hf_key, dim, start, stop)
        form = self._form(hf_key)
        keys = {**parts, "weight": hf_key}
        t = form.dequantize(*(self._raw(keys[p]) for p in (*form.parts, *form.optional) if p in keys))
        if tuple(t.shape) != self._shape(hf_key):
            raise ValueError(
                f"{self.path}: {hf_key} dequantizes to {tuple(t.shape)}, not {self._shape(hf_key)}"
            )
        if dim is not None:  # dequantized whole, then sliced
            t = t.narrow(dim, start, (t.shape[dim] if stop is None else stop) - start).contiguous()
        return t

    def _form(self, hf_key: str) -> Form:
        form = form_of(self.quantized[hf_key])
        if form is None:
            parts = ", ".join(sorted(self.quantized[hf_key]))
            raise ValueError(
                f"{self.path}: {hf_key} is stored as {parts}, a quantized form dstrain does not read"
            )
        return form

    def _raw_dtype(self, hf_key: str) -> torch.dtype:
        if hf_key in self._pickled:
            return self._pickled[hf_key].dtype
        name = self._entry(hf_key)["dtype"]
        if name not in SAFE_DTYPES:
            raise ValueError(f"{self.path}: {hf_key} has dtype {name}, which dstrain does not read")
        return SAFE_DTYPES[name]

    def _raw(
        self, hf_key: str, dim: int | None = None, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        if hf_key in self._pickled:
            t = self._pickled[hf_key]
            t = (
                t if dim is None else t.narrow(dim, start, (t.shape[dim] if stop is None else stop) - start)
            ).clone()
        else:
            t = self._handle(hf_key).read(hf_key, self._raw_dtype(hf_key), dim, start, stop)
        self.bytes_read += t.numel() * t.element_size()
        return t
