"""What QAT buys: held-out loss of a small V3-shaped model fine-tuned with and without `--qat`, then exported
quantized, beside the loss of the unquantized (bf16) model.

  python launch/bench_qat.py                              # ../shared/data/tinyshakespeare.txt, else the built-in text
  python launch/bench_qat.py --steps 400 --lr 3e-3
  python launch/bench_qat.py --lora_r 16                  # LoRA instead of a full fine-tune
  python launch/bench_qat.py --release RUN/release_hf     # an earlier run's quantized release: skip step 1

1. The "release": a model written as bench_muon writes its start (transformers' random init, 4 layers, 8 routed
   experts, hidden 128, byte-level tokenizer) is pretrained on the text for `--pretrain_steps` steps (no
   pretrained weights exist offline), exported bf16 and quantized as DeepSeek-V4-Flash is: every attention,
   dense-MLP and shared-expert projection in DeepSeek-V3's FP8 (e4m3, an fp32 `weight_scale_inv` per 128x128
   block), the routed experts in V4's FP4 (e2m1 packed in int8, an e8m0 `scale` per 1x32 block); embeddings,
   norms, routers and the head stay bf16.
2. Two fine-tunes of that folder on the same text, same seed, data order and schedule: `--qat off` (dense
   weights, as if the export were to be bf16) and `--qat on` (each weight the folder stores quantized is used
   in the forward as the export will quantize it, straight-through gradient). Full fine-tune, or `--lora_r`.
3. Exports: each run in the folder's own quantized form (`dstrain export`, its relative RMS error printed), and
   each dense (`--dtype bfloat16`): the no-QAT one is "the bf16 model", the QAT one its unquantized weights.
4. Held-out loss of every folder (`dstrain.model.from_pretrained(..., float32)` dequantizes on load; the rows of
   `--eval_split` of the text's paragraphs, chosen by content hash, never trained on in either stage), eval
   mode, summed over every held-out token: the release before fine-tuning (bf16 and quantized) too.

Prints JSON lines: the kernel path, each stage's steps and seconds, each folder's held-out loss, and a summary
with the losses side by side and each quantized export's gap to the bf16 model (no share-closed ratio: the
no-QAT gap can be as small as the difference two training trajectories make, docs/performance.md). Every
training run is `python -m dstrain` on one process (fp32, the CPU); the whole script ~3 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dstrain.data import DataOptions, build_eval_rows, load_tokenizer  # noqa: E402
from dstrain.model import from_pretrained  # noqa: E402
from dstrain.model.hf import SAFE_INDEX  # noqa: E402
from dstrain.model.hf.quant import dequantize_fp4, dequantize_fp8  # noqa: E402
from dstrain.model.hf.quantize import quantize_fp4, quantize_fp8  # noqa: E402
from launch.bench_dpo import read_text, tail_means  # noqa: E402
from launch.bench_model import kernel_path  # noqa: E402
from launch.bench_muon import write_start  # noqa: E402

TEXT = "tinyshakespeare.txt"
# HF names as DeepSeek-V3 folders spell them: the routed experts (V4-Flash: FP4) and every other projection in
# the decoder layers (FP8); the MoE router (`mlp.gate.weight`) and the rest are not quantized in the releases.
ROUTED = re.compile(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
FP8_LINEAR = re.compile(
    r"(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)"
    r"|mlp\.(shared_experts\.)?(gate|up|down)_proj)\.weight$"
)
V3_FP8 = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
LORA_TARGETS = "q_b_proj,kv_b_proj,o_proj,shared_experts,experts"


def dstrain(*args: str) -> str:
    """`python -m dstrain ARGS` -> its stdout."""
    cmd = [sys.executable, "-m", "dstrain", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc.stdout


def quantization_line(stdout: str) -> str:
    """The export's line on the error quantizing introduced (dstrain.checkpoint.export.error_summary)."""
    lines = [ln for ln in stdout.splitlines() if "weights quantized" in ln]
    return lines[-1].removeprefix("dstrain export: ") if lines else ""


def rel_rms(w: torch.Tensor, back: torch.Tensor) -> float:
    return float((back - w).norm() / w.norm())


