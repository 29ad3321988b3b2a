"""Shared pieces of the trainer tests: a very small model config, a batch source that defines each GLOBAL
batch independently of how it is split over ranks and micro batches, a plain-PyTorch reference loop, and
the multi-rank worker (`python -m torch.distributed.run ... tests/test_train_support.py MODE OUT`)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 256
SEQ = 32


def tiny_config(**kw: Any):
    from dstrain.model import ModelConfig

    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        num_nextn_predict_layers=1,
        bias_update_speed=0.01,
        aux_loss_alpha=0.01,
        mtp_loss_weight=0.3,
    )
    base.update(kw)
    return ModelConfig(**base)


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
        return stack([global_row(start + j, same_token=self.same_token) for j in range(self.micro)])

    def state_dict(self) -> dict[str, int]:
        return {"pulled": self.pulled}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pulled = int(state["pulled"])


def make_options(extra: list[str]):
    from dstrain.data.options import DataOptions
    from dstrain.training.options import parse_options

    return parse_options(["--seq_len", str(SEQ), "--warmup_steps", "2", "--lr", "3e-3", *extra], DataOptions)


def reference_run(
    cfg, opts, steps: int, global_batch: int, state: dict | None = None, model=None
) -> list[dict[str, float]]:
    """Plain PyTorch on the whole global batch: AdamW, clip_grad_norm_, the same schedule and objective.
    `model`: start from it (fp32) instead of a fresh one built from `cfg` and the seed."""
    from dstrain.model import build_model
    from dstrain.training.objective import Weights, count_targets, micro_loss
    from dstrain.training.options import min_lr
    from dstrain.training.schedule import make_scheduler_factory
    from dstrain.training.trainer import param_groups

    t = opts.train
    torch.manual_seed(t.seed)
    if model is None:
        model = build_model(cfg, dtype=torch.float32, seed=t.seed)
    opt = torch.optim.AdamW(
        param_groups(model, t.weight_decay), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps
    )
    sched = make_scheduler_factory(
        lr=t.lr, min_lr=min_lr(t), warmup_steps=t.warmup_steps, max_steps=t.max_steps, schedule=t.lr_schedule
    )(opt)
    w = Weights(alpha=cfg.aux_loss_alpha, lam=cfg.mtp_loss_weight)
    out_recs = []
    for s in range(steps):
        batch = stack([global_row(s * global_batch + j) for j in range(global_batch)])
        n = count_targets(batch, cfg.num_nextn_predict_layers).float()
        out = model(**batch)
        loss = micro_loss(out, n, 1.0, w)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), t.clip_grad if t.clip_grad > 0 else float("inf")
        )
        opt.step()
        opt.zero_grad()
        sched.step()
        model.update_expert_bias(out.expert_load)
        out_recs.append({"loss": float(loss.detach()), "grad_norm": float(norm)})
    if state is not None:  # the final weights, for callers comparing parameters
        state.update({k: v.detach().clone() for k, v in model.state_dict().items()})
    bias = [r.e_score_correction_bias.tolist() for r in model.routers()]
    out_recs[-1]["bias"] = bias
    return out_recs


def free_port() -> int:
    """A port nobody listens on now, so concurrent test runs never collide on a fixed master port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    args: list[str],
    nproc: int = 2,
    port: int | None = None,
    env: dict[str, str] | None = None,
    timeout: int = 300,
) -> subprocess.CompletedProcess:
    """torchrun with a bounded time; OMP_NUM_THREADS=1 so two ranks share two cores."""
    port = port or free_port()
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", **(env or {})}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(port),
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def test_global_rows_independent_of_split():
    """The same global batch whatever micro x GA x world: the premise of the equality tests."""
    a = [GlobalRows(2, 2, r, 2) for r in range(2)]
    b = [GlobalRows(4, 1, r, 2) for r in range(2)]
    rows_a = torch.cat([next(x)["input_ids"] for x in a for _ in range(2)])
    rows_b = torch.cat([next(x)["input_ids"] for x in b])
    assert torch.equal(rows_a, rows_b)
    single = GlobalRows(8, 1, 0, 1)
    assert torch.equal(next(single)["input_ids"], rows_a)


# ---------------------------------------------------------------------- the multi-rank worker
def _trainer(opts, out_dir: str, loader=None, resume: str | None = None, cfg=None, info=None):
    from dstrain.training.app import choose_resume
    from dstrain.training.ds_config import load_ds_config, resolve_ds_config
    from dstrain.training.trainer import Trainer

    cfg = cfg or tiny_config()
    _, raw = load_ds_config(opts.train.config)
    precision = "bf16" if opts.train.precision == "bf16" else "fp32"
    ds = resolve_ds_config(
        raw, opts.train, world_size=info.world_size, precision=precision, hidden_size=cfg.hidden_size
    )
    opts.train.output_dir = out_dir
    if resume is None:
        resume = choose_resume(opts, out_dir)
    loader = loader or GlobalRows(
        opts.train.micro_batch_size, opts.train.gradient_accumulation_steps, info.rank, info.world_size
    )
    tr = Trainer(opts, info, ds, out_dir, model_config=cfg, loader=loader, resume_path=resume, verbose=False)
    tr.setup()
    return tr


