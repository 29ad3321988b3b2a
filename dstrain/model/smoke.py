"""`dstrain smoke`: forward, backward and an AdamW step of a preset on random tokens, on the CPU or a GPU (no
data, no launcher, no DeepSpeed): the second command on a new machine, after `dstrain env`. Rows hold two
documents each (`--packed`, the default): packed rows take the kernels training takes."""

from __future__ import annotations

import argparse
import time

import torch

from dstrain.cmdline import command_parser

from .build import build_model
from .common.output import kernel_paths


def parse(argv: list[str]) -> argparse.Namespace:
    p = command_parser("dstrain smoke", __doc__)
    p.add_argument("--model", default="tiny", choices=["tiny", "tiny-dsa", "small"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (a GPU if CUDA starts)")
    p.add_argument(
        "--packed", action=argparse.BooleanOptionalAction, default=True, help="two documents per row"
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument(
        "--precision", choices=["fp32", "bf16"], default=None, help="default: bf16 on a GPU, fp32 on the CPU"
    )
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    from dstrain.errors import ConfigError

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)  # fmt: skip
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {args.device}: CUDA does not start here (see `dstrain env`)")
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = build_model(args.model, seed=0, dtype=dtype, device=device).train()
    print(f"dstrain smoke: {args.model} on {device} in {precision}: " + "; ".join(
        f"{k}: {v}" for k, v in kernel_paths(model.config, device, dtype).items()))  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq_len), device=device)
    pos = None
    if args.packed:
        half = args.seq_len // 2
        pos = (
            torch.cat([torch.arange(half), torch.arange(args.seq_len - half)])
            .expand(args.batch, -1)
            .to(device)
        )
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        out = model(ids, position_ids=pos, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_expert_bias(out.expert_load)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        if not torch.isfinite(out.loss):
            raise ConfigError(f"dstrain smoke: step {step}: non-finite loss on {device}")
        print(
            f"step {step} loss {out.loss.item():.4f} aux {out.aux_loss.item():.4f} {ids.numel() / dt:,.0f} tok/s"
        )
    return 0
