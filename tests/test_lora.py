"""LoRA: adapters on exactly the named linears, merging, PEFT folders transformers+peft load, the peft 0.21
target trap, training that changes only the adapters (one process, and 2-rank ZeRO-3).

Also the shared pieces of the export tests: a transformers-written HF folder and dstrain runs on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_fixtures import make_hf_model, v3_config
from test_train_support import ROOT, launch, make_options, tiny_config

from dstrain.lora import (
    LoRALinear,
    apply_finetune_options,
    apply_lora,
    lora_modules,
    lora_state,
    merge_lora,
    save_peft_adapter,
)
from dstrain.model import build_model, from_pretrained

DEFAULT_TARGETS = ["q_b_proj", "kv_b_proj", "o_proj", "shared_experts"]
ATTN_TARGETS = "q_b_proj,kv_b_proj,o_proj"
LORA_ARGS = ["--lora_r", "4", "--lora_alpha", "8", "--no-train_router", "--no-train_mtp"]
LORA_ARGS += ["--moe_bias_update_speed", "0", "--lr", "1e-2"]


# ---------------------------------------------------------------------- shared with test_export
def read_weights(ckpt):
    """A checkpoint's full weights (dstrain.training.weights, any layout), as a generator of (key, tensor)."""
    from dstrain.training.weights import iter_weights

    return iter_weights(Path(ckpt))


def hf_source(path: Path) -> Path:
    """A transformers-written tiny V3 folder extended with an MTP layer (bf16, 2 shards) and a byte
    tokenizer (so dstrain's data pipeline fits its 320-token vocabulary)."""
    from test_model_hf_format import official_folder

    from dstrain.data.testing import byte_tokenizer

    path.mkdir(parents=True)
    official_folder(path)
    byte_tokenizer().save_pretrained(path)
    return path


def train(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """One `python dstrain/train.py` process (no launcher): short rows, no MFU measurement."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["--seq_len", "32", "--micro_batch_size", "2", "--peak_tflops", "1", "--warmup_steps", "1"]
    cmd = [sys.executable, "dstrain/train.py", *common, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def check_lora_json(ckpt: Path, args: list[str]) -> None:
    """checkpoint.save wrote lora.json (through save_lora_settings), equal to a fresh derivation."""
    from dstrain.export import checkpoint_config
    from dstrain.model.model import DeepSeekLM
    from dstrain.training.trainer import apply_overrides

    opts = make_options(args)
    with torch.device("meta"):
        model = DeepSeekLM(apply_overrides(checkpoint_config(ckpt), opts))
    apply_finetune_options(model, opts.train)
    assert json.loads((ckpt / "lora.json").read_text()) == json.loads(json.dumps(model.lora_settings))


_RUNS: dict[str, dict[str, Path]] = {}


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> dict[str, Path]:
    """hf: the source folder; full: --max_steps 0 on it; lora0/lora3: a LoRA run's step 0 and step 3."""
    key = str(tmp_path_factory.getbasetemp())
    if key not in _RUNS:
        root = tmp_path_factory.mktemp("runs")
        hf = hf_source(root / "hf")
        train(["--model", str(hf), "--max_steps", "0", "--output_dir", str(root / "full")])
        lora = ["--model", str(hf), "--output_dir", str(root / "lora"), *LORA_ARGS]
        train([*lora, "--max_steps", "0"])
        train([*lora, "--max_steps", "3", "--resume", "auto"])
        ckpts = root / "lora" / "checkpoints"
        for step in ("step_00000000", "step_00000003"):
            check_lora_json(ckpts / step, LORA_ARGS)
        _RUNS[key] = {
            "hf": hf,
            "full": root / "full" / "checkpoints" / "step_00000000",
            "lora0": ckpts / "step_00000000",
            "lora3": ckpts / "step_00000003",
        }
    return _RUNS[key]


def randomize_adapters(model, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            m.lora_B.copy_(0.2 * torch.randn(m.lora_B.shape, generator=g))


# ---------------------------------------------------------------------- placement
def expected_default(n_layers: int = 2, moe_from: int = 1) -> set[str]:
    blocks = [f"layers.{i}" for i in range(n_layers)] + ["mtp.0.block"]
    out = {f"{b}.self_attn.{p}" for b in blocks for p in ("q_b_proj", "kv_b_proj", "o_proj")}
    moe = [f"layers.{i}" for i in range(moe_from, n_layers)] + ["mtp.0.block"]
    out |= {f"{b}.mlp.shared_experts.{p}" for b in moe for p in ("gate_proj", "up_proj", "down_proj")}
    return out


def test_adapters_land_exactly_on_the_named_modules():
    model = build_model(tiny_config(), seed=0)
    names = apply_lora(model, 4, 8.0, DEFAULT_TARGETS)
    assert set(names) == expected_default() == set(lora_modules(model))
    assert not any(".experts" in n or n.endswith(".gate") for n in names)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.{p}" for n in names for p in ("lora_A", "lora_B")}
    assert set(lora_state(model)) == trainable
    # base weights keep their names: the state dict only gains the adapters
    plain = set(build_model(tiny_config(), seed=0).state_dict())
    assert set(model.state_dict()) == plain | trainable
    m = model.layers[1].mlp.shared_experts.gate_proj
    assert isinstance(m, LoRALinear) and torch.equal(m.lora_B, torch.zeros_like(m.lora_B))
    assert m.lora_A.shape == (4, 32) and m.lora_B.shape == (16, 4) and m.lora_A.abs().sum() > 0

    dense_and_shared = apply_lora(build_model(tiny_config(), seed=0), 4, 8.0, ["gate_proj"])
    assert set(dense_and_shared) == {
        "layers.0.mlp.gate_proj",
        "layers.1.mlp.shared_experts.gate_proj",
        "mtp.0.block.mlp.shared_experts.gate_proj",
    }


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (["experts"], "routed experts: fused 3-D parameters, not nn.Linear"),
        (["o_proj", "gate"], "is the MoE router, not an nn.Linear"),
        (["nothing_here"], "matches no module"),
        (["input_layernorm"], "is not an nn.Linear"),
    ],
)
def test_unadaptable_targets_are_one_line_errors(targets, message):
    with pytest.raises(ValueError, match=message) as info:
        apply_lora(build_model(tiny_config(), seed=0), 4, 8.0, targets)
    assert "\n" not in str(info.value)


