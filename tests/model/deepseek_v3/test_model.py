"""Packed-document isolation, balancing (expert bias, sequence-balance loss), MTP loss, FLOP counter, config."""

import math

import pytest
import torch
import torch.nn.functional as F

from dstrain.model import ModelConfig, build_model, flops_per_token, get_config
from dstrain.model.deepseek_v3.model import MoE

SMALL = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
)


def tiny(**kw):
    return build_model(ModelConfig(**{**SMALL, **kw}), seed=0).eval()


def test_packed_documents_are_isolated():
    model = tiny()
    torch.manual_seed(0)
    lens = [10, 7, 15]
    docs = [torch.randint(0, 97, (n,)) for n in lens]
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=pos).logits[0]
        start = 0
        for d in docs:
            alone = model(d[None]).logits[0]
            assert (packed[start : start + len(d)] - alone).abs().max() <= 1e-5
            start += len(d)


def test_packed_loss_never_crosses_documents():
    model = tiny(num_nextn_predict_layers=2)
    torch.manual_seed(1)
    lens = [9, 12]
    docs = [torch.randint(0, 97, (n,)) for n in lens]
    ids, pos = torch.cat(docs)[None], torch.cat([torch.arange(n) for n in lens])[None]
    with torch.no_grad():
        packed = model(ids, position_ids=pos, labels=ids)
        alone = [model(d[None], labels=d[None]) for d in docs]
    assert packed.lm_tokens.item() == sum(n - 1 for n in lens)
    assert packed.lm_loss_sum.item() == pytest.approx(sum(o.lm_loss_sum.item() for o in alone), rel=1e-5)
    assert packed.mtp_tokens.tolist() == [sum(n - 1 - k for n in lens) for k in (1, 2)]
    assert torch.allclose(packed.mtp_loss_sum, sum(o.mtp_loss_sum for o in alone), rtol=1e-5)


def test_mtp_loss_matches_hand_computation():
    model = tiny(num_nextn_predict_layers=2, first_k_dense_replace=2)
    torch.manual_seed(2)
    t = 11
    ids = torch.randint(0, 97, (1, t))
    labels = ids.clone()
    labels[0, 4] = -100  # one masked target
    with torch.no_grad():
        out = model(ids, labels=labels)
        # Main model, by hand.
        rope = model._rope(torch.arange(t)[None])
        from dstrain.model.common.attention import AttentionLayout

        h = model.embed_tokens(ids)
        for blk in model.layers:
            h = blk(h, rope, AttentionLayout(causal_only=True))[0]
        prev = model.norm(h)
        for k, mtp in enumerate(model.mtp, start=1):
            emb = torch.stack(
                [
                    model.embed_tokens.weight[ids[0, i + k]] if i + k < t else model.embed_tokens.weight[0]
                    for i in range(t)
                ]
            )[None]
            x = mtp.eh_proj(torch.cat([mtp.enorm(emb), mtp.hnorm(prev)], -1))
            prev, _, _ = mtp.block(x, rope, AttentionLayout(causal_only=True))
            logp = F.log_softmax(model.lm_head(mtp.shared_head_norm(prev))[0], -1)
            terms = [-logp[i, labels[0, i + k + 1]] for i in range(t - k - 1) if labels[0, i + k + 1] != -100]
            assert out.mtp_tokens[k - 1].item() == len(terms)
            assert out.mtp_loss_sum[k - 1].item() == pytest.approx(sum(terms).item(), rel=1e-5)
    lm = out.lm_loss_sum / out.lm_tokens
    expected = lm + model.config.mtp_loss_weight * (out.mtp_loss_sum / out.mtp_tokens).mean()
    # Only the MTP blocks are MoE here (layers 2, 3 >= first_k_dense_replace): they carry the aux term.
    assert out.expert_load.shape[0] == 2
    expected = expected + model.config.aux_loss_alpha * out.aux_loss
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6)


