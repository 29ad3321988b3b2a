"""GLM-5.3-Flash under sequence parallelism (Ulysses, 2 ranks of a pool) against one process, one forward and
backward in float64: packed documents and padding, the MTP depth's halo, the sparse and the dense stage. The
8-step training runs are tests/parallel/test_layouts.py's glm5n_sp2; this one holds what those cannot see, the
gradient of every parameter (the pools' position bias, which every rank uses alike on whole rows, counted once
over the group: Adam hides a factor of 2 in it, and its share of the grad norm is too small to show)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.multirank]

T = 32


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 96, (2, T), generator=g)
    pos = torch.stack(
        [torch.cat([torch.arange(13), torch.arange(19)]), torch.cat([torch.arange(27), torch.full((5,), -1)])]
    )
    labels = ids.clone()
    labels[1, 27:] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def _model(stage: str):  # noqa: ANN202
    from dstrain.model import build_model, get_config

    model = build_model(get_config("tiny-glm5-next").replace(vocab_size=96), seed=1).double().train()
    with torch.no_grad():  # the biases that start at 0, random: their gradients mean something
        g = torch.Generator().manual_seed(2)
        for name, p in model.named_parameters():
            if name.endswith(("_ape", "norm.bias")):
                p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    model.set_sparse_attention(stage)
    model.set_indexer_grad_scale(1.0)  # the KL sums' gradients, each rank's slice of them
    return model


def _step(model, batch: dict, sp: int) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Forward and backward of the summed losses (the balance loss: each rank's is its share of the row's,
    averaged over the group) -> (lm sum, MTP sum, balance loss) and the indexers' figures."""
    out = model(batch["input_ids"], batch["position_ids"], batch["labels"])
    (out.lm_loss_sum + out.mtp_loss_sum.sum() + out.aux_loss / sp).backward()
    figures = torch.stack([out.lm_loss_sum, out.mtp_loss_sum.sum(), out.aux_loss / sp]).detach()
    return figures, out.indexer_stats


def sequence_parallel_step(info: Any, stage: str) -> dict[str, Any]:  # noqa: ANN401 - a pool scenario
    """Rank r of 2: the one-process step, then the SP step on its slice; the gradients summed over the group
    -> each figure's and parameter's deviation from one process's."""
    import torch.distributed as tdist

    from dstrain.batch import sequence_shard
    from dstrain.parallel.sp import SequenceParallel

    batch = _batch()
    reference = _model(stage)
    want, want_stats = _step(reference, batch, 1)
    model = _model(stage)
    hook = SequenceParallel(tdist.new_group([0, 1]), 2, info.rank)
    for m in model.modules():
        if hasattr(type(m), "seq_parallel"):
            m.seq_parallel = hook
    got, stats = _step(model, sequence_shard(batch, info.rank, 2, model.halo), 2)
    tdist.all_reduce(got)
    dev: dict[str, Any] = {
        "figures": float(((got - want).abs() / want.abs()).max()),
        "indexer": float(((stats - want_stats).abs() / want_stats.abs().clamp(min=1e-30)).max()),
        "params": {},
    }
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        tdist.all_reduce(grad)
        dev["params"][name] = float((grad - q.grad).abs().max() / q.grad.abs().max())
    return dev


@pytest.mark.parametrize("stage", ["sparse", "dense"])
def test_sequence_parallel_equals_one_process(rank_pools, stage: str) -> None:
    """The losses and the indexers' KL figures (whole rows on every rank) as one process's, every gradient
    (summed over the group) within fp32's rounding of the parts that run in fp32 (the loss (1.2e-7 seen), the indexer's key
    norm, the decay, mHC: 2.2e-6 seen); the pools' position bias, whose gradient is the float64 KL's alone,
    to float64's."""
    dev, _ = rank_pools.run(2, f"{__name__}:sequence_parallel_step", stage, timeout=300)
    params = dev.pop("params")
    worst = max(params.items(), key=lambda kv: kv[1])
    print(stage, dev, "worst gradient", worst)
    assert dev["figures"] <= 1e-6 and dev["indexer"] <= 1e-12, dev
    assert worst[1] <= 2e-5, worst
    apes = [v for k, v in params.items() if k.endswith("_ape")]
    assert len(apes) == 2 and max(apes) <= 1e-12, apes
