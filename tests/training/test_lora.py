"""LoRA in training: what the fine-tuning options freeze, training that changes only the adapters (one
process, and 2-rank ZeRO-3), and lora.json in the checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from dstrain.model import build_model
from dstrain.model.common.lora import EXPERT_ADAPTERS
from dstrain.training.finetune import apply_finetune_options
from tests.helpers.runs import read_weights
from tests.helpers.tiny import tiny_config
from tests.helpers.trainer import make_options
from tests.model.common.test_lora import expected_default


def test_finetune_options_freeze_and_unfreeze_explicitly():
    def trainable(args: list[str]) -> set[str]:
        model = build_model(tiny_config(), seed=0)
        opts = make_options(args)
        apply_finetune_options(model, opts.lora, opts.run.seed)
        return {n for n, p in model.named_parameters() if p.requires_grad}

    routers = {"layers.1.mlp.gate.weight", "mtp.0.block.mlp.gate.weight"}
    adapters = {f"{m}.{p}" for m in expected_default() for p in ("lora_A", "lora_B")}
    # LoRA by default: only adapters train; every base weight is frozen, routers and MTP modules included
    assert trainable(["--lora_r", "2"]) == {n for n in adapters if not n.startswith("mtp.")}
    lora = trainable(["--lora_r", "2", "--train_router", "--train_mtp"])  # opted in
    mtp_own = {n for n in lora if n.startswith("mtp.") and n not in adapters and n not in routers}
    assert "mtp.0.eh_proj.weight" in mtp_own and "mtp.0.block.mlp.experts.gate_up_proj" in mtp_own
    assert not any(n.endswith(("o_proj.weight", "q_b_proj.weight")) for n in lora)  # base weights frozen
    assert lora == adapters | routers | mtp_own
    off = trainable(["--lora_r", "2", "--no-train_router", "--no-train_mtp"])
    assert off == {n for n in adapters if not n.startswith("mtp.")}
    full = trainable(["--no-train_router"])
    everything = {n for n, _ in build_model(tiny_config(), seed=0).named_parameters()}
    assert full == everything - routers
    # experts and routers as targets: their adapters train, their base weights stay frozen (the MTP block's
    # adapters too, unless --train_mtp)
    moe = trainable(["--lora_r", "2", "--lora_targets", "experts,gate"])
    assert moe == {
        f"layers.1.mlp.{m}.{p}"
        for m, parts in (("gate", ("lora_A", "lora_B")), ("experts", EXPERT_ADAPTERS))
        for p in parts
    }
    with pytest.raises(ValueError, match="adapts the routers \\(gate\\) and --train_router trains them"):
        trainable(["--lora_r", "2", "--lora_targets", "o_proj,gate", "--train_router"])


def test_lora_training_changes_only_adapters(trained):
    before = dict(read_weights(trained["lora0"]))
    after = dict(read_weights(trained["lora3"]))
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    # --no-train_mtp freezes the MTP adapters too; γ = 0 leaves the expert bias alone
    want = {f"{m}.{p}" for m in expected_default(3) for p in ("lora_A", "lora_B") if not m.startswith("mtp.")}
    assert changed == want
    # frozen parameters get no optimizer state: the fp32 partition holds exactly the trainable adapters
    from dstrain.checkpoint.store import _deepspeed_state_classes

    with torch.serialization.safe_globals(_deepspeed_state_classes()):
        optim = torch.load(
            trained["lora3"] / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            map_location="cpu",
            weights_only=True,
        )["optimizer_state_dict"]
    assert sum(t.numel() for t in optim["single_partition_of_fp32_groups"]) == sum(
        after[k].numel() for k in want
    )
    settings = json.loads((trained["lora3"] / "lora.json").read_text())
    assert settings["r"] == 4 and settings["alpha"] == 8.0 and settings["train_router"] is False


@pytest.mark.multirank
def test_zero3_lora_two_ranks(tmp_path, rank_pools):
    res = rank_pools.run(2, "tests.training.worker:zero3_lora", str(tmp_path))
    assert res[0]["changed"] == res[0]["adapters"] and res[0]["changed"]
    assert res[0]["changed"] == res[1]["changed"] and res[0]["losses"] == res[1]["losses"]
    assert all(x is not None for x in res[0]["losses"]) and res[0]["losses"][-1] < res[0]["losses"][0]
    assert (tmp_path / "run" / "checkpoints" / "step_00000004" / "COMPLETE").is_file()


def test_expert_lora_rank_off_the_grouped_kernel_is_noted():
    from dstrain.config.plan import prepare

    def notes(r: str, targets: str) -> str:
        opts = make_options(["--lora_r", r, "--lora_targets", targets])
        return " ".join(prepare(opts, 1, model=tiny_config()).notes)

    assert "--lora_r 6: the routed experts' adapters run one GEMM per expert" in notes("6", "o_proj,experts")
    assert "lora_r" not in notes("8", "o_proj,experts") + notes("6", "o_proj")