def test_finetune_options_freeze_and_unfreeze_explicitly():
    def trainable(args: list[str]) -> set[str]:
        model = build_model(tiny_config(), seed=0)
        apply_finetune_options(model, make_options(args).train)
        return {n for n, p in model.named_parameters() if p.requires_grad}

    routers = {"layers.1.mlp.gate.weight", "mtp.0.block.mlp.gate.weight"}
    lora = trainable(["--lora_r", "2"])
    adapters = {n for n in lora if n.endswith(("lora_A", "lora_B"))}
    assert adapters == {f"{m}.{p}" for m in expected_default() for p in ("lora_A", "lora_B")}
    mtp_own = {n for n in lora if n.startswith("mtp.") and n not in adapters and n not in routers}
    assert "mtp.0.eh_proj.weight" in mtp_own and "mtp.0.block.mlp.experts.gate_up_proj" in mtp_own
    assert not any(n.endswith(("o_proj.weight", "q_b_proj.weight")) for n in lora)  # base weights frozen
    assert lora == adapters | routers | mtp_own
    off = trainable(["--lora_r", "2", "--no-train_router", "--no-train_mtp"])
    assert off == {n for n in adapters if not n.startswith("mtp.")}
    full = trainable(["--no-train_router"])
    everything = {n for n, _ in build_model(tiny_config(), seed=0).named_parameters()}
    assert full == everything - routers
    with pytest.raises(ValueError, match="--lora_targets gate:.*router"):
        trainable(["--lora_r", "2", "--lora_targets", "gate"])


def test_merge_equals_base_plus_scaled_BA():
    model = build_model(tiny_config(), seed=0).eval()
    names = apply_lora(model, 4, 6.0, DEFAULT_TARGETS)
    randomize_adapters(model)
    before = {
        n: (m.weight.detach().clone(), m.lora_A.detach().clone(), m.lora_B.detach().clone())
        for n, m in lora_modules(model).items()
    }
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        want = model(ids).logits
    assert merge_lora(model) == names
    assert not lora_modules(model) and set(model.state_dict()) == set(build_model(tiny_config()).state_dict())
    for n, (w, a, b) in before.items():
        assert torch.allclose(model.get_submodule(n).weight, w + 1.5 * b @ a, atol=1e-6), n
    with torch.no_grad():
        assert (model(ids).logits - want).abs().max() <= 1e-5


