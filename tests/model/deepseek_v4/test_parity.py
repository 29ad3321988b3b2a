"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM (the oracle: tiny random models it builds), and
the parts transformers does not train: MTP, packed documents, the balancing rules, mHC's Sinkhorn."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dstrain.batch import target_mask
from dstrain.model.common.experts import routed_experts
from dstrain.model.common.mhc import HyperConnection
from dstrain.model.deepseek_v4.attention import V4Inputs
from dstrain.model.deepseek_v4.config import V4Config
from dstrain.model.deepseek_v4.model import DeepSeekV4LM
from dstrain.model.sources import init_weights
from tests.helpers.v4 import tiny_v4

HCA128 = dict(
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
)


def twin(ref, mtp: int = 0, **changes) -> DeepSeekV4LM:  # noqa: ANN001
    """dstrain's model of transformers' `ref` (its config.json and its weights), no balance loss."""
    cfg = V4Config.from_hf_dict(ref.config.to_dict()).replace(
        **{"num_nextn_predict_layers": mtp, "aux_loss_alpha": 0.0, **changes}
    )
    model = DeepSeekV4LM(cfg)
    init_weights(model, seed=0)  # the MTP modules, which transformers does not build
    model.to(next(ref.parameters()).dtype)
    missing, unexpected = model.load_state_dict(
        {k.removeprefix("model."): v for k, v in ref.state_dict().items()}, strict=False
    )
    assert not unexpected and all(k.startswith("mtp.") for k in missing), (missing, unexpected)
    return model


