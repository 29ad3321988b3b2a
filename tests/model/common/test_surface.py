"""The model surface every family shares (dstrain/model/common/surface.py): --compile's per-block compilation on
the families beyond DeepSeek-V3 (whose compiled blocks tests/training/test_compile.py and test_experts.py train),
and the checkpointing modes each family names."""

from __future__ import annotations

import pytest
import torch

from dstrain.model import build_model
from tests.helpers.tiny import (
    CAPTURE_BACKEND,
    VOCAB,
    tiny_config,
    tiny_glm5_next_config,
    tiny_kimi_linear_config,
    tiny_v4_config,
)

FAMILIES = {"v4": tiny_v4_config, "kimi_linear": tiny_kimi_linear_config, "glm5_next": tiny_glm5_next_config}


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_blocks_train_like_eager(family):
    """compile_blocks (what --compile calls; DeepSeek-V4's model had none: --compile raised AttributeError)
    captures each block (Dynamo, AOTAutograd and its partitioner: what Inductor is handed) and the loss and
    every gradient stay eager's. fp32 at these sizes: the capture reorders nothing a 1e-4 relative (1e-6
    absolute) bound does not hold."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg = FAMILIES[family]()
    eager, compiled = build_model(cfg, seed=0), build_model(cfg, seed=0)
    compiled.compile_blocks(backend=CAPTURE_BACKEND)
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    losses = []
    for model in (eager, compiled):
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    assert counters["stats"]["unique_graphs"] >= 1, "nothing was captured"
    assert torch.allclose(losses[1], losses[0], rtol=1e-5), (losses[1].item(), losses[0].item())
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        if a.grad is None:
            assert b.grad is None, name
            continue
        assert torch.allclose(b.grad, a.grad, rtol=1e-4, atol=1e-6), name


def _v3_sublayer(block, mode):  # noqa: ANN001, ANN202
    return block.recompute == (mode if mode in ("attention", "mlp") else None)


def _v4_mhc(block, mode):  # noqa: ANN001, ANN202
    return block.recompute_hc == (mode == "mhc")


@pytest.mark.parametrize(
    ("make", "modes", "blocks_follow", "message"),
    [
        (tiny_config, ("none", "full", "attention", "mlp"), _v3_sublayer,
         "DeepSeek-V2/V3 runs none, full, attention or mlp"),
        (tiny_v4_config, ("none", "mhc", "full"), _v4_mhc, "DeepSeek-V4 runs none, full or mhc"),
        (tiny_kimi_linear_config, ("none", "full"), None, "Kimi Linear runs none or full"),
    ],
)  # fmt: skip
def test_checkpointing_modes_are_the_family_s_and_others_are_refused_in_one_line(
    make, modes, blocks_follow, message
):
    """Each mode a family names is set on the model (and where a mode recomputes part of a block, on every block,
    MTP's included); True is 'full'; another mode is a ValueError naming the family's."""
    model = build_model(make(), seed=0)
    for mode in modes:
        model.set_activation_checkpointing(mode)
        assert model.activation_checkpointing == mode
        if blocks_follow is not None:
            assert all(blocks_follow(b, mode) for b in model.blocks()), mode
    model.set_activation_checkpointing(True)
    assert model.activation_checkpointing == "full"
    with pytest.raises(ValueError, match=message):
        model.set_activation_checkpointing("everything")
