"""DPO that learns: held-out preference accuracy of a small V3-shaped model before and after LoRA DPO.

  python launch/bench_dpo.py                               # ../shared/data/tinyshakespeare.txt, else the built-in text
  python launch/bench_dpo.py --rejected reverse --dpo_steps 200
  python launch/bench_dpo.py --sft_ready RUN/sft_hf        # an earlier run's SFT folder (same split): skip step 2

1. Pairs from Shakespeare's paragraphs (speeches), in TRL's explicit-prompt format (`prompt`, `chosen`,
   `rejected`, texts): the prompt is a paragraph's first `--prompt_words` words, chosen the next
   `--completion_words` words as written, rejected those words shuffled (`--rejected shuffle`), reversed
   (`reverse`) or the same span of another paragraph (`other`: fluent but off-topic; this 1M-parameter model
   does not learn that preference in 100 steps, docs/training.md). The last `--heldout` share of the paragraphs
   gives the held-out pairs; no held-out paragraph is trained on in any step.
2. SFT: a model written as bench_muon writes its start (transformers' random init, 4 layers, 8 routed experts,
   byte-level tokenizer) is trained on the training paragraphs' text for `--sft_steps` steps (pretraining, no
   pretrained weights exist offline) so that it knows word order: something to prefer; exported (the reference).
3. DPO: `dstrain train --objective dpo --lora_r ...` on the training pairs, then `dstrain export` merged.
4. Held-out accuracy, as the trainer computes it (dstrain.training.dpo on the eval rows that
   `dstrain.data.build_eval_rows` packs from the held-out pairs): a pair is right when its chosen completion's
   implicit reward beta * (log pi - log pi_ref) is higher than the rejected one's. Before DPO the policy is the
   reference (LoRA's B = 0): every reward is 0, a tie, counted a half (chance). Also printed: the margins, and
   the models' own log-probability preference (log pi(chosen) > log pi(rejected)), which the SFT model may
   already hold for shuffled text: DPO's accuracy measures what DPO added on top of the reference.

Prints JSON lines: the kernel path, data sizes, each stage's steps and seconds, held-out figures before/after.
Every training run is `python -m dstrain` on one process (fp32, the CPU).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dstrain.batch import document_index, target_mask  # noqa: E402
from dstrain.data import DataOptions, build_eval_rows, load_tokenizer  # noqa: E402
from dstrain.data.sources import BUILTIN  # noqa: E402
from dstrain.model import from_pretrained  # noqa: E402
from dstrain.training.dpo import pair_losses, sequence_logps  # noqa: E402
from launch.bench_model import kernel_path  # noqa: E402
from launch.bench_muon import write_start  # noqa: E402

TEXT = "tinyshakespeare.txt"
LORA_TARGETS = "q_b_proj,kv_b_proj,o_proj,shared_experts,experts"


def dstrain(*args: str) -> None:
    cmd = [sys.executable, "-m", "dstrain", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def read_text(data_dir: Path) -> tuple[str, str]:
    """(the Shakespeare text, where it came from): `data_dir`'s copy, else the one dstrain ships."""
    path = data_dir / TEXT
    if not path.is_file():
        from importlib import resources

        path = Path(str(resources.files("dstrain.data").joinpath("builtin", BUILTIN["shakespeare"])))
    return path.read_text(encoding="utf-8"), str(path)


def make_pairs(paragraphs: list[str], prompt_words: int, completion_words: int, rejected: str, seed: int):
    """TRL explicit-prompt records from paragraphs long enough (the rest skipped)."""
    rng = random.Random(seed)
    spans = []
    for par in paragraphs:
        words = par.split()
        if len(words) >= prompt_words + completion_words:
            spans.append((words[:prompt_words], words[prompt_words : prompt_words + completion_words]))
    records = []
    for i, (prompt, chosen) in enumerate(spans):
        if rejected == "shuffle":
            other = chosen[:]
            while other == chosen:
                rng.shuffle(other)
        elif rejected == "reverse":
            other = chosen[::-1]
        else:  # the same span of another paragraph: fluent text that does not continue this prompt
            other = spans[(i + 1 + rng.randrange(len(spans) - 1)) % len(spans)][1]
        if other == chosen:
            continue
        records.append({"prompt": " ".join(prompt), "chosen": " ".join(chosen), "rejected": " ".join(other)})
    return records


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