def test_sequence_balance_loss_matches_hand_computation():
    cfg = ModelConfig(**{**SMALL, "n_group": 1, "topk_group": 1})
    moe = MoE(cfg)
    torch.manual_seed(3)
    for p in moe.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(2, 5, cfg.hidden_size)
    _, aux, load = moe(x)
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    total = 0.0
    for b in range(2):
        s = torch.sigmoid(x[b] @ moe.gate.weight.T)  # (T, E)
        top = s.topk(k, dim=-1).indices
        f = [e / (k * 5) * sum(int(i in top[t].tolist()) for t in range(5)) for i in range(e)]
        p = [sum((s[t, i] / s[t].sum()).item() for t in range(5)) / 5 for i in range(e)]
        total += sum(fi * pi for fi, pi in zip(f, p))
    assert aux.item() == pytest.approx(total / 2, rel=1e-5)
    assert load.sum().item() == 2 * 5 * k


def test_padding_is_no_token_for_routers_and_losses():
    """A row padded after its last document (position PAD_POSITION, as the SFT packer pads) trains exactly as
    the row without the padding: the same losses, balance loss and expert loads (main and MTP layers; an MTP
    position whose look-ahead token is padding or past the row counts nowhere), and no gradient reaches the
    pad token's embedding, even where that row is zero (transformers zeroes the pad row: the balance loss
    through RMSNorm at a zero vector made the gradient 1e19 before padding was kept out of routing)."""
    from dstrain.batch import IGNORE_INDEX, PAD_POSITION

    model = build_model(
        ModelConfig(**{**SMALL, "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 1})
    )
    pad = 1
    with torch.no_grad():
        model.embed_tokens.weight[pad] = 0.0
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, SMALL["vocab_size"], (2, 20), generator=g)
    pos = torch.cat([torch.arange(8), torch.arange(12)]).expand(2, 20)
    padded = {
        "input_ids": F.pad(ids, (0, 6), value=pad),
        "position_ids": F.pad(pos, (0, 6), value=PAD_POSITION),
        "labels": F.pad(ids, (0, 6), value=IGNORE_INDEX),
    }
    plain = model(input_ids=ids, position_ids=pos, labels=ids)
    out = model(**padded)
    for key in ("loss", "lm_loss_sum", "aux_loss", "expert_load"):
        torch.testing.assert_close(out[key], plain[key], rtol=0, atol=1e-6)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert model.embed_tokens.weight.grad[pad].abs().max() == 0


def _imbalance(model, ids):
    with torch.no_grad():
        load = model(ids, labels=ids).expert_load
    return (load.max(dim=1).values / load.mean(dim=1)).max().item(), load


def test_bias_update_moves_loads_toward_uniform():
    model = tiny(bias_update_speed=0.002, first_k_dense_replace=0)
    with torch.no_grad():
        for r in model.routers():
            r.weight.normal_(0, 0.3)
            r.weight[0] += 2.0  # skew: experts 0 and 1 win most tokens
            r.weight[1] += 1.5
    ids = torch.randint(0, 97, (8, 64), generator=torch.Generator().manual_seed(4))
    before, _ = _imbalance(model, ids)
    for _ in range(200):
        _, load = _imbalance(model, ids)
        model.update_expert_bias(load)
    after, _ = _imbalance(model, ids)
    assert before > 2.0
    assert after < 1.2


def test_bias_update_rule_is_sign_of_gap():
    model = tiny(bias_update_speed=0.1)
    load = torch.tensor([[5.0, 1, 1, 1, 0, 0, 0, 0]] * len(model.routers()))
    model.update_expert_bias(load)
    bias = model.routers()[0].e_score_correction_bias
    assert torch.allclose(bias, 0.1 * torch.sign(load[0].mean() - load[0]))
    model.config.bias_update_speed = 0.0
    model.update_expert_bias(load)
    assert torch.allclose(model.routers()[0].e_score_correction_bias, bias)


def test_flops_per_token_deepseek_v3_is_250_gflops():
    assert flops_per_token("deepseek-v3", 4096) / 1e9 == pytest.approx(250, rel=0.03)


def test_presets_construct_configs_and_tiny_trains():
    for name in ("tiny", "small", "deepseek-v2-lite", "deepseek-v2", "deepseek-v3"):
        assert get_config(name).num_hidden_layers > 0
    model = build_model("tiny", seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        out = model(ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0] - 0.5
    assert math.isfinite(losses[-1])


def test_bf16_forward_backward_keeps_router_fp32():
    model = build_model("tiny", seed=0, dtype=torch.bfloat16).train()
    ids = torch.randint(0, 500, (2, 16))
    out = model(ids, labels=ids)
    out.loss.backward()
    assert out.lm_loss_sum.dtype == torch.float32
    assert model.layers[1].mlp.experts.gate_up_proj.grad is not None
    assert all(r.e_score_correction_bias.dtype == torch.float32 for r in model.routers())


@pytest.mark.parametrize("mode", [True, "full", "attention", "mlp"])
def test_activation_checkpointing_gives_same_gradients(mode):
    """Every mode recomputes in backward and gives the stored run's gradients (packed rows: the mask too)."""
    a, b = tiny().train(), tiny().train()
    b.set_activation_checkpointing(mode)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(5))
    pos = torch.cat([torch.arange(6), torch.arange(10)]).expand(2, 16)
    for m in (a, b):
        m(ids, position_ids=pos, labels=ids).loss.backward()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-6), n


