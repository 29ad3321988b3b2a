"""PEFT adapter folders: the serving layout (one key per routed expert and projection, as vLLM and SGLang load
DeepSeek adapters), and what peft 0.21 loads onto transformers 5 gives dstrain's logits; the peft target trap."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from safetensors.torch import load_file

from dstrain.checkpoint.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    MTP_WEIGHTS,
    PEFT_PREFIX,
    peft_loadable,
    save_peft_adapter,
    write_peft_adapter,
)
from dstrain.model import build_model, from_pretrained
from dstrain.model.common.lora import apply_lora, lora_state, merge_lora, merged_weight
from tests.helpers.hf import make_hf_model, v2_config, v3_config
from tests.helpers.tiny import tiny_config
from tests.model.common.test_lora import randomize_adapters

ATTN_TARGETS = "q_b_proj,kv_b_proj,o_proj"
# every kind dstrain adapts: attention, dense MLP and shared-expert linears, routed experts, routers
ALL_TARGETS = ["q_b_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts", "gate"]
R, ALPHA, EXPERTS = 4, 8.0, 8
MOE_LAYERS = (1, 2)  # v3_config: 3 layers, the first dense
_PER_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(gate|up|down)_proj")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("lora") / "base"
    make_hf_model(v3_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def v2_base(tmp_path_factory):
    """V2-Lite-like: no query compression (q_proj), two shared experts, greedy routing without expert bias."""
    path = tmp_path_factory.mktemp("lora_v2") / "base"
    make_hf_model(v2_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 320, (2, 20), generator=torch.Generator().manual_seed(1))


def adapted(base, targets, seed: int = 0):
    model = from_pretrained(base, dtype=torch.float32).eval()
    apply_lora(model, R, ALPHA, list(targets))
    randomize_adapters(model, seed)
    return model


def dstrain_logits(model, ids):
    merge_lora(model)
    with torch.no_grad():
        return model(ids).logits


def hf_model(base):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()


def peft_model(base, folder):
    from peft import PeftModel

    with warnings.catch_warnings():
        # peft checks rank/alpha_pattern against target_modules only, and calls the experts' pattern unused
        warnings.filterwarnings("ignore", "The following (rank|alpha)_pattern keys", RuntimeWarning)
        return PeftModel.from_pretrained(hf_model(base), folder).eval()


def peft_logits(base, folder, ids):
    with torch.no_grad():
        return peft_model(base, folder)(input_ids=ids, use_cache=False).logits


def hand_merged_logits(base, folder, ids):
    """transformers' model with the serving folder's deltas added to its weights by hand (per-expert keys into
    the fused 3-D experts, gate rows first), modules_to_save copied in: what the folder means, read
    independently of dstrain and of peft."""
    hf = hf_model(base)
    conf = json.loads((folder / ADAPTER_CONFIG).read_text())
    scale = conf["lora_alpha"] / conf["r"]
    tensors = load_file(folder / ADAPTER_WEIGHTS)
    state = hf.state_dict()
    inter = hf.config.moe_intermediate_size
    with torch.no_grad():
        for key, t in tensors.items():
            name = key.removeprefix(PEFT_PREFIX)
            if not name.endswith(".lora_A.weight"):
                if ".lora_" not in name:
                    state[name].copy_(t)  # modules_to_save
                continue
            module = name.removesuffix(".lora_A.weight")
            delta = scale * tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] @ t
            m = _PER_EXPERT.fullmatch(module)
            if m is None:
                state[f"{module}.weight"] += delta
            elif m.group(3) == "down":
                state[f"{m.group(1)}.down_proj"][int(m.group(2))] += delta
            else:
                rows = slice(0, inter) if m.group(3) == "gate" else slice(inter, 2 * inter)
                state[f"{m.group(1)}.gate_up_proj"][int(m.group(2)), rows] += delta
        return hf(input_ids=ids, use_cache=False).logits


def wrapped(model) -> set[str]:
    return {n.removeprefix(PEFT_PREFIX) for n, m in model.named_modules() if hasattr(m, "lora_A")}


# ------------------------------------------------------------------ the serving folder
def test_serving_folder_has_per_expert_keys_and_engine_config(base, tmp_path):
    ours = adapted(base, ALL_TARGETS)
    state = lora_state(ours)
    out = tmp_path / "serve"
    paths = save_peft_adapter(ours, out, str(base))
    dense = [f"model.layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]
    attn = [f"model.layers.{n}.self_attn.{p}" for n in range(3) for p in ATTN_TARGETS.split(",")]
    moe = [
        f"model.layers.{n}.mlp.{m}"
        for n in MOE_LAYERS
        for m in (
            "experts",
            "gate",
            "shared_experts.gate_proj",
            "shared_experts.up_proj",
            "shared_experts.down_proj",
        )
    ]
    assert paths == sorted(dense + attn + moe)  # the MTP layer's adapters stay out

    tensors = load_file(out / ADAPTER_WEIGHTS)
    plain = [p for p in paths if not p.endswith(".experts")]
    experts = {
        f"{PEFT_PREFIX}model.layers.{n}.mlp.experts.{e}.{p}_proj.lora_{ab}.weight": (n, e, p, ab)
        for n in MOE_LAYERS
        for e in range(EXPERTS)
        for p in ("gate", "up", "down")
        for ab in "AB"
    }
    assert set(tensors) == {f"{PEFT_PREFIX}{p}.lora_{ab}.weight" for p in plain for ab in "AB"} | set(experts)
    for key, (n, e, p, ab) in experts.items():
        assert torch.equal(tensors[key], state[f"layers.{n}.mlp.experts.{p}_lora_{ab}"][e]), key
    hidden, inter = 64, 24
    one = f"{PEFT_PREFIX}model.layers.1.mlp.experts.5"
    assert tensors[f"{one}.gate_proj.lora_A.weight"].shape == (R, hidden)
    assert tensors[f"{one}.gate_proj.lora_B.weight"].shape == (inter, R)
    assert tensors[f"{one}.down_proj.lora_A.weight"].shape == (R, inter)
    assert tensors[f"{one}.down_proj.lora_B.weight"].shape == (hidden, R)
    router = f"{PEFT_PREFIX}model.layers.2.mlp.gate"
    assert torch.equal(tensors[f"{router}.lora_A.weight"], state["layers.2.mlp.gate.lora_A"])
    assert tensors[f"{router}.lora_B.weight"].shape == (EXPERTS, R)
    shared = f"{PEFT_PREFIX}model.layers.1.mlp.shared_experts.up_proj.lora_B.weight"
    assert torch.equal(tensors[shared], state["layers.1.mlp.shared_experts.up_proj.lora_B"])

    conf = json.loads((out / ADAPTER_CONFIG).read_text())
    assert conf["target_modules"] == [
        "down_proj",
        "gate",
        "gate_proj",
        "kv_b_proj",
        "o_proj",
        "q_b_proj",
        "up_proj",
    ]
    assert conf["peft_type"] == "LORA" and conf["task_type"] == "CAUSAL_LM"
    assert conf["r"] == R and conf["lora_alpha"] == ALPHA and conf["base_model_name_or_path"] == str(base)
    assert conf["modules_to_save"] is None and not conf["use_rslora"] and not conf["use_dora"]
    assert not (out / MTP_WEIGHTS).exists()


def test_peft_folder_loads_onto_transformers_with_equal_logits(base, tmp_path, ids):
    """Attention only: the serving folder is itself what peft loads (no target peft re-targets)."""
    ours = adapted(base, ATTN_TARGETS.split(","))
    paths = save_peft_adapter(ours, tmp_path / "adapter", str(base))
    assert paths == sorted(
        f"model.layers.{n}.self_attn.{p}" for n in range(3) for p in ATTN_TARGETS.split(",")
    )
    conf = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert conf["target_modules"] == sorted(ATTN_TARGETS.split(","))
    model = peft_model(base, tmp_path / "adapter")
    assert wrapped(model) == set(paths)
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
    assert (got - dstrain_logits(ours, ids)).abs().max() <= 1e-5


# ------------------------------------------------------------------ the peft check
@pytest.mark.parametrize("kind", ["v3", "v2"])
def test_peft_loadable_folder_gives_dstrain_logits(base, v2_base, tmp_path, ids, kind):
    """Experts, router, shared experts, dense MLP and attention adapters, B random: the serving folder, converted
    by `peft_loadable`, loads with peft 0.21 onto transformers 5 with every adapter in place, and its logits
    are dstrain's and those of transformers' model with the folder's deltas merged by hand."""
    if kind == "v2":
        base = v2_base
    targets = [t.replace("q_b_proj", "q_proj") if kind == "v2" else t for t in ALL_TARGETS]
    ours = adapted(base, targets)
    serve, loadable = tmp_path / "serve", tmp_path / "peft"
    paths = save_peft_adapter(ours, serve, str(base))
    conf = peft_loadable(serve, loadable)
    assert json.loads((loadable / ADAPTER_CONFIG).read_text()) == conf
    experts = [f"model.layers.{n}.mlp.experts" for n in MOE_LAYERS]
    assert {f"{e}.{p}" for e in experts for p in ("gate_up_proj", "down_proj")} <= set(
        conf["target_parameters"]
    )
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in conf["target_parameters"]
    assert "model.layers.2.mlp.gate.weight" in conf["target_parameters"]
    assert all(re.search(r"self_attn\.(q_b|q|kv_b|o)_proj$", m) for m in conf["target_modules"])
    assert conf["rank_pattern"][re.escape(f"{experts[0]}.gate_up_proj")] == 2 * R

    model = peft_model(base, loadable)
    assert {p.removesuffix(".base_layer") for p in wrapped(model)} == set(paths)
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
    want = dstrain_logits(ours, ids)
    assert (got - want).abs().max() <= 1e-5
    assert (hand_merged_logits(base, serve, ids) - want).abs().max() <= 1e-5
    assert (
        hf_model(base)(input_ids=ids, use_cache=False).logits - want
    ).abs().max() > 1e-2  # adapters matter