def quantize_release(folder: Path) -> dict[str, float]:
    """Rewrite the bf16 safetensors `folder` (one process's export) in the V4-Flash recipe's forms under V3's
    names. -> the mean relative RMS error of each form."""
    from safetensors.torch import load_file, save_file

    dense: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        dense.update(load_file(f))
        f.unlink()
    (folder / SAFE_INDEX).unlink(missing_ok=True)
    files: dict[str, torch.Tensor] = {}
    errors: dict[str, list[float]] = {"fp8": [], "fp4": []}
    for k, t in dense.items():
        w = t.float()
        if ROUTED.search(k):
            files[k], files[k.removesuffix("weight") + "scale"] = q, s = quantize_fp4(w)
            errors["fp4"].append(rel_rms(w, dequantize_fp4(q, s)))
        elif FP8_LINEAR.search(k):
            files[k], files[k + "_scale_inv"] = q, s = quantize_fp8(w, torch.float32)
            errors["fp8"].append(rel_rms(w, dequantize_fp8(q, s)))
        else:
            files[k] = t
    save_file(files, folder / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**conf, "quantization_config": V3_FP8}, indent=2))
    return {f"{form}_weights": len(e) for form, e in errors.items()} | {
        f"{form}_rel_rms_mean": sum(e) / len(e) for form, e in errors.items()
    }


@torch.no_grad()
def heldout_loss(folder: Path, rows: dict[str, torch.Tensor], batch: int) -> float:
    """Mean loss per held-out target token of the folder's model (dequantized to fp32), in eval mode."""
    model = from_pretrained(folder, dtype=torch.float32).eval()
    loss_sum, tokens = 0.0, 0
    for a in range(0, rows["input_ids"].shape[0], batch):
        out = model(**{k: v[a : a + batch] for k, v in rows.items()})
        loss_sum += float(out.lm_loss_sum)
        tokens += int(out.lm_tokens)
    return loss_sum / tokens


def make_release(args: argparse.Namespace, out: Path, common: list[str]) -> Path:
    """Step 1: pretrain, export bf16, quantize. -> the quantized folder."""
    t = time.perf_counter()
    write_start(out / "start_hf", args.seed)
    dstrain("train", "--model", str(out / "start_hf"), "--max_steps", str(args.pretrain_steps),
            "--lr", str(args.pretrain_lr), "--output_dir", str(out / "pretrain"), *common)  # fmt: skip
    dstrain(
        "export", str(out / "pretrain"), "--out", str(out / "release_bf16"), "--dtype", "bfloat16", "--force"
    )
    dstrain(
        "export", str(out / "pretrain"), "--out", str(out / "release_hf"), "--dtype", "bfloat16", "--force"
    )
    errors = quantize_release(out / "release_hf")
    print(json.dumps({"stage": "release", "pretrain_steps": args.pretrain_steps, "lr": args.pretrain_lr,
                      "loss_last10": tail_means(out / "pretrain", ("loss",))["loss"], **errors,
                      "s": round(time.perf_counter() - t, 1)}), flush=True)  # fmt: skip
    return out / "release_hf"


