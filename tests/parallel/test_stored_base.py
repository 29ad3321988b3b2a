"""LoRA on a frozen base kept as the folder stores it (`--base_precision stored`): an FP8 folder in DeepSeek-V3's
form in every layout on 2 ranks (no ZeRO, ZeRO-1/2/3, EP2, PP2, TP2 (whole 128-blocks per rank), SP2 under
ZeRO-3), DeepSeek-V4's FP8 + FP4 experts under EP2 and Kimi-K2.5's INT4 experts under ZeRO-3. Each trains like one process fine-tuning the dequantized folder (the same bound as any fine-tune's
layouts: loss and grad norm 1e-5, adapters 1e-4; on one process the two bases compute the same bits,
tests/model/common/test_stored.py); holds every quantized weight as its FP8 codes and fp32 scales and no
parameter of them, its share of them (ZeRO-3: half of every part; EP2: half of the experts; PP2: its
stage's); and resumes exactly without the base in its checkpoints."""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.pool import ScenarioResults
from tests.helpers.quantized import fp8_folder, int4_folder, v4_folder
from tests.helpers.trainer import make_options, reference_run
from tests.parallel.worker import FT_STEPS, GLOBAL_ROWS, STORED, STORED_LORA, common

pytestmark = [pytest.mark.multirank, pytest.mark.parallel]
LR = 3e-3  # tests/helpers/trainer.py's
# HF keys of the weights a layout splits in halves (tp.py, ep.py)
SPLITS = {
    "st_tp2": r"(q_b_proj|kv_b_proj|o_proj|mlp\.(shared_experts\.)?(gate|up|down)_proj)\.weight$",
    "st_ep2": r"\.experts\.\d+\.",
    "v4_st_ep2": r"\.experts\.\d+\.",
}
# The folder each layout's name starts with, and the dtypes of its stored parts
FORMS = {
    "st": (fp8_folder, {"torch.float8_e4m3fn", "torch.float32"}),  # DeepSeek-V3's FP8
    "v4": (v4_folder, {"torch.float8_e4m3fn", "torch.float8_e8m0fnu", "torch.int8"}),  # V4's FP8 + FP4
    "int4": (int4_folder, {"torch.int32", "torch.bfloat16"}),  # Kimi-K2.5's INT4 experts
}


def _form(name: str) -> str:
    return name.split("_")[0]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Each form's folder (written when first asked) -> (path, stored bytes by HF key)."""
    made: dict = {}

    def get(form: str):  # noqa: ANN202
        if form not in made:
            folder = tmp_path_factory.mktemp(form) / "src"
            made[form] = folder, FORMS[form][0](folder)
        return made[form]

    return get


@pytest.fixture(scope="module")
def runs(sources, tmp_path_factory, rank_pools):
    """form -> (its runs' folder, its layouts' runs on 2 ranks, in the pool when a test first asks)."""
    made: dict = {}

    def get(form: str):  # noqa: ANN202
        if form not in made:
            tmp = tmp_path_factory.mktemp(f"stored_{form}")
            folder = str(sources(form)[0])
            made[form] = (
                tmp,
                ScenarioResults(
                    rank_pools, 2, "tests.parallel.worker:stored_run", str(tmp), folder, all_ranks=True
                ),
            )
        return made[form]

    return get


@pytest.fixture(scope="module")
def references(sources):
    """form -> one process, LoRA on the folder dequantized (fp32 weights, no stored base)."""
    from dstrain.config.plan import model_config
    from dstrain.model import from_pretrained
    from dstrain.training.finetune import apply_finetune_options

    made: dict = {}

    def get(name: str):  # noqa: ANN202
        form = _form(name)
        if form not in made:
            model = from_pretrained(sources(form)[0], dtype=torch.float32)
            own = re.search(r"--lora_targets \S+", STORED[name])  # a layout's own targets win, as in the runs
            lora = [*STORED_LORA.split(), *(own[0].split() if own else ())]
            # the stage a LoRA fine-tune of a sparse-attention folder resolves to (config/plan.py): indexers kept
            stage = ["--dsa_stage", "frozen"]
            opts = make_options([*common(1).split(), "--max_steps", str(FT_STEPS), *lora, *stage])
            model.config = model_config(opts, model.config)
            apply_finetune_options(model, opts.lora, opts.run.seed)
            state: dict = {}
            hist = reference_run(
                model.config, opts, steps=FT_STEPS, global_batch=GLOBAL_ROWS, model=model, state=state
            )
            made[form] = hist, state
        return made[form]

    return get


@pytest.mark.parametrize("name", list(STORED))
def test_lora_on_the_stored_base_trains_like_one_process_on_the_dequantized_one(
    runs, references, sources, name
):
    from dstrain.checkpoint.weights import iter_weights

    tmp, res = runs(_form(name))
    ranks = res[name]
    hist, state = references(name)
    source = sources(_form(name))
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
def test_each_rank_holds_its_share_of_the_stored_bytes(runs, sources, name):
    """Every quantized weight of the folder held stored (FP8 codes and fp32 scales, as the file has them) and
    none as a parameter; together the ranks hold the folder's stored bytes once (ZeRO-3, also under SP: half
    of every part each; EP2, PP2, TP2: disjoint shares) or each whole (ZeRO-0/1/2); ZeRO-2 resumes exactly."""
    ranks = runs(_form(name))[1][name]
    source = sources(_form(name))
    keys, total = _stored_keys(source[0]), sum(source[1].values())
    held_keys = set()
    for rank in ranks:
        for w in rank["held"].values():
            assert set(w["dtypes"].values()) <= FORMS[_form(name)][1], w
            held_keys.add(w["source"][0])
        assert not keys & set(rank["params"])
    assert held_keys == keys
    held = [sum(w["bytes"] for w in r["held"].values()) for r in ranks]
    if name in (
        "st_z3",
        "st_sp2",
        "int4_st_z3",
    ):  # ZeRO-3: half of every part each, padded to a multiple of 2 elements
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


def test_dpo_on_the_stored_base_starts_at_log2_and_learns(sources, tmp_path, rank_pools):
    """DPO's reference is the model with its adapters off: the stored base itself. One process, LoRA on the FP8
    folder: step 1 at log 2 (policy = reference), then the pairs ranked."""
    import math

    flags = f"--config zero1 --max_steps 3 --micro_batch_size 2 --model {sources('st')[0]} --base_precision stored"
    history = rank_pools.run(1, "tests.training.worker:dpo_run", str(tmp_path), "stored", flags, 2)[0]
    assert abs(history[0]["loss"] - math.log(2)) <= 1e-6 and history[0]["rewards/margins"] == 0.0
    assert history[-1]["loss"] < math.log(2) - 0.01, history


def test_export_reads_the_base_from_its_folder_and_verifies(runs, tmp_path, capsys):
    """The checkpoint lacks the stored base: export reads it from the folder (checked to be the same), merges the
    adapters into it dequantized and writes the source's FP8 form; transformers' logits equal dstrain's."""
    from dstrain.cli import main as dstrain_main

    tmp, res = runs("st")
    res["st_z3"]  # noqa: B018 - the layout's run (in the pool, the first time)
    ckpt = tmp / "st_z3" / "straight" / "checkpoints" / f"step_{FT_STEPS:08d}"
    assert dstrain_main(["export", str(ckpt), "--out", str(tmp_path / "fp8"), "--verify"]) == 0
    printed = capsys.readouterr().out
    assert ": ok" in printed and "the source's quantized form" in printed, printed
