"""Every parallel layout trains exactly like one process: pipeline (PP), tensor (TP) and expert (EP)
parallelism alone on 2 ranks and combined with data parallelism / each other on 4, 8 steps in fp32 with
gradient clipping binding, against a plain PyTorch run of the same global batches. Compared: per-step loss
(MoE aux and MTP included), the logged global grad norm, and every final weight (read back from the
checkpoint's reassembled `weights/`), plus exact resume in the same layout, and the eval figures of the final weights (loss, MTP loss, MTP draft
acceptance) against one process's on the same rows, before and after a resume."""

from __future__ import annotations

import math
import re

import pytest
import torch

from tests.helpers.pool import ScenarioResults
from tests.helpers.tiny import tiny_config, tiny_dsa_config, tiny_v4_config
from tests.helpers.trainer import make_options, reference_run
from tests.parallel.worker import (
    DATA,
    DSA,
    DSA_DENSE,
    GLOBAL_ROWS,
    KIMI_LORA,
    LORA,
    MUON,
    RESHARD,
    RESHARD_DSA,
    STEPS,
    V4_LORA,
    common,
)

pytestmark = [pytest.mark.multirank, pytest.mark.parallel]

TWO = ["dp2_z0", "dp2_z1", "dp2_z2", "dp2_z3", "pp2", "tp2", "tp2_z2", "ep2_z1", "ep2_z2"]
TWO += ["sp2_z1", "sp2_z2", "sp2_z3", "sp2_ep2"]  # sequence parallel: each rank half of every row
FOUR = ["dp4_z1", "pp2dp2", "tp2dp2", "ep2dp2", "pp2tp2"]
TWO_LORA = ["ep2_lora"]  # LoRA on every kind of target, the routed experts' split over the EP ranks
# DeepSeek Sparse Attention, sparse stage: V3.2 in every layout; GLM-5's shared layer alone on a pipeline stage
TWO_DSA = ["dsa_z3", "dsa_pp2", "glm_pp2", "dsa_tp2", "dsa_ep2", "dsa_sp2"]
# DeepSeek-V4, the CSA indexer in its sparse stage (launched with DSA's)
TWO_V4 = ["v4_z3", "v4_ep2", "v4_pp2", "v4_sp2", "v4_tp2"]
TWO_GLM5N = ["glm5n_ep2", "glm5n_tp2", "glm5n_sp2", "glm5n_pp2"]  # GLM-5.3-Flash (launched with DSA's)
TWO_KIMI = ["kimi_ep2", "kimi_tp2", "kimi_pp2", "kimi_sp2"]  # Kimi Linear (launched with DSA's)
BF16 = ["pp2_bf16", "tp2_bf16", "ep2_bf16"]  # against dp2_bf16
TWO_MUON = ["muon_z0", "muon_z1", "muon_z2", "muon_z3", "muon_ep2", "muon_pp2", "muon_sp2", "muon_ep2_lora"]


@pytest.fixture(scope="module")
def reference():
    opts = make_options(common(1).split())
    state: dict = {}
    hist = reference_run(tiny_config(), opts, steps=STEPS, global_batch=GLOBAL_ROWS, state=state)
    return hist, state


def _lora_reference(extra: str = "", cfg=None, lora: str = LORA):  # noqa: ANN001
    from dstrain.config.plan import model_config
    from dstrain.model import build_model
    from dstrain.training.finetune import apply_finetune_options

    opts = make_options([*common(1).split(), *lora.split(), *extra.split()])
    cfg = model_config(
        opts, cfg or tiny_config()
    )  # the run's settings (the expert bias's speed) as the trainer's
    model = build_model(cfg, seed=opts.run.seed)
    apply_finetune_options(model, opts.lora, opts.run.seed)
    state: dict = {}
    hist = reference_run(cfg, opts, steps=STEPS, global_batch=GLOBAL_ROWS, state=state, model=model)
    return hist, state


@pytest.fixture(scope="module")
def lora_reference():
    return _lora_reference()


