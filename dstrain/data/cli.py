"""`dstrain data audit|stats`: inspect what the data pipeline feeds the model (see audit.py, bench.py)."""

from __future__ import annotations

import argparse
import json

from dstrain.cmdline import ArgumentParser, add_debug

from .options import add_arguments, from_args


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="dstrain data", description="Inspect training data.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    audit = sub.add_parser(
        "audit", help="print rendered samples with the trained tokens marked, and mask statistics"
    )
    audit.add_argument("--n", type=int, default=3, help="samples to print (default: 3)")
    audit.add_argument(
        "--max_docs", type=int, default=1000, help="samples to gather statistics over (default: 1000)"
    )
    audit.add_argument(
        "--color", choices=("auto", "always", "never"), default="auto", help="colour trained tokens"
    )
    stats = sub.add_parser(
        "stats", help="counts, fill, tokenize+pack speed vs the raw tokenizer (--json: one JSON object)"
    )
    stats.add_argument("--max_docs", type=int, default=None, help="measure at most this many documents")
    stats.add_argument("--rounds", type=int, default=3, help="ABBA rounds (2 runs of each side per round)")
    stats.add_argument("--json", action="store_true", help="one JSON object instead of lines for a reader")
    for p in (audit, stats):
        add_arguments(p)
        add_debug(p)
        p.add_argument(
            "--objective",
            choices=("sft", "dpo"),
            default=None,
            help="read the data as a run of this --objective does (dpo: pairs only; sft: a pair's chosen "
            "side); default: as the data is",
        )
        # --model as `dstrain train` spells it; --model_path as earlier versions did
        p.add_argument(
            "--model",
            "--model_path",
            dest="model_path",
            default=None,
            help="checkpoint folder whose tokenizer to use",
        )
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def readable(stats: dict) -> str:
    """`dstrain data stats` for a reader: a heading, then one aligned `name  value` line per figure."""
    head = f"{stats['data']}: format {stats['format']}, seq_len {stats['seq_len']}"
    rest = {k: v for k, v in stats.items() if k not in ("data", "format", "seq_len")}
    width = max(map(len, rest))
    return "\n".join([head] + [f"  {k:<{width}}  {v}" for k, v in rest.items()])


def run(args: argparse.Namespace) -> int:
    from .tokenizer import load_tokenizer

    opts = from_args(args)
    tok = load_tokenizer(opts.tokenizer, args.model_path)
    if args.command == "audit":
        from .audit import run_audit

        color = None if args.color == "auto" else args.color == "always"
        run_audit(opts, tok, n=args.n, max_docs=args.max_docs, color=color, objective=args.objective)
    else:
        from .bench import run_stats

        stats = run_stats(opts, tok, max_docs=args.max_docs, rounds=args.rounds, objective=args.objective)
        print(json.dumps(stats) if args.json else readable(stats))
    return 0