def _losses(tr) -> list[float | None]:
    return [r["loss"] for r in tr.history]


def worker(mode: str, out: str) -> None:
    from dstrain.training import dist

    info = dist.init_distributed()
    res: dict[str, Any] = {}
    common = (
        "--micro_batch_size 2 --max_steps 6 --clip_grad 0.5 --save_every 3 --keep_last 0 --precision fp32"
    )

    def opts_for(args: str):
        return make_options(args.split())

    if mode == "main":
        for stage in (1, 2, 3):
            base, args = f"{out}/z{stage}", f"--config zero{stage} {common}"
            tr = _trainer(opts_for(args), f"{base}/straight", info=info)
            tr.run()
            res[f"z{stage}_straight"] = tr.history
            res[f"z{stage}_bias"] = [r.e_score_correction_bias.tolist() for r in tr.model.routers()]
            step3 = f"{base}/straight/checkpoints/step_00000003"
            # N + resume + N, from the straight run's step-3 checkpoint into a fresh folder
            tr = _trainer(opts_for(args), f"{base}/resumed", info=info, resume=step3)
            tr.run()
            res[f"z{stage}_resumed"] = _losses(tr)
            # resumed twice: 3 -> 4 (saved, as if interrupted) -> 6
            tr = _trainer(opts_for(args), f"{base}/twice", info=info, resume=step3)
            tr.run(until=4)
            first = _losses(tr)
            tr = _trainer(opts_for(f"{args} --resume auto"), f"{base}/twice", info=info)
            tr.run()
            res[f"z{stage}_twice"] = first + _losses(tr)
        # GA=2 x micro 2 vs GA=1 x micro 4 (global batch 8 over 2 ranks), ZeRO-2
        for name, mb, ga in (("ga2", 2, 2), ("ga1", 4, 1)):
            args = f"--config zero2 --micro_batch_size {mb} --gradient_accumulation_steps {ga} --max_steps 2"
            tr = _trainer(opts_for(f"{args} --clip_grad 0.5 --save_every 0"), f"{out}/{name}", info=info)
            tr.run()
            res[name] = tr.history
        # ZeRO-3, rank 1 routes every token identically (most experts get nothing there): must not hang
        same = 7 if info.rank == 1 else None
        loader = GlobalRows(2, 1, info.rank, info.world_size, same_token=same)
        args = "--config zero3 --max_steps 2 --micro_batch_size 2 --save_every 0"
        tr = _trainer(opts_for(args), f"{out}/z3skip", loader=loader, info=info)
        tr.run()
        probe = GlobalRows(2, 1, info.rank, info.world_size, same_token=same)
        with torch.no_grad():
            load = tr.engine(**next(probe)).expert_load
        res[f"z3skip_zero_experts_rank{info.rank}"] = int((load == 0).sum())
        res["z3skip_losses"] = _losses(tr)
        # bf16: trains, expert bias stays fp32 and identical on every rank
        for stage in (2, 3):
            args = f"--config zero{stage} --precision bf16 --max_steps 3 --micro_batch_size 2 --save_every 0"
            tr = _trainer(opts_for(args), f"{out}/bf16_z{stage}", info=info)
            tr.run()
            biases = [r.e_score_correction_bias for r in tr.model.routers()]
            res[f"bf16_z{stage}"] = {
                "losses": _losses(tr),
                "bias_dtypes": sorted({str(b.dtype) for b in biases}),
                "param_dtype": str(next(tr.model.parameters()).dtype),
                f"bias_rank{info.rank}": [b.tolist() for b in biases],
            }
        # NaN: rank 1 alone sees a non-finite loss at step 2
        import dstrain.training.trainer as trainer_mod

        real = trainer_mod.micro_loss
        state = {"tr": None}

        def poisoned(out_, n, scale, w):
            loss = real(out_, n, scale, w)
            if state["tr"].step == 1 and info.rank == 1:
                loss = loss * float("nan")
            return loss

        trainer_mod.micro_loss = poisoned
        for policy in ("stop", "skip"):
            args = f"--config zero1 --max_steps 3 --micro_batch_size 2 --save_every 0 --nan_policy {policy}"
            tr = _trainer(opts_for(args), f"{out}/nan_{policy}", info=info)
            state["tr"] = tr
            history, sums, error = [], [], None
            try:
                for _ in range(3):
                    history.append(tr.train_step())
                    sums.append(float(sum(p.double().sum() for p in tr.model.parameters())))
            except Exception as exc:  # noqa: BLE001 - recorded for the test to assert on
                error = f"{type(exc).__name__}: {exc}"
            res[f"nan_{policy}"] = {"history": history, "param_sums": sums, "error": error}
        trainer_mod.micro_loss = real
    elif mode == "kill":
        tr = _trainer(opts_for(f"--config zero1 {common} --resume auto"), f"{out}/killed", info=info)
        res["start_step"] = tr.step
        tr.run()
        res["losses"] = _losses(tr)
    if info.rank == 0 or mode == "main":
        with open(f"{out}/result_{mode}_rank{info.rank}.json", "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    worker(sys.argv[1], sys.argv[2])
