"""Session fixtures. Helpers live in tests/helpers/. The suite runs on the CPU even where GPUs are visible
(the GPU-side logic runs on the CPU under DSTRAIN_KERNEL_POLICY=cuda): nothing in it may touch CUDA."""

from __future__ import annotations

import gc
import os
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# Inductor's C++ without SIMD (plain loops) in every process of the suite, the ranks and commands it starts
# included: the same graphs, lowered to code that g++ compiles in 2/3 of the time (no vector templates to
# instantiate per kernel: a compiled ZeRO-3 layout's test took 62 CPU-s instead of 94). What the tests check
# of --compile is dstrain's side (capture, recomputation, layouts, numerics against eager); the vector code is
# Inductor's, and differs between CPUs anyway (AVX512 on some of these machines, AVX2 on others), while a GPU
# runs Triton's.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest

from dstrain import collector


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Collecting imports torch, DeepSpeed and transformers: without the garbage collector, then frozen (see
    dstrain/collector.py; the later full collections of a session walked them every time)."""
    with collector.paused(freeze=True):
        return (yield)


def pytest_unconfigure(config):
    gc.unfreeze()  # collection imported Triton, whose objects held at exit would be reported as leaks


@pytest.fixture(scope="session")
def trained(tmp_path_factory, rank_pools) -> dict[str, Path]:
    """Single-process runs on a transformers-written HF folder (see tests/helpers/runs.py), made once."""
    from tests.helpers.runs import lora_runs

    return lora_runs(rank_pools, tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> Path:
    """A transformers-written tiny V3 folder with a byte tokenizer (tests/helpers/runs.py) for command runs about
    something else than the default model (signals, hangs, nodes, what a run writes, a routing collapse): its
    steps and saves take a fraction of the default preset's, whose 129K-token head is 79% of a step."""
    from tests.helpers.runs import hf_source

    return hf_source(tmp_path_factory.mktemp("small") / "hf")


@pytest.fixture(scope="session")
def rank_pools(tmp_path_factory):
    """The session's pools of ranks (tests/helpers/pool.py): multi-rank scenarios run in them."""
    from tests.helpers.pool import Pools

    pools = Pools(tmp_path_factory.mktemp("pool_logs"))
    yield pools
    pools.close()
