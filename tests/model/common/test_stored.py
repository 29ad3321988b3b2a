"""The frozen base kept as its folder stores it (common/stored.py, `--base_precision stored`), on one process: for
each stored form (DeepSeek-V3's FP8 with fp32 block scales, DeepSeek-V4's FP8 with e8m0 scales and FP4 routed
experts, Kimi-K2.5's compressed-tensors INT4 experts), LoRA on the stored base computes the same bits as LoRA on
the dequantized base (a dense load dequantizes to fp32 and rounds to the layer's dtype, the stored base does the
same when a layer uses it, and the same kernels run on the same values: fp32 and bf16 alike); every quantized
weight is held as the file's codes and scales (their dtypes and bytes) and none as a parameter; autograd keeps no
dequantized weight for backward; the option's mistakes are one line before anything is built."""

from __future__ import annotations

import shutil

import pytest
import torch

from dstrain.errors import CheckpointError, ConfigError
from dstrain.model import from_pretrained, get_config
from dstrain.model.build import materialize
from dstrain.model.common.stored import StoredWeight, stored_weights
from dstrain.model.quantized import dequantizer, fill_stored, store_base
from dstrain.model.registry import on_meta
from dstrain.model.sources import Weights, fill, open_folder
from dstrain.training.finetune import apply_finetune_options
from tests.helpers.quantized import fp8_folder, glm5n_fp8_folder
from tests.helpers.trainer import make_options


def _v4_folder(path):  # noqa: ANN001, ANN202
    from tests.model.deepseek_v4.test_state_dict import _ds_folder, _ds_model, _quantized_folder

    _quantized_folder(path, _ds_folder(path.parent / "v4_plain", _ds_model()))
    return path


def _k25_folder(path):  # noqa: ANN001, ANN202
    from tests.model.hf.test_kimi_k25 import k25_folder

    path.mkdir()
    k25_folder(path)
    return path


FORMS = {  # name -> (folder writer, LoRA targets)
    "fp8_v3": (lambda p: fp8_folder(p) and p, "q_b_proj,kv_b_proj,o_proj,shared_experts,experts"),
    "fp8_fp4_v4": (_v4_folder, "q_b_proj,kv_proj,o_a_proj,o_b_proj,shared_experts,experts"),
    "int4_k25": (_k25_folder, "q_b_proj,kv_b_proj,o_proj,shared_experts,experts"),
    # GLM-5.3-Flash's FP8 release: KDA's projections and gates, MLA's, the experts
    "fp8_glm5n": (
        lambda p: glm5n_fp8_folder(p) and p,
        "q_proj,v_proj,f_b_proj,q_b_proj,kv_b_proj,o_proj,experts",
    ),
}


@pytest.fixture(scope="module", params=list(FORMS))
def folder(request, tmp_path_factory):
    write, targets = FORMS[request.param]
    return request.param, write(tmp_path_factory.mktemp(request.param) / "src"), targets


def _models(path, targets: str, dtype: torch.dtype):  # noqa: ANN001, ANN202
    """(LoRA on the folder dequantized, LoRA on its stored base), the adapters' B drawn (A: seeded by name)."""
    opts = make_options(["--lora_r", "8", "--lora_targets", targets])
    cfg = get_config(path)
    dense = from_pretrained(path, dtype=dtype)
    apply_finetune_options(dense, opts.lora, 0)
    stored = on_meta(cfg)
    apply_finetune_options(stored, opts.lora, 0)
    with Weights(cfg, 0, folder=path) as weights:
        assert store_base(stored, weights.reader) > 0
        materialize(stored, "cpu", dtype)
        fill(stored, weights)
        fill_stored(stored, weights.reader)
    for model in (dense, stored):
        from dstrain.model.common.lora import init_adapters

        init_adapters(model, 0)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                if name.endswith("lora_B"):
                    p.copy_(0.02 * torch.randn(p.shape, generator=g))
    return dense, stored