@pytest.mark.parametrize("router", ["lora", "full"])
def test_trained_router_travels_as_modules_to_save(base, tmp_path, ids, router):
    """A LoRA'd router (its checkpoint weight passed in `extra`: written merged) or one trained in full (and
    its expert bias) travels whole as PEFT modules_to_save; MTP modules in `extra` go to the side file under
    HF keys, merged with their adapters. peft loads the router onto transformers' DeepseekV3TopkRouter."""
    targets = ["q_b_proj", "experts"] + (["gate"] if router == "lora" else [])
    ours = adapted(base, targets, seed=1)
    routers = [f"layers.{n}.mlp.gate" for n in MOE_LAYERS]
    state = ours.state_dict()
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        if router == "full":  # what a full fine-tune of the routers and their bias leaves
            for name in routers:
                module = ours.get_submodule(name)
                module.weight += 0.3 * torch.randn(module.weight.shape, generator=g)
                module.e_score_correction_bias += 0.1 * torch.randn(EXPERTS, generator=g)
        ours.mtp[0].enorm.weight += 0.1
    keys = [f"{r}.{leaf}" for r in routers for leaf in ("weight", "e_score_correction_bias")]
    mtp_q = "mtp.0.block.self_attn.q_b_proj"
    extra = {k: state[k].clone() for k in [*keys, "mtp.0.enorm.weight", f"{mtp_q}.weight"]}
    serve = tmp_path / "serve"
    paths = save_peft_adapter(ours, serve, str(base), extra=extra)
    assert not any(p.endswith(".mlp.gate") for p in paths)

    conf = json.loads((serve / ADAPTER_CONFIG).read_text())
    assert conf["modules_to_save"] == [f"model.{r}" for r in routers]
    assert "gate" not in conf["target_modules"]
    tensors = load_file(serve / ADAPTER_WEIGHTS)
    assert not any(".mlp.gate.lora_" in k for k in tensors)
    scale = ALPHA / R
    for r in routers:
        a, b = (state.get(f"{r}.lora_{ab}") for ab in "AB")
        want = merged_weight(state[f"{r}.weight"], a, b, scale) if router == "lora" else state[f"{r}.weight"]
        assert torch.equal(tensors[f"{PEFT_PREFIX}model.{r}.weight"], want)
    side = load_file(serve / MTP_WEIGHTS)
    n = v3_config().num_hidden_layers
    assert set(side) == {f"model.layers.{n}.enorm.weight", f"model.layers.{n}.self_attn.q_b_proj.weight"}
    assert torch.equal(side[f"model.layers.{n}.enorm.weight"], state["mtp.0.enorm.weight"])
    mtp_merged = merged_weight(
        state[f"{mtp_q}.weight"], state[f"{mtp_q}.lora_A"], state[f"{mtp_q}.lora_B"], scale
    )
    assert torch.equal(side[f"model.layers.{n}.self_attn.q_b_proj.weight"], mtp_merged)

    from peft.utils import ModulesToSaveWrapper

    peft_loadable(serve, tmp_path / "peft")
    model = peft_model(base, tmp_path / "peft")
    saved = {
        n.removeprefix(PEFT_PREFIX) for n, m in model.named_modules() if isinstance(m, ModulesToSaveWrapper)
    }
    assert saved == {f"model.{r}" for r in routers}
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
    want = dstrain_logits(ours, ids)
    assert (got - want).abs().max() <= 1e-5
    assert (hand_merged_logits(base, serve, ids) - want).abs().max() <= 1e-5


