"""`dstrain smoke`: forward, backward and an AdamW step of a preset on random tokens (no data, no launcher)."""

from __future__ import annotations

import argparse
import time

import torch

from dstrain.cmdline import command_parser

from .loading import build_model


def parse(argv: list[str]) -> argparse.Namespace:
    p = command_parser("dstrain smoke", __doc__)
    p.add_argument("--model", default="tiny", choices=["tiny", "small"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model = build_model(args.model, seed=0, dtype=dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len))
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        out = model(ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_expert_bias(out.expert_load)
        dt = time.perf_counter() - t0
        print(
            f"step {step} loss {out.loss.item():.4f} aux {out.aux_loss.item():.4f} {ids.numel() / dt:,.0f} tok/s"
        )
    return 0