def _step(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # noqa: ANN001
    model.train()
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_on_the_stored_base_computes_the_dequantized_base_s_bits(folder, dtype):
    name, path, targets = folder
    if dtype == torch.bfloat16 and name != "fp8_v3":
        pytest.skip("bf16 on one form: the same casts as fp32's on the others")
    dense, stored = _models(path, targets, dtype)
    ids = torch.randint(0, dense.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    loss_d, grads_d = _step(dense, ids)
    loss_s, grads_s = _step(stored, ids)
    assert torch.equal(loss_d, loss_s), (loss_d, loss_s)
    assert grads_d.keys() == grads_s.keys() and any("lora_" in k for k in grads_s)
    for k, g in grads_d.items():
        assert torch.equal(g, grads_s[k]), k


def test_every_quantized_weight_is_held_as_the_file_stores_it(folder):
    """Parts in the file's dtypes, byte for byte the folder's (codes and scales), none as a parameter."""
    name, path, targets = folder
    _, stored = _models(path, targets, torch.float32)
    cfg = get_config(path)
    with open_folder(path, cfg) as reader:
        keys = {k for k in reader.sources if reader.stored_form(k)}
        held = dict(stored_weights(stored))
        assert {w.source.key for w in held.values()} == keys
        assert not keys & {n for n, _ in stored.named_parameters()}
        for w in held.values():
            raw = reader.read_stored(w.source.key, w.source.half, *(w.source.experts or ()))
            assert {p: t.dtype for p, t in raw.items()} == w.dtypes
            for p, t in raw.items():
                assert torch.equal(w.part(p).view(torch.uint8), t.contiguous().view(torch.uint8)), (
                    w.source,
                    p,
                )
        total = sum(w.nbytes for w in held.values())
        dense = sum(4 * torch.Size(w.shape).numel() for w in held.values())
        print(name, f"stored {total} bytes, fp32 {dense}")
        # a byte per FP8 element, half a byte per FP4/INT4 one, and the scales: at most 0.26 of fp32's 4 bytes
        assert total <= 0.26 * dense


def test_nothing_dequantized_is_kept_for_backward(tmp_path):
    """What autograd saves in the forward is the same with the stored base as with the dense one (whose saved
    weights are the parameters themselves, no memory): no layer keeps its dequantized weight."""
    path = tmp_path / "src"
    fp8_folder(path)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    saved = []
    for model in _models(path, FORMS["fp8_v3"][1], torch.float32):
        held = {p.untyped_storage().data_ptr() for p in model.parameters()}
        nbytes = [0]

        def pack(t: torch.Tensor, held=held, nbytes=nbytes) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in held:
                nbytes[0] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model.train()(ids, labels=ids).loss.backward()
        saved.append(nbytes[0])
    dense_weights = sum(4 * torch.Size(w.shape).numel() for _, w in stored_weights(model))
    print(f"saved: dense base {saved[0]}, stored base {saved[1]}; dequantized weights {dense_weights}")
    assert saved[1] <= saved[0] + 4096  # empty placeholders only


def test_the_option_s_mistakes_are_one_line(tmp_path):
    from dstrain.config.plan import prepare
    from tests.helpers.tiny import tiny_config

    path = tmp_path / "src"
    fp8_folder(path, tiny_config())  # projections of 16-64 rows: TP2 would cut their 128-blocks
    lora = ["--lora_r", "8", "--model", str(path)]
    with pytest.raises(ConfigError, match=r"--tp 2 with --base_precision stored: .* cuts its stored blocks"):
        prepare(make_options([*lora, "--tp", "2", "--qat", "off"]), 2, "cpu")
    with pytest.raises(
        ConfigError, match=r"--tp 2 with QAT: .* cuts its stored blocks .* --qat off splits it$"
    ):
        prepare(make_options([*lora, "--tp", "2", "--base_precision", "bf16"]), 2, "cpu")
    with pytest.raises(ConfigError, match="--base_precision stored: a full fine-tune trains every weight"):
        prepare(make_options(["--model", str(path), "--base_precision", "stored"]), 1, "cpu")
    dense = tmp_path / "dense"
    from dstrain.model import build_model, save_pretrained

    save_pretrained(build_model(tiny_config(), seed=0), dense)
    with pytest.raises(ConfigError, match="needs a --model folder with quantized weights"):
        prepare(
            make_options(["--lora_r", "8", "--model", str(dense), "--base_precision", "stored"]), 1, "cpu"
        )
    plan = prepare(make_options(lora), 1, "cpu")
    assert plan.stored_base and any("kept as stored" in n for n in plan.notes)
    assert not prepare(make_options([*lora, "--base_precision", "bf16"]), 1, "cpu").stored_base
    assert not prepare(make_options(["--model", str(path)]), 1, "cpu").stored_base  # a full fine-tune


def test_a_changed_base_folder_is_refused(tmp_path):
    """A checkpoint of a stored-base run holds no copy of the base: resuming or exporting needs the very folder,
    told by its files' sizes and a hash of its index and headers (the issue's rule: values rewritten in place
    under the same names, dtypes and shapes are not detected)."""
    from safetensors.torch import load_file, save_file

    from dstrain.checkpoint.store import check_base
    from dstrain.model.hf import folder_identity

    path = tmp_path / "src"
    fp8_folder(path)
    base = {"folder": str(path), "identity": folder_identity(path)}
    check_base(base, "resuming x")
    shutil.move(path, tmp_path / "moved")
    with pytest.raises(CheckpointError, match="resuming x reads its frozen base from .* cannot be read"):
        check_base(base, "resuming x")
    shutil.move(tmp_path / "moved", path)
    tensors = load_file(path / "model.safetensors")
    tensors.pop(next(k for k in tensors if k.endswith("q_b_proj.weight_scale_inv")))
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match="whose files changed since the run started"):
        check_base(base, "resuming x")


def test_stored_weight_is_no_parameter_deepspeed_could_cast():
    """uint8 buffers, not persistent: DeepSpeed's module casts and ZeRO see none of it, nor does a state dict."""
    w = StoredWeight("weight_scale_inv", dequantizer("weight_scale_inv"), {"weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn),
                                          "weight_scale_inv": torch.ones(1, 1)}, (4, 4), None)  # fmt: skip
    m = torch.nn.Module()
    m.w = w
    m.bfloat16()
    assert not list(m.parameters()) and m.state_dict() == {}
    assert {b.dtype for b in m.buffers()} == {torch.uint8}
    assert w.dtypes == {"weight": torch.float8_e4m3fn, "weight_scale_inv": torch.float32}


@pytest.mark.parametrize("chunk", [1, 3])
def test_experts_dequantized_a_group_at_a_time_compute_the_same_bits(tmp_path, chunk):
    """A layer's stored experts are dequantized `chunk` experts at a time (stored.EXPERT_CHUNK_BYTES bounds the
    transient: 6 of DeepSeek-V3's 256): the same rows meet the same weights, so the same bits (4 experts of
    this model in groups of 1, and of 3 and 1)."""
    from dstrain.model.common.stored import StoredExperts

    path = tmp_path / "src"
    fp8_folder(path)
    dense, stored = _models(path, FORMS["fp8_v3"][1], torch.float32)
    groups = [m for m in stored.modules() if isinstance(m, StoredExperts)]
    assert groups and all(m.chunk >= 4 for m in groups)  # a tiny model's experts: one group by default
    for m in groups:
        m.chunk = chunk
    ids = torch.randint(0, dense.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    (loss_d, grads_d), (loss_s, grads_s) = _step(dense, ids), _step(stored, ids)
    assert torch.equal(loss_d, loss_s) and grads_d.keys() == grads_s.keys()
    for k, g in grads_d.items():
        assert torch.equal(g, grads_s[k]), k
