"""LoRA in checkpoints and adapter folders: `lora.json` (the settings a checkpoint was trained with), the PEFT
serving folder (adapter_config.json + adapter_model.safetensors in the layout vLLM and SGLang load for DeepSeek
models), and that folder converted to the form peft 0.21 loads onto transformers 5.

The serving layout, from the engines' loaders (read 2026-11; repository paths and the commits read):
- vLLM, vllm/lora/lora_model.py @0306474e: the safetensors keys are the source of truth (adapter_config's
  `target_modules` is not checked; earlier versions read it, for .bin files, as leaf names); a key
  `...experts.{e}.{proj}.lora_{A,B}.weight`
  is checked against `experts.{e}.{proj}`, which vllm/lora/utils.py @0fd15707 (process_packed_modules_mapping)
  lists per expert from the model's expert mapping, `gate_proj`/`up_proj`/`down_proj` for DeepSeek
  (vllm/model_executor/models/deepseek_v2.py @b863fe5b, which also packs the shared experts' and dense MLPs'
  `gate_proj`+`up_proj` into `gate_up_proj` and makes the router `gate` a ReplicatedLinear, itself LoRA-able).
  vllm/lora/model_manager.py @01533aa8 packs those per-expert A (r, in) / B (out, r) (`pack_moe`); the fused
  3-D form (`experts.base_layer` = gate_up_proj, `experts` = down_proj, A (E*r, in), B (out, r*E)) is only for
  models declaring `is_3d_moe_weight`, which DeepSeek does not. vllm/lora/peft_helper.py @e745baff refuses any
  non-empty `modules_to_save` and scales by lora_alpha / r. MTP layers are skipped.
- SGLang, python/sglang/srt/lora/mem_pool.py @00639c4d: a key matching `experts\\.(\\d+)\\.` is a per-expert 2-D
  weight of the routed experts, `shared_experts.*` a plain module; python/sglang/srt/lora/utils.py @8613c481
  (get_normalized_target_modules) iterates `target_modules` and keeps each entry's leaf, mapping
  gate_proj/up_proj to gate_up_proj: it needs a list (a regex string would be read character by character).
  python/sglang/srt/lora/deepseek_mla_correction.py @16c8d35a applies kv_b_proj LoRA on the absorbed-MLA path.
So: one key per expert and projection, `target_modules` a list of leaf names, and `modules_to_save` only when
the caller makes something travel whole (vLLM then refuses the folder).

peft 0.21 on transformers 5 (peft/utils/transformers_weight_conversion.py, peft/tuners/lora/layer.py
ParamWrapper, as installed): transformers 5 fuses DeepSeek's routed experts into 3-D parameters, and peft maps
every target whose leaf is gate_proj/up_proj/down_proj onto them and `gate` onto the router's weight
(deepseek_v3 -> the qwen2_moe rules, by leaf name alone), converting per-expert adapter keys to match:
attention, routed experts and routers load as they are, but shared-expert and dense-MLP adapters would load
nowhere. The serving folder therefore also names those linears' weights exactly, as `target_parameters` (peft
keeps explicit ones, and a ParamWrapper on a linear's weight reads the same keys): `PeftModel.from_pretrained`
loads it as written, adapters in place (vLLM and SGLang read the keys and the leaf names, not this field).
`peft_loadable` writes another form peft loads: experts as `target_parameters` (ParamWrapper, A (E*r', in)
expert-major, B (out, r'*E) expert-fastest, gate_up_proj with r' = 2r holding gate's and up's adapters
block-diagonally), the other MLP linears and the router as `target_parameters` on their `.weight`, the rest as
exact `target_modules`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dstrain.atomic import write_json
from dstrain.model import DeepSeekLM, ModelConfig
from dstrain.model.common.layers import EXPERT_BIAS
from dstrain.model.common.lora import (
    EXPERT_ADAPTERS,
    EXPERT_PROJ,
    adapted_parts,
    is_lora_key,
    lora_state,
    merge_parts,
)
from dstrain.model.registry import family_of

LORA_JSON = "lora.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# MTP modules carried whole (train_mtp): transformers, vLLM and SGLang load no MTP weights from an adapter.
MTP_WEIGHTS = "mtp_modules.safetensors"
PEFT_PREFIX = "base_model.model."
# peft 0.21 on transformers 5 re-targets LoRA on modules with these leaf names (even from an exact-path regex,
# which it reduces to leaf names) onto the fused routed experts' parameters or the router's weight.
PEFT_REMAPPED_LEAVES = ("gate", "gate_proj", "up_proj", "down_proj")
# The leaves of those that name linears outside the routed experts (shared experts, dense MLPs).
PEFT_MLP_LEAVES = ("gate_proj", "up_proj", "down_proj")
_PER_EXPERT = re.compile(r"base_model\.model\.(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.lora_([AB])\.weight")


def save_lora_settings(model: nn.Module, checkpoint_dir: str | os.PathLike, rank: int) -> None:
    """Write `lora.json` (r, alpha, targets, adapted modules, what else trained) into a checkpoint folder, from
    rank 0, before its COMPLETE marker. A no-op for a model without LoRA. `model`: the engine's module."""
    settings = getattr(model, "lora_settings", None)
    if rank != 0 or not settings:
        return
    write_json(Path(checkpoint_dir) / LORA_JSON, settings, indent=2)


