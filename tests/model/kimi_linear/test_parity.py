"""Kimi Linear against transformers' KimiLinearForCausalLM (torch path: `fla` is not importable) on a folder it
wrote: logits, every parameter's gradient; and packed documents, which transformers' torch path runs through
KDA as one sequence (the state leaks from one document into the next)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import KimiLinearForCausalLM

from dstrain.model import from_pretrained

EPS32 = torch.finfo(torch.float32).eps


def tokens(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 96, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def models(kimi_folder):  # noqa: ANN001, ANN201
    """(transformers' fp32 model, its float64 copy, dstrain's fp32 model) of the same folder; the experts run
    transformers' eager loop (its grouped_mm takes no float64)."""
    assert importlib.util.find_spec("fla") is None  # else transformers would run fla's kernels
    ref = KimiLinearForCausalLM.from_pretrained(kimi_folder, experts_implementation="eager").eval()
    exact = KimiLinearForCausalLM.from_pretrained(kimi_folder, experts_implementation="eager").eval().double()
    ours = from_pretrained(kimi_folder, dtype=torch.float32)
    ours.config.aux_loss_alpha = 0.0  # transformers' loss is the LM loss alone
    return ref, exact, ours.eval()


def test_logits_match_transformers(models) -> None:  # noqa: ANN001
    """T 100: several of KDA's chunks, MLA over the whole row (measured: 2-3.5e-6 of the largest logit over
    8 seeds, as far as transformers' own fp32 run is from its float64 one)."""
    ref, _, ours = models
    ids = tokens(2, 100, 0)
    with torch.no_grad():
        want = ref(ids, use_cache=False).logits
        got = ours(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def _grads(model, ids: torch.Tensor, hf: bool) -> dict[str, torch.Tensor]:  # noqa: ANN001
    model.zero_grad(set_to_none=True)
    model.train()
    out = model(ids, labels=ids, use_cache=False) if hf else model(ids, labels=ids)
    out.loss.backward()
    model.eval()
    return {k: p.grad for k, p in model.named_parameters()}


def _theirs(name: str, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' gradient of dstrain's parameter `name` (its names: `model.`, the forget gate's module, one
    stacked convolution)."""
    layer, _, rest = name.partition(".self_attn.")
    if rest.split(".")[0] in ("f_a_proj", "f_b_proj", "A_log", "dt_bias"):
        return grads[f"model.{layer}.self_attn.forget_gate.{rest}"]
    if "conv1d" in rest:
        return grads[f"model.{layer}.self_attn.conv1d.weight"].chunk(3)["qkv".index(rest[0])]
    return grads[name if name.startswith("lm_head") else f"model.{name}"]


def test_gradients_match_transformers(models) -> None:  # noqa: ANN001
    """Every parameter's gradient of the mean CE, against transformers' float64 gradient. A gradient entry sums
    the B T = 140 tokens' terms through the 4 layers and up to 70 recurrence steps; rounding that grows as a
    random walk over those additions stays within sqrt(140 x 4 x 70) ~ 200 eps32 of the tensor's largest entry
    (measured: at most 51; transformers' own fp32 gradient up to 76). A wrong term is ~1e-2."""
    ref, exact, ours = models
    ids = tokens(2, 70, 1)
    got = _grads(ours, ids, hf=False)
    want64 = _grads(exact, ids.clone(), hf=True)
    bound = (140 * 4 * 70) ** 0.5 * EPS32
    assert len(got) == len(want64) + 2 * sum(ours.config.is_kda_layer(i) for i in range(4))  # convs split
    for name, g in got.items():
        r = _theirs(name, want64)
        err = (g.double() - r.view_as(g)).abs().max() / r.abs().max()
        assert err <= bound, (name, err.item() / EPS32)


def test_packed_documents_compute_as_alone(models) -> None:  # noqa: ANN001
    """Three documents in a row (transformers without fla lets KDA's state cross them): each one's logits are
    those of the document alone, KDA's state and short convolutions restarting at its start and MLA attending
    within it, within fp32 rounding (the chunks fall at other offsets)."""
    _, _, ours = models
    lengths = [30, 75, 15]
    ids = tokens(2, sum(lengths), 2)
    pos = torch.cat([torch.arange(n) for n in lengths]).expand(2, -1)
    with torch.no_grad():
        packed = ours(ids, position_ids=pos).logits
        begin = 0
        for n in lengths:
            alone = ours(ids[:, begin : begin + n]).logits
            assert (packed[:, begin : begin + n] - alone).abs().max() <= 1e-5 * alone.abs().max()
            begin += n


def test_recurrent_form_gives_the_same_logits(models) -> None:  # noqa: ANN001
    """The chunked KDA the model trains with and the token-by-token recurrence give the same model output."""
    _, _, ours = models
    ids = tokens(1, 80, 3)
    with torch.no_grad():
        chunked = ours(ids).logits
        kda = [b.self_attn for b in ours.layers if b.kda]
        forward = [layer.forward for layer in kda]
        try:
            for layer in kda:
                layer.forward = lambda x, starts=None, f=layer.forward: f(x, starts, recurrent=True)
            recurrent = ours(ids).logits
        finally:
            for layer, f in zip(kda, forward, strict=True):
                layer.forward = f
    assert (chunked - recurrent).abs().max() <= 1e-5 * recurrent.abs().max()


def test_lora_on_kda_and_mla_merges_to_the_same_model() -> None:
    """LoRA on the family's default targets (KDA's q/k/v and output, MLA's kv_b_proj and output, the shared
    experts) plus KDA's gates and the routed experts and routers: with random adapters the model equals the
    merged one, and the adapters change it."""
    from dstrain.model import build_model, get_config
    from dstrain.model.common.lora import apply_lora, lora_modules, merge_lora
    from dstrain.model.kimi_linear import FAMILY
    from tests.model.common.test_lora import randomize_adapters

    model = build_model(get_config("tiny-kimi-linear").replace(vocab_size=96), seed=3).eval()
    ids = tokens(2, 40, 11)
    with torch.no_grad():
        base = model(ids).logits
    targets = [
        *FAMILY.lora_targets,
        "f_a_proj",
        "f_b_proj",
        "g_a_proj",
        "g_b_proj",
        "b_proj",
        "experts",
        "gate",
    ]
    names = apply_lora(model, 4, 8.0, targets)
    assert {
        "layers.0.self_attn.k_proj",
        "layers.0.self_attn.f_b_proj",
        "layers.2.self_attn.kv_b_proj",
    } <= set(names)
    randomize_adapters(model)
    with torch.no_grad():
        adapted = model(ids).logits
        merge_lora(model)
        merged = model(ids).logits
    assert not lora_modules(model)
    assert (adapted - merged).abs().max() <= 1e-5 * merged.abs().max()
    assert (adapted - base).abs().max() > 1e-3