@pytest.fixture(scope="module")
def muon_reference():
    """One process with the test's own Muon (tests/helpers/muon.py), LoRA with it too."""
    opts = make_options([*common(1).split(), *MUON.split()])
    state: dict = {}
    hist = reference_run(tiny_config(), opts, steps=STEPS, global_batch=GLOBAL_ROWS, state=state)
    return {"full": (hist, state), "lora": _lora_reference(MUON)}


@pytest.fixture(scope="module")
def dsa_reference():
    opts = make_options([*common(1).split(), *DSA.split()])
    out = {}
    for glm in (False, True):
        state: dict = {}
        hist = reference_run(
            tiny_dsa_config(glm=glm), opts, steps=STEPS, global_batch=GLOBAL_ROWS, state=state
        )
        out[glm] = hist, state
    state = {}
    out["v4"] = (
        reference_run(tiny_v4_config(), opts, steps=STEPS, global_batch=GLOBAL_ROWS, state=state),
        state,
    )
    dense = make_options([*common(1).split(), *DSA_DENSE.split()])
    state = {}
    out["dense"] = (
        reference_run(tiny_dsa_config(), dense, steps=STEPS, global_batch=GLOBAL_ROWS, state=state),
        state,
    )
    return out


def _layouts(pools, tmp, nproc: int) -> ScenarioResults:
    """Each layout's run on `nproc` ranks in the pool, when a test first asks for it (worker.run_layout)."""
    return ScenarioResults(pools, nproc, "tests.parallel.worker:run_layout", str(tmp), timeout=600)


@pytest.fixture(scope="module")
def dsa_two_rank(tmp_path_factory, rank_pools):
    tmp = tmp_path_factory.mktemp("dsa2")
    return tmp, _layouts(rank_pools, tmp, 2)


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory, rank_pools):
    tmp = tmp_path_factory.mktemp("par2")
    return tmp, _layouts(rank_pools, tmp, 2)


@pytest.fixture(scope="module")
def four_rank(tmp_path_factory, rank_pools):
    tmp = tmp_path_factory.mktemp("par4")
    return tmp, _layouts(rank_pools, tmp, 4)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _check(
    tmp,
    name: str,
    got: dict,
    reference,
    lora: bool = False,
    param: float = 2e-5,
    loose=None,
    norm: float = 1e-5,
) -> dict[str, float]:
    """`loose`: (pattern, bound) for final weights held to a bound of their own (the rest: `param`); `norm`:
    the grad norm's bound."""
    from dstrain.checkpoint.weights import iter_weights

    ref_hist, ref_state = reference
    dev = {"loss": 0.0, "grad_norm": 0.0, "param": 0.0, "loose": 0.0}
    for g, want in zip(got["history"], ref_hist, strict=True):
        assert lora or want["grad_norm"] > 0.5  # the clip binds every step (the adapters' norm is smaller)
        dev["loss"] = max(dev["loss"], _rel(g["loss"], want["loss"]))
        dev["grad_norm"] = max(dev["grad_norm"], _rel(g["grad_norm"], want["grad_norm"]))
    ckpt = tmp / name / "straight" / "checkpoints" / f"step_{STEPS:08d}"
    seen = set()
    for key, value in iter_weights(ckpt):
        want = ref_state[key]
        assert value.shape == want.shape, key
        err = float((value - want).abs().max()) / max(float(want.abs().max()), 1e-12)
        kind = "loose" if loose is not None and re.search(loose[0], key) else "param"
        dev[kind] = max(dev[kind], err)
        seen.add(key)
    assert seen == set(ref_state) - {"eval"}, set(ref_state) ^ seen
    (ev,) = got["eval"]
    ev.pop("eval_time_s")
    if got["resumed"] is not None:  # resumed in the same layout (worker.NO_SAME_LAYOUT_RESUME: not)
        assert got["resumed"] == [h["loss"] for h in got["history"]][3:]
        # Eval at the end: one figure per run, the same after a resume, and one process's on the same rows.
        (ev_resumed,) = got["eval_resumed"]
        ev_resumed.pop("eval_time_s")
        assert ev_resumed == ev
    want = ref_state["eval"]
    assert ev["step"] == STEPS and ev["eval_tokens"] == want["eval_tokens"]
    dev["eval_loss"] = _rel(ev["eval_loss"], want["eval_loss"])
    if want["eval_mtp_loss"] is not None or ev["eval_mtp_loss"] is not None:  # without MTP: None in both
        dev["eval_mtp_acc"] = _rel(ev["eval_mtp_acc"], want["eval_mtp_acc"])
        dev["eval_mtp_loss"] = _rel(ev["eval_mtp_loss"][0], want["eval_mtp_loss"][0])
    # Weights after 5 Adam steps get 2e-5: Adam turns the rounding of a near-zero gradient element into a
    # step of up to lr (seen: one element of kv_a_proj_with_mqa at 1.02e-5 in TP2 and ZeRO-3); the loss and
    # the grad norm, which every element feeds, are held to 1e-5.
    # Adapters: an idle expert's tiny gradient, amplified the same way, up to 2.6e-5 (test_finetune.py).
    bounds = {"param": 1e-4 if lora else param, "loose": loose[1] if loose else 0.0, "grad_norm": norm}
    for k, v in dev.items():
        assert v <= bounds.get(k, 1e-5), (name, k, v)
    return dev


