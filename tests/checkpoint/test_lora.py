"""PEFT adapter folders: what transformers + peft load gives dstrain's logits; the peft 0.21 target trap."""

from __future__ import annotations

import json

import pytest
import torch

from dstrain.checkpoint.lora import save_peft_adapter
from dstrain.model import build_model, from_pretrained
from dstrain.model.lora import apply_lora, merge_lora
from tests.conftest import tiny_config
from tests.model.hf_fixtures import make_hf_model, v3_config
from tests.model.test_lora import DEFAULT_TARGETS, randomize_adapters

ATTN_TARGETS = "q_b_proj,kv_b_proj,o_proj"


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
