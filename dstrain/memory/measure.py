"""Peak memory of live tensors on a CPU, where torch has no `max_memory_allocated`.

`AllocationTracker` runs the block under torch's profiler with `profile_memory=True`, following user scopes
only (the phases, no operators): torch's CPU allocator then reports every allocation and free (bytes, address,
time) made on the threads the profiler follows (this one, the autograd engine's, the collectives' it hands
work to). The running sum of those events is the bytes of live tensor storage allocated since the block began,
temporaries inside kernels included, and its maximum is the CPU analogue of `torch.cuda.max_memory_allocated`
minus what was alive before: what `dstrain.memory.estimate` predicts. Unlike resident memory it counts no
Python objects, shared libraries, thread stacks, allocator caches or page cache. Not counted: tensors alive
before the block (their frees are ignored) and allocations on threads the profiler does not follow. A free on
such a thread is not reported either; the allocation is closed when its address is allocated again (see
`_replay`), and a caller that runs several identical steps can compare their starts (launch/bench_plan.py
does).

Named phases (`with tracker.phase("step 1"):`) report their own peak and the live bytes at their start.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

PHASE_PREFIX = "memtrack::"


@dataclass
class Phase:
    name: str
    start_bytes: int = 0
    """Live bytes (above the block's start) when the phase began."""
    peak_bytes: int = 0
    """Highest live bytes during the phase."""


@dataclass
class AllocationTracker:
    peak_bytes: int = 0
    """Highest live bytes over the whole block, above what was alive when it began."""
    end_bytes: int = 0
    """Live bytes when the block ended."""
    phases: list[Phase] = field(default_factory=list)

    def __enter__(self) -> AllocationTracker:
        from torch._C._profiler import RecordScope, _ExperimentalConfig
        from torch.autograd import (
            ProfilerActivity,
            ProfilerConfig,
            ProfilerState,
            _enable_profiler,
            _prepare_profiler,
        )

        # The allocator's events and the phases' spans only: torch's `profile()` also records every operator,
        # which made the tracked steps ~25% slower and its event tree several times larger to walk.
        # (state, input shapes, memory, stacks, flops, modules, experimental): memory only
        config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
        _prepare_profiler(config, {ProfilerActivity.CPU})
        _enable_profiler(config, {ProfilerActivity.CPU}, {RecordScope.USER_SCOPE})
        return self

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        from torch.profiler import record_function

        with record_function(f"{PHASE_PREFIX}{name}"):
            yield

    def __exit__(self, *exc: object) -> None:
        from torch.autograd import _disable_profiler

        spans, allocations = _events(_disable_profiler())
        self._replay(spans, allocations)

    def _replay(self, spans: list[tuple[int, int, str]], allocations: list[tuple[int, int, int]]) -> None:
        """Live bytes over time from the allocation events (time, address, bytes; a free has negative bytes).
        A free made on a thread the profiler does not follow (a gloo worker dropping the last reference to a
        bucket) is not reported; a later allocation at the same address shows that it happened, and it is
        counted at the end of the phase that made the allocation (or at that later allocation, if earlier):
        nothing a training step allocates and frees survives into the next step."""
        timeline: list[tuple[int, int]] = []
        open_at: dict[int, tuple[int, int]] = {}
        for t, addr, nbytes in allocations:
            if nbytes < 0:
                if open_at.pop(addr, None) is not None:
                    timeline.append((t, nbytes))
                continue
            if addr in open_at:  # freed unseen
                born, size = open_at[addr]
                end = next((stop for start, stop, _ in spans if start <= born <= stop), t)
                timeline.append((min(t, end), -size))
            open_at[addr] = (t, nbytes)
            timeline.append((t, nbytes))
        self.phases = [Phase(name) for _, _, name in spans]
        live = 0
        for t, nbytes in sorted(timeline):
            live += nbytes
            self.peak_bytes = max(self.peak_bytes, live)
            for phase, (start, end, _) in zip(self.phases, spans):
                if t < start:
                    phase.start_bytes = live
                elif t <= end:
                    phase.peak_bytes = max(phase.peak_bytes, live)
        self.end_bytes = live
        for phase in self.phases:
            phase.peak_bytes = max(phase.peak_bytes, phase.start_bytes)


def _events(results: Any) -> tuple[list[tuple[int, int, str]], list[tuple[int, int, int]]]:
    """The phases' spans (start, end, name) and the allocation events (time, address, bytes), each in time
    order, from the profiler's event tree (ns). The tree is the one place the allocator's addresses are
    exposed besides the Chrome trace, whose JSON export and parse cost three times as much."""
    from torch._C._profiler import _EventType

    spans, allocations = [], []
    stack = list(results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            allocations.append((event.start_time_ns, fields.ptr, fields.alloc_size))
            continue
        if event.tag == _EventType.TorchOp and event.name.startswith(PHASE_PREFIX):
            spans.append((event.start_time_ns, event.end_time_ns, event.name.removeprefix(PHASE_PREFIX)))
        stack.extend(event.children)
    return sorted(spans), sorted(allocations, key=lambda a: a[0])
