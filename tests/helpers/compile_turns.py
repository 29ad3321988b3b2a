"""The ranks of a compiled scenario share Inductor's work on the graphs they have in common.

Under data, tensor or expert parallelism every rank traces the same blocks with the same shapes, so both ranks of
a 2-rank scenario would lower and generate the same graphs at the same moment (~10 CPU-s a layout each), only to
write the same entry of Inductor's FX graph cache. `share_compiles` makes the lookup of a cache key exclusive
until the graph is in the cache: the first rank to ask compiles it, the others wait on a file lock named by the
key (no collective runs inside a compile, so a waiting rank holds nothing the first needs) and then load it.
Graphs that differ between ranks (pipeline stages) have different keys and compile side by side as before. The
compiled code is Inductor's own, from its cache, as when a later run of the same layout finds it there."""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from typing import Any

_local = threading.local()  # the forward compiles in the caller's thread, the backward in autograd's


def _held() -> list[list[tuple[str, int]]]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _release(key: str | None = None) -> None:
    """Unlock `key` (every lock this compile took if None)."""
    stack = _held()
    if not stack:
        return
    keep = []
    for k, fd in stack[-1]:
        if key is None or k == key:
            os.close(fd)  # closing the descriptor drops its flock
        else:
            keep.append((k, fd))
    stack[-1] = keep


def share_compiles() -> None:
    """Patch Inductor in this process (once): a cache miss holds the key's lock until the graph is saved, or
    until that compile ends, whether it saved or failed."""
    from torch._inductor import codecache, compile_fx
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    graphs = codecache.FxGraphCache
    if getattr(graphs, "_shared_by_ranks", False):
        return
    if not all(hasattr(graphs, n) for n in ("load_with_key", "_save_graph")) or not hasattr(
        compile_fx, "_compile_fx_inner"
    ):
        return  # another torch's Inductor: every rank compiles on its own, as without this
    lookup, save, inner = graphs.load_with_key, graphs._save_graph, compile_fx._compile_fx_inner
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
            _held()[-1].append((key, fd))
        else:
            os.close(fd)
        return graph, info

    def save_graph(key: str, *args: Any, **kwargs: Any) -> None:
        try:
            save(key, *args, **kwargs)
        finally:
            _release(key)

    def compile_inner(*args: Any, **kwargs: Any) -> Any:
        _held().append([])
        try:
            return inner(*args, **kwargs)
        finally:
            _release()
            _held().pop()

    graphs.load_with_key = staticmethod(load_with_key)
    graphs._save_graph = staticmethod(save_graph)
    compile_fx._compile_fx_inner = compile_inner
    graphs._shared_by_ranks = True