def load_lora_settings(checkpoint_dir: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(checkpoint_dir) / LORA_JSON
    return json.loads(path.read_text()) if path.is_file() else None


# ------------------------------------------------------------------ PEFT adapter folders
def peft_keys(key: str, cfg: ModelConfig) -> list[str]:
    """dstrain tensor -> the names transformers' model gives it (the family's `peft_keys`)."""
    names = family_of(cfg).peft_keys
    if names is None:
        raise ValueError(f"{family_of(cfg).name} has no PEFT adapter form")
    return names(key, cfg)


def hf_module_name(module: str, cfg: ModelConfig) -> str:
    """dstrain module path -> the HF module path (`layers.0.self_attn.o_proj` -> `model.layers.0...`)."""
    keys = peft_keys(f"{module}.weight", cfg)
    if len(keys) != 1:
        raise ValueError(f"{module} has no single Hugging Face counterpart")
    return keys[0].removesuffix(".weight")


def hf_expert_modules(module: str, cfg: ModelConfig) -> list[str]:
    """Routed experts `layers.1.mlp.experts` -> the HF module of each expert, `model.layers.1.mlp.experts.{e}`."""
    return [k.removesuffix(".down_proj.weight") for k in peft_keys(f"{module}.down_proj", cfg)]


def _is_experts(module: str) -> bool:
    return module.rpartition(".")[2] == "experts"


def _by_module(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, _, leaf = key.rpartition(".")
        out.setdefault(module, {})[leaf] = t
    return out


def _own(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor with its own storage (safetensors refuses tensors sharing memory)."""
    return t.detach().contiguous().clone()


def write_peft_adapter(
    adapters: dict[str, torch.Tensor],
    settings: dict[str, Any],
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    base_model_name_or_path: str,
    extra: dict[str, torch.Tensor] | None = None,
) -> list[str]:
    """The serving folder (module docstring) from dstrain adapter tensors (`adapters`: key -> tensor, every key
    a LoRA key), `lora.json`'s settings (r, alpha) and the model config. Returns the HF modules given LoRA
    (the routed experts of a layer as one module, `model.layers.N.mlp.experts`).

    `extra`: dstrain tensors of modules that travel whole, as PEFT `modules_to_save` (a trained router:
    `layers.N.mlp.gate.weight` and, with V3 routing, its `e_score_correction_bias`: peft loads a module to save
    only with all its tensors; vLLM refuses any folder with modules_to_save) or, for MTP modules (`mtp.*`), in
    the side file `mtp_modules.safetensors` under HF keys `model.layers.{num_hidden_layers + k}...`. Give the
    checkpoint's tensors as they are: a module in `extra` that also has adapters is written merged (W + s·B·A)
    and its adapters are left out of the LoRA part. MTP adapters of modules not in `extra` are left out
    (transformers builds no MTP modules, the engines load none from an adapter)."""
    from safetensors.torch import save_file

    lora = _by_module(adapters)
    for module, parts in lora.items():
        want = set(EXPERT_ADAPTERS) if _is_experts(module) else {"lora_A", "lora_B"}
        if set(parts) != want:
            raise ValueError(f"LoRA module {module}: adapters {sorted(parts)}, expected {sorted(want)}")
    whole = _by_module(extra or {})
    scale = float(settings["alpha"]) / int(settings["r"])
    for module, parts in whole.items():
        if module not in lora:
            continue
        base = [leaf for leaf in adapted_parts(module) if not is_lora_key(leaf)]
        missing = [leaf for leaf in base if leaf not in parts]
        if missing:
            raise ValueError(f"{module} has adapters, and `extra` carries it without {', '.join(missing)}")
        parts.update(merge_parts(module, parts | lora.pop(module), scale))

    tensors: dict[str, torch.Tensor] = {}
    adapted, leaves = [], set()
    for module, parts in lora.items():
        if module.startswith("mtp."):
            continue
        if _is_experts(module):
            per_expert = hf_expert_modules(module, cfg)
            for e, path in enumerate(per_expert):
                for proj in EXPERT_PROJ:
                    for ab in "AB":
                        key = f"{PEFT_PREFIX}{path}.{proj}_proj.lora_{ab}.weight"
                        tensors[key] = _own(parts[f"{proj}_lora_{ab}"][e])
            adapted.append(per_expert[0].rpartition(".")[0])
            leaves |= {f"{proj}_proj" for proj in EXPERT_PROJ}
        else:
            path = hf_module_name(module, cfg)
            for ab in ("lora_A", "lora_B"):
                tensors[f"{PEFT_PREFIX}{path}.{ab}.weight"] = _own(parts[ab])
            adapted.append(path)
            leaves.add(path.rpartition(".")[2])

    saved, mtp = [], {}
    for module, parts in whole.items():
        if module.startswith("mtp."):
            mtp.update({f"{module}.{leaf}": t for leaf, t in parts.items()})
            continue
        if _is_experts(module):
            raise ValueError(f"{module}: the routed experts cannot travel whole in an adapter folder")
        if module.endswith(".mlp.gate") and cfg.uses_expert_bias and EXPERT_BIAS not in parts:
            # peft loads a modules_to_save module only with every tensor of it in the file (else a KeyError)
            raise ValueError(f"{module} travels whole: `extra` must carry its {EXPERT_BIAS} too")
        for leaf, t in parts.items():
            (key,) = peft_keys(f"{module}.{leaf}", cfg)
            tensors[PEFT_PREFIX + key] = _own(t)
        saved.append(hf_module_name(module, cfg))
    if not tensors:
        raise ValueError(
            f"no adapters outside the MTP layers (model.layers.{cfg.num_hidden_layers}+) to write"
        )

    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    if mtp:
        side = {k: _own(t) for k, t in family_of(cfg).to_hf(sorted(mtp.items()), cfg, None)}
        save_file(side, os.path.join(out_dir, MTP_WEIGHTS), metadata={"format": "pt"})
    alpha = float(settings["alpha"])
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": int(settings["r"]),
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        # Leaf names, as vLLM and SGLang read them (module docstring); the keys say exactly which modules.
        "target_modules": sorted(leaves),
        "modules_to_save": sorted(saved) or None,
    }
    mlp = sorted(f"{p}.weight" for p in adapted if p.rpartition(".")[2] in PEFT_MLP_LEAVES)
    if mlp and peft_fuses_experts(cfg):
        # peft re-targets these leaf names onto the fused routed experts (module docstring): the MLP linears'
        # weights named exactly keep their adapters in place; the engines read the keys, not this field.
        config["target_parameters"] = mlp
    write_json(Path(out_dir) / ADAPTER_CONFIG, config, indent=2)
    return sorted(adapted)


def peft_fuses_experts(cfg: ModelConfig) -> bool:
    """Whether transformers (5) converts this model type's checkpoints, fusing its routed experts: then peft
    re-targets gate_proj/up_proj/down_proj adapters (a model type it does not convert, e.g. kimi_k2's remote
    code, keeps one module per expert and loads the leaf names as they are)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return False
    return get_checkpoint_conversion_mapping(cfg.model_type) is not None


def save_peft_adapter(
    model: DeepSeekLM,
    out_dir: str | os.PathLike,
    base_model_name_or_path: str,
    extra: dict[str, torch.Tensor] | None = None,
) -> list[str]:
    """The model's adapters as a serving folder (`write_peft_adapter`; `extra` as there)."""
    settings = getattr(model, "lora_settings", None)
    if not settings:
        raise ValueError("the model has no LoRA adapters")
    return write_peft_adapter(
        lora_state(model), settings, model.config, out_dir, base_model_name_or_path, extra
    )


def _fused_A(a: torch.Tensor) -> torch.Tensor:
    """Per-expert A (E, r, in) -> ParamWrapper's (E*r, in): rows expert-major."""
    return a.reshape(-1, a.shape[-1]).contiguous()


def _fused_B(b: torch.Tensor) -> torch.Tensor:
    """Per-expert B (E, out, r) -> ParamWrapper's (out, r*E): column k*E + e is expert e's rank k."""
    return b.permute(1, 2, 0).reshape(b.shape[1], -1).contiguous()


def peft_loadable(src_dir: str | os.PathLike, dst_dir: str | os.PathLike) -> dict[str, Any]:
    """The serving folder `src_dir` rewritten into `dst_dir` in the form `PeftModel.from_pretrained` (peft 0.21)
    loads onto transformers 5's DeepseekV3ForCausalLM / DeepseekV2ForCausalLM with every adapter in place:
    - routed experts: `target_parameters` `<experts>.gate_up_proj` and `<experts>.down_proj` (peft's
      ParamWrapper, nested: `experts.base_layer.lora_*` is gate_up_proj, `experts.lora_*` down_proj). gate and
      up have their own A per expert, so gate_up_proj takes rank 2r (`rank_pattern`, with `alpha_pattern` 2·alpha
      keeping the scale alpha/r): A_e = [A_gate; A_up], B_e = [[B_gate, 0], [0, B_up]];
    - other modules named gate_proj/up_proj/down_proj (shared experts, dense MLPs) and the router `gate`:
      `target_parameters` on their `.weight` (same keys as the serving folder), where peft's leaf-name remapping
      does not reach;
    - everything else (attention): `target_modules` as exact module paths; `modules_to_save` as it was.
    Returns the adapter_config written."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src_dir), Path(dst_dir)
    config = json.loads((src / ADAPTER_CONFIG).read_text())
    r, alpha = int(config["r"]), config["lora_alpha"]
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, str, str], torch.Tensor]] = {}
    modules: set[str] = set()
    for key, t in load_file(src / ADAPTER_WEIGHTS).items():
        m = _PER_EXPERT.fullmatch(key)
        if m:
            experts.setdefault(m.group(1), {})[int(m.group(2)), m.group(3), m.group(4)] = t
            continue
        tensors[key] = t
        if key.endswith((".lora_A.weight", ".lora_B.weight")):
            modules.add(key.removeprefix(PEFT_PREFIX).rsplit(".", 2)[0])

    target_parameters, rank_pattern, alpha_pattern = [], {}, {}
    for path, parts in sorted(experts.items()):
        n = 1 + max(e for e, _, _ in parts)
        if len(parts) != 6 * n:
            raise ValueError(
                f"{src}: {path} has {len(parts)} per-expert adapter tensors, expected 6 x {n} experts"
            )

        a = {proj: torch.stack([parts[e, proj, "A"] for e in range(n)]) for proj in EXPERT_PROJ}
        b = {proj: torch.stack([parts[e, proj, "B"] for e in range(n)]) for proj in EXPERT_PROJ}
        gate_up_a = torch.cat([a["gate"], a["up"]], 1)  # (E, 2r, D)
        zero_gate, zero_up = torch.zeros_like(b["gate"]), torch.zeros_like(b["up"])
        gate_up_b = torch.cat([torch.cat([b["gate"], zero_gate], 2), torch.cat([zero_up, b["up"]], 2)], 1)
        tensors[f"{PEFT_PREFIX}{path}.base_layer.lora_A.weight"] = _fused_A(gate_up_a)
        tensors[f"{PEFT_PREFIX}{path}.base_layer.lora_B.weight"] = _fused_B(gate_up_b)  # (2I, 2r*E)
        tensors[f"{PEFT_PREFIX}{path}.lora_A.weight"] = _fused_A(a["down"])
        tensors[f"{PEFT_PREFIX}{path}.lora_B.weight"] = _fused_B(b["down"])
        target_parameters += [f"{path}.gate_up_proj", f"{path}.down_proj"]
        rank_pattern[re.escape(f"{path}.gate_up_proj")] = 2 * r
        alpha_pattern[re.escape(f"{path}.gate_up_proj")] = 2 * alpha
    remapped = {p for p in modules if p.rpartition(".")[2] in PEFT_REMAPPED_LEAVES}
    target_parameters += [f"{p}.weight" for p in remapped]

    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, dst / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    config |= {
        "target_modules": sorted(modules - remapped),
        "target_parameters": sorted(target_parameters),
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
    }
    write_json(dst / ADAPTER_CONFIG, config, indent=2)
    return config