# ---------------------------------------------------------------------- PEFT folders
def test_peft_folder_loads_onto_transformers_with_equal_logits(tmp_path):
    from peft import PeftModel
    from transformers import DeepseekV3ForCausalLM

    make_hf_model(v3_config()).save_pretrained(tmp_path / "base")
    ours = from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    names = apply_lora(ours, 4, 8.0, ATTN_TARGETS.split(","))
    randomize_adapters(ours)
    paths = save_peft_adapter(ours, tmp_path / "adapter", str(tmp_path / "base"))
    main_layers = [n for n in names if not n.startswith("mtp.")]
    assert paths == sorted(f"model.{n}" for n in main_layers)
    from safetensors.torch import load_file

    keys = set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_b_proj.lora_A.weight" in keys
    assert len(keys) == 2 * len(main_layers)
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (
        conf["r"] == 4 and conf["lora_alpha"] == 8.0 and conf["target_modules"].startswith("(model\\.layers")
    )

    hf = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    wrapped = {
        n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if hasattr(m, "lora_A")
    }
    assert wrapped == set(paths)
    merge_lora(ours)
    ids = torch.randint(0, 320, (2, 20))
    with torch.no_grad():
        got = peft_model(input_ids=ids, use_cache=False).logits
        assert (got - ours(ids).logits).abs().max() <= 1e-5


def test_peft_trap_is_real_and_guarded(tmp_path):
    """peft 0.21 on transformers 5 turns LoRA targets named gate_proj/up_proj/down_proj (even spelled as an
    exact-path regex) into targets on the fused routed experts: the shared-expert adapters would load
    nowhere. dstrain refuses to write such an adapter folder (the merged export is unaffected)."""
    from peft import LoraConfig, get_peft_model

    regex = r"model\.layers\.1\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)"
    peft_model = get_peft_model(make_hf_model(v3_config()), LoraConfig(r=4, target_modules=regex))
    wrapped = {n for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert not any("shared_experts" in n for n in wrapped)
    assert any(n.endswith("mlp.experts") for n in wrapped)

    model = build_model(tiny_config(), seed=0)
    apply_lora(model, 4, 8.0, DEFAULT_TARGETS)
    with pytest.raises(ValueError, match="onto the routed experts"):
        save_peft_adapter(model, tmp_path / "adapter", "base")


# ---------------------------------------------------------------------- training
def test_lora_training_changes_only_adapters(trained):
    before = dict(read_weights(trained["lora0"]))
    after = dict(read_weights(trained["lora3"]))
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    # --no-train_mtp freezes the MTP adapters too; γ = 0 leaves the expert bias alone
    want = {f"{m}.{p}" for m in expected_default(3) for p in ("lora_A", "lora_B") if not m.startswith("mtp.")}
    assert changed == want
    # frozen parameters get no optimizer state: the fp32 partition holds exactly the trainable adapters
    from dstrain.training.checkpoint import _deepspeed_state_classes

    with torch.serialization.safe_globals(_deepspeed_state_classes()):
        optim = torch.load(
            trained["lora3"] / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
            map_location="cpu",
            weights_only=True,
        )["optimizer_state_dict"]
    assert sum(t.numel() for t in optim["single_partition_of_fp32_groups"]) == sum(
        after[k].numel() for k in want
    )
    settings = json.loads((trained["lora3"] / "lora.json").read_text())
    assert settings["r"] == 4 and settings["alpha"] == 8.0 and settings["train_router"] is False


@pytest.mark.multirank
def test_zero3_lora_two_ranks(tmp_path):
    proc = launch(["tests/test_lora.py", "zero3", str(tmp_path)], timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    res = [json.loads((tmp_path / f"zero3_rank{r}.json").read_text()) for r in range(2)]
    assert res[0]["changed"] == res[0]["adapters"] and res[0]["changed"]
    assert res[0]["changed"] == res[1]["changed"] and res[0]["losses"] == res[1]["losses"]
    assert all(x is not None for x in res[0]["losses"]) and res[0]["losses"][-1] < res[0]["losses"][0]
    assert (tmp_path / "run" / "checkpoints" / "step_00000004" / "COMPLETE").is_file()


def zero3_worker(out: str) -> None:
    import deepspeed
    from test_train_support import _trainer

    from dstrain.training import dist

    info = dist.init_distributed()
    args = "--config zero3 --micro_batch_size 2 --max_steps 4 --save_every 0 --lr 1e-2 --lora_r 4"
    opts = make_options([*args.split(), "--no-train_router", "--no-train_mtp"])
    tr = _trainer(opts, f"{out}/run", info=info)
    params = dict(tr.model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        start = {n: p.detach().clone() for n, p in params.items()}
    tr.run()
    with deepspeed.zero.GatheredParameters(list(params.values())):
        changed = sorted(n for n, p in params.items() if not torch.equal(p.detach(), start[n]))
    adapters = sorted(n for n, p in params.items() if p.requires_grad)
    res = {"changed": changed, "adapters": adapters, "losses": [r["loss"] for r in tr.history]}
    Path(out, f"zero3_rank{info.rank}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if sys.argv[1] == "zero3":
        zero3_worker(sys.argv[2])
