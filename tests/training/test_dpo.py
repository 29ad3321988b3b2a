"""--objective dpo: sequence log-probabilities against transformers', the loss and its gradients against TRL's
DPOTrainer on the same log-probabilities, the adapters-off reference against an explicit copy, the precomputed
reference (keys, table, against the live one, full fine-tunes in layouts and resumed), the options' refusals,
and DPO runs in the pool of ranks (one process, ZeRO-2/3 on 2 ranks, the layouts; DeepSeek-V4's) and their eval
figures."""

from __future__ import annotations

import copy
import json
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from dstrain.batch import document_index, target_mask
from dstrain.errors import ConfigError, DataError
from dstrain.model import build_model, from_pretrained
from dstrain.model.common.lora import adapters_disabled, apply_lora
from dstrain.training.dpo import METRICS, pair_losses, sequence_logps
from dstrain.training.reference import Table, document_keys
from tests.helpers.hf import make_hf_model, v3_config
from tests.helpers.pairs import pair_eval_rows, pair_row
from tests.helpers.tiny import tiny_config, tiny_v4_config
from tests.helpers.trainer import make_options, stack

TARGETS = ["q_b_proj", "kv_b_proj", "o_proj", "shared_experts", "experts"]


def doc_logps(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """(each document's log-probability, its target count, the per-position losses) as the DPO step sums them."""
    out = model(**batch, token_losses=True)
    docs = document_index(batch["labels"], batch["position_ids"])
    n = out.lm_token_loss.shape[1]
    valid = target_mask(batch["labels"], batch["position_ids"], 1)[:, :n]
    logps, counts = sequence_logps(out.lm_token_loss, docs[:, 1 : 1 + n], valid, int(docs.max()) + 1)
    return logps, counts, out.lm_token_loss


def test_sequence_logps_match_transformers(tmp_path):
    hf = make_hf_model(v3_config())
    hf.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path, dtype=torch.float32).eval()
    batch = stack([pair_row(0), pair_row(1)])
    batch["input_ids"] = batch["input_ids"] % hf.config.vocab_size
    batch["labels"] = torch.where(batch["labels"] >= 0, batch["input_ids"], -100)
    with torch.no_grad():
        got, counts, _ = doc_logps(ours, batch)
        expected = []
        for row in range(2):  # each document alone through transformers
            starts = (batch["position_ids"][row] == 0).nonzero().flatten().tolist() + [
                batch["labels"].shape[1]
            ]
            for a, b in zip(starts[:-1], starts[1:]):
                ids, labels = batch["input_ids"][row, a:b], batch["labels"][row, a:b]
                logp = torch.log_softmax(hf(input_ids=ids[None], use_cache=False).logits[0, :-1].float(), -1)
                picked = logp.gather(1, ids[1:, None]).squeeze(1)
                expected.append(picked[labels[1:] != -100].sum())
    assert counts.tolist() == [4.0] * 8
    assert (got - torch.stack(expected)).abs().max().item() <= 1e-5


def lora_model(seed: int = 0):  # noqa: ANN201
    """The tiny model with adapters whose B is random: policy and reference differ."""
    model = build_model(tiny_config(), seed=seed)
    apply_lora(model, 4, 8.0, TARGETS, seed=seed)
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.05)
    return model