def tokens(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "t, overrides",
    [
        (37, {}),  # sliding, CSA (10 entries, top-k 3), HCA (rate 8), a hash layer, hc_mult 2
        (3, {}),  # shorter than every window: no compressed entry yet
        (40, {"hc_mult": 4}),
        (300, HCA128),  # the published HCA rate: 2 entries
        (
            45,
            {
                "num_hidden_layers": 4,
                "num_hash_layers": 2,
                "layer_types": [
                    "compressed_sparse_attention",
                    "sliding_attention",
                    "heavily_compressed_attention",
                    "compressed_sparse_attention",
                ],
            },
        ),
    ],
    ids=["every-kind", "no-entries", "hc4", "hca128", "hash2"],
)
def test_logits_match_transformers(t: int, overrides: dict) -> None:
    ref = tiny_v4(seed=t, **overrides)
    ids = tokens(2, t, t)
    with torch.no_grad():
        want = ref(ids, use_cache=False).logits
        got = twin(ref)(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def _grads(model, ids: torch.Tensor, hf: bool) -> dict[str, torch.Tensor]:  # noqa: ANN001
    model.train()
    out = model(ids, labels=ids, use_cache=False) if hf else model(ids, labels=ids)
    out.loss.backward()
    return {k.removeprefix("model."): p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("t", [37, 70])
def test_gradients_match_transformers(t: int) -> None:
    """Every parameter transformers trains, against its backward of the same loss (mean shifted CE). The
    indexer gets no gradient in either (its output is a selection; training adds the KL rule apart). Both fp32
    gradients are measured against transformers' float64 one: the mHC bases' gradients sum many small terms of
    both signs after fp32 islands (Sinkhorn, RMS) that stay fp32 in either model, so either implementation's
    rounding there is some 30-300 eps32 of the tensor's largest entry, the amount depending on the CPU's BLAS and
    the summation order. dstrain's error may be 4x transformers' own on the same machine, or 4x 128 eps32 where
    transformers' happens to round better; a wrong term is 1e-2 or more."""
    ref = tiny_v4(seed=t, experts_implementation="eager")
    ids = tokens(2, t, 1)
    model = twin(ref)
    model.set_sparse_attention("frozen")  # the indexer's KL rule: tested below
    got = _grads(model, ids, hf=False)
    want = _grads(ref, ids, hf=True)
    exact = _grads(tiny_v4(seed=t, experts_implementation="eager").double(), ids, hf=True)
    floor = 128 * torch.finfo(torch.float32).eps
    assert got.keys() == want.keys()
    for name, g in got.items():
        r = want[name]
        if r is None:
            assert g is None and ".indexer." in name, name
            continue
        scale = exact[name].abs().max()
        own = ((r.double() - exact[name]).abs().max() / scale).item()
        err = ((g.double() - exact[name]).abs().max() / scale).item()
        assert err <= 4 * max(own, floor), (name, err, own)


def test_packed_document_computes_as_alone() -> None:
    """A document starting at a multiple of the compress rates (4, 8) computes as it does alone: its window,
    its compressed entries (the CSA overlap closed at its start) and their positions are its own."""
    ref = tiny_v4(seed=4)
    model = twin(ref).eval()
    ids, start = tokens(2, 40, 4), 16
    pos = torch.cat([torch.arange(start), torch.arange(40 - start)]).expand(2, 40)
    with torch.no_grad():
        packed = model(ids, position_ids=pos).logits[:, start:]
        alone = model(ids[:, start:]).logits
    assert (packed - alone).abs().max() <= 1e-5 * alone.abs().max()


def test_token_losses_sum_to_the_loss_and_keep_documents_apart() -> None:
    """`token_losses=True` (what DPO sums per document): each position's cross-entropy, 0 where no target
    counts (a prompt, the step across a document boundary), summing to the model's own lm_loss_sum (the same
    logits, only the order of the fp32 sum differs: n eps32 of the summed magnitudes); a packed document's
    losses are those it has alone (its logits within 1e-5 of its largest, the log-softmax moving by 2x that)."""
    model = twin(tiny_v4(seed=4)).eval()
    ids, start = tokens(2, 40, 4), 16
    pos = torch.cat([torch.arange(start), torch.arange(40 - start)]).expand(2, 40)
    labels = ids.clone()
    labels[:, :4] = labels[:, start + 1 : start + 3] = -100  # the prompts; labels[start]: a document's first
    with torch.no_grad():
        out = model(ids, position_ids=pos, labels=labels, token_losses=True)
        plain = model(ids, position_ids=pos, labels=labels)
        alone = model(ids[:, start:], labels=labels[:, start:], token_losses=True, return_logits=True)
    rows, valid = out.lm_token_loss, target_mask(labels, pos, 1)[:, :39]
    assert rows.shape == (2, 39) and rows.dtype == torch.float32
    assert (rows[~valid] == 0).all() and (rows[valid] > 0).all() and not valid[:, start - 1].any()
    assert out.lm_tokens == plain.lm_tokens == valid.sum() == 2 * (39 - 3 - 2 - 1)
    bound = valid.sum() * torch.finfo(torch.float32).eps * rows.abs().sum()
    assert (rows.sum() - plain.lm_loss_sum).abs() <= bound and out.lm_loss_sum == rows.sum()
    assert (out.loss - plain.loss).abs() <= bound / valid.sum()
    assert (rows[:, start:] - alone.lm_token_loss).abs().max() <= 2e-5 * alone.logits.abs().max()


def test_sinkhorn_is_doubly_stochastic_in_every_layer() -> None:
    """At the scales training keeps (fn ~ N(0, 0.02), transformers' init) 20 iterations converge: every
    token's comb matrix, in every mHC of every layer, has rows and columns summing to 1 within 1e-5."""
    ref = tiny_v4(seed=5, hc_mult=4)
    model = twin(ref, mtp=1).eval()
    combs = []

    def keep(module, args, _out) -> None:  # noqa: ANN001
        combs.append(module.weights(args[0])[2])

    hcs = [m for m in model.modules() if isinstance(m, HyperConnection)]
    assert len(hcs) == 2 * (3 + 1)
    for m in hcs:
        m.register_forward_hook(keep)
    with torch.no_grad():
        model(tokens(2, 40, 5), labels=tokens(2, 40, 5))
    assert len(combs) == len(hcs)
    for comb in combs:
        assert (comb.sum(-1) - 1).abs().max() < 1e-5
        assert (comb.sum(-2) - 1).abs().max() < 1e-5


def test_mtp_trains_as_deepseeks_mtp_block() -> None:
    """Depth 1 at position i: e_proj(enorm(embed(token i+1))) added to h_proj(hnorm(streams)) per stream, one
    block, its HC head and norm, the shared head predicting token i+2: written out here from DeepSeek's
    MTPBlock and compared with the model's MTP loss; then every MTP parameter gets a gradient."""
    ref = tiny_v4(seed=6)
    model = twin(ref, mtp=1)
    ids = tokens(2, 37, 6)
    streams = []
    model.layers[-1].register_forward_hook(lambda m, a, out: streams.append(out[0]))
    out = model(ids, labels=ids)
    mtp, t = model.mtp[0], ids.shape[1]
    with torch.no_grad():
        ahead = F.pad(ids[:, 1:], (0, 1))
        x = mtp.e_proj(mtp.enorm(model.embed_tokens(ahead))).unsqueeze(2) + mtp.h_proj(mtp.hnorm(streams[0]))
        x, _, _ = mtp.block(x, V4Inputs(model.rope, torch.arange(t).expand(2, t), None, ahead))
        logits = model.lm_head(mtp.norm(mtp.hc_head(x)))[:, : t - 2].float()
        want = F.cross_entropy(logits.flatten(0, 1), ids[:, 2:].flatten(), reduction="sum")
    assert out.mtp_tokens.tolist() == [2 * (t - 2)]
    torch.testing.assert_close(out.mtp_loss_sum[0], want, rtol=1e-5, atol=0)
    out.loss.backward()
    trained = [n for n, p in model.mtp.named_parameters() if p.grad is None or not p.grad.any()]
    assert all(".indexer." in n for n in trained), trained


def test_hash_table_is_frozen_and_only_biased_layers_balance() -> None:
    """Steps of AdamW with the bias update: tid2eid never changes (a buffer, in no optimizer), the hash layer
    reports no load and no balance loss, the biased layers' biases move."""
    ref = tiny_v4(seed=7)
    model = twin(ref, mtp=1, aux_loss_alpha=1e-2, bias_update_speed=1e-2).train()
    tables = {n: b.clone() for n, b in model.named_buffers() if n.endswith("tid2eid")}
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    assert list(tables) == ["layers.0.mlp.gate.tid2eid"] and len(biases) == 3  # 2 main layers + MTP
    assert not any(n.endswith("tid2eid") for n, _ in model.named_parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        ids = tokens(2, 37, 10 + step)
        out = model(ids, labels=ids)
        assert out.expert_load.shape == (3, 4) and out.aux_loss > 0
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        model.update_expert_bias(out.expert_load)
    for n, b in model.named_buffers():
        if n in tables:
            assert torch.equal(b, tables[n])
        if n in biases:
            assert not torch.equal(b, biases[n])


def test_clamped_experts_match_autograd() -> None:
    """The grouped-GEMM experts with V4's SwiGLU clamp against a plain per-expert loop under autograd: the
    gradient stops where torch's clamp stops it (values pushed past the limit on purpose)."""
    g = torch.Generator().manual_seed(8)
    e, d, i, n, k, limit = 4, 16, 8, 30, 2, 0.5
    x = torch.randn(n, d, generator=g, requires_grad=True)
    gate_up = torch.randn(e, 2 * i, d, generator=g).requires_grad_()
    down = torch.randn(e, d, i, generator=g).requires_grad_()
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    w = torch.rand(n, k, generator=g).requires_grad_()
    got = routed_experts(x, idx, w, gate_up, down, limit=limit)
    want = torch.zeros_like(got)
    for j in range(k):
        gu = torch.einsum("nd,nod->no", x, gate_up[idx[:, j]])
        gt, up = gu.chunk(2, dim=-1)
        h = F.silu(gt.clamp(max=limit)) * up.clamp(-limit, limit)
        want = want + w[:, j : j + 1] * torch.einsum("ni,ndi->nd", h, down[idx[:, j]])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dy = torch.randn(n, d, generator=g)
    grads = torch.autograd.grad(got, (x, gate_up, down, w), dy)
    wants = torch.autograd.grad(want, (x, gate_up, down, w), dy)
    for a, b in zip(grads, wants, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_indexer_learns_by_the_kl_rule_and_nothing_else() -> None:
    """CSA's indexer: its parameters' gradient is the KL's (target: the attention's entry probabilities with
    the window and the sink in the denominator, summed over heads, L1-normalised over the visible entries in
    the dense stage, over the selected ones in the sparse stage), computed here by autograd from the
    indexer's scores; every other gradient is the one without the indexer's loss, bit for bit."""
    ref = tiny_v4(seed=9)
    ids = tokens(2, 37, 9)
    for stage in ("dense", "sparse"):
        model = twin(ref).train()
        model.set_sparse_attention(stage)
        for settings in model.sparse_settings():
            settings.loss = False  # the same attention, no indexer loss
        base = _grads(model, ids, hf=False)
        model.zero_grad()
        model.set_sparse_attention(stage)
        attn = model.layers[1].self_attn
        seen = {}
        original = attn._indexer_loss

        def spy(o, scores, probs, support, chosen, inputs, seen=seen, original=original):  # noqa: ANN001, ANN202
            seen.update(scores=scores, probs=probs, support=support)
            return original(o, scores, probs, support, chosen, inputs)

        attn._indexer_loss = spy
        out = model(ids, labels=ids)
        out.loss.backward(retain_graph=True)  # the indexer's scores are differentiated again below
        got = {n: p.grad for n, p in model.named_parameters()}
        for name, g in got.items():
            if ".indexer." in name:
                continue
            assert (g is None and base[name] is None) or torch.equal(g, base[name]), name
        # the KL written out, differentiated by autograd through the indexer alone
        model.zero_grad()
        scores, probs, support = seen["scores"], seen["probs"], seen["support"]
        target = torch.where(support, probs.double(), 0.0)
        target = target / target.sum(-1, keepdim=True).clamp(min=1e-30)
        logq = scores.double().masked_fill(~support, float("-inf"))
        rows = support.any(-1)
        logq = logq[rows].log_softmax(-1)
        kl = torch.where(
            support[rows], target[rows] * (target[rows].clamp(min=1e-300).log() - logq), 0.0
        ).sum()
        (kl / scores[..., 0].numel()).backward()
        indexer = [n for n in got if ".indexer." in n]
        assert indexer and all(got[n] is not None for n in indexer)
        for n in indexer:
            want = model.get_parameter(n).grad
            torch.testing.assert_close(got[n], want.to(got[n].dtype), rtol=1e-5, atol=1e-8)
        stats = out.indexer_stats
        assert stats[1] == rows.sum() and abs(stats[0] - kl.item()) < 1e-9 * max(1.0, kl.item())
        assert (stats[2] > 0) == (stage == "dense")


def test_lora_on_every_v4_target_merges_to_the_same_model() -> None:
    """LoRA on V4's projections (the block-diagonal o_a_proj through its whole weight), the shared and routed
    experts (clamped), the routers (the hash layer's keeps its table) and MTP's projections: with random
    adapters the model equals the merged one, and merging restores V4's own router kinds."""
    from dstrain.model import build_model
    from dstrain.model.common.lora import apply_lora, lora_modules, merge_lora
    from dstrain.model.deepseek_v4.model import V4Router
    from tests.helpers.tiny import tiny_v4_config
    from tests.model.common.test_lora import randomize_adapters

    model = build_model(tiny_v4_config(), seed=3).eval()
    ids = tokens(2, 37, 11)
    with torch.no_grad():
        base = model(ids).logits
    targets = ["q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj", "shared_experts", "experts", "gate"]
    names = apply_lora(model, 4, 8.0, [*targets, "e_proj", "h_proj"])
    assert "layers.0.self_attn.o_a_proj" in names and "layers.0.mlp.gate" in names
    assert torch.equal(
        model.layers[0].mlp.gate.tid2eid, build_model(tiny_v4_config(), seed=3).layers[0].mlp.gate.tid2eid
    )
    randomize_adapters(model)
    only_o_a = dict(model.named_parameters())["layers.0.self_attn.o_a_proj.lora_B"]
    with torch.no_grad():
        adapted = model(ids).logits
        merge_lora(model)
        merged = model(ids).logits
    assert not lora_modules(model) and all(type(r) is V4Router for r in model.routers())
    assert model.layers[0].mlp.gate.tid2eid is not None
    assert (adapted - merged).abs().max() <= 1e-5 * merged.abs().max()
    assert (adapted - base).abs().max() > 1e-2 and only_o_a.abs().sum() > 0


def test_recomputing_mhc_keeps_the_gradients_and_less_memory() -> None:
    """--activation_checkpointing mhc recomputes each hyper-connection's weights in backward: every gradient
    bit for bit as without (and as 'full'), fewer bytes kept for backward."""
    from dstrain.model import build_model
    from tests.helpers.tiny import tiny_v4_config

    model = build_model(tiny_v4_config(), seed=4).train()
    ids = tokens(2, 64, 12)
    kept, grads = {}, {}
    for mode in ("none", "mhc", "full"):
        model.set_activation_checkpointing(mode)
        model.zero_grad(set_to_none=True)
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor, seen=seen) -> torch.Tensor:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(ids, labels=ids)
        out.loss.backward()
        kept[mode] = sum(seen.values())
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for mode in ("mhc", "full"):
        assert grads[mode].keys() == grads["none"].keys()
        assert all(torch.equal(grads[mode][n], g) for n, g in grads["none"].items()), mode
    assert kept["full"] < kept["mhc"] < kept["none"]