@pytest.mark.parametrize("name", TWO)
def test_two_rank_layouts_match_one_process(two_rank, reference, name):
    tmp, res = two_rank
    dev = _check(tmp, name, res[name], reference)
    print(name, dev, f"step {sorted(h['step_time_s'] for h in res[name]['history'])[2]:.3f}s")


@pytest.mark.parametrize("name", TWO_LORA)
def test_lora_layouts_match_one_process(two_rank, lora_reference, name):
    tmp, res = two_rank
    print(name, _check(tmp, name, res[name], lora_reference, lora=True))


@pytest.mark.parametrize("name", TWO_MUON)
def test_muon_layouts_match_one_process(two_rank, muon_reference, name):
    """Muon in every layout it supports, 8 steps with clipping binding, against a plain single-process Muon
    written from the paper's rule: each matrix's slices gathered over its data-parallel (or expert-data-
    parallel) ranks, orthogonalised whole, per expert and per gate/up half; the pipeline's stages apart."""
    tmp, res = two_rank
    lora = name.endswith("_lora")
    print(name, _check(tmp, name, res[name], muon_reference["lora" if lora else "full"], lora=lora))


@pytest.mark.parametrize(
    ("muon", "adamw"), [("muon_z1", "dp2_z1"), ("muon_z3", "dp2_z3"), ("muon_ep2", "ep2_z2")]
)
def test_muon_state_bytes_are_the_estimate(two_rank, muon, adamw):
    """What the optimizer keeps per rank (fp32 master and state tensors, measured on rank 0) is `dstrain plan`'s
    estimate to the byte, for Muon (one momentum buffer per hidden matrix) and AdamW (two moments)."""
    from dstrain.config.plan import prepare
    from dstrain.memory.estimate import STATES, Workload, estimate
    from tests.parallel.worker import LAYOUTS

    _, res = two_rank
    for name in (muon, adamw):
        plan = prepare(make_options(f"{LAYOUTS[name]} {common(2)}".split()), 2, model=tiny_config())
        assert res[name]["state_bytes"] == estimate(Workload.of(plan)).terms[STATES], name
    print(muon, res[muon]["state_bytes"], adamw, res[adamw]["state_bytes"])
    assert res[muon]["state_bytes"] < 0.8 * res[adamw]["state_bytes"]


@pytest.fixture(scope="module")
def bf16_two_rank(tmp_path_factory, rank_pools):
    tmp = tmp_path_factory.mktemp("bf16")
    return tmp, _layouts(rank_pools, tmp, 2)


