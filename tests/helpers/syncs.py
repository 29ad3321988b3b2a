"""Host syncs counted on the CPU: every op that on a GPU makes the host wait for the device (a scalar read:
`item`/`_local_scalar_dense`/`is_nonzero`, `equal`, `nonzero` (its size), and `tolist`, which reads without
the dispatcher), each with the innermost frame outside torch that asked for it: dstrain's, DeepSpeed's or
another's."""

from __future__ import annotations

import traceback
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = ("item", "_local_scalar_dense", "is_nonzero", "equal", "nonzero")


def _caller() -> str:
    """'dstrain/…/file.py:line function' (or deepspeed/… or other) of the innermost frame outside torch."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if path.endswith("tests/helpers/syncs.py") or "/torch/" in path:
            continue
        for top in ("/dstrain/", "/deepspeed/"):
            if top in path:
                return f"{top[1:]}{path.rsplit(top, 1)[1]}:{frame.lineno} {frame.name}"
        return f"{path}:{frame.lineno} {frame.name}"
    return "?"


class HostSyncs(TorchDispatchMode):
    """`with HostSyncs() as syncs:` -> syncs.calls: (op, caller) in order; `by_caller()` counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self._tolist = torch.Tensor.tolist

    def __enter__(self) -> HostSyncs:
        recorder, tolist = self, self._tolist

        def recorded_tolist(t: torch.Tensor) -> Any:
            recorder.calls.append(("tolist", _caller()))
            return tolist(t)

        torch.Tensor.tolist = recorded_tolist
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.Tensor.tolist = self._tolist
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.calls.append((name, _caller()))
        return func(*args, **(kwargs or {}))

    def by_caller(self, top: str) -> Counter:
        """Counts per (op, caller) of the calls from `top` ('dstrain/' or 'deepspeed/')."""
        return Counter(c for c in self.calls if c[1].startswith(top))
