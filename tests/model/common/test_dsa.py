"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): against transformers' own models on checkpoints they wrote,
and the indexer's training signal against the KL's definition in float64."""

from __future__ import annotations

import pytest
import torch

from dstrain.batch import IGNORE_INDEX, PAD_POSITION
from dstrain.model import DeepSeekLM, from_pretrained
from dstrain.model.common import dsa as dsa_module
from dstrain.model.common.dsa import Target, index_pass, top_keys
from dstrain.model.sources import init_weights
from tests.helpers.hf import DSA, glm_config, make_hf_model, v32_config
from tests.helpers.tiny import tiny_config

CASES = {"deepseek_v32": v32_config, "glm_moe_dsa": glm_config}
T = 40  # > index_topk 6: sparsity is exercised


def _pair(case: str, tmp_path) -> tuple:  # noqa: ANN001
    hf = make_hf_model(CASES[case]())
    hf.save_pretrained(tmp_path)
    return hf, from_pretrained(tmp_path, dtype=torch.float32)


def _ids(vocab: int, t: int = T, b: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_in_inference_and_in_the_training_forward(case, tmp_path):
    hf, ours = _pair(case, tmp_path)
    ids = _ids(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(input_ids=ids, use_cache=False).logits
        assert (ours.eval()(ids).logits - ref).abs().max().item() <= 1e-5
        ours.train().set_sparse_attention("sparse")
        out = ours(ids, labels=ids, return_logits=True)
        assert (out.logits - ref).abs().max().item() <= 1e-5
        assert out.indexer_stats[0] > 0  # the KL was computed
        ours.set_sparse_attention("dense")  # the warm-up attends to every key: another model
        assert (ours(ids, labels=ids, return_logits=True).logits - ref).abs().max().item() > 1e-3


def test_glm_shared_layer_has_no_indexer_and_reuses_the_previous_selection(tmp_path):
    _, ours = _pair("glm_moe_dsa", tmp_path)
    assert [b.self_attn.indexer is not None for b in ours.layers] == [True, True, False, True]
    assert ours.layers[2].self_attn.sparse.source == 1
    assert not any(".layers.2.self_attn.indexer" in k for k in ours.state_dict())


def test_rows_no_longer_than_the_top_k_are_dense_mla(tmp_path):
    _, ours = _pair("deepseek_v32", tmp_path)
    cfg = ours.config
    dense = DeepSeekLM(cfg.replace(model_type="deepseek_v3", index_topk=None, hf_source=None))
    state = {k: v for k, v in ours.state_dict().items() if ".indexer." not in k}
    dense.load_state_dict(state)
    ids = _ids(cfg.vocab_size, t=DSA["index_topk"])
    with torch.no_grad():
        assert torch.equal(ours.eval()(ids).logits, dense.eval()(ids).logits)


def _grads(model, loss_of) -> dict[str, torch.Tensor]:  # noqa: ANN001
    model.zero_grad(set_to_none=True)
    loss_of(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", list(CASES))
def test_gradients_match_transformers_and_the_indexer_loss_reaches_only_the_indexer(case, tmp_path):
    hf, ours = _pair(case, tmp_path)
    ids = _ids(hf.config.vocab_size)
    probe = torch.randn(3, T, hf.config.vocab_size, generator=torch.Generator().manual_seed(2))
    ours.train()
    ours.set_sparse_attention("frozen")  # no indexer loss: what transformers computes
    off = _grads(ours, lambda m: (m(ids, return_logits=True).logits * probe).sum())
    ref = _grads(hf, lambda m: (m(input_ids=ids, use_cache=False).logits * probe).sum())
    ref = {n.removeprefix("model."): g for n, g in ref.items()}
    assert not [n for n in off if ".indexer." in n]
    for name, g in off.items():
        err = (g - ref[name]).abs().max() / ref[name].abs().max().clamp(min=1e-30)
        assert err <= 1e-5, (name, err)
    ours.set_sparse_attention("sparse")
    on = _grads(ours, lambda m: (m(ids, return_logits=True).logits * probe).sum())
    for name, g in off.items():
        assert torch.equal(g, on[name]), name  # the main model sees the LM loss alone
    indexer = [n for n in on if ".indexer." in n]
    assert indexer and all(on[n].abs().max() > 0 for n in indexer)


def _reference_kl(q, k, w, qm, km, scale, doc, sparse_topk=None):  # noqa: ANN001, ANN202
    """The KL as the DeepSeek-V3.2 report defines it, dense (T, T) in float64, written independently."""
    t = q.shape[1]
    valid = torch.ones(t, t, dtype=torch.bool).tril() & (doc[:, :, None] == doc[:, None, :])
    index = torch.einsum("bthd,bud->bthu", q, k).mul(q.shape[-1] ** -0.5).relu()
    index = torch.einsum("bth,bthu->btu", w, index).masked_fill(~valid, float("-inf"))
    support = valid
    if sparse_topk is not None:
        chosen = torch.zeros_like(valid).scatter_(-1, top_keys(index.detach(), sparse_topk), True)
        support = valid & chosen
    attn = torch.einsum("bthd,buhd->bhtu", qm, km).mul(scale)
    p = attn.masked_fill(~support.unsqueeze(1), float("-inf")).softmax(-1).sum(1)
    p = p / p.sum(-1, keepdim=True)
    logq = index.masked_fill(~support, float("-inf")).log_softmax(-1)
    return torch.where(support, torch.xlogy(p, p) - p * logq.masked_fill(~support, 0), 0).sum()


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_indexer_gradient_is_the_kl_gradient_in_float64(sparse):
    g = torch.Generator().manual_seed(0)
    b, t, heads, dim, main_heads = 2, 21, 3, 8, 2
    q, k, w = (
        torch.randn(*s, generator=g, dtype=torch.float64)
        for s in ((b, t, heads, dim), (b, t, dim), (b, t, heads))
    )
    qm, km = (torch.randn(b, t, main_heads, 6, generator=g, dtype=torch.float64) for _ in range(2))
    doc = torch.tensor([[0] * 12 + [1] * 9, [0] * 21])
    topk = 5

    class KL(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, w):  # noqa: ANN001, ANN205
            res = index_pass(q, k, w, topk, doc, Target(qm, km, 0.3, sparse), grads=True)
            ctx.save_for_backward(*res.grads)
            return res.stats[0].clone()

        @staticmethod
        def backward(ctx, grad):  # noqa: ANN001, ANN205
            return tuple(grad * d for d in ctx.saved_tensors)

    leaves = [x.clone().requires_grad_() for x in (q, k, w)]
    assert torch.autograd.gradcheck(KL.apply, leaves, eps=1e-6, atol=1e-7)
    want = _reference_kl(*leaves, qm, km, 0.3, doc, topk if sparse else None)
    got = KL.apply(*leaves)
    assert abs(float(got.detach() - want.detach())) <= 1e-10 * max(1.0, abs(float(want.detach())))
    for a, r in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(want, leaves)):
        assert torch.allclose(a, r, atol=1e-10, rtol=1e-8)


def test_the_kl_in_fp32_holds_float64_s_value_for_close_distributions():
    """An indexer that has learned: target and index distributions close (KLs of 1e-6 to 1e-4 per query), some
    keys off the support, probabilities that underflow fp32. dsa._kl in fp32 against the direct sum in float64:
    per query within 5e-4, the batch's sum within 1e-5 (measured: 6.7e-5 and 2.1e-6; term by term in fp32,
    5.6e-2 and 4.8e-5)."""
    g = torch.Generator().manual_seed(0)
    rows, t = 64, 2048
    a = torch.randn(rows, t, generator=g, dtype=torch.float64) * 2
    a[:, :4] = -120.0  # exp underflows in fp32
    b = a + torch.randn(rows, t, generator=g, dtype=torch.float64) * torch.logspace(-3, -2, rows).unsqueeze(1)
    support = torch.rand(rows, t, generator=g) < 0.7
    support[:, :8] = True
    logp, logq = (x.masked_fill(~support, float("-inf")).log_softmax(-1) for x in (a, b))
    p = logp.exp()
    want = torch.where(support, p * (logp - logq), 0.0).sum(-1)
    got = dsa_module._kl(p.float(), logq.float(), support).double()
    assert want.min() > 1e-7 and want.max() < 1e-3
    assert ((got - want).abs() / want).max() <= 5e-4
    assert abs(got.sum() - want.sum()) <= 1e-5 * want.sum()


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_one_layer_models_indexer_gradient_is_its_kl_gradient(stage, monkeypatch):
    """In the model: what reaches the indexer's parameters is exactly the gradient of its KL (times the
    scale), the KL computed independently from the inputs the indexer and the target saw."""
    cfg = tiny_config(model_type="deepseek_v32", num_hidden_layers=1, first_k_dense_replace=1,
                      num_nextn_predict_layers=0, index_topk=5, index_n_heads=4, index_head_dim=16)  # fmt: skip
    model = DeepSeekLM(cfg).double()
    init_weights(model, 0)
    model.train().set_sparse_attention(stage)
    model.set_indexer_grad_scale(0.7)
    seen = {}
    real = dsa_module.index_pass

    def spy(q, k, w, topk, doc, target=None, grads=False):  # noqa: ANN001, ANN202
        seen.update(q=q, k=k, w=w, target=target, doc=doc)
        return real(q, k, w, topk, doc, target, grads)

    monkeypatch.setattr(dsa_module, "index_pass", spy)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(3))
    out = model(ids, labels=ids)
    params = dict(model.layers[0].self_attn.indexer.named_parameters())
    got = torch.autograd.grad(out.loss, list(params.values()), retain_graph=True)
    tgt = seen["target"]
    doc = torch.zeros(2, 17, dtype=torch.long)
    want_kl = _reference_kl(seen["q"], seen["k"], seen["w"], tgt.q, tgt.k, tgt.scale, doc,
                            5 if stage == "sparse" else None)  # fmt: skip
    want = torch.autograd.grad(want_kl * 0.7, list(params.values()))
    for name, a, r in zip(params, got, want):
        assert torch.allclose(a, r, atol=1e-12, rtol=1e-9), name


def test_packed_rows_equal_their_documents_run_one_by_one():
    cfg = tiny_config(model_type="deepseek_v32", index_topk=5, index_n_heads=4, index_head_dim=16)
    model = DeepSeekLM(cfg)
    init_weights(model, 0)
    model.eval()
    g = torch.Generator().manual_seed(4)
    a, b = (
        torch.randint(0, cfg.vocab_size, (1, 23), generator=g),
        torch.randint(0, cfg.vocab_size, (1, 17), generator=g),
    )
    pos = torch.cat([torch.arange(23), torch.arange(17)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(torch.cat([a, b], dim=1), position_ids=pos)
        alone = torch.cat([model(a).logits, model(b).logits], dim=1)
    assert (packed.logits - alone).abs().max() <= 1e-5


def test_top_k_is_deterministic_and_the_later_key_wins_a_tie():
    scores = torch.tensor([[0.5, 0.0, 0.0, -0.0, 0.7, 0.0, float("-inf")]])
    assert top_keys(scores, 3).tolist() == [[4, 0, 5]]
    assert torch.equal(top_keys(scores, 3), top_keys(scores.clone(), 3))


@pytest.mark.parametrize("case", list(CASES))
def test_folder_with_mtp_round_trips_bit_identically_and_transformers_loads_the_export(case, tmp_path):
    """A folder as DeepSeek / Z.ai ship it: the MTP layer a full sparse-attention block (its indexer
    included), with copies of the embedding and head in V3.2's, none in GLM-5's."""
    from transformers import AutoModelForCausalLM

    from dstrain.model import save_pretrained
    from tests.helpers.hf import official_folder, read_folder

    src, dst = tmp_path / "src", tmp_path / "dst"
    sd = official_folder(src, cfg=CASES[case](), dtype=torch.float32)
    n = CASES[case]().num_hidden_layers
    assert f"model.layers.{n}.self_attn.indexer.wq_b.weight" in sd
    assert (f"model.layers.{n}.embed_tokens.weight" in sd) == (case == "deepseek_v32")
    model = from_pretrained(src)
    assert model.mtp[0].block.self_attn.indexer is not None
    assert torch.equal(model.mtp[0].eh_proj.weight, sd[f"model.layers.{n}.eh_proj.weight"])
    save_pretrained(model, dst, max_shard_bytes=64 * 1024)
    written = read_folder(dst)
    assert written.keys() == sd.keys()
    for k in sd:
        assert written[k].dtype == sd[k].dtype and torch.equal(written[k], sd[k]), k
    import json

    source, exported = (json.loads((d / "config.json").read_text()) for d in (src, dst))
    assert exported["model_type"] == case and exported["architectures"] == source["architectures"]
    assert {k: exported[k] for k in source if k != "transformers_version"} == {
        k: v for k, v in source.items() if k != "transformers_version"
    }
    ids = _ids(CASES[case]().vocab_size)
    back = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (back(input_ids=ids, use_cache=False).logits - model.eval()(ids).logits).abs().max() <= 1e-5
    out = model.train()(ids, labels=ids)  # the MTP block, indexer and all, trains
    out.loss.backward()
    assert model.mtp[0].block.self_attn.indexer.wq_b.weight.grad.abs().max() > 0


def test_fp8_indexer_weights_are_dequantized(tmp_path):
    """V3.2's published weights keep the indexer's wq_b and wk in FP8 e4m3 with 128x128 block scales."""
    from safetensors.torch import load_file, save_file

    make_hf_model(v32_config()).save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    want = {}
    for name in ("wq_b", "wk"):  # wq_b (256, 24): two row blocks of 128, each its own scale
        key = f"model.layers.1.self_attn.indexer.{name}.weight"
        w = sd[key]
        blocks = w.split(128, dim=0)
        scales = torch.stack([b.abs().amax() / 448 for b in blocks])
        sd[key] = torch.cat([(b / sc).to(torch.float8_e4m3fn) for b, sc in zip(blocks, scales)])
        sd[key.replace(".weight", ".weight_scale_inv")] = scales.view(-1, 1).float()
        want[name] = torch.cat([q.float() * sc for q, sc in zip(sd[key].split(128, dim=0), scales)])
    save_file(sd, tmp_path / "model.safetensors")
    indexer = from_pretrained(tmp_path, dtype=torch.float32).layers[1].self_attn.indexer
    for name, w in want.items():
        assert torch.equal(getattr(indexer, name).weight, w), name


def test_sparse_kl_over_the_blocks_chosen_keys_equals_the_kl_over_all_keys(monkeypatch):
    """index_pass computes the sparse stage's target only on the keys a block of rows chose (gathered):
    the same KL and gradient as over every key, masked."""
    g = torch.Generator().manual_seed(1)
    b, t, heads, dim = 2, 48, 2, 8
    q, k, w = (
        torch.randn(*s, generator=g, dtype=torch.float64)
        for s in ((b, t, heads, dim), (b, t, dim), (b, t, heads))
    )
    qm, km = (torch.randn(b, t, 2, 6, generator=g, dtype=torch.float64) for _ in range(2))
    monkeypatch.setattr(dsa_module, "SCORE_ELEMENTS", b * heads * t * 8)  # blocks of 8 query rows
    results = []
    for share in (1.0, 0.0):  # gather the block's chosen keys always / never
        monkeypatch.setattr(dsa_module, "UNION_DENSE", share)
        results.append(index_pass(q, k, w, 6, None, Target(qm, km, 0.4, sparse=True), grads=True))
    (a, b_), (ga, gb) = (r.stats for r in results), (r.grads for r in results)
    assert torch.allclose(a, b_, rtol=1e-12, atol=0) and torch.equal(
        results[0].selection, results[1].selection
    )
    for x, y in zip(ga, gb):
        assert torch.allclose(x, y, rtol=1e-10, atol=1e-14)


def test_lora_on_the_indexer_learns_from_its_kl_and_merges_exactly():
    """`--lora_targets indexer` adapts the indexers' linears (wq_b, wk, weights_proj): with their base weights
    frozen, the adapters learn from the KL alone; merged, the indexer scores what the adapted one did."""
    from dstrain.model.common.lora import apply_lora, merge_lora

    cfg = tiny_config(model_type="deepseek_v32", index_topk=5, index_n_heads=4, index_head_dim=16)
    model = DeepSeekLM(cfg)
    init_weights(model, 0)
    names = apply_lora(model, 4, 8.0, ["indexer"], seed=0)
    assert names and all(".indexer." in n for n in names)
    assert {n.rsplit(".", 1)[1] for n in names} == {"wq_b", "wk", "weights_proj"}
    for n, p in model.named_parameters():
        p.requires_grad = "lora_" in n
        if "lora_B" in n:
            p.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    model.train().set_sparse_attention("sparse")
    ids = torch.randint(0, cfg.vocab_size, (2, 30), generator=torch.Generator().manual_seed(2))
    model(ids, labels=ids).loss.backward()
    assert all(
        p.grad is not None and p.grad.abs().max() > 0 for n, p in model.named_parameters() if "lora_" in n
    )
    model.eval()
    with torch.no_grad():
        before = model(ids).logits
        merge_lora(model)
        assert (model(ids).logits - before).abs().max() <= 1e-5


@pytest.mark.parametrize("stage", ["dense", "sparse"])
def test_padding_queries_give_the_indexer_no_loss_and_no_gradient(stage):
    """A batch whose second row ends in padding (PAD_POSITION) gives the indexer the gradient and the KL
    figures of its rows run alone without the padding (Megatron-LM's THD path drops padded queries); the
    default scale is the mean over the real queries. Within 1e-6: the attention the target comes from runs in
    fp32 on the CPU whatever the model's dtype, and the rows' shapes differ."""
    cfg = tiny_config(model_type="deepseek_v32", num_hidden_layers=1, first_k_dense_replace=1,
                      num_nextn_predict_layers=0, index_topk=5, index_n_heads=4, index_head_dim=16)  # fmt: skip
    model = DeepSeekLM(cfg).double()
    init_weights(model, 0)
    model.train().set_sparse_attention(stage)
    params = list(model.layers[0].self_attn.indexer.parameters())

    def run(ids, pos, scale):  # noqa: ANN001, ANN202
        model.set_indexer_grad_scale(scale)
        labels = ids.masked_fill(pos == PAD_POSITION, IGNORE_INDEX) if pos is not None else ids
        out = model(ids, position_ids=pos, labels=labels)
        return torch.autograd.grad(out.loss, params), out.indexer_stats

    t, n = 24, 17
    ids = torch.randint(0, cfg.vocab_size, (2, t), generator=torch.Generator().manual_seed(5))
    row1 = torch.cat([torch.arange(10), torch.arange(n - 10)])  # two documents, then 7 padding positions
    pos = torch.stack([torch.arange(t), torch.cat([row1, torch.full((t - n,), PAD_POSITION)])])
    padded, stats = run(ids, pos, None)
    alone0, stats0 = run(ids[:1], None, 1.0)
    alone1, stats1 = run(ids[1:, :n], row1[None], 1.0)
    assert stats[1] == stats0[1] + stats1[1] == t + n
    assert abs(stats[0] - stats0[0] - stats1[0]) <= 1e-6 * abs(stats[0])
    if stage == "dense":
        assert stats[3] == t + n and abs(stats[2] - stats0[2] - stats1[2]) <= 1e-6 * abs(stats[2])
    for got, a, b in zip(padded, alone0, alone1, strict=True):
        want = (a + b) / (t + n)
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()