def trl_loss(token_loss, docs, valid, ref, beta: float, loss_type: str):  # noqa: ANN001, ANN201
    """TRL's DPOTrainer._compute_loss (trl 1.16) on the same per-token log-probabilities, laid out as TRL's
    batch is: one sequence per row, chosen rows then rejected rows, completion_mask on the inputs."""
    from trl import DPOTrainer

    n_docs = int(docs.max()) + 1
    keep = valid & (docs >= 0)
    doc_of = docs[keep]
    slot = torch.zeros_like(doc_of)
    for d in range(n_docs):  # each target's column in its sequence's row
        where = (doc_of == d).nonzero().flatten()
        slot[where] = torch.arange(where.numel())
    order = torch.cat([torch.arange(0, n_docs, 2), torch.arange(1, n_docs, 2)])
    row_of = torch.empty(n_docs, dtype=torch.long)
    row_of[order] = torch.arange(n_docs)
    width = int(slot.max()) + 1
    log_probs = torch.zeros(n_docs, width).index_put((row_of[doc_of], slot), -token_loss[keep])
    completion = torch.zeros(n_docs, width + 1, dtype=torch.long)
    completion[row_of[doc_of], slot + 1] = 1
    outputs = SimpleNamespace(
        log_probs=log_probs,
        entropy=torch.zeros(n_docs, width),
        mean_logits=torch.zeros(n_docs, width),
        is_top1=torch.zeros(n_docs, width, dtype=torch.bool),
        aux_loss=None,
    )
    model = SimpleNamespace(training=True)
    fake = SimpleNamespace(
        model=model,
        accelerator=SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x, gather=lambda x: x),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros(n_docs, width + 1, dtype=torch.long),
        "attention_mask": torch.ones(n_docs, width + 1, dtype=torch.long),
        "completion_mask": completion,
        "ref_chosen_logps": ref[0::2],
        "ref_rejected_logps": ref[1::2],
    }
    loss = DPOTrainer._compute_loss(fake, lambda **kw: outputs, inputs, False)
    return loss, {k: v[0] for k, v in fake._metrics["train"].items()}


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_loss_and_gradients_match_trl(loss_type):
    model = lora_model()
    batch = stack([pair_row(2), pair_row(3)])
    with torch.no_grad(), adapters_disabled(model):
        ref, _, _ = doc_logps(model, batch)
    # the MTP modules' adapters: frozen under DPO, and outside the main head's losses
    params = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("mtp.")]
    policy, counts, token_loss = doc_logps(model, batch)
    losses, figures = pair_losses(policy, ref, counts, 0.1, loss_type)
    ours = losses.mean()
    g_ours = torch.autograd.grad(ours, params, retain_graph=True)
    docs = document_index(batch["labels"], batch["position_ids"])[:, 1:]
    valid = target_mask(batch["labels"], batch["position_ids"], 1)[:, : docs.shape[1]]
    theirs, metrics = trl_loss(token_loss, docs, valid, ref, 0.1, loss_type)
    g_theirs = torch.autograd.grad(theirs, params)
    assert abs(ours.item() - theirs.item()) <= 1e-6 and ours.item() > 0
    assert max((a - b).abs().max().item() for a, b in zip(g_ours, g_theirs)) <= 1e-6
    assert max(g.abs().max().item() for g in g_ours) > 1e-4  # the comparison is not of zeros
    for key in METRICS:  # TRL's names, TRL's values
        assert abs(figures[key].mean().item() - metrics[key]) <= 1e-6, key


def test_lora_reference_equals_an_explicit_copy():
    base = build_model(tiny_config(), seed=0)
    reference = copy.deepcopy(base)
    apply_lora(base, 4, 8.0, TARGETS, seed=0)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in base.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0, 0.05)
    batch = stack([pair_row(4), pair_row(5)])
    with torch.no_grad():
        policy, _, _ = doc_logps(base, batch)
        with adapters_disabled(base):
            off, _, _ = doc_logps(base, batch)
        again, _, _ = doc_logps(base, batch)
        expected, _, _ = doc_logps(reference, batch)
    assert torch.equal(off, expected)  # the adapters add exactly nothing
    assert torch.equal(again, policy) and (policy - off).abs().max() > 1e-3  # and come back