@pytest.mark.parametrize("name", BF16)
def test_bf16_layouts_with_overlapped_reductions(bf16_two_rank, reference, name):
    """The GPU configuration on gloo (gpu_readiness #16, N14): bf16 weights and activations, ZeRO's reductions
    overlapped with backward: 8 steps' losses and global grad norms within bf16's rounding of data parallel's
    and of one fp32 process. Each layout rounds its own partial sums to bf16 (unit roundoff u = 2^-8) where data
    parallel rounds whole ones: the two differ by at most one rounding each, 2u = bf16's eps (1e-3 seen here),
    where a stage's or a double-counted norm would be off by tens of %. Against fp32, every logit and gradient
    carries bf16's rounding: within 4 eps of the fp32 run. (Until this test's layouts gave --precision after the
    common flags, its runs were fp32.)"""
    _, res = bf16_two_rank
    got, dp = res[name]["history"], res["dp2_bf16"]["history"]
    eps = torch.finfo(torch.bfloat16).eps
    assert got[0]["grad_norm"] != reference[0][0]["grad_norm"]  # bf16 arithmetic, not fp32's
    assert _rel(got[0]["grad_norm"], reference[0][0]["grad_norm"]) <= 4 * eps
    for g, d, w in zip(got, dp, reference[0], strict=True):
        assert _rel(g["loss"], d["loss"]) <= eps and _rel(g["grad_norm"], d["grad_norm"]) <= eps, (name, g, d)
        assert _rel(g["loss"], w["loss"]) <= 4 * eps, (name, g, w)


def test_muon_in_bf16_with_overlapped_reductions(bf16_two_rank, muon_reference):
    """Muon steps the fp32 master slices of a bf16 run like an fp32 one's: within bf16's error of one fp32
    process's Muon (7.2e-5 loss, 1.5e-3 grad norm seen), clipping binding. AdamW in the same layout is 5.6e-4 /
    1.1e-2 off that reference: these bounds tell the two optimizers apart."""
    _, res = bf16_two_rank
    for got, want in zip(res["muon_ep2_bf16"]["history"], muon_reference["full"][0], strict=True):
        assert _rel(got["loss"], want["loss"]) <= 2e-4, (got, want)
        assert _rel(got["grad_norm"], want["grad_norm"]) <= 5e-3, (got, want)


@pytest.mark.parametrize("name", TWO_DSA)
def test_sparse_attention_layouts_match_one_process(dsa_two_rank, dsa_reference, name):
    """Sequence parallel gathers the indexers' inputs to whole rows, tensor parallel sums the KL's target over
    the ranks' heads, the pipeline carries GLM-5's selection to the stage whose first layer shares it."""
    _check_sparse(dsa_two_rank, dsa_reference[name.startswith("glm_")], name)


@pytest.mark.parametrize("name", ["dsa_dense_tp2", "dsa_dense_sp2"])
def test_dense_stage_layouts_match_one_process(dsa_two_rank, dsa_reference, name):
    """The dense warm-up: attention over every key while the indexers learn the KL over every key, its target
    summed over the heads that other ranks hold (tensor parallel) or that the ranks' rows were exchanged for
    (sequence parallel)."""
    # The norm is the indexers' gradient alone, the KL's (p - q of close distributions) through ReLU(q . k): a
    # score at 0 that rounds to the other side in one layout flips an element's slope, and Adam turns that into
    # a step of up to lr (seen in TP2: the norm 3.5e-5 off at step 6, 4e-7 at steps 1-5; the indexers' weights
    # 4.8e-4 at the end; the loss within 1.3e-7, the KL 6.9e-7).
    _check_sparse(dsa_two_rank, dsa_reference["dense"], name, norm=1e-4, loose=(r"\.indexer\.", 1e-3))