def test_selective_checkpointing_keeps_less():
    """What autograd keeps for backward: 'attention' and 'mlp' each keep less than storing everything, and
    'full' less than either."""

    def saved_bytes(mode: str) -> int:
        model = tiny().train()
        model.set_activation_checkpointing(mode)
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(5))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids, labels=ids).loss
        loss.backward()
        return total

    kept = {mode: saved_bytes(mode) for mode in ("none", "attention", "mlp", "full")}
    assert kept["full"] < kept["attention"] < kept["none"] and kept["full"] < kept["mlp"] < kept["none"], kept


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(n_group=3), "divisible"),
        (dict(topk_group=3), "topk_group"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(model_type="llama"), "model_type"),
        (dict(qk_rope_head_dim=5), "even"),
        (dict(rope_scaling={"rope_type": "linear", "factor": 2}), "yarn"),
    ],
)
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**SMALL, **bad})


@pytest.mark.parametrize("native", [False, True], ids=["emulated", "native"])
def test_bf16_kernels_match_fp32_within_bf16_precision(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both CPU bf16 paths, forced whatever this CPU has (kernels.CPU_NATIVE_BF16, DSTRAIN_CPU_BF16 for a
    process): the emulated one is fp32 compute rounded once, bit for bit; the native one is a bf16 GEMM with fp32
    accumulation, whose kernel (AVX512-BF16, AMX, or torch's conversion loop) picks the summation order: it is
    within one bf16 rounding of the fp32 result plus an fp32 sum's worst case over K terms (products of bf16
    values are exact in fp32). A whole bf16 model tracks the fp32 one on either path."""
    from dstrain.model.common import kernels

    monkeypatch.setattr(kernels, "CPU_NATIVE_BF16", native)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 96, generator=g), torch.randn(48, 96, generator=g)
    xb, wb = x.bfloat16(), w.bfloat16()
    got = kernels.linear(xb, wb)
    assert got.dtype == torch.bfloat16
    exact = F.linear(xb.double(), wb.double())
    if not native:
        assert torch.equal(got, F.linear(xb.float(), wb.float()).bfloat16())
    k, u32, u16 = x.shape[1], 2.0**-24, 2.0**-8  # unit roundoffs: fp32, bf16
    bound = u16 * exact.abs() + (k * u32 / (1 - k * u32)) * F.linear(xb.double().abs(), wb.double().abs())
    assert ((got.double() - exact).abs() <= bound * (1 + u16)).all()
    ids = torch.randint(0, 97, (2, 24), generator=g)
    fp32 = tiny()
    bf16 = tiny().to(torch.bfloat16)
    with torch.no_grad():
        ref, out = fp32(ids).logits, bf16(ids).logits.float()
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    # bf16 weights and activations (eps 2^-7) through two blocks and the head: a few eps of the logits' scale
    assert (out - ref).abs().max() <= 0.05 * ref.abs().max()
