"""Quantization-aware training (common/qat.py, `--qat`): the fake quantization is the export's (its blocks,
rounding and kept scales) with a straight-through gradient; a QAT fine-tune of an FP8 folder exports a model
whose transformers logits equal dstrain's training-mode logits (adapters unmerged, QAT on) within 1e-5, where
the same run without QAT differs by the rounding the export adds."""

from __future__ import annotations

import torch

from dstrain.model.common.qat import Quantizer
from dstrain.model.hf.quant import dequantize_fp8
from dstrain.model.hf.quantize import quantize_fp8, round_trip
from tests.checkpoint.test_export import v3_fp8_folder
from tests.helpers.runs import train
from tests.helpers.trainer import make_options


def test_fake_quantization_is_the_export_s_round_trip_with_a_straight_through_gradient():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=g)
    q, s = quantize_fp8(w, torch.float32)
    on_grid = dequantize_fp8(q, s)
    quant = Quantizer(round_trip("weight_scale_inv", torch.float32), s)
    assert torch.equal(quant.round_trip(on_grid), on_grid)  # the source's weights: on its grid, unchanged
    moved = (on_grid + 0.01 * torch.randn(w.shape, generator=g)).requires_grad_()
    out = quant(moved)
    assert torch.equal(out, dequantize_fp8(*quantize_fp8(moved.detach(), torch.float32, keep=s)))
    probe = torch.randn(w.shape, generator=g)
    (out * probe).sum().backward()
    assert torch.equal(moved.grad, probe)


def _training_model(src, ckpt, lora: list[str]):  # noqa: ANN001, ANN202
    """dstrain's model as the run trained it (QAT on, adapters unmerged, the checkpoint's adapters)."""
    from dstrain.checkpoint.weights import iter_weights
    from dstrain.model import get_config
    from dstrain.model.build import materialize
    from dstrain.model.common.lora import is_lora_key
    from dstrain.model.quantized import apply_qat
    from dstrain.model.registry import on_meta
    from dstrain.model.sources import Weights, fill
    from dstrain.training.finetune import apply_finetune_options

    cfg = get_config(src).replace(bias_update_speed=0.0)
    model = on_meta(cfg)
    apply_finetune_options(model, make_options(lora).lora, 0)
    with Weights(cfg, 0, folder=src) as weights:
        assert apply_qat(model, weights.reader) > 0
        materialize(model, "cpu", torch.float32)
        fill(model, weights)
    state = model.state_dict()
    with torch.no_grad():
        for key, t in iter_weights(ckpt):
            if is_lora_key(key):
                state[key].copy_(t)
    return model


def test_a_qat_fine_tune_s_quantized_export_computes_its_training_forward(tmp_path, capsys, rank_pools):
    from transformers import AutoModelForCausalLM

    from dstrain.checkpoint.export import _dequantizing
    from dstrain.cli import main as dstrain_main
    from dstrain.model import get_config

    src = v3_fp8_folder(tmp_path / "src")
    lora = ["--base_precision", "bf16", "--lora_r", "8", "--lora_targets", "q_b_proj,o_proj,experts"]
    gaps = {}
    for qat in ("on", "off"):
        run = tmp_path / qat
        args = ["--model", str(src), *lora, "--max_steps", "3", "--lr", "3e-2", "--output_dir", str(run),
                "--no-plots", "--qat", qat, "--precision", "fp32"]  # fmt: skip
        train(rank_pools, args)
        assert dstrain_main(["export", str(run), "--out", str(tmp_path / f"hf_{qat}")]) == 0
        ckpt = next((run / "checkpoints").glob("step_*"))
        model = _training_model(src, ckpt, lora)
        if qat == "off":
            for m in model.modules():
                if hasattr(m, "qat"):
                    del m.qat
        ref = (
            AutoModelForCausalLM.from_pretrained(
                tmp_path / f"hf_{qat}",
                dtype=torch.float32,
                **_dequantizing(tmp_path / f"hf_{qat}", get_config(src)),
            )
            .float()
            .eval()
        )
        ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ours = model.train()(ids).logits  # training mode: QAT's fake quantization on
            theirs = ref(ids).logits
        gaps[qat] = float((ours - theirs).abs().max())
    capsys.readouterr()
    print(f"max |logits diff| of the quantized export against the training forward: {gaps}")
    assert gaps["on"] <= 1e-5, gaps
    assert gaps["off"] > 100 * max(gaps["on"], 1e-7), gaps  # without QAT the export's rounding shows