def test_dpo_options_and_refusals():
    from dstrain.config.plan import prepare

    opts = make_options(["--objective", "dpo", "--lora_r", "4"])
    plan = prepare(opts, 1, model=tiny_config())
    # the MoE defaults under DPO: routers frozen (LoRA's), no bias update, no balance loss, no MTP loss
    assert (plan.opts.lora.train_router, plan.opts.lora.train_mtp) == (False, False)
    cfg = plan.model
    assert (cfg.bias_update_speed, cfg.aux_loss_alpha, cfg.mtp_loss_weight) == (0.0, 0.0, 0.0)
    switched = make_options(
        ["--objective", "dpo", "--lora_r", "4", "--mtp_loss_weight", "0.3", "--train_router"]
    )
    assert prepare(switched, 1, model=tiny_config()).model.mtp_loss_weight == 0.3
    assert (opts.objective.dpo_beta, opts.objective.dpo_loss) == (0.1, "sigmoid")
    assert plan.opts.objective.dpo_reference == "adapters"  # auto: under LoRA the adapters-off model
    full = prepare(make_options(["--objective", "dpo"]), 1, model=tiny_config())
    assert full.opts.objective.dpo_reference == "precomputed"
    assert (full.opts.lora.train_router, full.opts.lora.train_mtp) == (False, False)  # as under LoRA
    v4 = prepare(opts, 1, model=tiny_v4_config())  # DeepSeek-V4 alike, its own default LoRA targets
    assert v4.opts.objective.dpo_reference == "adapters" and "kv_proj" in v4.opts.lora.targets
    assert (v4.model.bias_update_speed, v4.model.aux_loss_alpha, v4.model.mtp_loss_weight) == (0.0, 0.0, 0.0)
    refusals = {
        "--dpo_reference adapters needs --lora_r > 0": (
            ["--objective", "dpo", "--dpo_reference", "adapters"],
            1,
            tiny_config(),
        ),
    }
    for message, (flags, world, cfg) in refusals.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            prepare(make_options(flags), world, model=cfg)
    with pytest.raises(ConfigError, match="--dpo_beta 0.0: must be > 0"):
        make_options(["--dpo_beta", "0"])
    with pytest.raises(ConfigError, match="--dpo_loss: invalid choice: 'simpo'"):
        make_options(["--dpo_loss", "simpo"])


@pytest.mark.multirank
def test_dpo_one_process_starts_at_log2_and_learns(tmp_path, rank_pools):
    # 8 steps over 8 rows (16 pairs), 2 epochs of 4 steps: the adapters learn these pairs' preference
    flags = "--config zero1 --max_steps 8 --micro_batch_size 2"
    res = rank_pools.run(1, "tests.training.worker:dpo_run", str(tmp_path), "one", flags, 8)[0]
    first, last = res[0], res[-1]
    # the adapters start at B = 0: policy == reference, every reward 0, the loss log 2
    assert abs(first["loss"] - math.log(2)) <= 1e-6 and first["rewards/margins"] == 0.0
    assert first["pairs"] == 4 and first["rewards/accuracies"] == 0.0
    second_epoch = res[4:]  # the same pairs again: every one ranked right, by a clear margin
    assert all(r["rewards/accuracies"] == 1.0 and r["rewards/margins"] > 0.02 for r in second_epoch)
    assert all(r["loss"] < math.log(2) - 0.01 for r in second_epoch)
    rows = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert all(k in rows[-1] for k in METRICS) and rows[-1]["rewards/margins"] == last["rewards/margins"]


DPO_STEP = "--max_steps 3 --micro_batch_size 2"  # 4 rows (8 pairs) a step, as one process with GA 2


def dpo_one_process(rank_pools, tmp_path) -> list[dict]:  # noqa: ANN001
    """One process, micro batch 2 x GA 2: the reference of the 2-rank DPO runs (once per session)."""
    flags = f"--config zero1 {DPO_STEP} --gradient_accumulation_steps 2"
    return rank_pools.cached("dpo_one_ga2", 1, "tests.training.worker:dpo_run", str(tmp_path), "one", flags)[
        0
    ]


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [2, 3])
def test_dpo_zero_two_ranks_match_one_process(tmp_path, rank_pools, stage):
    one = dpo_one_process(rank_pools, tmp_path)
    two = rank_pools.run(
        2, "tests.training.worker:dpo_run", str(tmp_path), "two", f"--config zero{stage} {DPO_STEP}"
    )
    for a, b in zip(one, two[0], strict=True):
        for key in ("loss", "rewards/margins", "logps/chosen", "grad_norm"):
            assert abs(a[key] - b[key]) <= 2e-5 * max(1.0, abs(a[key])), (key, a[key], b[key])