def _check_sparse(dsa_two_rank, reference, name: str, norm: float = 1e-5, loose=None) -> None:  # noqa: ANN001
    """Layout `name` against the one-process `reference`, its indexers' KL within 1e-5 (`norm`, `loose`: as
    `_check` takes them)."""
    tmp, res = dsa_two_rank
    # The embedding row of a token seen twice in the 1024 (steps 2 and 7) gets Adam steps from near-zero
    # second moments: up to 3.1e-5 (EP2), loss and grad norm within 2e-7 meanwhile.
    dev = _check(tmp, name, res[name], reference, param=5e-5, norm=norm, loose=loose)
    for got, want in zip(res[name]["history"], reference[0], strict=True):
        dev["indexer_loss"] = max(
            dev.get("indexer_loss", 0.0), _rel(got["indexer_loss"], want["indexer_loss"])
        )
    assert dev["indexer_loss"] <= 1e-5, dev
    print(name, dev)


@pytest.mark.parametrize("name", TWO_V4)
def test_v4_layouts_match_one_process(dsa_two_rank, dsa_reference, name):
    """DeepSeek-V4 (mHC streams, every attention kind on packed rows, a hash layer, MTP, the CSA indexer's KL
    in the sparse stage) in data parallelism with ZeRO-3, in expert parallelism, on 2 pipeline stages
    (the streams and the token ids cross them) and sequence parallel (each rank's queries against the whole
    rows' keys and compressed entries, gathered): 8 steps with the
    clip binding equal one process's, the hash table included among the final weights, unchanged."""
    tmp, res = dsa_two_rank
    reference = dsa_reference["v4"]
    # The mHC biases start at 0 and take 8 Adam steps of ~lr; their gradients sum many small terms of both
    # signs (fp32 rounds them to ~3e-5 relative, transformers' own as ours: test_v4_parity.py), which Adam's
    # normalisation turns into steps that differ by up to 6.3e-4 of the biases' size (loss and grad norm
    # within 1e-7 meanwhile).
    dev = _check(tmp, name, res[name], reference, param=5e-5, loose=(r"(\.base|hc_base)$", 2e-3))
    for got, want in zip(res[name]["history"], reference[0], strict=True):
        dev["indexer_loss"] = max(
            dev.get("indexer_loss", 0.0), _rel(got["indexer_loss"], want["indexer_loss"])
        )
    assert dev["indexer_loss"] <= 1e-5, dev
    print(name, dev)


def test_v4_lora_under_tensor_parallelism_matches_one_process(dsa_two_rank):
    """DeepSeek-V4's LoRA on TP2: the heads' query adapters split with their rows, the grouped output
    projection's (used as a weight: its whole A's gradient summed over the ranks) with its groups, the shared
    key=value head's whole, the CSA indexer's trained by its KL (the target summing both ranks' heads), every
    routed expert's replicated: 8 steps equal one process's."""
    tmp, res = dsa_two_rank
    reference = _lora_reference(DSA, tiny_v4_config(), V4_LORA)
    print("v4_tp2_lora", _check(tmp, "v4_tp2_lora", res["v4_tp2_lora"], reference, lora=True))


@pytest.fixture(scope="module")
def glm5n_reference():
    from tests.helpers.tiny import tiny_glm5_next_config

    state: dict = {}
    opts = make_options([*common(1).split(), *DSA.split()])
    return reference_run(
        tiny_glm5_next_config(), opts, steps=STEPS, global_batch=GLOBAL_ROWS, state=state
    ), state


