"""A pool of ranks for the multi-rank tests: N processes that build the process group once (torch.distributed on
gloo) and then run scenario after scenario, so that a test pays for a DeepSpeed engine and a few steps instead
of starting Python, torch, DeepSpeed and transformers on every rank.

A scenario is a function `module:name` that takes this rank's `DistInfo` and JSON arguments and returns a JSON
value; every rank calls it, and `RankPool.run` returns each rank's value. A scenario that raises on any rank,
or runs past its timeout, fails with its own message (the traceback and the ranks' output while it ran) and
the pool is killed: the next scenario starts a fresh one, so a failure never leaves a rank waiting in a
collective for the next test. What needs a process of its own (a launcher, a signal, a killed rank, srun's
environment, the installed wheel, a memory measurement) keeps launching it.

`python -m tests.helpers.pool` is one rank (started by `RankPool`, never by hand). docs/interfaces.md says how
to add a scenario."""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from dstrain import collector
from dstrain.dist import free_port
from tests.helpers.tiny import ROOT

START_S = 180  # starting the ranks (imports, the process group), on top of the first scenario's timeout
# Every process group keeps gloo threads, which poll, while it lives (idle, 170 threads took 7% of a core; 500,
# half a core). The reset ends each scenario's engines and groups (a few live on until replaced, as DeepSpeed's
# pipeline groups): a rank past this many threads, something left alive, is restarted
MAX_THREADS = 128
LOG_TAIL = 4000  # characters of each rank's output shown with a failure
_REPLY_FD = "DSTRAIN_POOL_REPLY_FD"


class ScenarioError(AssertionError):
    """A scenario raised or ran past its timeout (an AssertionError: pytest shows it as the test's failure)."""


class RankPool:
    """`nproc` ranks on this machine, started on the first `run` and again after a failure."""

    def __init__(self, nproc: int, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.nproc, self.log_dir, self.env = nproc, Path(log_dir), env or {}
        self.procs: list[subprocess.Popen] = []
        self.replies: list[int] = []
        self.logs: list[Path] = [self.log_dir / f"pool{nproc}_rank{r}.log" for r in range(nproc)]
        self.starts = 0  # how many times the ranks were started (a restart follows each failure)
        self.count = 0

    def run(self, fn: str, *args: Any, timeout: float = 300) -> list[Any]:
        """Call `fn` (`module:name`) as fn(info, *args) on every rank -> each rank's return value. Raises
        ScenarioError (and kills the ranks) when a rank raises or the scenario takes over `timeout` s."""
        fresh = not self.procs
        if fresh:
            self._start()
        self.count += 1
        marks = [log.stat().st_size for log in self.logs]
        request = json.dumps({"id": self.count, "fn": fn, "args": args}) + "\n"
        try:
            for p in self.procs:
                p.stdin.write(request)
                p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # a rank that died: _collect reports it
        t0 = time.monotonic()
        replies = self._collect(timeout + (START_S if fresh else 0))
        waited = time.monotonic() - t0
        failed = {r: rep for r, rep in replies.items() if not rep.get("ok")}
        if len(replies) < self.nproc or failed:
            self.close(now=True)
            what = f"{fn}{tuple(args)!r}"
            lines = [f"scenario {what} failed on {self.nproc} ranks"]
            for r in range(self.nproc):
                if r not in replies:
                    lines.append(
                        f"rank {r}: no reply after {waited:.0f} s (killed; the timeout: {timeout:.0f} s)"
                    )
                elif r in failed:
                    lines.append(f"rank {r} raised:\n{failed[r]['error']}")
            for r, (log, mark) in enumerate(zip(self.logs, marks, strict=True)):
                text = log.read_text(errors="replace")[mark:]
                lines.append(
                    f"--- rank {r} output during the scenario (last {LOG_TAIL} chars):\n{text[-LOG_TAIL:]}"
                )
            raise ScenarioError("\n".join(lines))
        if any(rep["restart"] for rep in replies.values()):
            self.close()
        return [replies[r]["value"] for r in range(self.nproc)]

    def _start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        port = str(free_port())
        self.starts += 1
        for r in range(self.nproc):
            read, write = os.pipe()
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "DS_ACCELERATOR": "cpu",
                **self.env,
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(self.nproc),
                "LOCAL_WORLD_SIZE": str(self.nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                _REPLY_FD: str(write),
            }
            with open(self.logs[r], "a") as log:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tests.helpers.pool"],
                        cwd=ROOT,
                        env=env,
                        stdin=subprocess.PIPE,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        text=True,
                        pass_fds=(write,),
                        start_new_session=True,  # its DataLoader workers die with it (killpg)
                    )
                )
            os.close(write)
            self.replies.append(read)

    def _collect(self, timeout: float) -> dict[int, dict]:
        """Each rank's reply (one JSON line), until all replied, one failed and the others had a moment to
        fail too, a rank died, or `timeout` passed."""
        deadline = time.monotonic() + timeout
        replies: dict[int, dict] = {}
        buffers = {r: b"" for r in range(self.nproc)}
        sel = selectors.DefaultSelector()
        for r, fd in enumerate(self.replies):
            sel.register(fd, selectors.EVENT_READ, r)
        try:
            while len(replies) < self.nproc:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                for key, _ in sel.select(min(left, 1.0)):
                    r = key.data
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:  # the rank exited
                        sel.unregister(key.fd)
                        replies[r] = {"ok": False, "error": f"rank {r} exited ({self.procs[r].wait()})"}
                        continue
                    buffers[r] += chunk
                    if buffers[r].endswith(b"\n"):
                        replies[r] = json.loads(buffers[r])
                        sel.unregister(key.fd)
                if any(not rep.get("ok") for rep in replies.values()):
                    # the others are likely waiting for the failed rank in a collective: a short grace
                    deadline = min(deadline, time.monotonic() + 5)
        finally:
            sel.close()
        return replies

    def close(self, now: bool = False) -> None:
        """Stop the ranks: idle ones exit on the end of their input, SIGKILL after a moment (a rank may be stuck
        in a collective); `now` (after a failure, the pool being discarded) kills them at once: a rank that
        raised has written its output, one still in the scenario would only be waited for."""
        for p in self.procs:
            if p.poll() is None and p.stdin:
                with contextlib.suppress(OSError):
                    p.stdin.close()  # an idle rank exits on end of input
        stop = time.monotonic() + (0 if now else 5)
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, stop - time.monotonic()))
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for fd in self.replies:
            os.close(fd)
        self.procs, self.replies = [], []


