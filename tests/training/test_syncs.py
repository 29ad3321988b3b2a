"""Host syncs in a training step: a GPU runs a step ahead of the host only where nothing reads a device value
back before the step ends. Counted on the CPU under the CUDA kernel policy (tests/helpers/syncs.py) over 3
optimizer steps (2 micro batches each, bf16 ZeRO-1, packed rows, the run loop's preemption check): dstrain's
code reads once per step (the step's figures, read_once); DeepSpeed's own reads are named."""

from __future__ import annotations

from collections import Counter

import pytest

pytestmark = pytest.mark.multirank

STEPS = 3
# The CPU stand-in of the GPU's varlen attention kernel (the CUDA policy's, never run on a GPU) reads its
# document lengths: not a sync of the GPU path.
EMULATION = ("dstrain/model/common/attention.py", "_varlen_reference")
# DeepSpeed 0.19.8's ZeRO-1/2 bf16 step reads its grad norm's validity (runtime/utils.py is_invalid_grad_norm:
# 3 a step) and the overflow flag (stage_1_and_2.py has_overflow): inside engine.step, unavoidable from outside.
DEEPSPEED = {"is_invalid_grad_norm": 3, "has_overflow": 1}


def test_one_host_read_per_optimizer_step(rank_pools, tmp_path):
    res = rank_pools.run(1, "tests.training.worker:host_syncs", str(tmp_path), STEPS, timeout=600)[0]
    ours = [
        tuple(c)
        for c in res["dstrain"]
        if not (c[1].startswith(EMULATION[0]) and c[1].endswith(EMULATION[1]))
    ]
    assert len(ours) <= STEPS, Counter(ours)
    assert all(op == "tolist" and "read_once" in where for op, where in ours), Counter(ours)
    deepspeed = Counter(where.rsplit(" ", 1)[1] for _, where in res["deepspeed"])
    assert dict(deepspeed) == {name: n * STEPS for name, n in DEEPSPEED.items()}, deepspeed
    history = res["history"]
    assert [h["step"] for h in history] == list(range(1, STEPS + 2))
    assert all(h["grad_norm"] > 0 and 0 < h["lm_loss"] < 10 and not h["skipped"] for h in history)
    assert all(h["target_tokens"] > 0 and set(h["moe_imbalance"]) for h in history)