@torch.no_grad()
def doc_logps(model: torch.nn.Module, rows: dict[str, torch.Tensor], batch: int) -> tuple[torch.Tensor, ...]:
    """(every document's summed completion log-probability, its target count), in the rows' document order
    (chosen, rejected, chosen, ...), summed as the DPO step sums them."""
    logps, counts = [], []
    for a in range(0, rows["input_ids"].shape[0], batch):
        b = {k: v[a : a + batch] for k, v in rows.items()}
        out = model(**b, token_losses=True)
        n = out.lm_token_loss.shape[1]
        docs = document_index(b["labels"], b["position_ids"])
        valid = target_mask(b["labels"], b["position_ids"], 1)[:, :n]
        lp, ct = sequence_logps(out.lm_token_loss, docs[:, 1 : 1 + n], valid, int(docs.max()) + 1)
        logps.append(lp)
        counts.append(ct)
    return torch.cat(logps), torch.cat(counts)


def heldout_figures(policy: torch.Tensor, ref: torch.Tensor, counts: torch.Tensor, beta: float) -> dict:
    """The DPO figures over the held-out pairs (dstrain.training.dpo.pair_losses), ties counted a half."""
    losses, fig = pair_losses(policy, ref, counts, beta, "sigmoid")
    margins = fig["rewards/margins"]
    own = policy[0::2] - policy[1::2]
    return {
        "accuracy": ((margins > 0).float() + 0.5 * (margins == 0).float()).mean().item(),
        "ties": int((margins == 0).sum()),
        "rewards/margins_mean": margins.mean().item(),
        "rewards/margins_median": margins.median().item(),
        "rewards/chosen": fig["rewards/chosen"].mean().item(),
        "rewards/rejected": fig["rewards/rejected"].mean().item(),
        "dpo_loss": losses.mean().item(),
        "logp_accuracy": (own > 0).float().mean().item(),
        "logp_margin_mean": own.mean().item(),
        "logps/chosen": fig["logps/chosen"].mean().item(),
        "logps/rejected": fig["logps/rejected"].mean().item(),
    }


