"""A stored base's memory, planned and measured (issue 62.4): LoRA on a wide DeepSeek-V3-style FP8 folder (hidden
1024, 2 MoE layers of 48 experts: ~165 MB of FP8 codes and fp32 scales) with `--base_precision stored`, one
process. It holds the folder's stored bytes of every quantized weight (codes + scales, within 2%), and the
peak of live tensor bytes over 3 training steps (the allocation tracker, as launch/bench_plan.py measures) is
the estimate's within 15%: there the dequantized experts of one layer (fp32 temporaries and gate_up, down)
are most of the peak."""

from __future__ import annotations

import sys

import pytest

from tests.helpers.tiny import ROOT

SEQ, MICRO, STEPS = 128, 2, 3


def wide_config():  # noqa: ANN201 - a dstrain ModelConfig
    from dstrain.model import ModelConfig

    return ModelConfig(
        vocab_size=8192, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=3,
        num_attention_heads=8, q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, n_routed_experts=48, n_shared_experts=1, num_experts_per_tok=4, n_group=1, topk_group=1,
        first_k_dense_replace=1, num_nextn_predict_layers=0,
    )  # fmt: skip


def measured(info, folder: str, out: str, precision: str = "fp32", config: str = "zero1") -> dict:  # noqa: ANN001
    """A pool scenario: LoRA on `folder` with its base stored, 3 steps in `precision` with the DeepSpeed
    `config` under the allocation tracker -> the stored bytes held, the measured peak (launch/bench_plan.py's
    steady_peak), the estimate's peak and terms, and the phases' (start, peak) bytes."""
    import gc

    import torch

    sys.path.insert(0, str(ROOT / "launch"))
    from bench_plan import small_bucket_config, steady_peak

    from dstrain.config.options import parse_options
    from dstrain.config.plan import prepare
    from dstrain.memory.estimate import Workload, estimate
    from dstrain.memory.measure import AllocationTracker
    from dstrain.model.common.stored import stored_weights
    from dstrain.training.trainer import Trainer

    flags = [
        "--model", folder, "--config", small_bucket_config(config, out), "--precision", precision, "--lora_r", "8",
        "--seq_len", str(SEQ), "--micro_batch_size", str(MICRO), "--max_steps", str(STEPS), "--save_every", "0",
        "--no-tensorboard", "--no-plots", "--base_precision", "stored",
    ]  # fmt: skip
    plan = prepare(parse_options(flags), info.world_size).with_output_dir(out)
    g = torch.Generator().manual_seed(0)

    class Rows:
        def __next__(self) -> dict:
            ids = torch.randint(0, plan.model.vocab_size, (MICRO, SEQ), generator=g)
            return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(SEQ).expand_as(ids)}

    with AllocationTracker() as tracker:
        with tracker.phase("setup"):
            trainer = Trainer(plan, info, loader=Rows(), verbose=False)
            trainer.setup()
        for step in range(1, STEPS + 1):
            with tracker.phase(f"step {step}"):
                trainer.train_step()
    held = sum(w.nbytes for _, w in stored_weights(trainer.model))
    del trainer
    gc.collect()
    est = estimate(Workload.of(plan))
    peak = steady_peak({p.name: p for p in tracker.phases})
    return {"stored": plan.stored_base, "held": held, "measured": peak, "predicted": est.peak,
            "terms": est.terms, "phases": {p.name: (p.start_bytes, p.peak_bytes) for p in tracker.phases}}  # fmt: skip


def test_each_forms_bytes_are_what_the_quantizers_write():
    """Form.nbytes: codes + scales (+ compressed-tensors' weight_shape) as the releases' forms hold a matrix,
    blocks cut short at the edges counted whole."""
    import torch

    from dstrain.memory.stored import FP4, FP8, FP8_E8M0, packed
    from dstrain.model.hf.files import E8M0
    from dstrain.model.hf.quantize import quantize_fp4, quantize_fp8, quantize_packed

    def nbytes(*parts: torch.Tensor) -> int:
        return sum(t.numel() * t.element_size() for t in parts)

    w = torch.randn(200, 320)
    assert FP8.nbytes(200, 320) == nbytes(*quantize_fp8(w, torch.float32))
    assert FP8_E8M0.nbytes(200, 320) == nbytes(*quantize_fp8(w, E8M0))
    assert FP4.nbytes(200, 320) == nbytes(*quantize_fp4(w))
    shape = torch.tensor([200, 320], dtype=torch.int32)
    assert packed(4, 32).nbytes(200, 320) == nbytes(*quantize_packed(w, 4, 10, torch.bfloat16), shape)


@pytest.mark.multirank
def test_the_stored_base_holds_its_stored_bytes_and_peaks_as_planned(tmp_path, rank_pools):
    from tests.helpers.quantized import fp8_folder

    folder = tmp_path / "fp8"
    stored = fp8_folder(folder, wide_config())
    (res,) = rank_pools.run(1, f"{__name__}:measured", str(folder), str(tmp_path), timeout=300)
    assert res["stored"]
    assert abs(res["held"] / sum(stored.values()) - 1) <= 0.02, (res["held"], sum(stored.values()))
    mib = {k: round(v / 2**20, 1) for k, v in res["terms"].items()}
    error = res["predicted"] / res["measured"] - 1
    print(f"stored {res['held']} B held of the folder's {sum(stored.values())} B; peak predicted "
          f"{res['predicted'] / 2**20:.1f} MiB, measured {res['measured'] / 2**20:.1f} MiB ({error:+.1%}); {mib}")  # fmt: skip
    assert abs(error) <= 0.15, (res["predicted"] / 2**20, res["measured"] / 2**20, mib, res["phases"])
