"""Fine-tuning a Muon-pre-trained model with Muon vs AdamW: eval loss at each optimizer's best of three
learning rates.

  python launch/bench_muon.py --chats ../shared/data/self_instruct_seed_tasks.jsonl
  python launch/bench_muon.py --chats my_chats.jsonl --pretrain_steps 1000 --steps 100 --lrs 3e-4,1e-3,3e-3

1. Writes a small DeepSeek-V3-shaped model (transformers' own random init, 4 layers, 8 routed experts, hidden
   128) with a byte-level tokenizer (vocabulary 261: most parameters are then matrices Muon steps, unlike the
   tiny preset, whose 129K-token embedding and head are 99% of it), pre-trains it with `--optimizer muon` on
   the built-in Shakespeare text for `--pretrain_steps` steps and exports it (`dstrain export`).
2. Fine-tunes that folder on the chats for `--steps` steps with each optimizer at each of its learning rates
   (`--lrs` for AdamW, `--muon_lrs` for Muon: with Moonlight's scale Muon's updates start smaller than AdamW's
   at one lr, and its best was at the top of AdamW's grid), with the same data order, seed, schedule and weight
   decay, holding out `--eval_split` of the chats, and evaluates at the end.
Prints one JSON line per run and a summary line per optimizer (its best eval loss and learning rate). Every
run is `python -m dstrain train` on one process.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def dstrain(*args: str) -> None:
    cmd = [sys.executable, "-m", "dstrain", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_start(folder: Path, seed: int) -> None:
    """The starting model and its tokenizer, as a Hugging Face folder."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )  # fmt: skip
    tok.chat_template = CHATML
    cfg = DeepseekV3Config(
        vocab_size=272, hidden_size=128, intermediate_size=384, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=2048,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    # No pad_token_id in the config: transformers would zero that embedding row, and a zero row at the padding
    # that ends a packed row makes its RMSNorm gradient 1/sqrt(eps) per layer (see the closing note).
    torch.manual_seed(seed)
    DeepseekV3ForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)


def last_eval(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if "eval_loss" in r]
    if not evals:
        raise SystemExit(f"{run}: no eval record")
    return evals[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chats", required=True, help="chat or instruction data (dstrain --data)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pretrain_steps", type=int, default=600)
    ap.add_argument("--pretrain_lr", type=float, default=3e-3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lrs", default="3e-4,1e-3,3e-3", help="AdamW's learning rates")
    ap.add_argument("--muon_lrs", default="1e-3,3e-3,1e-2", help="Muon's, as many (its best sits higher)")
    ap.add_argument("--eval_split", type=float, default=0.1)
    ap.add_argument("--pretrain_seq_len", type=int, default=256)
    ap.add_argument("--seq_len", type=int, default=1024, help="fine-tuning rows (longer tasks are dropped)")
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    ap.add_argument("--pretrained", default=None, help="an earlier run's pretrained_hf folder: skip step 1")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_muon_"))
    common = ["--precision", "fp32", "--num_workers", "0", "--save_every", "0",
              "--seed", str(args.seed)]  # fmt: skip
    t0 = time.perf_counter()
    folder = Path(args.pretrained) if args.pretrained else out / "pretrained_hf"
    if not args.pretrained:
        start, pre = out / "start_hf", out / "pretrain"
        write_start(start, args.seed)
        dstrain(
            "train", "--model", str(start), "--data", "shakespeare", "--optimizer", "muon", "--max_steps",
            str(args.pretrain_steps), "--lr", str(args.pretrain_lr), "--output_dir", str(pre), "--seq_len",
            str(args.pretrain_seq_len), *common,
        )  # fmt: skip
        dstrain("export", str(pre), "--out", str(folder), "--force")
        loss = json.loads((pre / "metrics.jsonl").read_text().splitlines()[-1]).get("loss")
        took = round(time.perf_counter() - t0)
        print(
            json.dumps(
                {"pretrained": str(folder), "steps": args.pretrain_steps, "last_loss": loss, "s": took}
            )
        )
    best: dict[str, tuple[float, float]] = {}
    grids = [
        [("adamw", float(x)) for x in args.lrs.split(",")],
        [("muon", float(x)) for x in args.muon_lrs.split(",")],
    ]
    for pair in zip(*grids, strict=True):  # interleaved: the machine's drift hits both alike
        for optimizer, lr in pair:
            run = out / f"{optimizer}_lr{lr:g}"
            t = time.perf_counter()
            dstrain(
                "train", "--model", str(folder), "--data", args.chats, "--optimizer", optimizer, "--lr", str(lr),
                "--max_steps", str(args.steps), "--warmup_steps", str(max(1, args.steps // 10)),
                "--eval_split", str(args.eval_split), "--eval_every", str(args.steps), "--output_dir", str(run),
                "--seq_len", str(args.seq_len), *common,
            )  # fmt: skip
            ev = last_eval(run)
            rec = {"optimizer": optimizer, "lr": lr, "eval_loss": ev["eval_loss"], "step": ev["step"]}
            print(json.dumps({**rec, "s": round(time.perf_counter() - t)}), flush=True)
            if optimizer not in best or ev["eval_loss"] < best[optimizer][0]:
                best[optimizer] = (ev["eval_loss"], lr)
    for optimizer, (loss, lr) in best.items():
        print(json.dumps({"best": optimizer, "eval_loss": round(loss, 4), "lr": lr, "steps": args.steps}))


if __name__ == "__main__":
    main()