class Pools:
    """One RankPool per rank count, for a pytest session (tests/conftest.py's `rank_pools`), and a cache of
    scenario results: `cached` runs a scenario once per key and gives every later caller its result (or its
    failure again, without rerunning it)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.pools: dict[int, RankPool] = {}
        self.results: dict[Any, Any] = {}

    def run(self, nproc: int, fn: str, *args: Any, timeout: float = 300) -> list[Any]:
        if nproc not in self.pools:
            self.pools[nproc] = RankPool(nproc, self.log_dir)
        return self.pools[nproc].run(fn, *args, timeout=timeout)

    def cached(self, key: Any, nproc: int, fn: str, *args: Any, timeout: float = 300) -> list[Any]:
        if key not in self.results:
            try:
                self.results[key] = self.run(nproc, fn, *args, timeout=timeout)
            except ScenarioError as exc:
                self.results[key] = exc
        got = self.results[key]
        if isinstance(got, ScenarioError):
            raise ScenarioError(f"(as before) {got}")
        return got

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()


class ScenarioResults:
    """`results[name]`: scenario `fn(info, *args, name)` run on `nproc` ranks on first use (cached in `pools`) ->
    rank 0's value, or every rank's with `all_ranks`."""

    def __init__(
        self, pools: Pools, nproc: int, fn: str, *args: Any, timeout: float = 300, all_ranks: bool = False
    ) -> None:
        self.pools, self.nproc, self.fn, self.args = pools, nproc, fn, args
        self.timeout, self.all_ranks = timeout, all_ranks

    def __getitem__(self, name: str) -> Any:
        key = (self.fn, self.args, name)
        values = self.pools.cached(key, self.nproc, self.fn, *self.args, name, timeout=self.timeout)
        return values if self.all_ranks else values[0]


# DeepSpeed's cache of the process groups it made (deepspeed.utils.groups), emptied with the groups themselves
_DEEPSPEED_GROUPS = {
    "_EXPERT_PARALLEL_GROUP": dict,
    "_EXPERT_PARALLEL_GROUP_RANKS": dict,
    "_EXPERT_DATA_PARALLEL_GROUP": dict,
    "_EXPERT_DATA_PARALLEL_GROUP_RANKS": dict,
    "_ALL_TO_ALL_GROUP": dict,
    "_WORLD_GROUP": lambda: None,
    "_ZERO_PARAM_INTRA_PARALLEL_GROUP": lambda: None,
    "_TENSOR_MODEL_PARALLEL_GROUP": lambda: None,
    "_MODEL_PARALLEL_GROUP": lambda: None,
    "_DATA_PARALLEL_GROUP": lambda: None,
    # the layout's grid an EP run hands it (parallel/ep.py): its groups die with the scenario
    "mpu": lambda: None,
}


def _destroy_engines() -> None:
    """Every DeepSpeed engine alive, destroyed, and what DeepSpeed keeps of them (a function of its own: a loop
    variable left in the caller would keep the last engine through the collection and the freeze that follow,
    with its process groups' threads)."""
    from deepspeed import DeepSpeedEngine

    for engine in [o for o in gc.get_objects() if isinstance(o, DeepSpeedEngine)]:
        engine.destroy()
    # What DeepSpeed 0.19 keeps of every ZeRO-3 engine, with its model, parameters and their groups, for the
    # process's life: its model on the stack of modules in forward (pushed at the engine's start, never popped;
    # no forward runs between scenarios), and its coordinator in a method's class-wide functools.lru_cache
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None and isinstance(getattr(offload, "FWD_MODULE_STACK", None), list):
        offload.FWD_MODULE_STACK.clear()
    coordinator = sys.modules.get("deepspeed.runtime.zero.partitioned_param_coordinator")
    if coordinator is not None:
        owner = coordinator.PartitionedParameterCoordinator
        memoized = vars(owner).get(f"_{owner.__name__}__params_to_release")
        # the lru_cache, under DeepSpeed's nvtx wrapper
        for cell in getattr(memoized, "__closure__", None) or ():
            if hasattr(cell.cell_contents, "cache_clear"):
                cell.cell_contents.cache_clear()


def _reset_between_scenarios() -> None:
    """What one scenario leaves in the process that would change the next or slow the machine: the process groups
    it made (gloo keeps threads for each: after a few hundred layouts the idle ranks took half a core each), and
    DeepSpeed's cache of them; engines wait for the garbage collector, compiled code for dynamo's reset. One
    collection at the end frees all of it (three, one per step, cost 60 ms a scenario per rank: 16 CPU-s a run)."""
    import torch.distributed as tdist
    from torch.distributed import distributed_c10d as c10d

    if "deepspeed" in sys.modules:  # its hooks on the parameters keep each engine (and its groups) alive
        _destroy_engines()
    world = c10d._get_default_group()
    for group in list(c10d._world.pg_map):
        if group is not world:
            tdist.destroy_process_group(group)
    if "deepspeed.utils.groups" in sys.modules:
        groups = sys.modules["deepspeed.utils.groups"]
        for name, empty in _DEEPSPEED_GROUPS.items():
            setattr(groups, name, empty())
    if "torch._dynamo" in sys.modules:
        sys.modules["torch._dynamo"].reset()
    gc.collect()
    # What is left lives on (modules, caches, what DeepSpeed's hooks keep): out of the collector's sight, so
    # that the collections DeepSpeed runs while it builds an engine (ZeRO-3's defragment) stay cheap.
    gc.freeze()


def serve() -> None:
    """One rank: the process group, then scenarios from stdin until it closes; a reply line per scenario."""
    from dstrain import dist

    reply = os.fdopen(int(os.environ.pop(_REPLY_FD)), "w")
    info = dist.init_distributed()
    for line in sys.stdin:
        request = json.loads(line)
        print(f"=== scenario {request['id']}: {request['fn']}{tuple(request['args'])!r}", flush=True)
        try:
            module, _, name = request["fn"].partition(":")
            with collector.paused():  # a scenario module's first import brings the trainer's (collector.py)
                fn = getattr(importlib.import_module(module), name)
            value = fn(info, *request["args"])
            answer = {"ok": True, "value": json.loads(json.dumps(value))}  # JSON, or the scenario fails
        except BaseException:  # noqa: BLE001 - the test shows it; the pool is restarted
            answer = {"ok": False, "error": traceback.format_exc()}
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            _reset_between_scenarios()
            # a rank past MAX_THREADS is restarted before the next scenario
            answer["restart"] = len(os.listdir("/proc/self/task")) > MAX_THREADS
        except Exception:  # noqa: BLE001 - the scenario's result stands; the next one gets a fresh pool
            answer["restart"] = True
            traceback.print_exc()
        reply.write(json.dumps(answer) + "\n")
        reply.flush()
        if not answer["ok"]:
            break  # the parent kills the pool; a rank waiting in a collective would never read on
    dist.shutdown()
    reply.close()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    serve()