# ------------------------------------------------------------------ the trap
def test_peft_trap_is_real_and_the_conversion_avoids_it(base, tmp_path, ids):
    """peft 0.21 on transformers 5 turns LoRA targets named gate_proj/up_proj/down_proj (even spelled as an
    exact-path regex) into targets on the fused routed experts: a serving folder with shared-expert adapters
    and leaf names alone puts them nowhere; with their weights named as target_parameters (as written) it loads
    them in place. Without such targets (experts, router, attention) peft's own
    per-expert conversion loads the serving folder as it is, with dstrain's logits: the per-expert keys mean to
    peft what they mean to dstrain. `peft_loadable` loads either."""
    from peft import LoraConfig, get_peft_model

    regex = r"model\.layers\.1\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)"
    trapped = get_peft_model(make_hf_model(v3_config()), LoraConfig(r=4, target_modules=regex))
    assert not any("shared_experts" in n for n in wrapped(trapped))
    assert any(n.endswith("mlp.experts") for n in wrapped(trapped))

    shared = adapted(base, ["shared_experts"])
    save_peft_adapter(shared, tmp_path / "shared", str(base))
    want = dstrain_logits(shared, ids)
    # the serving folder names the shared experts' weights as target_parameters: loaded as written, in place
    assert (peft_logits(base, tmp_path / "shared", ids) - want).abs().max() <= 1e-5
    conf = json.loads((tmp_path / "shared" / ADAPTER_CONFIG).read_text())
    del conf["target_parameters"]
    (tmp_path / "shared" / ADAPTER_CONFIG).write_text(json.dumps(conf))
    direct = peft_model(base, tmp_path / "shared")  # leaf names alone: the trap
    assert not any("shared_experts" in n for n in wrapped(direct))
    with torch.no_grad():
        lost = direct(input_ids=ids, use_cache=False).logits
    assert (lost - want).abs().max() > 1e-2
    peft_loadable(tmp_path / "shared", tmp_path / "shared_peft")
    assert (peft_logits(base, tmp_path / "shared_peft", ids) - want).abs().max() <= 1e-5

    ours = adapted(base, ["experts", "gate", *ATTN_TARGETS.split(",")], seed=3)
    save_peft_adapter(ours, tmp_path / "experts", str(base))
    assert (peft_logits(base, tmp_path / "experts", ids) - dstrain_logits(ours, ids)).abs().max() <= 1e-5


