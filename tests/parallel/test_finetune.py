"""Fine-tuning from a Hugging Face folder in the layouts that load without any rank holding the whole model:
ZeRO-3 (partitioned init) on 2 ranks, ZeRO++ hpz, PP2, TP2 and EP2, and LoRA (attention, shared and routed
experts, routers) under ZeRO-3, PP2, TP2 and EP2. Each loads the folder, checkpoints at step 0 (export ->
the source's exact bits) and after 3 steps (export --verify: transformers' logits equal dstrain's), trains like
one process fine-tuning the same folder, and reads less than the whole folder on every rank."""

from __future__ import annotations

import re

import pytest
import torch

from tests.helpers.hf import read_folder
from tests.helpers.pool import ScenarioResults
from tests.helpers.tiny import tiny_config
from tests.helpers.trainer import make_options, reference_run
from tests.parallel.worker import FINETUNE, FT_STEPS, GLOBAL_ROWS, LORA, common

pytestmark = [pytest.mark.multirank, pytest.mark.parallel]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A sharded fp32 folder in the official layout (MTP layer included), every weight random: norms and
    the expert bias too, so a tensor left at its fresh-init value would show."""
    from dstrain.model import build_model, save_pretrained

    folder = tmp_path_factory.mktemp("hf") / "src"
    model = build_model(tiny_config(), seed=11)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
        for r in model.routers():
            r.e_score_correction_bias.copy_(0.01 * torch.randn(r.e_score_correction_bias.shape, generator=g))
    save_pretrained(model, folder, dtype="float32", max_shard_bytes=96 * 1024)
    return folder


@pytest.fixture(scope="module")
def finetuned(source, tmp_path_factory, rank_pools):
    """Each layout's runs on 2 ranks (every rank's figures), run in the pool when a test first asks."""
    tmp = tmp_path_factory.mktemp("ft")
    res = ScenarioResults(
        rank_pools, 2, "tests.parallel.worker:finetune_run", str(tmp), str(source), all_ranks=True
    )
    return tmp, res


@pytest.fixture(scope="module")
def reference(source):
    """One process fine-tuning the folder, without and with LoRA (adapters seeded by module name, so they
    start the same in every layout)."""
    from dstrain.config.plan import model_config
    from dstrain.model import from_pretrained
    from dstrain.training.finetune import apply_finetune_options

    runs = {}
    for lora in ("", LORA):
        model = from_pretrained(source, dtype=torch.float32)
        opts = make_options([*common(1).split(), "--max_steps", str(FT_STEPS), *lora.split()])
        model.config = model_config(opts, model.config)  # the run's: LoRA keeps the expert bias
        apply_finetune_options(model, opts.lora, opts.run.seed)
        state = {}
        runs[bool(lora)] = reference_run(
            model.config, opts, steps=FT_STEPS, global_batch=GLOBAL_ROWS, model=model, state=state
        )
        runs[f"{bool(lora)}_state"] = state
    return runs


@pytest.mark.parametrize("name", list(FINETUNE))
def test_loaded_weights_are_the_folders_bits(finetuned, source, tmp_path, name):
    from dstrain.checkpoint.export import export

    tmp, res = finetuned
    res[name]  # noqa: B018 - the layout's runs (in the pool, the first time)
    export(tmp / name / "steps0" / "checkpoints" / "step_00000000", tmp_path / "out")
    src, got = read_folder(source), read_folder(tmp_path / "out")
    assert got.keys() == src.keys()
    for k in src:
        assert got[k].dtype == src[k].dtype and torch.equal(got[k], src[k]), k


@pytest.mark.parametrize("name", list(FINETUNE))
def test_finetunes_like_one_process(finetuned, reference, name):
    _, res = finetuned
    hist = res[name][0][str(FT_STEPS)]["history"]
    assert len(hist) == FT_STEPS
    dev = max(
        max(abs(g[k] - w[k]) / abs(w[k]) for k in ("loss", "grad_norm"))
        for g, w in zip(hist, reference["lora" in name], strict=True)
    )
    print(name, f"max relative deviation {dev:.1e}")
    assert dev <= 1e-5, (name, hist, reference["lora" in name])


@pytest.mark.parametrize("name", [n for n in FINETUNE if n.endswith("_lora")])
def test_adapters_train_like_one_process(finetuned, reference, name):
    """Every adapter tensor after the steps (each routed expert's, the routers', a TP slice's, an EP rank's)
    equals one process's: a wrong or unsynchronised adapter gradient moves it by ~lr (1e-2 of its size), far
    above the bound, where the loss and grad norm, dominated by B's gradients, could hide it. The bound is
    looser than the loss's: Adam's steps amplify the summation-order noise of an idle expert's tiny gradient
    (measured up to 2.6e-5)."""
    from dstrain.checkpoint.weights import iter_weights

    tmp, res = finetuned
    res[name]  # noqa: B018
    ckpt = tmp / name / f"steps{FT_STEPS}" / "checkpoints" / f"step_{FT_STEPS:08d}"
    got = {k: t for k, t in iter_weights(ckpt) if k.endswith(("lora_A", "lora_B"))}
    want = {k: t for k, t in reference["True_state"].items() if k.endswith(("lora_A", "lora_B"))}
    assert got.keys() == want.keys() and any(".experts.up_lora_A" in k for k in got)
    devs = {k: float((got[k] - t).abs().max() / t.abs().max().clamp(min=1e-12)) for k, t in want.items()}
    worst = max(devs, key=devs.get)
    print(name, f"max relative adapter deviation {devs[worst]:.1e} ({worst})")
    assert devs[worst] <= 1e-4, (worst, devs[worst])


@pytest.mark.parametrize("name", list(FINETUNE))
def test_export_after_finetuning_matches_transformers(finetuned, tmp_path, name, capsys):
    from dstrain.cli import main as dstrain_main

    tmp, res = finetuned
    res[name]  # noqa: B018
    ckpt = tmp / name / f"steps{FT_STEPS}" / "checkpoints" / f"step_{FT_STEPS:08d}"
    assert dstrain_main(["export", str(ckpt), "--out", str(tmp_path / "hf"), "--verify"]) == 0
    found = re.search(r"max \|logits diff\| (\S+) ", capsys.readouterr().out)
    assert found and float(found.group(1)) <= 1e-5, found


@pytest.mark.parametrize("name", list(FINETUNE))
def test_each_rank_reads_only_what_it_holds(finetuned, name):
    _, res = finetuned
    runs = [r["0"] for r in res[name]]
    total = runs[0]["load"]["checkpoint_bytes"]
    read = [x["load"]["bytes_read"] for x in runs]
    print(name, [f"{b / total:.2f}" for b in read], [x["load"]["peak_rss_growth"] for x in runs])
    if name == "ft_z3_hpz":  # one tensor at a time through rank 0, which DeepSpeed then partitions
        assert read[0] >= total and 0 < read[1] < 0.01 * total, (read, total)  # rank 1: the expert bias only
        return
    assert all(0 < b < total for b in read), (read, total)
    if name.startswith("ft_z3"):  # each partition once, plus the rows two partitions share (a tiny model's)
        assert total <= sum(read) <= 1.25 * total, (read, total)
    else:  # a stage's layers, a TP slice, a range of experts: exactly the bytes of what the rank keeps
        assert read == [x["held_bytes"] for x in runs], (read, [x["held_bytes"] for x in runs])


def test_zero3_bf16_keeps_the_expert_bias_fp32(finetuned, source, rank_pools):
    """zero.Init casts every buffer to bf16, where bias steps of γ = 1e-3 near 0.4 would round away."""
    from dstrain.model import get_config
    from dstrain.model.sources import open_folder

    tmp, _ = finetuned
    with open_folder(source, get_config(source)) as reader:
        want = [reader.read(k).tolist() for k in sorted(reader.sources) if k.endswith("correction_bias")]
    ranks = rank_pools.cached("z3_bf16", 2, "tests.parallel.worker:finetune_bf16", str(tmp), str(source))
    for rank in ranks:
        assert [v for _, v in rank["loaded"]] == want  # exact fp32 values
        assert all(d == "torch.float32" for d, _ in rank["loaded"] + rank["trained"])
        steps = torch.tensor([v for _, v in rank["trained"]]) - torch.tensor(want)
        gamma = get_config(source).bias_update_speed  # the folder's (its config.json has none: the default)
        assert steps.abs().max() > 0 and torch.allclose(steps / gamma, (steps / gamma).round(), atol=1e-3)
