"""Two nodes of one process each on this machine (two `torchrun --nnodes 2 --node_rank K` meeting at
127.0.0.1) against one node of two processes (the command's run on the session's pool of 2 ranks): the same
losses, the same files in the output folder, each file written by one rank only (node 1's local rank 0 is
global rank 1 and must not write rank 0's files), and data-parallel ranks reading disjoint shares of the data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.ranks import free_port
from tests.helpers.tiny import ROOT

pytestmark = pytest.mark.multirank
ARGS = [
    "--max_steps",
    "4",
    "--seq_len",
    "32",
    "--micro_batch_size",
    "2",
    "--save_every",
    "2",
    "--keep_last",
    "0",
]
ARGS += ["--no-tensorboard", "--no-plots", "--config", "zero2"]


def _torchrun(node_rank: int, port: int, args: list[str], logs: Path) -> subprocess.Popen:
    """Node NODE_RANK of 2, one rank each, running tests/helpers/audited.py ARGS (dstrain train, its writes
    logged)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DSTRAIN_WRITE_LOG": str(logs)}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--node_rank",
        str(node_rank),
    ]
    cmd += ["--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    cmd += ["tests/helpers/audited.py", *args]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _written(logs: Path, rank: int, out: Path) -> set[str]:
    lines = Path(f"{logs}.rank{rank}").read_text().splitlines()
    return {
        os.path.relpath(p, out) for p in lines if p.startswith(str(out) + os.sep) and not p.endswith(".tmp")
    }


def test_two_nodes_of_one_rank_train_like_one_node_of_two(tmp_path, rank_pools, small_model):
    args = [*ARGS, "--model", str(small_model)]
    one = tmp_path / "nodes1"
    assert rank_pools.run(2, "tests.training.worker:cli_run", [*args, "--output_dir", str(one)]) == [0, 0]
    two, two_logs = tmp_path / "nodes2", tmp_path / "writes2"
    port = free_port()
    procs = [_torchrun(k, port, [*args, "--output_dir", str(two)], two_logs) for k in range(2)]
    texts = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(t[-2000:] for t in texts)
    losses = [
        [json.loads(line)["loss"] for line in (o / "metrics.jsonl").read_text().splitlines()]
        for o in (one, two)
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 4
    files = [sorted(str(p.relative_to(o)) for p in o.rglob("*") if p.is_file()) for o in (one, two)]
    assert files[0] == files[1]
    rank0, rank1 = _written(two_logs, 0, two), _written(two_logs, 1, two)
    assert rank0 and rank1 and not (rank0 & rank1), sorted(rank0 & rank1)
    assert {
        "metrics.jsonl",
        "ds_config.resolved.json",
        "checkpoints/step_00000004/mp_rank_00_model_states.pt",
    } <= rank0
    assert "checkpoints/step_00000004/zero_pp_rank_1_mp_rank_00_optim_states.pt" in rank1
    assert rank0 | rank1 == set(files[1]) | {"checkpoints/latest"}  # every file of the run, by one rank each
    states = [
        json.loads(
            (two / "checkpoints" / "step_00000004" / "dstrain_state" / f"rank_{r:05d}.json").read_text()
        )
        for r in (0, 1)
    ]
    # data shards are disjoint: each rank holds its own data streams (0, 2, 4, 6 and 1, 3, 5, 7)
    assert [sorted(map(int, s["loader"]["stream_states"])) for s in states] == [[0, 2, 4, 6], [1, 3, 5, 7]]
