"""`dstrain export CHECKPOINT --out DIR`: a training checkpoint -> a Hugging Face folder transformers loads.

The weights stream from `weights.iter_weights` one full fp32 tensor at a time, whatever the training layout,
and are written by the family's `to_hf` (`dstrain.model.deepseek_v3.state_dict.to_hf` for V2/V3) in the official DeepSeek layout (per-expert keys, MTP layers as
`model.layers.{n+k}` with their copies of the embedding and head, the expert bias in fp32), sharded with an
index. LoRA adapters are merged into their base weights on the way (or written alone as a PEFT folder with
--adapter_only). --verify loads the folder with transformers and compares its logits with dstrain's model
built from the checkpoint's own weights, not from the folder just written.
A run from a quantized folder (FP8, FP4, packed INT) is written in that folder's form unless --dtype is
given: each weight the folder stored quantized is quantized again (`hf.quantize.SourceForms`, the source's
scales kept where the weights did not move), so an untrained run's export is the source's tensors byte for
byte; --verify then compares transformers' dequantization of the folder with dstrain's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from dstrain.cmdline import command_parser
from dstrain.errors import CheckpointError, ConfigError, UserError
from dstrain.model import ModelConfig, family_of
from dstrain.model.build import hf_tensors, parse_dtype, write_config
from dstrain.model.common.dsa import top_keys
from dstrain.model.common.layers import EXPERT_BIAS, is_expert_bias
from dstrain.model.common.lora import adapted_parts, is_lora_key, merge_parts
from dstrain.model.hf import DEFAULT_SHARD_BYTES, SAFE_INDEX, save_hf_tensors
from dstrain.model.hf.quantize import SourceForms
from dstrain.model.registry import on_meta

from .lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, peft_loadable, write_peft_adapter
from .store import Checkpoint, checkpoint_weights, open_checkpoint
from .weights import iter_weights

log = logging.getLogger("dstrain.export")
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
# What an earlier export may have left in --out: removed first under --force, so no stale shard survives.
OUTPUT_PATTERNS = ("*.safetensors", "model.safetensors.index.json", "config.json", "generation_config.json")


# ------------------------------------------------------------------ the checkpoint
def default_dtype(cfg: ModelConfig) -> torch.dtype:
    """The dtype of the folder training started from (its config.json: of a multimodal checkpoint, the one
    around the text model's, as `from_pretrained` reads it), else float32."""
    outer = (cfg.hf_source or {}).get("outer") or {}
    name = next((c[k] for c in (outer, cfg.extra) for k in ("dtype", "torch_dtype") if c.get(k)), None)
    try:
        return parse_dtype(str(name)) if name else torch.float32
    except ValueError:
        return torch.float32


# ------------------------------------------------------------------ dstrain tensors -> HF tensors
def merge_stream(
    weights: Iterator[tuple[str, torch.Tensor]], lora: dict[str, Any] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """dstrain (key, tensor) with every adapter folded into its base weights. Holds back only the pieces of
    one adapted module until all of them (base weights and adapters, `adapted_parts`) have arrived."""
    modules = set(lora["modules"]) if lora else set()
    scale = float(lora["alpha"]) / int(lora["r"]) if lora else 0.0
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in weights:
        module, _, part = key.rpartition(".")
        if is_lora_key(key) and not lora:
            raise CheckpointError(
                f"the checkpoint has LoRA adapters ({key}) but no lora.json with their rank and alpha"
            )
        if module not in modules or part not in adapted_parts(module):
            yield key, t
            continue
        got = pending.setdefault(module, {})
        got[part] = t
        if len(got) == len(adapted_parts(module)):
            del pending[module]
            for leaf, merged in merge_parts(module, got, scale).items():
                yield f"{module}.{leaf}", merged
    if pending:
        module, got = next(iter(pending.items()))
        raise CheckpointError(f"incomplete LoRA module {module} in the checkpoint: only {sorted(got)}")


def expected_hf_keys(cfg: object) -> set[str]:
    """Every HF key a complete export of this config holds (from a meta-device model: no memory)."""
    model = on_meta(cfg)
    return {name for name, _ in hf_tensors(model.state_dict().items(), cfg)}


# ------------------------------------------------------------------ writing
def prepare_out(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise ConfigError(f"--out {out} is not empty: choose another folder or pass --force to overwrite")
        for pattern in (
            *OUTPUT_PATTERNS,
            *TOKENIZER_FILES,
            ADAPTER_CONFIG,
            ADAPTER_WEIGHTS,
        ):
            for p in out.glob(pattern):
                p.unlink()
    out.mkdir(parents=True, exist_ok=True)


def write_configs(cfg: ModelConfig, out: Path, dtype: torch.dtype, source: str | None) -> list[str]:
    """config.json, generation_config.json (the source folder's, when training started from one) and the
    source folder's tokenizer files and code (of a multimodal checkpoint: every file but its weights and
    configs, its processor's too: the export is that folder with the text model trained)."""
    src = Path(source) if source and os.path.isdir(source) else None
    generation = None
    if src is not None and (src / "generation_config.json").is_file():
        generation = json.loads((src / "generation_config.json").read_text())
    write_config(cfg, out, dtype, generation)
    if src is None:
        return []
    if cfg.wrapper:
        written = ("config.json", "generation_config.json")
        names = [
            p.name for p in src.iterdir() if p.is_file() and not _is_weights(p.name) and p.name not in written
        ]
    else:
        names = [n for n in (*TOKENIZER_FILES, *_remote_code(cfg)) if (src / n).is_file()]
    for name in sorted(names):
        shutil.copyfile(src / name, out / name)
    return sorted(names)


def _is_weights(name: str) -> bool:
    return name.endswith((".safetensors", ".bin", ".pt", ".pth")) or name == SAFE_INDEX


def _remote_code(cfg: ModelConfig) -> list[str]:
    """The code files a config's auto_map names (a model_type transformers does not know, e.g. kimi_k2, loads
    through them with trust_remote_code): the export must carry them like the checkpoint did."""
    entries = (cfg.extra.get("auto_map") or {}).values()
    refs = [r for e in entries for r in (e if isinstance(e, list) else [e]) if isinstance(r, str)]
    return sorted({f"{r.split('--')[-1].rsplit('.', 1)[0]}.py" for r in refs})


def export(
    checkpoint: str | os.PathLike | Checkpoint,
    out: str | os.PathLike,
    dtype: str | torch.dtype | None = None,
    adapter_only: bool = False,
    force: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> dict[str, Any]:
    """Write the checkpoint as an HF folder (or a PEFT adapter folder). Raises UserError for user mistakes."""
    opened = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    ckpt, cfg, lora, source = opened.path, opened.config, opened.lora, opened.source
    out = Path(out)
    dt = parse_dtype(dtype) or default_dtype(cfg)
    if adapter_only:
        check_adapter_only(lora, cfg)
    # no --dtype: a quantized source's weights are written in its own form
    forms = None if adapter_only or dtype is not None else source_forms(cfg, source)
    prepare_out(out, force)
    if adapter_only:
        whole = travels_whole(lora, cfg)
        adapters, extra = {}, {}
        for key, t in iter_weights(ckpt):  # a stored base's frozen weights stay in its folder
            if is_lora_key(key):
                adapters[key] = t.to(dt)
            elif whole(key):
                extra[key] = t if is_expert_bias(key) else t.to(dt)
        base = os.path.abspath(source) if source and os.path.isdir(source) else (source or "")
        try:
            paths = write_peft_adapter(adapters, lora, cfg, out, base, extra)
            if not family_of(cfg).serving_adapters:  # no engine reads its LoRA: the form peft loads
                peft_loadable(out, out)
        except ValueError as exc:
            raise ConfigError(f"--adapter_only: {exc}") from None
        return {"checkpoint": str(ckpt), "out": str(out), "dtype": dt, "adapted": paths, "files": []}
    seen: set[str] = set()

    def hf_items() -> Iterator[tuple[str, torch.Tensor]]:
        if forms is None:
            yield from hf_tensors(merge_stream(checkpoint_weights(opened), lora), cfg, dt)
            return
        for item in merge_stream(checkpoint_weights(opened), lora):
            exact = list(hf_tensors([item], cfg, None))  # in fp32, as the checkpoint holds it
            if not any(k in forms for k, _ in exact):
                yield from hf_tensors([item], cfg, dt)
                continue
            # a weight to quantize is quantized from its fp32 value, not from its rounding to dt
            rounded: dict[str, torch.Tensor] = {}
            for k, t in exact:
                if k not in forms and not rounded:
                    rounded = dict(hf_tensors([item], cfg, dt))
                yield k, t if k in forms else rounded[k]

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        try:
            for key, t in hf_items():
                if key in seen:
                    raise CheckpointError(f"checkpoint yields {key} twice")
                seen.add(key)
                if forms is not None and key in forms:  # LoRA already merged: the sum is quantized
                    yield from forms.quantize(key, t)
                else:
                    yield key, t
        except KeyError as exc:  # dstrain_to_hf: a dstrain key this config has no place for
            raise CheckpointError(
                f"checkpoint tensor {exc.args[0]} has no place in the model's config"
            ) from None

    try:
        # a multimodal checkpoint's vision tower and projector, copied from the folder its text model came from
        with family_of(cfg).copied_tensors(cfg, source) as copied, forms or contextlib.nullcontext():
            files = save_hf_tensors(tensors(), out, max_shard_bytes, copied)
    except UserError:
        raise
    except ValueError as exc:  # that folder is not there, or a form not written
        raise CheckpointError(f"checkpoint {ckpt}: {exc}") from None
    missing = expected_hf_keys(cfg) - seen
    if missing:
        raise CheckpointError(f"checkpoint {ckpt} lacks {len(missing)} tensors, e.g. {sorted(missing)[0]}")
    copied = write_configs(cfg, out, dt, source)
    if forms is not None:
        keep_quantization_config(Path(source), out)
    if not any(name in copied for name in TOKENIZER_FILES):
        copied = save_tokenizer(opened.tokenizer, source, out)
    info = {"checkpoint": str(ckpt), "out": str(out), "dtype": dt, "files": files, "tokenizer": copied}
    if forms is not None:
        info["quantized"] = forms.errors
    return info


# ------------------------------------------------------------------ the source's quantized form
QUANT_KEYS = ("quantization_config", "expert_dtype")  # config.json keys that describe stored weights


def _quant_levels(d: dict[str, Any]) -> list[dict[str, Any]]:
    """A config.json's levels that declare quantized weights (a multimodal one's: its text_config's too)."""
    levels = [d, *(v for v in d.values() if isinstance(v, dict) and "model_type" in v)]
    return [level for level in levels if "quantization_config" in level]


def source_forms(cfg: ModelConfig, source: str | None) -> SourceForms | None:
    """The quantized forms of the folder training started from, for an export in them; None for a source that
    stored none (or a preset run). A quantized source that is gone is a ConfigError (its scales and which
    modules it left unquantized are read from it)."""
    if not _quant_levels(cfg.to_hf_dict()):
        return None
    if not (source and os.path.isdir(source)):
        raise ConfigError(
            f"the run started from a quantized folder ({source}) that is not there: its form is read from "
            "it; export with --dtype bfloat16, or move the folder back"
        )
    try:
        forms = SourceForms(source)
    except ValueError as exc:
        raise ConfigError(f"{exc}; export with --dtype bfloat16") from None
    return forms if forms.parts else None


def keep_quantization_config(source: Path, out: Path) -> None:
    """config.json's quantization keys (QUANT_KEYS) as the source folder's, at the same levels."""
    src = json.loads((source / "config.json").read_text())
    conf = json.loads((out / "config.json").read_text())
    for name, level in [(None, src), *((k, v) for k, v in src.items() if isinstance(v, dict))]:
        target = conf if name is None else conf.get(name)
        if isinstance(target, dict):
            target.update({k: level[k] for k in QUANT_KEYS if k in level})
    (out / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True))


def error_summary(errors: dict[str, float], worst: int = 3) -> str:
    """One line: the relative RMS error quantizing introduced, per tensor (mean, the worst few)."""
    if not errors:
        return "no weights quantized"
    ranked = sorted(errors.items(), key=lambda kv: -kv[1])
    if ranked[0][1] == 0:
        return f"{len(errors)} weights quantized, all exactly (on the source's grid: untrained)"
    mean = sum(errors.values()) / len(errors)
    tops = ", ".join(f"{k} {v:.3g}" for k, v in ranked[:worst])
    return f"{len(errors)} weights quantized: relative RMS error mean {mean:.3g}, worst {tops}"


def save_tokenizer(spec: str | None, source: str | None, out: Path) -> list[str]:
    """The tokenizer the run trained with, saved beside the weights where the source folder had none to copy
    (a preset run: the bundled DeepSeek-V3 tokenizer or its --tokenizer) -> the files written."""
    from dstrain.data.tokenizer import load_tokenizer

    folder = source if source and os.path.isdir(source) else None
    try:
        tok = load_tokenizer(spec, folder)
    except UserError as exc:
        log.warning("dstrain export: no tokenizer written (%s)", exc)
        return []
    return sorted(
        os.path.basename(f) for f in tok.save_pretrained(out) if os.path.basename(f) in TOKENIZER_FILES
    )


def check_adapter_only(lora: dict[str, Any] | None, cfg: ModelConfig) -> None:
    """An adapter folder needs adapters; say what it carries beyond them (what vLLM then refuses)."""
    if not lora:
        raise ConfigError("--adapter_only: the checkpoint has no LoRA adapters (it was a full fine-tune)")
    try:
        family_of(cfg).refuse("adapter_only", "--adapter_only")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.is_moe and (lora.get("train_router", True) or _bias_trained(lora, cfg)):
        log.warning(
            "--adapter_only: the routers changed in full (--train_router, or the expert bias with "
            "--moe_bias_update_speed > 0): they travel as PEFT modules_to_save, which peft loads and vLLM "
            "refuses; for vLLM, fine-tune with --no-train_router --moe_bias_update_speed 0 (LoRA on `gate` "
            "stays an adapter)"
        )
    if lora.get("train_mtp", True) and cfg.num_nextn_predict_layers:
        log.warning(
            "--adapter_only: the trained MTP modules go to a side file (mtp_modules.safetensors): "
            "transformers and the serving engines load no MTP weights from an adapter"
        )


def _bias_trained(lora: dict[str, Any], cfg: ModelConfig) -> bool:
    return lora.get("bias_update_speed", 0.0) > 0 and cfg.uses_expert_bias


def travels_whole(lora: dict[str, Any], cfg: ModelConfig) -> Callable[[str], bool]:
    """Which base tensors (dstrain keys) an adapter folder must carry whole, besides the adapters: the
    routers' weight and bias when either trained (`write_peft_adapter` merges a router's adapters into its
    weight then), and the MTP modules' tensors under --train_mtp."""
    routers = cfg.is_moe and (lora.get("train_router", True) or _bias_trained(lora, cfg))
    mtp = bool(lora.get("train_mtp", True) and cfg.num_nextn_predict_layers)

    def whole(key: str) -> bool:
        if key.startswith("mtp."):
            return mtp
        module, _, leaf = key.rpartition(".")
        return routers and module.endswith(".mlp.gate") and leaf in ("weight", EXPERT_BIAS)

    return whole


# ------------------------------------------------------------------ verification
@torch.no_grad()
def verify(
    checkpoint: str | os.PathLike | Checkpoint,
    out: str | os.PathLike,
    dtype: torch.dtype,
    seq_len: int = 32,
    adapter_only: bool = False,
    quantized: bool = False,
) -> float:
    """Max |logits| difference between transformers on the exported folder and dstrain's model built from
    the checkpoint's weights (adapters unmerged for fp32; for other dtypes merged and rounded the way the
    export rounds, so the check measures the layout, not the dtype's precision). `adapter_only`: `out` is an
    adapter folder, loaded by peft as it is onto transformers' model of the folder training started from
    (the adapters rounded to `dtype` in the reference, unmerged). `quantized`: `out` holds the source's quantized
    form, which transformers dequantizes as it loads (on a CPU too); the reference is dstrain's model read from
    `out` (dequantized by quant.py), so the check measures the layout and the dequantization, the quantization
    error being the export's own report."""
    opened = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    if adapter_only:
        check_adapter_verify(opened)
    if quantized:
        from dstrain.model import from_pretrained

        ref = from_pretrained(out, dtype=torch.float32)
        _dequantize_as_compressed_tensors(ref, out)
    else:
        ref = _checkpoint_model(opened, dtype, adapter_only)
    return _compare(ref, opened, out, seq_len, adapter_only)


def _dequantize_as_compressed_tensors(ref: torch.nn.Module, out: str | os.PathLike) -> None:
    """compressed-tensors dequantizes packed integers in the scale's dtype (q * scale rounded to bf16 for
    Kimi-K2.5); dstrain reads them exactly in fp32. The reference's packed weights rounded the same way, so
    that verify compares the readings, not that rounding."""
    from dstrain.model.sources import open_folder

    state = ref.state_dict()
    with open_folder(out, ref.config) as reader, SourceForms(out) as forms:
        for key, parts in reader.sources.items():
            first = forms.parts.get(next(iter(parts.values())), {})
            if key in state and "weight_packed" in first:
                dtype = forms.dtype(first["weight_scale"])
                state[key].copy_(state[key].to(dtype).float())


def _checkpoint_model(opened: Checkpoint, dtype: torch.dtype, adapter_only: bool) -> torch.nn.Module:
    """dstrain's model of the checkpoint's weights (see `verify`), fp32."""
    from dstrain.model import build_model
    from dstrain.model.common.lora import apply_lora, merge_lora

    ckpt, cfg, lora = opened.path, opened.config, opened.lora
    ref = build_model(cfg, dtype=torch.float32, init=False)
    if lora and apply_lora(ref, int(lora["r"]), float(lora["alpha"]), lora["targets"]) != lora["modules"]:
        raise CheckpointError(f"checkpoint {ckpt}: lora.json's targets no longer select its adapted modules")
    state = ref.state_dict(keep_vars=True)
    filled = set()
    for key, t in checkpoint_weights(opened):
        if key not in state:
            raise CheckpointError(f"checkpoint tensor {key} is not in the model")
        state[key].data.copy_(t)
        filled.add(key)
    unfilled = set(state) - filled - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    if unfilled:
        raise CheckpointError(f"checkpoint {ckpt} lacks {sorted(unfilled)[0]}")
    if dtype != torch.float32:
        if not adapter_only:
            merge_lora(ref)
        for name, t in ref.state_dict(keep_vars=True).items():
            if t.is_floating_point() and not family_of(cfg).keeps_fp32(name):
                t.data.copy_(t.data.to(dtype).float())
    return ref


@torch.no_grad()
def _compare(
    ref: torch.nn.Module, opened: Checkpoint, out: str | os.PathLike, seq_len: int, adapter_only: bool
) -> float:
    """Max |logits diff| of transformers' model of `out` and `ref` on random ids."""
    from transformers.utils import logging as hf_logging

    cfg = opened.config
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report lists the MTP layers it does not build, as "unexpected"
    hf_logging.disable_progress_bar()
    quant = {} if adapter_only else _dequantizing(out, cfg)
    try:
        with warnings.catch_warnings():
            # ours is the folder's own quantization_config, dequantizing: transformers warns that it sees two
            warnings.filterwarnings("ignore", "You passed `quantization_config`", UserWarning)
            if adapter_only:
                hf = _peft_model(opened.source, out)
            elif cfg.wrapper:
                hf = _text_model(cfg, out, **quant).eval()
            else:
                hf = _hf_lm(str(out), dtype=torch.float32, **quant).eval()
        if quant:  # its FP8 loader leaves the unquantized weights in the file's dtype (exactly: upcast)
            hf = hf.float()
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (3, min(seq_len, cfg.max_position_embeddings)), generator=gen)
    want = ref.eval()(ids).logits
    with TieRule() as rule:
        got = hf(input_ids=ids, use_cache=False).logits
    if rule.tied_rows:
        log.info(
            "verify: transformers ran with dstrain's top-k tie rule (%d rows tied at the boundary)",
            rule.tied_rows,
        )
    return float((got.float() - want.float()).abs().max())


class TieRule(TorchFunctionMode):
    """transformers' `topk` calls with dstrain's tie rule (`dsa.top_keys`: of equal scores the later key).
    A sparse-attention indexer with few heads leaves many scores exactly 0 after its ReLU, and torch.topk
    breaks such ties its own way: the two models would then attend to different keys with the same weights,
    and a correct export would differ by the selection alone. Where no scores tie, the selection is the same
    set either way; `tied_rows` counts the rows whose k-th and (k+1)-th scores were equal."""

    def __init__(self) -> None:
        super().__init__()
        self.tied_rows = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func not in (torch.topk, torch.Tensor.topk) or not args[0].is_floating_point():
            return func(*args, **kwargs)
        scores, k = args[0], args[1] if len(args) > 1 else kwargs["k"]
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        if dim not in (-1, scores.dim() - 1) or not kwargs.get("largest", True) or k >= scores.shape[-1]:
            return func(*args, **kwargs)
        ordered = scores.sort(dim=-1, descending=True).values
        self.tied_rows += int(((ordered[..., k - 1] == ordered[..., k]) & ordered[..., k].isfinite()).sum())
        indices = top_keys(scores, k)
        return torch.return_types.topk((scores.gather(-1, indices), indices))


def check_adapter_verify(opened: Checkpoint) -> None:
    """`--verify --adapter_only` loads the adapter onto the folder training started from: it needs one."""
    if not opened.lora:
        return  # no adapter to verify: check_adapter_only says so
    if not (opened.source and os.path.isdir(opened.source)):
        raise ConfigError(
            f"--verify with --adapter_only: the run did not start from a Hugging Face folder "
            f"({opened.source or 'a preset'}) to load the adapter onto; export merged to verify"
        )
    if opened.config.wrapper:
        raise ConfigError(
            "--verify with --adapter_only: not for a multimodal folder; export merged to verify"
        )


def _peft_model(base: str, adapter: str | os.PathLike) -> Any:
    """peft's model of the adapter folder as it is, on transformers' model of `base`, in fp32."""
    from peft import PeftModel

    hf = _hf_lm(base, dtype=torch.float32)
    with warnings.catch_warnings():
        # peft checks its own fused experts' rank_pattern against target_modules only and calls it unused
        warnings.filterwarnings("ignore", "The following (rank|alpha)_pattern keys", RuntimeWarning)
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        return PeftModel.from_pretrained(hf, str(adapter)).eval()


def _hf_lm(path: str, **kwargs: Any) -> Any:
    """transformers' model with the language-model head of a folder: AutoModelForCausalLM's, or where
    transformers maps the architecture to image-text-to-text only (GLM-5.3-Flash's), that one (the text path
    runs without images)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(path)
    if type(config) in AutoModelForCausalLM._model_mapping:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return AutoModelForImageTextToText.from_pretrained(path, **kwargs)


def _dequantizing(out: str | os.PathLike, cfg: ModelConfig) -> dict[str, Any]:
    """from_pretrained's `quantization_config` for a folder holding quantized weights: its own, dequantizing
    as it loads, on any device (transformers' FP8 and compressed-tensors loaders do so; without it, on a CPU,
    the FP8 one dequantizes to bf16 whatever the dtype asked). {} for a folder without."""
    from transformers.quantizers.auto import AutoQuantizationConfig

    conf = json.loads((Path(out) / "config.json").read_text())
    levels = _quant_levels(conf)
    if not levels:
        return {}
    level = levels[-1]  # a multimodal folder's text model's, where it has one
    quant = AutoQuantizationConfig.from_dict(level["quantization_config"])
    quant.dequantize = True
    if "expert_dtype" in level:  # DeepSeek-V4's FP4 experts: declared beside the quantization_config
        quant.expert_dtype = level["expert_dtype"]
    return {"quantization_config": quant}


def _text_model(cfg: ModelConfig, out: str | os.PathLike, **kwargs: Any) -> Any:
    """transformers' model of a multimodal folder's text model alone (its family's class, its tensors read from
    under the prefix; the vision tower's are left unread), in fp32."""
    import transformers

    text = json.loads((Path(out) / "config.json").read_text())[cfg.wrapper.text_config]
    del text["model_type"]  # e.g. kimi_k2, which transformers does not know: the variant's class reads it
    config = getattr(transformers, cfg.variant.hf_config)(**text)
    hf_class = getattr(transformers, cfg.variant.architecture)
    prefix = {f"^{re.escape(cfg.hf_prefix)}": ""}
    return hf_class.from_pretrained(
        str(out), config=config, dtype=torch.float32, key_mapping=prefix, **kwargs
    )


# ------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    p = command_parser(
        "dstrain export",
        "Write a dstrain checkpoint as a Hugging Face folder (LoRA merged), or as a PEFT adapter.",
    )
    p.add_argument(
        "checkpoint", help="a checkpoint folder (…/checkpoints/step_N) or a run's output dir (its newest)"
    )
    p.add_argument("--out", required=True, help="the folder to write (must be empty unless --force)")
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default=None,
        help="weight dtype (default: that of the HF folder training started from, else float32; a quantized "
        "folder's quantized weights in its own form); given, every weight is written in it, unquantized; "
        "the expert bias is always float32",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="load the result with transformers (an --adapter_only folder with peft, onto the folder training "
        "started from), compare logits with dstrain's",
    )
    p.add_argument(
        "--adapter_only",
        action="store_true",
        help="write the LoRA adapter as a PEFT folder instead of merging",
    )
    p.add_argument("--force", action="store_true", help="overwrite a non-empty --out")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def run(args: argparse.Namespace) -> int:
    ckpt = open_checkpoint(args.checkpoint)
    if args.verify and args.adapter_only:
        check_adapter_verify(ckpt)  # before anything is written
    info = export(ckpt, args.out, args.dtype, args.adapter_only, args.force)
    dtype = info["dtype"]
    quantized = "quantized" in info
    what = "PEFT adapter" if args.adapter_only else f"{len(info['files'])} safetensors file(s)"
    form = "the source's quantized form, the rest " if quantized else ""
    print(
        f"dstrain export: {info['checkpoint']} -> {info['out']} ({what}, "
        f"{form}{str(dtype).removeprefix('torch.')})"
    )
    if quantized:
        print(f"dstrain export: {error_summary(info['quantized'])}")
    if args.verify:
        diff = verify(ckpt, args.out, dtype, adapter_only=args.adapter_only, quantized=quantized)
        tol = TOLERANCE[torch.float32 if quantized else dtype]
        ok = diff <= tol
        how = "peft on transformers" if args.adapter_only else "transformers"
        both = ", both dequantizing the folder written" if quantized else ""
        print(
            f"dstrain export: verify: max |logits diff| {diff:.3g} (tolerance {tol:g}, {how} against "
            f"dstrain{both}): {'ok' if ok else 'FAILED'}"
        )
        return 0 if ok else 1
    return 0