@pytest.mark.parametrize("name", TWO_GLM5N)
def test_glm5_next_layouts_match_one_process(dsa_two_rank, glm5n_reference, name):
    """GLM-5.3-Flash (KDA with the bounded gate, NoPE DSA over k-pools in its sparse stage with a shared layer,
    mHC streams, clamped MoE with the expert bias, MTP): 8 steps with the clip binding equal one process's.
    Tensors that start at 0 (the mHC biases, the k-pools' position bias, the indexers' key-norm bias) take
    Adam steps of ~lr from gradients summing terms of both signs, where fp32's summation order shows (as V4's
    mHC biases: test_v4_layouts_match_one_process); the MTP block's indexer, trained by its KL alone, up to
    6.2e-5 of its size, the embedding row of a token seen twice (Adam from near-zero second moments, as in
    V3's layouts) 1.0e-4 under TP2: loss and grad norm within 1e-5 meanwhile."""
    tmp, res = dsa_two_rank
    loose = (r"(\.base|_ape|norm\.bias)$", 2e-3)
    dev = _check(tmp, name, res[name], glm5n_reference, param=2e-4, loose=loose)
    # The indexers' KL starts near 0 here (1.2e-5): held relative to 1e-3 where smaller (its fp32 rounding is
    # absolute, ~eps32 x its terms of order 1)
    for got, want in zip(res[name]["history"], glm5n_reference[0], strict=True):
        err = abs(got["indexer_loss"] - want["indexer_loss"]) / max(abs(want["indexer_loss"]), 1e-3)
        dev["indexer_loss"] = max(dev.get("indexer_loss", 0.0), err)
    assert dev["indexer_loss"] <= 1e-5, dev
    print(name, dev)


@pytest.fixture(scope="module")
def kimi_reference():
    from tests.helpers.tiny import tiny_kimi_linear_config

    state: dict = {}
    opts = make_options(common(1).split())
    return reference_run(
        tiny_kimi_linear_config(), opts, steps=STEPS, global_batch=GLOBAL_ROWS, state=state
    ), state


@pytest.mark.parametrize("name", TWO_KIMI)
def test_kimi_linear_layouts_match_one_process(dsa_two_rank, kimi_reference, name):
    """Kimi Linear (KDA layers' short convs, gates and delta-rule state, NoPE MLA, V3's MoE with the expert
    bias) with its routed experts over 2 ranks: 8 steps with the clip binding equal one process's, resumed
    exactly in the same layout."""
    tmp, res = dsa_two_rank
    print(name, _check(tmp, name, res[name], kimi_reference))


def test_kimi_linear_lora_under_tensor_parallelism_matches_one_process(dsa_two_rank):
    """Kimi Linear's LoRA on TP2: KDA's split projections' adapters (q/k/v, the gates' second projections, beta)
    with their heads, the gates' replicated first projections' whole, MLA's as V3's: 8 steps equal one process's."""
    from tests.helpers.tiny import tiny_kimi_linear_config

    tmp, res = dsa_two_rank
    reference = _lora_reference("", tiny_kimi_linear_config(), KIMI_LORA)
    print("kimi_tp2_lora", _check(tmp, "kimi_tp2_lora", res["kimi_tp2_lora"], reference, lora=True))


def test_v4_hash_table_never_trains(dsa_reference):
    """The reference's hash layer still routes by the table it started with after 8 steps."""
    from dstrain.model import build_model

    fresh = build_model(tiny_v4_config(), seed=make_options(common(1).split()).run.seed)
    table = "layers.0.mlp.gate.tid2eid"
    assert torch.equal(dsa_reference["v4"][1][table], fresh.state_dict()[table])


@pytest.mark.parametrize("name", FOUR)
def test_four_rank_layouts_match_one_process(four_rank, reference, name):
    tmp, res = four_rank
    dev = _check(tmp, name, res[name], reference)
    assert all(math.isfinite(h["loss"]) for h in res[name]["history"])
    print(name, dev)


@pytest.mark.parametrize("name", ["pp2", "tp2", "dp2_z1", "sp2_z1"])
def test_tokens_per_s_and_mfu_count_each_token_once(two_rank, name):
    """tokens/s is the global batch's tokens over the step time, whatever the layout (PP and TP ranks work on
    the same tokens: counting them per rank overstated tokens/s and MFU by pp x tp); MFU divides the step's
    FLOPs by the peak of all devices (--peak_tflops 1 per rank here)."""
    from dstrain.model import flops_per_token
    from tests.helpers.trainer import SEQ

    world, peak = 2, 1e12
    for h in two_rank[1][name]["history"]:
        by_hand = GLOBAL_ROWS * SEQ / h["step_time_s"]
        assert h["tokens_per_s"] == pytest.approx(by_hand, rel=1e-9)
        assert h["mfu"] == pytest.approx(
            by_hand * flops_per_token(tiny_config(), SEQ) / (world * peak), rel=1e-9
        )