# 2 ranks; sequence and tensor parallel ranks share their rows, so they take the step's 4 rows in 2 micro batches
DPO_LAYOUTS = {
    "ep2": "--config zero1 --ep 2",  # the routed experts (and their adapters) split over the ranks
    "sp2": "--config zero1 --sp 2 --gradient_accumulation_steps 2",  # each rank half of every pair's tokens
    "tp2": "--config zero1 --tp 2 --gradient_accumulation_steps 2",  # heads and MLP columns split
    "pp2": "--config zero1 --pp 2 --gradient_accumulation_steps 2",  # the loss on the last stage
}


@pytest.mark.multirank
@pytest.mark.parallel
@pytest.mark.parametrize("layout", list(DPO_LAYOUTS))
def test_dpo_layouts_match_one_process(tmp_path, rank_pools, layout):
    """A DPO step in each layout against one process, 3 steps: the loss and the grad norm within the layout
    tests' bound (1e-5 relative; seen: 4e-8 and 1.4e-7), the policy's sequence log-probabilities within 1e-6
    (seen: equal), the rewards, which hold the adapters-off reference's, within 1e-6 (seen: 5e-8)."""
    one = dpo_one_process(rank_pools, tmp_path)
    flags = f"{DPO_LAYOUTS[layout]} {DPO_STEP}"
    ranks = rank_pools.run(2, "tests.training.worker:dpo_run", str(tmp_path), layout, flags)
    assert ranks[0][-1]["rewards/margins"] > 2e-3  # the adapters moved: the reference differs from the policy
    for got in ranks:  # every rank reports the step's figures over the whole batch
        for a, b in zip(one, got, strict=True):
            assert b["pairs"] == a["pairs"] == 8 and b["rewards/accuracies"] == a["rewards/accuracies"]
            bounds = {"loss": 1e-5, "grad_norm": 1e-5, "logps/chosen": 1e-6, "logps/rejected": 1e-6}
            for key, bound in bounds.items():
                assert abs(a[key] - b[key]) <= bound * abs(a[key]), (layout, key, a[key], b[key])
            for key in METRICS[:3]:
                assert abs(a[key] - b[key]) <= 1e-6, (layout, key, a[key], b[key])


DPO_EVAL_ONE = f"--config zero1 {DPO_STEP} --gradient_accumulation_steps 2"  # as dpo_one_process, evaluating


def dpo_eval_one_process(rank_pools, tmp_path) -> dict:  # noqa: ANN001
    """One process trained as dpo_one_process, then evaluated on pair_eval_rows (once per session)."""
    worker = "tests.training.worker:dpo_eval_run"
    return rank_pools.cached("dpo_eval_one", 1, worker, str(tmp_path), "eval_one", DPO_EVAL_ONE)[0]


