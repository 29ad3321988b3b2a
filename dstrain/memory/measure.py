"""Peak memory of live tensors on a CPU, where torch has no `max_memory_allocated`.

`AllocationTracker` runs the block under torch's profiler with `profile_memory=True`: torch's CPU allocator
then reports every allocation and free (bytes, address, time) made on the threads the profiler follows (this
one, the autograd engine's, the collectives' it hands work to). The running sum of those events is the bytes
of live tensor storage allocated since the block began, temporaries inside kernels included, and its maximum
is the CPU analogue of `torch.cuda.max_memory_allocated` minus what was alive before: what
`dstrain.memory.estimate` predicts. Unlike resident memory it counts no Python objects, shared libraries,
thread stacks, allocator caches or page cache. Not counted: tensors alive before the block (their frees are
ignored) and allocations on threads the profiler does not follow. A free on such a thread is not reported
either; the allocation is closed when its address is allocated again (see `_replay`), and a caller that runs
several identical steps can compare their starts (launch/bench_plan.py does).

Named phases (`with tracker.phase("step 1"):`) report their own peak and the live bytes at their start.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field


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
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        from torch.profiler import record_function

        with record_function(f"memtrack::{name}"):
            yield

    def __exit__(self, *exc: object) -> None:
        import json
        import os
        import tempfile

        self._prof.__exit__(*exc)
        # The exported trace is the one place the allocator's addresses are exposed (see _replay).
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            self._prof.export_chrome_trace(path)
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        finally:
            os.unlink(path)
        del self._prof
        self._replay(events)

    def _replay(self, events: list[dict]) -> None:
        """Live bytes over time from the allocation events. A free made on a thread the profiler does not
        follow (a gloo worker dropping the last reference to a bucket) is not reported; a later allocation
        at the same address shows that it happened, and it is counted at the end of the phase that made
        the allocation (or at that later allocation, if earlier): nothing a training step allocates and
        frees survives into the next step."""
        spans = sorted(
            (e["ts"], e["ts"] + e.get("dur", 0), e["name"].removeprefix("memtrack::"))
            for e in events
            if str(e.get("name", "")).startswith("memtrack::")
        )
        timeline: list[tuple[float, int]] = []
        open_at: dict[int, tuple[float, int]] = {}
        for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
            t, addr, nbytes = e["ts"], e["args"]["Addr"], e["args"]["Bytes"]
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