@pytest.mark.parametrize("name", ["pp2", "tp2", "ep2_z1", "pp2tp2"])
def test_no_rank_builds_the_whole_fresh_model(two_rank, four_rank, name):
    """A fresh model in a model-parallel layout is built on meta and each rank draws its own part of one
    process's values (which the parity tests compare): a pipeline stage or an expert-parallel rank draws
    exactly what it keeps; a tensor-parallel rank draws whole only a tensor it slices, one at a time."""
    from dstrain.model.deepseek_v3.model import DeepSeekLM
    from dstrain.model.sources import local_tensors

    with torch.device("meta"):
        whole = sum(t.numel() * 4 for _, t in local_tensors(DeepSeekLM(tiny_config())))
    fresh = (four_rank if name in FOUR else two_rank)[1][name]["fresh"]
    assert fresh["held"] < whole
    if "tp" in name:
        assert fresh["drawn"] < whole, (fresh, whole)
    else:
        assert fresh["drawn"] <= fresh["held"], (fresh, whole)


@pytest.mark.parametrize("name", ["dp2_z1", "dp2_z3", "ep2_z2"])
def test_saves_spread_over_the_data_parallel_ranks(two_rank, name):
    """weights/ and the moments (3 x the fp32 model) are written by both ranks of a data-parallel group, about
    half each (by bytes, whole tensors), not by rank 0 alone."""
    two_rank[1][name]  # noqa: B018 - the run (in the pool, the first time)
    ckpt = two_rank[0] / name / "straight" / "checkpoints" / f"step_{STEPS:08d}"
    for folder in ("weights", "optimizer/exp_avg", "optimizer/exp_avg_sq"):
        written = [
            sum(f.stat().st_size for f in (ckpt / folder).glob(f"rank{r:05d}-*.safetensors")) for r in (0, 1)
        ]
        assert min(written) > 0.3 * sum(written), (folder, written)


@pytest.mark.parametrize("name", ["pp2", "tp2", "ep2_z2", "dp2_z3"])
def test_export_from_each_layout_loads_in_transformers(two_rank, tmp_path, name, capsys):
    """`dstrain export --verify` on the final checkpoint of a parallel run: the HF folder transformers loads
    gives the logits of dstrain's model built from the checkpoint."""
    from dstrain.cli import main as dstrain_main

    tmp, res = two_rank
    res[name]  # noqa: B018 - the run (in the pool, the first time)
    ckpt = tmp / name / "straight" / "checkpoints" / f"step_{STEPS:08d}"
    assert (
        dstrain_main(["export", str(ckpt), "--out", str(tmp_path / "hf"), "--dtype", "float32", "--verify"])
        == 0
    )
    found = re.search(r"max \|logits diff\| (\S+) ", capsys.readouterr().out)
    assert found and float(found.group(1)) <= 1e-5, found


class _Resumed:
    """`[TARGET@SOURCE]`: the SOURCE layout's step-3 checkpoint (run first if it has not) continued in layout
    TARGET on the ranks `ranks` gives it (worker.reshard_run); `data_*` runs: real data, 2 ranks' run first."""

    def __init__(self, pools, sources, tmp, ranks: dict[str, int]) -> None:  # noqa: ANN001
        self.sources, self.ranks = sources, ranks
        self.runs = {
            n: ScenarioResults(
                pools, n, "tests.parallel.worker:reshard_run", str(tmp), str(sources[0]), timeout=600
            )
            for n in set(ranks.values())
        }

    def __getitem__(self, run: str):  # noqa: ANN204
        source = run.partition("@")[2]
        if source.startswith("data_"):
            self[source]  # noqa: B018 - its checkpoint first
        elif source:
            self.sources[1][source]  # noqa: B018
        return self.runs[self.ranks[run]][run]