@pytest.mark.multirank
def test_dpo_eval_figures_match_the_dpo_functions(tmp_path, rank_pools):
    """The eval figures of a trained DPO run (3 micro batches of 2 rows, the last padded) equal dpo.py's
    functions on the whole eval set at once, with the trained weights and their adapters-off reference."""
    res = dpo_eval_one_process(rank_pools, tmp_path)
    got = res["eval"][-1]
    model = build_model(tiny_config(), seed=0)
    apply_lora(model, 8, 16.0, TARGETS, seed=0)
    model.load_state_dict(torch.load(res["weights"]))
    model.eval()
    rows = pair_eval_rows()
    with torch.no_grad():
        with adapters_disabled(model):
            ref, _, _ = doc_logps(model, rows)
        policy, counts, _ = doc_logps(model, rows)
    losses, figures = pair_losses(policy, ref, counts, 0.1, "sigmoid")
    assert got["eval_pairs"] == 10 and abs(got["eval_dpo_loss"] - losses.mean().item()) <= 1e-6
    assert (
        abs(got["eval_rewards/margins"]) > 5e-4
    )  # the adapters moved (seen: -1.1e-3): not a comparison of zeros
    for key in METRICS:  # within 1e-6 (relative for the log-probabilities, ~-22: fp32 summation order)
        want = figures[key].mean().item()
        assert abs(got[f"eval_{key}"] - want) <= 1e-6 * max(1.0, abs(want)), key
    assert got["eval_loss"] > 0  # the NLL of both completions stays beside them


@pytest.mark.multirank
@pytest.mark.parallel
@pytest.mark.parametrize("layout", list(DPO_LAYOUTS))
def test_dpo_eval_layouts_match_one_process(tmp_path, rank_pools, layout):
    """Eval in each layout (EP: the eval rows split over 2 data-parallel ranks; SP: documents numbered on
    whole rows; PP: a reference pass through the pipeline first): the figures of one process, trained alike,
    within the layout tests' bounds (seen: PP equal, SP 4e-8)."""
    one = dpo_eval_one_process(rank_pools, tmp_path)["eval"][-1]
    flags = f"{DPO_LAYOUTS[layout]} {DPO_STEP}"
    ranks = rank_pools.run(2, "tests.training.worker:dpo_eval_run", str(tmp_path), f"eval_{layout}", flags)
    for res in ranks:  # every rank reports the figures over the whole eval set
        got = res["eval"][-1]
        assert got["eval_pairs"] == one["eval_pairs"] == 10
        assert got["eval_rewards/accuracies"] == one["eval_rewards/accuracies"]
        for key in ("eval_dpo_loss", "eval_logps/chosen", "eval_logps/rejected", "eval_loss"):
            assert abs(got[key] - one[key]) <= 1e-5 * abs(one[key]), (layout, key, got[key], one[key])
        for key in METRICS[:3]:
            assert abs(got[f"eval_{key}"] - one[f"eval_{key}"]) <= 1e-6, (layout, key)


def test_a_completion_keeps_its_key_wherever_it_is_packed(tmp_path):
    """The precomputed reference finds a completion by its content: the same document in another row, at
    another place, beside other documents, has the same key; other tokens or other targets another key."""
    a, b = pair_row(0), pair_row(1)
    keys = document_keys(stack([a, b]))
    assert len(keys) == 8 and len(set(keys)) == 8  # 2 rows of 2 pairs
    # row b's documents first, then row a's, all in one row of 64 tokens
    swapped = {k: torch.cat([b[k], a[k]])[None] for k in a}
    assert document_keys(swapped) == keys[4:] + keys[:4]
    moved = {k: v.clone()[None] for k, v in a.items()}
    moved["labels"][0, 7] = -100  # a target fewer in the first document
    assert document_keys(moved)[0] != keys[0] and document_keys(moved)[1:] == keys[1:4]
    table = Table()
    table.add(keys, torch.arange(8, dtype=torch.float64) - 30.5)
    table.save(tmp_path / "ref.safetensors")
    back = Table.load(tmp_path / "ref.safetensors")
    assert back.lookup(keys[::-1], torch.device("cpu")).tolist() == [-23.5 - i for i in range(8)]
    with pytest.raises(DataError, match="a preference pair the DPO reference pass never saw"):
        back.lookup(document_keys(moved)[:1], torch.device("cpu"))


