"""`dstrain plan` as scripts call it: the published DeepSeek-V3, V2-Lite and Moonlight shapes on 8 x 80 GB
(configs only, no weights), the verdict on the last line, the layouts that fit, and one-line errors."""

from __future__ import annotations

import json
import re

import pytest

from dstrain.cli import main as dstrain_main
from tests.model.deepseek_v3.test_config import KIMI_K25, MOONLIGHT

VERDICT = re.compile(r"^(fits|does not fit): predicted peak (\d+\.\d) GiB per rank of 80 GiB$")
GPUS = ["--num_gpus", "8", "--gpu_memory_gb", "80", "--seq_len", "4096", "--micro_batch_size", "1"]


def plan(capsys, *args: str) -> tuple[int, list[str], str]:  # noqa: ANN001
    code = dstrain_main(["plan", *args])
    out = capsys.readouterr()
    return code, out.out.strip().splitlines(), out.err


def test_deepseek_v3_does_not_fit_eight_gpus_and_says_what_would(capsys):
    code, lines, _ = plan(capsys, "--model", "deepseek-v3", "--config", "zero1", "--ep", "8", *GPUS,
                          "--activation_checkpointing")  # fmt: skip
    assert code == 0
    verdict = VERDICT.match(lines[-1])
    assert verdict and verdict[1] == "does not fit" and float(verdict[2]) > 80
    text = "\n".join(lines)
    assert "no layout of 8 x 80 GiB fits without offloading" in text
    assert "offload optimizer+param" in text and "host memory" in text  # ZeRO-3 with everything on the host
    assert re.search(r"the fewest GPUs that fit without offloading: \d+ x 80 GiB", text)


def test_v2_lite_fits_and_lists_cheaper_layouts(capsys):
    code, lines, _ = plan(capsys, "--model", "deepseek-v2-lite", "--config", "zero2", *GPUS)
    verdict = VERDICT.match(lines[-1])
    assert code == 0 and verdict and verdict[1] == "fits"
    assert any(line.startswith("layouts that fit on 8 x 80 GiB") for line in lines)
    assert any("parameters" in line for line in lines) and any("activations" in line for line in lines)


def test_moonlight_from_its_config_json_alone(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(MOONLIGHT))
    code, lines, _ = plan(
        capsys, "--model", str(tmp_path), "--config", "zero3", *GPUS, "--activation_checkpointing"
    )
    assert code == 0 and VERDICT.match(lines[-1])
    assert "ZeRO-3" in lines[1]


STORED = "frozen base, stored (codes + scales)"


def rows(lines: list[str]) -> dict[str, float]:
    """The per-rank table's rows: name -> GiB."""
    found = (re.match(r"^  (\S.*?)\s+(\d+\.\d+)$", line) for line in lines)
    return {m[1]: float(m[2]) for m in found if m}


def test_a_quantized_release_under_lora_plans_its_stored_base(capsys, tmp_path):
    """A preset of an FP8 release under LoRA plans the frozen base as the release stores it (one line says
    so): its stored bytes instead of bf16 parameters, and the dequantized working set of one layer;
    --base_precision bf16 plans today's dense base. A folder of config.json alone plans what its
    quantization_config says: Kimi-K2.5's INT4 experts, as its preset does."""
    args = ["--config", "zero1", "--ep", "8", *GPUS, "--activation_checkpointing", "--lora_r", "16"]
    code, lines, _ = plan(capsys, "--model", "deepseek-v3", *args)
    assert code == 0 and VERDICT.match(lines[-1])
    assert any(
        line.startswith("frozen base held as the release stores it: FP8 e4m3 128x128") for line in lines
    )
    stored = rows(lines)
    _, lines, _ = plan(capsys, "--model", "deepseek-v3", *args, "--base_precision", "bf16")
    dense = rows(lines)
    assert STORED not in dense and not any(line.startswith("frozen base") for line in lines)
    # FP8 codes of ~97% of the weights: about half of bf16's bytes
    assert 0.45 < (stored[STORED] + stored["parameters"]) / dense["parameters"] < 0.6
    assert stored["dequantized base weights (one layer)"] > 0 and stored["total"] < dense["total"]
    (tmp_path / "config.json").write_text(json.dumps(KIMI_K25))
    _, folder, _ = plan(capsys, "--model", str(tmp_path), *args)
    _, preset, _ = plan(capsys, "--model", "kimi-k2.5", *args)
    assert any(line.startswith("frozen base held as the release stores it: INT4 g32") for line in folder)
    assert rows(folder) == rows(preset) and folder[-1] == preset[-1]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "deepseek-v2-lite", "--tp", "32", "--num_gpus", "32"], "--tp 32 must divide num_attention_heads 16"),
        (["--model", "deepseek-v3", "--ep", "3", "--num_gpus", "6"], "--ep 3 must divide n_routed_experts 256"),
        (["--model", "deepseek-v3", "--tp", "3", "--num_gpus", "8"], "world size 8 is not divisible by --pp 1 x --tp 3"),
        (["--model", "nope", "--num_gpus", "8"], "--model nope"),
        (["--model", "deepseek-v3", "--num_gpus", "0"], "--num_gpus 0"),
        (["--model", "tiny-kimi-linear", "--lora_r", "8", "--lora_targets", "kv_a_proj", "--num_gpus", "8"],
         "--lora_targets kv_a_proj: 'kv_a_proj' matches no module of this model"),
        (["--model", "deepseek-v2", "--lora_r", "8", "--base_precision", "stored", "--num_gpus", "8"],
         "--base_precision stored: needs a --model folder with quantized weights"),
    ],
)  # fmt: skip
def test_mistakes_are_one_line_errors(capsys, args, message):
    code, lines, err = plan(capsys, *args, "--gpu_memory_gb", "80")
    assert code == 2 and lines == []
    assert err.count("\n") == 1 and err.startswith("dstrain: error:") and message in err, err


def test_a_family_the_estimate_does_not_model_is_said_first(capsys, monkeypatch):
    """Every family is modelled now: one marked `memory_estimate` in its Family record (here Kimi Linear, as a
    new family would be) is refused in one line, before a LoRA target of another family's names."""
    from dstrain.model import family_of, get_config

    family = family_of(get_config("tiny-kimi-linear"))
    monkeypatch.setitem(family.unsupported, "memory_estimate", "the memory estimate does not model it yet")
    args = ["--model", "tiny-kimi-linear", "--lora_r", "8", "--lora_targets", "kv_a_proj", "--num_gpus", "8"]
    code, lines, err = plan(capsys, *args, "--gpu_memory_gb", "80")
    assert code == 2 and lines == []
    assert (
        err
        == "dstrain: error: dstrain plan --model tiny-kimi-linear: the memory estimate does not model it yet\n"
    )
