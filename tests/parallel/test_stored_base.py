"""LoRA on a frozen base kept as the folder stores it (`--base_precision stored`, an FP8 folder in DeepSeek-V3's
form) in every layout on 2 ranks: no ZeRO, ZeRO-1/2/3, EP2, PP2, TP2 (whole 128-blocks per rank) and SP2 under
ZeRO-3. Each trains like one process fine-tuning the dequantized folder (the same bound as any fine-tune's
layouts: loss and grad norm 1e-5, adapters 1e-4; on one process the two bases compute the same bits,
tests/model/common/test_stored.py); holds every quantized weight as its FP8 codes and fp32 scales and no
parameter of them, its share of them (ZeRO-3: half of every part; EP2: half of the experts; PP2: its
stage's); and resumes exactly without the base in its checkpoints."""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.pool import ScenarioResults
from tests.helpers.quantized import fp8_folder
from tests.helpers.trainer import make_options, reference_run
from tests.parallel.worker import FT_STEPS, GLOBAL_ROWS, STORED, STORED_LORA, common

pytestmark = [pytest.mark.multirank, pytest.mark.parallel]
LR = 3e-3  # tests/helpers/trainer.py's
# HF keys of the weights a layout splits in halves (tp.py, ep.py)
SPLITS = {
    "st_tp2": r"(q_b_proj|kv_b_proj|o_proj|mlp\.(shared_experts\.)?(gate|up|down)_proj)\.weight$",
    "st_ep2": r"\.experts\.\d+\.",
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8") / "src"
    return folder, fp8_folder(folder)


@pytest.fixture(scope="module")
def runs(source, tmp_path_factory, rank_pools):
    tmp = tmp_path_factory.mktemp("stored")
    res = ScenarioResults(
        rank_pools, 2, "tests.parallel.worker:stored_run", str(tmp), str(source[0]), all_ranks=True
    )
    return tmp, res


@pytest.fixture(scope="module")
def reference(source):
    """One process, LoRA on the folder dequantized (fp32 weights, no stored base)."""
    from dstrain.config.plan import model_config
    from dstrain.model import from_pretrained
    from dstrain.training.finetune import apply_finetune_options

    model = from_pretrained(source[0], dtype=torch.float32)
    opts = make_options([*common(1).split(), "--max_steps", str(FT_STEPS), *STORED_LORA.split()])
    model.config = model_config(opts, model.config)
    apply_finetune_options(model, opts.lora, opts.run.seed)
    state: dict = {}
    hist = reference_run(
        model.config, opts, steps=FT_STEPS, global_batch=GLOBAL_ROWS, model=model, state=state
    )
    return hist, state


@pytest.mark.parametrize("name", list(STORED))
def test_lora_on_the_stored_base_trains_like_one_process_on_the_dequantized_one(
    runs, reference, source, name
):
    from dstrain.checkpoint.weights import iter_weights

    tmp, res = runs
    ranks = res[name]
    hist, state = reference
    for rank in ranks:
        dev = max(
            max(abs(g[k] - w[k]) / abs(w[k]) for k in ("loss", "grad_norm"))
            for g, w in zip(rank["history"], hist, strict=True)
        )
        assert dev <= 1e-5, (name, rank["history"], hist)
    ckpt = tmp / name / "straight" / "checkpoints" / f"step_{FT_STEPS:08d}"
    got = dict(iter_weights(ckpt))
    assert not got.keys() & _stored_keys(source[0]), "the checkpoint holds no copy of the stored base"
    adapters = {k: t for k, t in state.items() if k.endswith(("lora_A", "lora_B"))}
    assert adapters and adapters.keys() <= got.keys()
    # Adam moves an element by at most lr a step: a wrong or unsynchronised gradient shows as deviations of
    # ~lr; the layouts' fp32 summation order, which Adam amplifies where a gradient is near 0, stays far below
    # 5% of lr (measured: 0.8%, an attention adapter under EP2)
    worst = max(float((got[k] - t).abs().max()) for k, t in adapters.items())
    print(name, f"loss/grad norm {dev:.1e}, adapters {worst / LR:.2%} of lr")
    assert worst <= 0.05 * LR


@pytest.mark.parametrize("name", list(STORED))
def test_each_rank_holds_its_share_of_the_stored_bytes(runs, source, name):
    """Every quantized weight of the folder held stored (FP8 codes and fp32 scales, as the file has them) and
    none as a parameter; together the ranks hold the folder's stored bytes once (ZeRO-3, also under SP: half
    of every part each; EP2, PP2, TP2: disjoint shares) or each whole (ZeRO-0/1/2); ZeRO-2 resumes exactly."""
    ranks = runs[1][name]
    keys, total = _stored_keys(source[0]), sum(source[1].values())
    held_keys = set()
    for rank in ranks:
        for w in rank["held"].values():
            assert set(w["dtypes"].values()) == {"torch.float8_e4m3fn", "torch.float32"}, w
            held_keys.add(w["source"][0])
        assert not keys & set(rank["params"])
    assert held_keys == keys
    held = [sum(w["bytes"] for w in r["held"].values()) for r in ranks]
    if name in ("st_z3", "st_sp2"):  # ZeRO-3: half of every part each, padded to a multiple of 2 elements
        assert total <= sum(held) <= total * 1.01 and all(h < total for h in held), (held, total)
    elif name == "st_pp2":  # a stage's layers each
        assert sum(held) == total and all(h < total for h in held), (held, total)
    else:  # the split weights' halves (TP: attention's and the MLPs' projections; EP: the routed experts)
        split = SPLITS.get(name)
        want = sum(b // 2 if split and re.search(split, k) else b for k, b in source[1].items())
        assert held == [want, want], (held, want, total)
    if name == "st_z2":
        assert ranks[0]["resumed"] == [h["loss"] for h in ranks[0]["history"]][2:]


def _stored_keys(folder) -> set[str]:  # noqa: ANN001
    """The dstrain keys of the weights the folder stores quantized."""
    from dstrain.model import get_config
    from dstrain.model.sources import open_folder

    with open_folder(folder, get_config(folder)) as reader:
        return {k for k in reader.sources if reader.stored_form(k)}


def test_dpo_on_the_stored_base_starts_at_log2_and_learns(source, tmp_path, rank_pools):
    """DPO's reference is the model with its adapters off: the stored base itself. One process, LoRA on the FP8
    folder: step 1 at log 2 (policy = reference), then the pairs ranked."""
    import math

    flags = f"--config zero1 --max_steps 3 --micro_batch_size 2 --model {source[0]} --base_precision stored"
    history = rank_pools.run(1, "tests.training.worker:dpo_run", str(tmp_path), "stored", flags, 2)[0]
    assert abs(history[0]["loss"] - math.log(2)) <= 1e-6 and history[0]["rewards/margins"] == 0.0
    assert history[-1]["loss"] < math.log(2) - 0.01, history


def test_export_reads_the_base_from_its_folder_and_verifies(runs, tmp_path, capsys):
    """The checkpoint lacks the stored base: export reads it from the folder (checked to be the same), merges the
    adapters into it dequantized and writes the source's FP8 form; transformers' logits equal dstrain's."""
    from dstrain.cli import main as dstrain_main

    tmp, res = runs
    res["st_z3"]  # noqa: B018 - the layout's run (in the pool, the first time)
    ckpt = tmp / "st_z3" / "straight" / "checkpoints" / f"step_{FT_STEPS:08d}"
    assert dstrain_main(["export", str(ckpt), "--out", str(tmp_path / "fp8"), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert ": ok" in printed and "the source's quantized form" in printed, printed