@pytest.mark.multirank
def test_the_precomputed_reference_equals_the_live_one(tmp_path, rank_pools):
    """LoRA DPO with the reference's log-probabilities precomputed by a first pass and looked up by content
    takes the same steps, and evaluates alike, as with the adapters-off forward beside each step (seen: equal)."""
    live = dpo_one_process(rank_pools, tmp_path)
    flags = f"--config zero1 {DPO_STEP} --gradient_accumulation_steps 2 --dpo_reference precomputed"
    table = rank_pools.run(1, "tests.training.worker:dpo_run", str(tmp_path), "table", flags)[0]
    assert (tmp_path / "table" / "dpo_reference.safetensors").is_file()
    assert live[-1]["rewards/margins"] > 2e-3  # the policy moved away from the reference
    for a, b in zip(live, table, strict=True):
        for key in ("loss", "grad_norm", *METRICS):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), (key, a[key], b[key])
    # the eval set's pairs are in the table too: the eval figures are the live reference's
    live_eval = dpo_eval_one_process(rank_pools, tmp_path)["eval"][-1]
    worker = "tests.training.worker:dpo_eval_run"
    got = rank_pools.run(1, worker, str(tmp_path), "table_eval", flags)[0]["eval"][-1]
    for key in ("eval_dpo_loss", *(f"eval_{k}" for k in METRICS)):
        assert abs(got[key] - live_eval[key]) <= 1e-6 * max(1.0, abs(live_eval[key])), key


FULL = f"{DPO_STEP} --save_every 2"


def dpo_full_one_process(rank_pools, tmp_path) -> dict:  # noqa: ANN001
    """Full fine-tune DPO on one process, micro batch 2 x GA 2, 3 steps (once per session)."""
    flags = f"--config zero1 {FULL} --gradient_accumulation_steps 2"
    worker = "tests.training.worker:dpo_full_run"
    return rank_pools.cached("dpo_full_one", 1, worker, str(tmp_path), "full_one", flags)[0]


@pytest.mark.multirank
def test_full_fine_tune_dpo_starts_at_log2_and_its_reference_is_the_initial_model(tmp_path, rank_pools):
    history = dpo_full_one_process(rank_pools, tmp_path)["history"]
    first = history[0]  # the policy is the initial model: every reward 0, the loss log 2
    assert abs(first["loss"] - math.log(2)) <= 1e-6 and first["rewards/margins"] == 0.0
    assert history[-1]["rewards/margins"] > 1e-3 and history[-1]["loss"] < math.log(2)


V4_DPO = "--max_steps 3 --micro_batch_size 2 --gradient_accumulation_steps 2"  # 4 pair rows a step


def dpo_v4_one_process(rank_pools, tmp_path) -> list[dict]:  # noqa: ANN001
    """Full fine-tune DPO on the tiny DeepSeek-V4, one process, the same 4 rows (8 pairs) every step (once
    per session)."""
    args = (str(tmp_path), "v4_one", f"--config zero1 {V4_DPO}", 4)
    return rank_pools.cached("dpo_v4_one", 1, "tests.training.worker:dpo_v4_run", *args)[0]


@pytest.mark.multirank
def test_deepseek_v4_dpo_starts_at_log2_and_learns(tmp_path, rank_pools):
    """Full fine-tune DPO (the precomputed reference) on the tiny DeepSeek-V4 (CSA, HCA and sliding attention,
    a hash layer, mHC, MTP), one process: the policy at step 1 is the initial model, then it ranks the step's
    pairs (seen: 0.693, 0.676, 0.645)."""
    history = dpo_v4_one_process(rank_pools, tmp_path)
    first = history[0]  # the same forward as the reference pass's: the loss log 2 to fp32's rounding of it
    assert abs(first["loss"] - math.log(2)) <= 1e-6 and first["rewards/margins"] == 0.0
    assert first["pairs"] == 8 and history[2]["loss"] < history[1]["loss"]
    assert all(r["rewards/accuracies"] == 1.0 and r["loss"] < math.log(2) - 0.01 for r in history[1:])