def tail_means(run: Path, keys: tuple[str, ...], n: int = 10) -> dict:
    """Each of `keys` averaged over the run's last `n` training steps (one step's figure is noisy)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r and "eval_loss" not in r][-n:]
    return {k: sum(r[k] for r in steps) / len(steps) for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data_dir", default=str(ROOT.parent / "shared" / "data"),
                    help=f"folder holding {TEXT} (absent: dstrain's built-in copy)")  # fmt: skip
    ap.add_argument("--rejected", choices=["shuffle", "reverse", "other"], default="shuffle")
    ap.add_argument("--prompt_words", type=int, default=8)
    ap.add_argument("--completion_words", type=int, default=8)
    ap.add_argument("--heldout", type=float, default=0.1, help="share of the paragraphs held out (the last)")
    ap.add_argument("--heldout_pairs", type=int, default=256, help="at most this many held-out pairs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sft_steps", type=int, default=300)
    ap.add_argument("--sft_lr", type=float, default=3e-3)
    ap.add_argument("--dpo_steps", type=int, default=100)
    ap.add_argument("--dpo_lr", type=float, default=1e-3)
    ap.add_argument("--dpo_beta", type=float, default=0.1)
    ap.add_argument("--lora_r", type=int, default=8)
    ap.add_argument("--sft_micro_batch_size", type=int, default=4)
    ap.add_argument("--micro_batch_size", type=int, default=8, help="DPO's rows per step (a pair per row)")
    ap.add_argument("--seq_len", type=int, default=256, help="rows of both stages (a pair shares one row)")
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    ap.add_argument("--sft_ready", default=None, help="an earlier run's sft_hf folder: skip the SFT stage")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_dpo_"))
    out.mkdir(parents=True, exist_ok=True)
    common = ["--precision", "fp32", "--num_workers", "0", "--save_every", "0", "--seed", str(args.seed),
              "--seq_len", str(args.seq_len)]  # fmt: skip
    t_all = time.perf_counter()

    text, source = read_text(Path(args.data_dir))
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    cut = int(len(paragraphs) * (1 - args.heldout))
    kw = dict(prompt_words=args.prompt_words, completion_words=args.completion_words, rejected=args.rejected)
    train = make_pairs(paragraphs[:cut], seed=args.seed, **kw)
    heldout = make_pairs(paragraphs[cut:], seed=args.seed + 1, **kw)[: args.heldout_pairs]
    write_jsonl(out / "train_pairs.jsonl", train)
    write_jsonl(out / "heldout_pairs.jsonl", heldout)
    (out / "sft_text.txt").write_text("\n\n".join(paragraphs[:cut]) + "\n", encoding="utf-8")
    print(json.dumps({"data": source, "paragraphs": len(paragraphs), "train_paragraphs": cut,
                      "train_pairs": len(train), "heldout_pairs": len(heldout), "rejected": args.rejected,
                      "prompt_words": args.prompt_words, "completion_words": args.completion_words,
                      "example": heldout[0]}), flush=True)  # fmt: skip

    sft = Path(args.sft_ready) if args.sft_ready else out / "sft_hf"
    if not args.sft_ready:
        t = time.perf_counter()
        write_start(out / "start_hf", args.seed)
        dstrain("train", "--model", str(out / "start_hf"), "--data", str(out / "sft_text.txt"),
                "--max_steps", str(args.sft_steps), "--lr", str(args.sft_lr), "--output_dir", str(out / "sft"),
                "--micro_batch_size", str(args.sft_micro_batch_size), *common)  # fmt: skip
        dstrain("export", str(out / "sft"), "--out", str(sft), "--force")
        print(json.dumps({"stage": "sft", "steps": args.sft_steps, "lr": args.sft_lr,
                          "loss_last10": tail_means(out / "sft", ("loss",))["loss"],
                          "s": round(time.perf_counter() - t, 1)}), flush=True)  # fmt: skip

    ref_model = from_pretrained(sft, dtype=torch.float32).eval()
    print(json.dumps({"model_params": sum(p.numel() for p in ref_model.parameters()),
                      **kernel_path(ref_model.config, torch.float32, "cpu")}), flush=True)  # fmt: skip
    tok = load_tokenizer(None, str(sft))
    opts = DataOptions(eval_data=str(out / "heldout_pairs.jsonl"), data_format="preference", seq_len=args.seq_len,
                       eval_tokens=0, num_workers=0)  # fmt: skip
    rows = build_eval_rows(opts, tok)
    ref, counts = doc_logps(ref_model, rows, args.micro_batch_size * 4)
    n_pairs = ref.numel() // 2  # a pair longer than a row is dropped (--overlong), as in training
    before = heldout_figures(ref, ref, counts, args.dpo_beta)
    print(json.dumps({"heldout": "before DPO (policy = reference)", "pairs": n_pairs,
                      "completion_tokens_mean": counts.mean().item(), **before}), flush=True)  # fmt: skip

    t = time.perf_counter()
    dpo = out / "dpo"
    dstrain("train", "--model", str(sft), "--data", str(out / "train_pairs.jsonl"), "--objective", "dpo",
            "--dpo_beta", str(args.dpo_beta), "--lora_r", str(args.lora_r), "--lora_alpha", str(2 * args.lora_r),
            "--lora_targets", LORA_TARGETS, "--lr", str(args.dpo_lr), "--max_steps", str(args.dpo_steps),
            "--warmup_steps", str(max(1, args.dpo_steps // 10)), "--output_dir", str(dpo),
            "--micro_batch_size", str(args.micro_batch_size), *common)  # fmt: skip
    dstrain("export", str(dpo), "--out", str(out / "dpo_merged"), "--force")
    last = tail_means(dpo, ("dpo_loss", "rewards/accuracies", "rewards/margins", "pairs"))
    print(json.dumps({"stage": "dpo", "steps": args.dpo_steps, "lr": args.dpo_lr, "beta": args.dpo_beta,
                      "lora_r": args.lora_r, "train_last10_steps": last, "s": round(time.perf_counter() - t, 1)}), flush=True)  # fmt: skip

    policy, _ = doc_logps(from_pretrained(out / "dpo_merged", dtype=torch.float32).eval(), rows,
                          args.micro_batch_size * 4)  # fmt: skip
    after = heldout_figures(policy, ref, counts, args.dpo_beta)
    print(json.dumps({"heldout": "after DPO", "pairs": n_pairs, **after}), flush=True)
    print(json.dumps({"summary": "held-out preference accuracy", "before": before["accuracy"],
                      "after": after["accuracy"], "rewards/margins_mean_after": after["rewards/margins_mean"],
                      "logp_accuracy_before": before["logp_accuracy"], "logp_accuracy_after": after["logp_accuracy"],
                      "dpo_steps": args.dpo_steps, "total_s": round(time.perf_counter() - t_all, 1),
                      "out": str(out)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