def fine_tune(args: argparse.Namespace, release: Path, out: Path, qat: str, common: list[str]) -> dict:
    """Step 2 and 3 for one --qat setting: train, export quantized and bf16. -> the stage's JSON record."""
    t = time.perf_counter()
    run = out / f"qat_{qat}"
    lora = []
    if args.lora_r:
        lora = ["--lora_r", str(args.lora_r), "--lora_alpha", str(2 * args.lora_r), "--lora_targets", LORA_TARGETS,
                "--base_precision", "bf16"]  # fmt: skip
    dstrain("train", "--model", str(release), "--qat", qat, "--max_steps", str(args.steps), "--lr", str(args.lr),
            "--warmup_steps", str(max(1, args.steps // 10)), "--output_dir", str(run), *lora, *common)  # fmt: skip
    t_train = time.perf_counter() - t
    quantized = dstrain("export", str(run), "--out", str(out / f"qat_{qat}_quantized"), "--force")
    dstrain("export", str(run), "--out", str(out / f"qat_{qat}_bf16"), "--dtype", "bfloat16", "--force")
    return {"stage": f"fine-tune --qat {qat}", "steps": args.steps, "lr": args.lr, "lora_r": args.lora_r,
            "loss_last10": tail_means(run, ("loss",))["loss"], "export": quantization_line(quantized),
            "train_s": round(t_train, 1), "s": round(time.perf_counter() - t, 1)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data_dir", default=str(ROOT.parent / "shared" / "data"),
                    help=f"folder holding {TEXT} (absent: dstrain's built-in copy)")  # fmt: skip
    ap.add_argument("--eval_split", type=float, default=0.1, help="share of the paragraphs held out")
    ap.add_argument(
        "--eval_tokens", type=int, default=0, help="held-out token budget (0: every held-out row)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pretrain_steps", type=int, default=300)
    ap.add_argument("--pretrain_lr", type=float, default=3e-3)
    ap.add_argument("--steps", type=int, default=150, help="fine-tuning steps of each run")
    ap.add_argument("--lr", type=float, default=1e-3, help="fine-tuning learning rate")
    ap.add_argument("--lora_r", type=int, default=0, help="LoRA rank (0: full fine-tune)")
    ap.add_argument("--micro_batch_size", type=int, default=4)
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temporary one)")
    ap.add_argument("--release", default=None, help="an earlier run's release_hf folder: skip step 1")
    args = ap.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_qat_"))
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()

    text, source = read_text(Path(args.data_dir))
    data = out / TEXT
    data.write_text(text, encoding="utf-8")  # one path for every stage: the same paragraphs held out
    common = ["--data", str(data), "--eval_split", str(args.eval_split), "--precision", "fp32",
              "--num_workers", "0", "--save_every", "0", "--seed", str(args.seed), "--seq_len", str(args.seq_len),
              "--micro_batch_size", str(args.micro_batch_size), "--no-plots",
              "--eval_tokens", "8192"]  # fmt: skip
    # --eval_split keeps the held-out paragraphs out of training; the trainer's own end-of-run eval is cut to a
    # few rows (the full held-out set is evaluated below, the same way for every folder)
    print(json.dumps({"data": source, "eval_split": args.eval_split}), flush=True)

    release = Path(args.release) if args.release else make_release(args, out, common)
    tok = load_tokenizer(None, str(release))
    opts = DataOptions(data=str(data), eval_split=args.eval_split, seq_len=args.seq_len,
                       eval_tokens=args.eval_tokens, num_workers=0)  # fmt: skip
    rows = build_eval_rows(opts, tok)
    batch = 4 * args.micro_batch_size
    model = from_pretrained(release, dtype=torch.float32)
    print(json.dumps({"model_params": sum(p.numel() for p in model.parameters()),
                      "heldout_rows": rows["input_ids"].shape[0],
                      **kernel_path(model.config, torch.float32, "cpu")}), flush=True)  # fmt: skip
    del model

    for qat in ("off", "on"):
        print(json.dumps(fine_tune(args, release, out, qat, common)), flush=True)

    t = time.perf_counter()
    folders = {"release bf16 (before fine-tuning)": release.parent / "release_bf16",
               "release quantized (before fine-tuning)": release,
               "no QAT, bf16 (the bf16 model)": out / "qat_off_bf16",
               "no QAT, quantized export": out / "qat_off_quantized",
               "QAT, quantized export": out / "qat_on_quantized",
               "QAT, its bf16 weights": out / "qat_on_bf16"}  # fmt: skip
    losses = {}
    for name, folder in folders.items():
        if folder.is_dir():  # --release from elsewhere: its bf16 sibling may be absent
            losses[name] = heldout_loss(folder, rows, batch)
            print(
                json.dumps({"heldout": name, "loss": round(losses[name], 4), "folder": str(folder)}),
                flush=True,
            )
    bf16, plain, qat = (losses[k] for k in list(folders)[2:5])
    print(
        json.dumps({"stage": "eval", "folders": len(losses), "s": round(time.perf_counter() - t, 1)}),
        flush=True,
    )
    print(json.dumps({"summary": "held-out loss after fine-tuning", "bf16": round(bf16, 4),
                      "quantized_no_qat": round(plain, 4), "quantized_qat": round(qat, 4),
                      "gap_no_qat": round(plain - bf16, 4), "gap_qat": round(qat - bf16, 4),
                      "steps": args.steps, "lr": args.lr, "lora_r": args.lora_r,
                      "total_s": round(time.perf_counter() - t_all, 1), "out": str(out)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
