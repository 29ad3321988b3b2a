"""Naming the rank that stopped a multi-rank job: the others must not wait for it until the allocation ends.

Every collective gives up after --collective_timeout (dist.init_distributed), and a rank that dies closes its
connections at once. Either way the survivors' collective raises; `dstrain train` (cli.py) hands the error to `report`,
which says which rank is to blame, and exits with PeerLostError's code. To know who, each rank leaves in torch's
rendezvous store a heartbeat per optimizer step (`heartbeat`, one small TCP message) and, on failure, a mark
that it is alive and gave up itself; the ranks without such a mark after REPORT_GRACE_S are the ones that
died or hang. The lowest-numbered survivor prints the line. A store that cannot be reached (it lives in rank
0's process, or in the launcher's under torchrun) means its host is gone: every survivor says so.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from datetime import timedelta
from typing import Any

import torch.distributed as tdist

from dstrain.dist import group_rank_world
from dstrain.errors import PeerLostError

PEER_LOST_EXIT_CODE = PeerLostError.exit_code
REPORT_GRACE_S = 5.0  # how long survivors wait for each other's marks before naming the silent ranks
HANG_ENV = "DSTRAIN_TEST_HANG_AT_STEP"  # "STEP:RANK": that rank sleeps forever before the step (tests)
DIE_ENV = "DSTRAIN_TEST_DIE_AT_STEP"  # "STEP:RANK": that rank SIGKILLs itself before the step (tests)

_ALIVE, _GAVE_UP = "dstrain/alive/", "dstrain/gave_up/"
_LOST = re.compile(
    r"connection (closed|reset|refused)|closed by peer|broken pipe|failed to recv|read error", re.I
)
_TIMEOUT = re.compile(r"timed? ?out|timeout", re.I)
_BACKEND = re.compile(r"gloo|nccl|c10d|store", re.I)  # a torch.distributed error, not e.g. a DataLoader's
_timeout_s = 600.0
_step: int | None = None  # optimizer steps done at the last heartbeat; None before the first


def arm(timeout_s: float) -> None:
    """Record --collective_timeout for the report."""
    global _timeout_s
    _timeout_s = timeout_s


def heartbeat(step: int) -> None:
    """Call between optimizer steps with the number done: this rank is alive and about to run step + 1."""
    global _step
    _step = step
    rank, world = group_rank_world()
    if world > 1:
        tdist.distributed_c10d._get_default_store().set(f"{_ALIVE}{rank}", f"{step} {time.time():.3f}")
    if os.environ.get(HANG_ENV) == f"{step + 1}:{rank}":
        while True:
            time.sleep(3600)
    if os.environ.get(DIE_ENV) == f"{step + 1}:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective or the store giving up on another rank (timed out, connection lost)."""
    if group_rank_world()[1] <= 1:
        return False
    text = str(exc)
    return isinstance(exc, getattr(tdist, "DistError", ())) or (
        isinstance(exc, RuntimeError)
        and bool(_BACKEND.search(text))
        and bool(_LOST.search(text) or _TIMEOUT.search(text))
    )


def report(exc: BaseException) -> PeerLostError:
    """The error naming who stopped the job: its message is empty except on the lowest surviving rank (every
    survivor's when the store is gone)."""
    rank, world = group_rank_world()
    where = "during setup" if _step is None else f"in step {_step + 1}"
    lost = bool(_LOST.search(str(exc)))
    how = "died" if lost else "stopped responding"
    then = "stopped too" if lost else f"gave up after --collective_timeout {_timeout_s:g} s"
    then += f" (exit code {PEER_LOST_EXIT_CODE})"
    try:
        store = _store()
        store.set(f"{_GAVE_UP}{rank}", "1")
        time.sleep(REPORT_GRACE_S)
        if any(store.check([f"{_GAVE_UP}{r}"]) for r in range(rank)):
            return PeerLostError()  # a lower rank reports
        silent = [r for r in range(world) if not store.check([f"{_GAVE_UP}{r}"])]
        beats = [b for b in (_beat(store, r) for r in silent) if b is not None]
    except Exception:  # the store's process is gone; no census without it: every survivor says so
        host = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        owner = "torchrun's agent" if agent else "rank 0"
        return PeerLostError(
            f"{owner}, host of the rendezvous store at {host}, cannot be reached {where}; rank {rank} {then}"
        )
    if not silent:
        return PeerLostError(f"a collective failed on every rank {where}: {_first_line(exc)}")
    names = ", ".join(map(str, silent[:8])) + (f" and {len(silent) - 8} more" if len(silent) > 8 else "")
    ages = sorted({round(time.time() - when) for when in beats})
    span = f"{ages[0]}" if len(ages) == 1 else f"{ages[0]}-{ages[-1]}"
    heard = ("connection lost; " if lost else "") + (
        f"last heard {span} s ago" if ages else "never heard from"
    )
    who = f"rank {names}" if len(silent) == 1 else f"ranks {names}"
    return PeerLostError(f"{who} {how} {where} ({heard}); rank {rank} {then}")


def _store() -> Any:
    """The default store, with short timeouts; connect first, so a vanished host fails fast and quietly."""
    host, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "0"))
    with socket.create_connection((host, port), timeout=5):
        pass
    store = tdist.distributed_c10d._get_default_store()
    store.set_timeout(timedelta(seconds=5))
    return store


def _beat(store: Any, rank: int) -> float | None:
    """When `rank` last finished a step (or started training), by its clock."""
    if not store.check([f"{_ALIVE}{rank}"]):
        return None
    return float(store.get(f"{_ALIVE}{rank}").decode().split()[1])


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
