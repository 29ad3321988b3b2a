"""The ranks of a compiled scenario share Inductor's work on the graphs they have in common.

Under data, tensor or expert parallelism every rank traces the same blocks with the same shapes, so both ranks of
a 2-rank scenario would lower and generate the same graphs at the same moment (~10 CPU-s a layout each), only to
write the same entry of Inductor's FX graph cache. `share_compiles` makes the lookup of a cache key exclusive
until the compile that missed has put the graph in the cache: the first rank to ask compiles it, the others wait
on a file lock named by the key (no collective runs inside a compile, so a waiting rank holds nothing the first
needs) and then load it. Graphs that differ between ranks (pipeline stages) have different keys and compile side
by side as before. The compiled code is Inductor's own, from its cache, as when a later run of the same layout
finds it there."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from typing import Any

_local = threading.local()  # the forward compiles in the caller's thread, the backward in autograd's


def _held() -> list[list[int]]:
    """Per thread, per `_compile_fx_inner` call in progress: the lock descriptors its cache misses took."""
    return _local.__dict__.setdefault("stack", [])


def share_compiles() -> None:
    """Patch Inductor in this process (once): a cache miss holds the key's lock until the compile that missed
    ends (its graph saved, or failed)."""
    from torch._inductor import codecache, compile_fx
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    graphs = codecache.FxGraphCache
    if getattr(graphs, "_shared_by_ranks", False):
        return
    if not hasattr(graphs, "load_with_key") or not hasattr(compile_fx, "_compile_fx_inner"):
        return  # another torch's Inductor: every rank compiles on its own, as without this
    lookup, inner = graphs.load_with_key, compile_fx._compile_fx_inner
    locks = Path(cache_dir()) / "rank_turns"
    locks.mkdir(parents=True, exist_ok=True)

    def load_with_key(key: str, *args: Any, **kwargs: Any) -> Any:
        fd = os.open(locks / f"{key}.lock", os.O_CREAT | os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            graph, info = lookup(key, *args, **kwargs)
        except BaseException:
            os.close(fd)
            raise
        if graph is None and _held():
            _held()[-1].append(fd)  # compiled and saved by the caller before it returns
        else:
            os.close(fd)
        return graph, info

    def compile_inner(*args: Any, **kwargs: Any) -> Any:
        _held().append([])
        try:
            return inner(*args, **kwargs)
        finally:
            for fd in _held().pop():
                os.close(fd)  # closing the descriptor drops its flock

    graphs.load_with_key = staticmethod(load_with_key)
    compile_fx._compile_fx_inner = compile_inner
    graphs._shared_by_ranks = True