@pytest.mark.multirank
@pytest.mark.parametrize(
    ("model", "lora"), [("kimi", False), ("kimi", True), ("glm5n", False), ("glm5n", True)]
)
def test_kda_hybrid_dpo_starts_at_log2_and_learns(tmp_path, rank_pools, model, lora):
    """DPO on the tiny Kimi Linear (KDA and NoPE MLA layers) and GLM-5.3-Flash (KDA, k-pool DSA, mHC, MTP), one
    process, in full (the precomputed reference) and with LoRA on the family's default targets (the reference:
    the adapters off): the policy at step 1 is the reference, then it ranks the step's pairs."""
    flags = f"--config zero1 {V4_DPO}" + (" --lora_r 8 --lora_alpha 16 --lr 1e-2" if lora else "")
    worker = "tests.training.worker:dpo_v4_run"
    history = rank_pools.run(1, worker, str(tmp_path), model, flags, 4, model)[0]
    first = history[0]
    assert abs(first["loss"] - math.log(2)) <= 1e-6 and first["rewards/margins"] == 0.0
    assert first["pairs"] == 8 and history[2]["loss"] < history[1]["loss"] < math.log(2) - 0.01
    assert history[2]["rewards/accuracies"] == 1.0


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["sp2", "pp2"])
def test_deepseek_v4_dpo_layouts_match_one_process(tmp_path, rank_pools, layout):
    """V4's own sequence parallelism (whole rows' keys and compressed entries gathered, the halo) and a
    pipeline (the streams and token ids crossing the stages) under full DPO equal one process within the
    layout bounds of the V3 tests (seen: 1e-7 relative at most)."""
    one = dpo_v4_one_process(rank_pools, tmp_path)
    worker = "tests.training.worker:dpo_v4_run"
    ranks = rank_pools.run(
        2, worker, str(tmp_path), f"v4_{layout}", f"--config zero1 --{layout[:2]} 2 {V4_DPO}", 4
    )
    for res in ranks:
        for a, b in zip(one, res, strict=True):
            for key in ("loss", "grad_norm", "logps/chosen"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (layout, key, a[key], b[key])
            for key in METRICS[:3]:
                assert abs(a[key] - b[key]) <= 1e-6, (layout, key, a[key], b[key])


@pytest.mark.multirank
@pytest.mark.parametrize("layout", ["zero3", "pp2", "sp2"])
def test_full_fine_tune_dpo_layouts_match_one_process(tmp_path, rank_pools, layout):
    """The first pass and the steps in ZeRO-3 (2 data-parallel ranks, each its half of the table), PP2 (the
    last stage's table) and SP2 (documents split over the ranks) equal one process within the layout bounds."""
    one = dpo_full_one_process(rank_pools, tmp_path)["history"]
    flags = {"zero3": "--config zero3", "pp2": "--config zero1 --pp 2 --gradient_accumulation_steps 2",
             "sp2": "--config zero1 --sp 2 --gradient_accumulation_steps 2"}[layout]  # fmt: skip
    worker = "tests.training.worker:dpo_full_run"
    ranks = rank_pools.run(2, worker, str(tmp_path), f"full_{layout}", f"{flags} {FULL}")
    for res in ranks:
        for a, b in zip(one, res["history"], strict=True):
            for key in ("loss", "grad_norm", "logps/chosen"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (layout, key, a[key], b[key])
            for key in METRICS[:3]:
                assert abs(a[key] - b[key]) <= 1e-6, (layout, key, a[key], b[key])


@pytest.mark.multirank
def test_full_fine_tune_dpo_resumes_on_another_layout(tmp_path, rank_pools):
    """Saved at step 2 by 2 ZeRO-3 ranks, resumed by one process into a fresh folder: its reference table is
    read beside the checkpoint (not recomputed from the trained weights) and step 3 is the straight run's."""
    one = dpo_full_one_process(rank_pools, tmp_path)["history"]
    worker = "tests.training.worker:dpo_full_run"
    saved = rank_pools.run(2, worker, str(tmp_path), "full_saved", f"--config zero3 {FULL}")[0]
    step2 = next(p for p in saved["checkpoints"] if p.endswith("step_00000002"))
    flags = f"--config zero1 {FULL} --gradient_accumulation_steps 2"
    resumed = rank_pools.run(1, worker, str(tmp_path), "full_resumed", flags, step2)[0]["history"]
    assert [r["step"] for r in resumed] == [3]
    for key in ("loss", "grad_norm", *METRICS[:3]):
        assert abs(one[2][key] - resumed[0][key]) <= 1e-5 * max(1.0, abs(one[2][key])), key
    assert (tmp_path / "full_resumed" / "dpo_reference.safetensors").is_file()


@pytest.mark.multirank
def test_the_reference_pass_covers_every_epoch_of_real_data(tmp_path, rank_pools):
    """12 pairs of a jsonl through the data package's loader (shuffled, packed, 2 data-parallel ranks), 8 steps
    of 4 rows: more than two epochs. The first pass stores each of the 24 completions once, every later epoch
    finds its pairs, and the first step is the initial model against itself."""
    words = ["the", "king", "queen", "lord", "sword", "crown", "night", "day"]
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for i in range(12):
            prompt = " ".join(words[(i + j * 3) % 8] for j in range(5))
            f.write(
                json.dumps({"prompt": f"{i}: {prompt}", "chosen": prompt[:9], "rejected": f"no {i}"}) + "\n"
            )
    res = rank_pools.run(
        2, "tests.training.worker:dpo_data_run", str(tmp_path), str(tmp_path / "pairs.jsonl"), 8
    )
    first = res[0]["history"][0]
    assert abs(first["loss"] - math.log(2)) <= 1e-6 and first["rewards/margins"] == 0.0
    assert [r["table"] for r in res] == [24, 24] and len(res[0]["history"]) == 8
    assert res[0]["history"][-1]["rewards/accuracies"] > 0.5


@pytest.mark.multirank
def test_a_finished_full_dpo_run_extends_its_reference_when_resumed_further(
    tmp_path, rank_pools, small_model
):
    """A 2-step full DPO run resumed to 6 steps: its reference pass covered 2 steps, so before the checkpoint
    loads (the engine still the initial model) the pass is extended over the steps past them, and the table
    equals a straight 6-step run's (the same forwards of the same rows)."""
    from tests.helpers.runs import train

    with open(tmp_path / "pairs.jsonl", "w") as f:
        for i in range(30):
            f.write(
                json.dumps({"prompt": f"{i} plus {i}?", "chosen": f"{2 * i}.", "rejected": f"{2 * i + 1}."})
            )
            f.write("\n")
    flags = ["--model", str(small_model), "--objective", "dpo", "--data", str(tmp_path / "pairs.jsonl")]
    flags += ["--seq_len", "128", "--micro_batch_size", "1", "--no-plots", "--no-tensorboard"]
    run, straight = tmp_path / "run", tmp_path / "straight"
    train(rank_pools, [*flags, "--max_steps", "2", "--output_dir", str(run)])
    two = Table.load(run / "dpo_reference.safetensors")
    out = train(rank_pools, [*flags, "--max_steps", "6", "--output_dir", str(run), "--resume", "auto"]).stdout
    assert "its pass covered 2 steps, the run goes to 6: extending it with the initial model" in out
    train(rank_pools, [*flags, "--max_steps", "6", "--output_dir", str(straight)])
    extended = Table.load(run / "dpo_reference.safetensors")
    want = Table.load(straight / "dpo_reference.safetensors")
    assert (two.steps, extended.steps, want.steps) == (2, 6, 6) and len(two) < len(extended)
    assert extended.logps.keys() == want.logps.keys()
    assert all(abs(extended.logps[k] - v) <= 1e-6 * abs(v) for k, v in want.logps.items())
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
