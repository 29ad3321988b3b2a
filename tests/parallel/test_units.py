"""Layout validation and bookkeeping that needs no process group: one-line errors before anything is
allocated, dstrain's rank layout equal to DeepSpeed's expert groups, pipeline partitions, config sections."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dstrain.config.plan import prepare
from dstrain.parallel import ParallelDims
from dstrain.parallel.dims import layout_ranks
from dstrain.parallel.pipe import parse_partition
from tests.helpers.tiny import ROOT, tiny_config
from tests.helpers.trainer import make_options


def _resolve(flags: str, world: int, config: str = "zero1"):  # noqa: ANN202 - a RunPlan
    return prepare(make_options(f"--config {config} {flags}".split()), world, model=tiny_config())


@pytest.mark.parametrize(
    ("dims", "message"),
    [
        (dict(world=6, tp=4), "world size 6 is not divisible by --pp 1 x --tp 4 = 4"),
        (dict(world=4, pp=2, ep=4), "--ep 4 must divide the data-parallel size 2"),
        (dict(world=0, pp=0), "--pp 0: must be a positive integer"),
        (dict(world=2, sp=4), "--sp 4 must divide the data-parallel size 2"),
    ],
)
def test_sizes_that_cannot_tile_the_world(dims, message):
    with pytest.raises(ValueError) as err:
        ParallelDims(**dims)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    ("dims", "stage", "cfg", "message"),
    [
        (dict(tp=4), 1, {}, "--tp 4 must divide num_attention_heads 2"),
        (dict(ep=8), 1, {}, "--ep 8 must divide n_routed_experts 4"),
        (dict(pp=4), 1, {}, "--pp 4 exceeds num_hidden_layers 2"),
        (dict(pp=2), 2, {}, "--pp 2 with ZeRO-2: DeepSpeed's pipeline engine supports ZeRO stage 0-1 only"),
        (dict(pp=2), 3, {}, "--pp 2 with ZeRO-3"),
        (dict(ep=2), 3, {}, "--ep 2 with ZeRO-3: expert parallelism needs ZeRO stage 1 or 2"),
        (dict(tp=2), 3, {}, "--tp 2 with ZeRO-3"),
        (dict(tp=2), 0, {}, "dp 4 x tp 2 with ZeRO-0"),
        (dict(pp=2), 1, {"tie_word_embeddings": True}, "--pp 2: tie_word_embeddings=true"),
        (dict(tp=2), 1, {"intermediate_size": 63}, "--tp 2 must divide intermediate_size 63"),
        (dict(sp=4), 1, {}, "--sp 4 must divide num_attention_heads 2"),
        (dict(sp=2, tp=2), 1, {}, "--sp 2 with --pp/--tp: sequence parallelism combines with data"),
        (dict(sp=2, pp=2), 1, {}, "--sp 2 with --pp/--tp"),
    ],
)
def test_layouts_the_model_or_zero_stage_cannot_take(dims, stage, cfg, message):
    with pytest.raises(ValueError) as err:
        ParallelDims(8, **dims).validate(tiny_config(**cfg), stage)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("world", "pp", "tp", "ep"), [(8, 1, 1, 2), (8, 2, 2, 2), (16, 2, 2, 4), (8, 1, 2, 4)]
)
def test_rank_layout_is_deepspeeds(world, pp, tp, ep):
    """dstrain dispatches tokens over the same EP groups whose expert gradients DeepSpeed's ZeRO reduces."""
    from deepspeed.utils.groups import _get_expert_parallel_ranks

    ours = layout_ranks(ParallelDims(world, pp=pp, tp=tp, ep=ep))
    ep_groups, edp_groups = _get_expert_parallel_ranks(world, tp, ep, pp)
    assert sorted(ours["ep"]) == sorted(ep_groups)
    assert sorted(ours["edp"]) == sorted(edp_groups)
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=world // (pp * tp))
    assert sorted(ours["dp"]) == sorted(topo.get_axis_comm_lists("data"))
    assert sorted(ours["tp"]) == sorted(topo.get_axis_comm_lists("model"))


def test_pipeline_partition_spec():
    assert parse_partition("parameters", 2, 4) == "parameters"
    assert parse_partition("2", 2, 4) == [0, 3, 6]  # [Embed, blocks 0-1] [blocks 2-3, Tail]
    assert parse_partition("1,3", 3, 4) == [0, 2, 4, 6]
    for bad in ("0", "4", "2,1", "x"):
        with pytest.raises(ValueError, match="--pp_partition"):
            parse_partition(bad, 2 if "," not in bad else 3, 4)


def test_cli_refuses_a_bad_layout_before_starting():
    env = {**os.environ, "WORLD_SIZE": "2"}
    proc = subprocess.run(
        [sys.executable, "dstrain/train.py", "--config", "zero2", "--ep", "4"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "dstrain: error: --ep 4 must divide the data-parallel size 2 (world 2 / (pp x tp))"
    )


def test_sum_of_squares_equals_the_float64_norm_without_float64_copies():
    """The exact grad norm (gradnorm.sum_of_squares): fp32-accumulated blocks of each gradient in its own dtype,
    float64 only across blocks, equal to the sum of float64 squares within 1e-6 relative on gradients with a
    large dynamic range (whole-tensor fp32 sums are 1e-4 off there), whatever their shape or dtype."""
    import torch

    from dstrain.parallel.gradnorm import NORM_BLOCK, sum_of_squares

    g = torch.Generator().manual_seed(0)
    shapes = [(1_000_003,), (512, 1024), (4, 96, 256), (NORM_BLOCK,), (7,), (0,)]
    for dtype in (torch.float32, torch.bfloat16):
        grads = [
            (torch.randn(s, generator=g) * torch.exp(3 * torch.randn(s, generator=g))).to(dtype)
            for s in shapes
        ]
        want = sum(float(x.double().square().sum()) for x in grads)
        got = sum_of_squares(grads)
        assert got.dtype == torch.float64 and abs(float(got) - want) <= 1e-6 * want, (dtype, float(got), want)
        single = [torch.linalg.vector_norm(x, dtype=torch.float32).double().square() for x in grads]
        assert abs(float(sum(single)) - want) > 1e-6 * want  # what the blocks are for
    assert float(sum_of_squares([])) == 0.0