@pytest.fixture(scope="module")
def resharded(two_rank, tmp_path_factory, rank_pools):
    """The 2-rank layouts' step-3 checkpoints continued on 1, 2 and 4 ranks in other layouts, and the
    real-data runs (the 1-rank one continues the 2-rank one)."""
    ranks = {f"{t}@{s}": n for n, pairs in RESHARD.items() for t, s in pairs}
    ranks.update({run: n for n, runs in DATA.items() for run in runs})
    return _Resumed(rank_pools, two_rank, tmp_path_factory.mktemp("reshard"), ranks)


@pytest.mark.parametrize("run", [f"{t}@{s}" for n in (1, 2, 4) for t, s in RESHARD[n]])
def test_resume_on_another_layout(two_rank, resharded, reference, lora_reference, muon_reference, run):
    """A checkpoint of one layout continues on another (world size, ZeRO stage, PP/TP/EP degree; LoRA
    adapters, per-expert ones included, and their moments): the 5 resumed steps' losses and grad norms are
    the uninterrupted run's (the source layout's own, and one process's) within 1e-5."""
    source = run.split("@")[1]
    got = resharded[run]
    one = (muon_reference["full"] if "muon" in run else lora_reference if "lora" in run else reference)[0][3:]
    assert [h["step"] for h in got] == list(range(4, STEPS + 1))
    dev = {}
    for label, want in (("source", two_rank[1][source]["history"][3:]), ("one process", one)):
        for key in ("loss", "grad_norm"):
            dev[f"{label} {key}"] = max(_rel(g[key], w[key]) for g, w in zip(got, want, strict=True))
    print(run, {k: f"{v:.1e}" for k, v in dev.items()})
    assert max(dev.values()) <= 1e-5, dev


def test_real_data_rows_do_not_depend_on_rank_count(resharded):
    """Through the data package's loader: 1 rank with GA 4 logs 2 ranks' (GA 2) losses from the start, and
    continues the 2-rank run's step-3 checkpoint (data position re-sharded) with its losses."""
    one, two, cont = resharded["data_dp1"], resharded["data_dp2"], resharded["data_dp1@data_dp2"]
    dev_start = max(_rel(a["loss"], b["loss"]) for a, b in zip(one, two, strict=True))
    dev_resume = max(_rel(a["loss"], b["loss"]) for a, b in zip(cont, two[3:], strict=True))
    print(f"1 rank GA4 vs 2 ranks GA2 {dev_start:.1e}; 2 -> 1 rank resume {dev_resume:.1e}")
    assert len(one) == 6 and [h["step"] for h in cont] == [4, 5, 6]
    assert dev_start <= 1e-5 and dev_resume <= 1e-5


@pytest.fixture(scope="module")
def dsa_resharded(dsa_two_rank, tmp_path_factory, rank_pools):
    ranks = {f"{t}@{s}": n for n, pairs in RESHARD_DSA.items() for t, s in pairs}
    return _Resumed(rank_pools, dsa_two_rank, tmp_path_factory.mktemp("dsa_reshard"), ranks)


@pytest.mark.parametrize("run", [f"{t}@{s}" for pairs in RESHARD_DSA.values() for t, s in pairs])
def test_sparse_attention_resumes_on_another_layout(dsa_two_rank, dsa_resharded, dsa_reference, run):
    """The indexers' weights and moments re-shard like the rest: the resumed steps equal the uninterrupted."""
    got, want = dsa_resharded[run], dsa_reference["v4" if run.startswith("v4_") else False][0][3:]
    assert [h["step"] for h in got] == list(range(4, STEPS + 1))
    dev = max(_rel(g[k], w[k]) for g, w in zip(got, want, strict=True) for k in ("loss", "grad_norm"))
    assert dev <= 1e-5, (run, dev)