def test_writer_refusals(tmp_path):
    cfg = tiny_config()
    model = build_model(cfg, seed=0)
    apply_lora(model, 4, 8.0, ["experts", "q_b_proj"])
    adapters, settings = lora_state(model), model.lora_settings
    partial = {k: v for k, v in adapters.items() if k != "layers.1.mlp.experts.up_lora_B"}
    with pytest.raises(ValueError, match="layers.1.mlp.experts: adapters"):
        write_peft_adapter(partial, settings, cfg, tmp_path / "a", "base")
    bias_only = {"layers.1.self_attn.q_b_proj.bias": torch.zeros(3)}
    with pytest.raises(ValueError, match="carries it without weight"):
        write_peft_adapter(adapters, settings, cfg, tmp_path / "b", "base", extra=bias_only)
    whole_experts = {"layers.1.mlp.experts.gate_up_proj": torch.zeros(1)}
    with pytest.raises(ValueError, match="cannot travel whole"):
        write_peft_adapter({}, settings, cfg, tmp_path / "c", "base", extra=whole_experts)
    router = build_model(cfg, seed=0).layers[1].mlp.gate
    with pytest.raises(ValueError, match="must carry its e_score_correction_bias too"):
        write_peft_adapter(
            adapters, settings, cfg, tmp_path / "e", "base", {"layers.1.mlp.gate.weight": router.weight}
        )
    mtp_only = {k: v for k, v in adapters.items() if k.startswith("mtp.")}
    with pytest.raises(ValueError, match="no adapters outside the MTP layers"):
        write_peft_adapter(mtp_only, settings, cfg, tmp_path / "d", "base")
