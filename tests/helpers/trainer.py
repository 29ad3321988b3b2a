"""Shared pieces of the trainer tests: a batch source that defines each GLOBAL batch independently of how it
is split over ranks and micro batches, options and a Trainer from flags the way `dstrain train` makes them,
and a plain-PyTorch reference loop."""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from tests.helpers.tiny import VOCAB, tiny_config

SEQ = 32


def global_row(index: int, seq: int = SEQ, same_token: int | None = None) -> dict[str, torch.Tensor]:
    """Row `index` of the stream: packed documents (position_ids restart) and a masked prefix of uneven
    length, so micro batches hold different numbers of targets."""
    g = torch.Generator().manual_seed(10_000 + index)
    ids = torch.randint(2, VOCAB, (seq,), generator=g)
    if same_token is not None:
        ids = torch.full((seq,), same_token)
    labels = ids.clone()
    labels[: int(torch.randint(0, seq // 2, (1,), generator=g))] = -100
    cut = int(torch.randint(4, seq - 4, (1,), generator=g))
    pos = torch.cat([torch.arange(cut), torch.arange(seq - cut)])
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def stack(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


class GlobalRows:
    """Loader of micro batches: step s's global batch is rows [s*G, (s+1)*G), G = micro*GA*world; rank r's
    micro batch i takes its slice. state_dict/load_state_dict like the data package's loader."""

    def __init__(self, micro: int, ga: int, rank: int, world: int, same_token: int | None = None) -> None:
        self.micro, self.ga, self.rank, self.world, self.same_token = micro, ga, rank, world, same_token
        self.pulled = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        step, i = divmod(self.pulled, self.ga)
        start = step * self.micro * self.ga * self.world + (self.rank * self.ga + i) * self.micro
        self.pulled += 1
        return stack([self.row(start + j) for j in range(self.micro)])

    def row(self, index: int) -> dict[str, torch.Tensor]:
        """Global row `index`."""
        return global_row(index, same_token=self.same_token)

    def state_dict(self) -> dict:
        # the data package's form: a global position (re-shardable over another rank count), no streams
        return {"global_rows": self.pulled * self.micro * self.world, "stream_states": {}}

    def load_state_dict(self, state: dict) -> None:
        self.pulled = int(state["global_rows"]) // (self.micro * self.world)


def eval_rows(n: int = 5) -> dict[str, torch.Tensor]:
    """A global eval set of `n` rows (5: uneven over 2 and 4 ranks, so padding rows are exercised)."""
    return stack([global_row(100_000 + i) for i in range(n)])


def reference_eval(model, rows: dict[str, torch.Tensor]) -> dict[str, float]:  # noqa: ANN001
    """The eval figures of one process on the whole eval set at once."""
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(**rows)
    model.train(was)
    loss = float(out.lm_loss_sum / out.lm_tokens)
    mtp = out.mtp_loss_sum is not None  # a model without MTP (Kimi Linear): None, as the trainer's eval says
    return {
        "eval_loss": loss,
        "eval_mtp_loss": [float(out.mtp_loss_sum[0] / out.mtp_tokens[0])] if mtp else None,
        "eval_mtp_acc": float(out.mtp_hits / out.mtp_tokens[0]) if mtp else None,
        "eval_tokens": int(out.lm_tokens),
    }


def make_options(extra: list[str]):  # noqa: ANN201 - dstrain.config.options.Options
    """Options from flags, with the tests' row length, a short warmup, and no plots (their own tests make them:
    1.4 s of matplotlib at the end of each run would be a third of a layout test's time)."""
    from dstrain.config.options import parse_options

    return parse_options(["--seq_len", str(SEQ), "--warmup_steps", "2", "--lr", "3e-3", "--no-plots", *extra])


def make_trainer(
    opts,  # noqa: ANN001
    out_dir: str,
    info,  # noqa: ANN001
    *,
    cfg=None,  # noqa: ANN001
    loader: Any = None,
    resume: str | None = None,
    eval_rows: dict[str, torch.Tensor] | None = None,
    tokenizer: Any = None,
):  # noqa: ANN202
    """A set-up Trainer the way `dstrain train` makes one: the plan for this world (model `cfg`, default the
    tiny test model; with `--model FOLDER` in `opts`, the folder's), the resume rule, and a GlobalRows
    loader over this rank's data-parallel share unless `loader` is given (or a `tokenizer`: the Trainer's
    own loader of --data)."""
    from dstrain.config.plan import prepare
    from dstrain.training.cli import choose_resume
    from dstrain.training.trainer import Trainer

    folder = os.path.isdir(opts.model.model)
    plan = prepare(opts, info.world_size, model=None if folder else (cfg or tiny_config()))
    plan = plan.with_output_dir(out_dir)
    if resume is None:
        resume = choose_resume(opts.checkpoint, out_dir)
    if loader is None and tokenizer is None:
        data_rank, _ = plan.dims.data_coords(info.rank)
        layout = plan.opts.layout  # with what the DeepSpeed file set
        loader = GlobalRows(
            layout.micro_batch_size, layout.gradient_accumulation_steps, data_rank, plan.dims.data
        )
    tr = Trainer(
        plan, info, loader=loader, tokenizer=tokenizer, eval_rows=eval_rows, resume_path=resume, verbose=False
    )
    tr.setup()
    return tr


def reference_run(
    cfg, opts, steps: int, global_batch: int, state: dict | None = None, model=None
) -> list[dict[str, float]]:
    """Plain PyTorch on the whole global batch: AdamW, clip_grad_norm_, the same schedule and objective.
    `model`: start from it (fp32) instead of a fresh one built from `cfg` and the seed."""
    from dstrain.model import build_model
    from dstrain.model.common.lora import set_trainable
    from dstrain.optim.groups import adamw_groups
    from dstrain.training.objective import LossWeights, count_queries, count_targets, micro_loss
    from dstrain.training.schedule import make_scheduler_factory
    from tests.helpers.muon import ReferenceMuon, uses_muon

    o, s = opts.optimizer, opts.schedule
    torch.manual_seed(opts.run.seed)
    stage = None
    if cfg.sparse_attention:
        stage = opts.model.dsa_stage if opts.model.dsa_stage != "auto" else "sparse"
    # DeepSeek-V3.2's warm-up trains the lightning indexers alone: the experts' bias stays as it is
    if stage == "dense":
        cfg = cfg.replace(bias_update_speed=0.0)
    if model is None:
        model = build_model(cfg, dtype=torch.float32, seed=opts.run.seed)
    if stage is not None:
        # and the stage's freezing, as the trainer's (the dense warm-up: the indexers alone); the routers and
        # MTP trained as the options resolve them (LoRA's default: kept as they are)
        model.set_sparse_attention(stage)
        set_trainable(model, bool(opts.lora.train_router), bool(opts.lora.train_mtp), dsa_stage=stage)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = None
    if o.optimizer == "muon":  # the test's own Muon on the matrices, AdamW on the rest
        muon = ReferenceMuon([(n, p) for n, p in trained if uses_muon(n, p)], o.weight_decay, o.muon_momentum)
        trained = [(n, p) for n, p in trained if not uses_muon(n, p)]
    opt = torch.optim.AdamW(  # fused, as dstrain's resolved config has torch's AdamW run
        adamw_groups([p for _, p in trained], o.weight_decay),
        lr=s.lr,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps,
        fused=True,
    )
    sched = make_scheduler_factory(s)(opt)
    w = LossWeights.of(cfg)
    out_recs = []
    for step in range(steps):
        batch = stack([global_row(step * global_batch + j) for j in range(global_batch)])
        n = count_targets(batch, cfg.num_nextn_predict_layers).float()
        if cfg.sparse_attention:  # one forward per step: the indexers' KL is a mean over its real queries
            model.set_indexer_grad_scale(opts.model.indexer_loss_coef / float(count_queries(batch)))
        out = model(**batch)
        loss = micro_loss(out, n, 1.0, w)
        loss.backward()
        # The global norm in float64, and clipping by it with torch's (and DeepSpeed's) rule
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).norm()
        if o.clip_grad > 0 and o.clip_grad / (float(norm) + 1e-6) < 1:
            torch._foreach_mul_(grads, o.clip_grad / (float(norm) + 1e-6))
        if muon is not None:
            muon.step(opt.param_groups[0]["lr"])
        opt.step()
        model.zero_grad()
        sched.step()
        model.update_expert_bias(out.expert_load)
        rec = {"loss": float(loss.detach()), "grad_norm": float(norm)}
        if out.indexer_stats is not None:
            rec["indexer_loss"] = float(out.indexer_stats[0] / out.indexer_stats[1])
        out_recs.append(rec)
    if state is not None:  # the final weights and eval figures, for callers comparing them
        state.update({k: v.detach().clone() for k, v in model.state_dict().items()})
        state["eval"] = reference_eval(model, eval_rows())
    bias = [r.e_score_correction_bias.tolist() for r in model.routers()]
    out_recs[-1]["bias"] = bias
    return out_recs


_REFERENCES: dict[tuple, list[dict[str, float]]] = {}


def cached_reference(flags: list[str], steps: int, global_batch: int) -> list[dict[str, float]]:
    """`reference_run` of the tiny test model with `make_options(flags)`, computed once per test session for each
    question (flags, steps, global batch) that several tests ask; a copy for each caller."""
    key = (tuple(flags), steps, global_batch)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_run(
            tiny_config(), make_options(flags), steps=steps, global_batch=global_batch
        )
    return copy.deepcopy(_REFERENCES[key])
