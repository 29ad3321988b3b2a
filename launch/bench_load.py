"""Memory per rank while loading a Hugging Face folder into each training layout, against the model's size.

  python launch/bench_load.py                 # writes a ~0.6 GB bf16 folder, then 2-rank loads
  python launch/bench_load.py --folder DIR    # an existing DeepSeek folder

Each layout is one 2-rank launch that only builds the model as `dstrain/train.py` would (no engine, no
optimizer). Printed per layout and rank: the bytes read from the folder, what the rank keeps (fp32, as
dstrain trains), and its peak resident memory growth while loading (sampled every 5 ms). Peak memory counts
the folder's memory-mapped pages that were touched (page cache, which the kernel may drop under pressure).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ranks import torchrun

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "dp2 ZeRO-1": "--config zero1",
    "dp2 ZeRO-3": "--config zero3",
    "pp2": "--config zero1 --pp 2",
    "tp2": "--config zero1 --tp 2",
    "ep2": "--config zero2 --ep 2",
}


def write_folder(path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from dstrain.model import ModelConfig, build_model, save_pretrained

    cfg = ModelConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512,
        num_hidden_layers=6, num_attention_heads=8, q_lora_rank=256, kv_lora_rank=256, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=32, n_shared_experts=1, num_experts_per_tok=4,
        n_group=1, topk_group=1, first_k_dense_replace=1, num_nextn_predict_layers=1,
    )  # fmt: skip
    save_pretrained(build_model(cfg, dtype="bfloat16", seed=0), path, max_shard_bytes=256 * 2**20)


def worker(folder: str, flags: str, out: str) -> None:
    sys.path.insert(0, str(ROOT))
    from dstrain import dist
    from dstrain.config.options import parse_options
    from dstrain.config.plan import prepare
    from dstrain.training.build import build_for_training

    plan = prepare(
        parse_options(["--model", folder, *flags.split(), "--micro_batch_size", "1", "--seq_len", "64"])
    )
    info = dist.init_distributed()

    def no_loss(out, n_global):  # noqa: ANN001, ANN202 - nothing trains here
        raise AssertionError("bench_load builds the model only")

    built = build_for_training(plan, info.rank, info.device, no_loss)
    held = 0
    for p in built.module.parameters():
        held += getattr(p, "ds_tensor", p).numel() * 4
    Path(out, f"rank{info.rank}.json").write_text(json.dumps({**built.load, "held_bytes": held}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", help="a DeepSeek HF folder (default: write a ~0.6 GB one to a temp dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.folder
        if folder is None:
            folder = os.path.join(tmp, "model")
            write_folder(Path(folder))
        size = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors"))
        print(f"folder {folder}: {size / 2**20:.0f} MiB of safetensors", flush=True)
        mib = 2**20
        for name, flags in LAYOUTS.items():
            out = tempfile.mkdtemp(dir=tmp)
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
            }
            cmd = torchrun(2, __file__, "--worker", folder, flags, out)
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
            if proc.returncode != 0:
                print(f"{name}: failed\n{proc.stderr[-3000:]}", flush=True)
                continue
            for r in range(2):
                s = json.loads(Path(out, f"rank{r}.json").read_text())
                print(
                    f"{name:12s} rank {r}: read {s['bytes_read'] / mib:6.0f} MiB, keeps {s['held_bytes'] / mib:6.0f} MiB"
                    f" fp32, peak memory +{s['peak_rss_growth'] / mib:6.0f} MiB while loading",
                    flush=True,
                )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:5])
    else:
        main()
