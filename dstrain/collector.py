"""The garbage collector around a process's heavy imports (torch, DeepSpeed, transformers, torch._dynamo): they
make millions of objects that live as long as the process, which the collector walked again and again as they
arrived (~25% of the imports' CPU; a tiny `dstrain train` process: 12.7 -> 11.0 CPU-s, the tokenizer's lighter
import included).
`paused()` imports without it; at a process's start (`freeze`) it also freezes what exists then (gc.freeze:
later full collections skip those objects, and forked data workers leave their pages shared). Never freeze
later: a frozen object that joins a reference cycle keeps the cycle (an engine, its GPU memory) for good. Nor
Triton (torch._dynamo imports it): its nanobind module reports the objects still held at exit as leaks, on
stderr after an error's one line (unfreezing at exit instead cost 0.9 CPU-s of collection)."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused(freeze: bool = False) -> Iterator[None]:
    """Run the block without automatic collection (nested: the outermost block restores it), then with
    `freeze` (a process's start only) freeze every object alive."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        if freeze:
            gc.freeze()
