"""Kimi Delta Attention (dstrain/model/common/kda.py): the chunked training form against the token-by-token
recurrence, documents of a packed row against each alone, and one KDA layer of each forget-gate form against
transformers' own (Kimi Linear's, GLM-5.3-Flash's with the lower bound), `fla` not importable."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dstrain.model.common.kda import KDA, kda_chunked, kda_recurrent, l2norm

EPS32 = torch.finfo(torch.float32).eps
EPS64 = torch.finfo(torch.float64).eps


def inputs(b: int, t: int, h: int, dk: int, dv: int, seed: int, dtype=torch.float64):  # noqa: ANN001, ANN201
    """q (normalised, scaled), k (normalised), v, g (log-decay in (-2, 0)), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (l2norm(torch.randn(b, t, h, dk, generator=gen, dtype=dtype)) for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=gen, dtype=dtype)
    g = -2 * torch.rand(b, t, h, dk, generator=gen, dtype=dtype)
    beta = torch.rand(b, t, h, generator=gen, dtype=dtype)
    return q * dk**-0.5, k, v, g, beta


def starts_of(lengths: list[int], b: int) -> torch.Tensor:
    pos = torch.cat([torch.arange(n) for n in lengths]).expand(b, -1)
    starts = pos == 0
    starts[:, 0] = False
    return starts


def test_fla_is_not_importable() -> None:
    """transformers swaps fla's kernels in when it imports: the comparisons below are with its torch code."""
    assert importlib.util.find_spec("fla") is None


@pytest.mark.parametrize("t, chunk", [(150, 64), (150, 16), (7, 64), (64, 64)])
def test_chunked_equals_recurrent(t: int, chunk: int) -> None:
    """In float64 the two forms agree to rounding (a few hundred eps64 of the output: the chunk's triangular
    solve and state products are sums of at most T terms of size ~1)."""
    q, k, v, g, beta = inputs(2, t, 3, 16, 20, seed=t + chunk)
    want = kda_recurrent(q, k, v, g, beta)
    got = kda_chunked(q, k, v, g, beta, chunk=chunk)
    assert (got - want).abs().max() <= t * 16 * EPS64 * want.abs().max()


def test_chunked_fp32_error_is_rounding() -> None:
    """In fp32 (the training state's precision) the chunked form's error against the float64 recurrence is
    rounding: within T x d_k eps32 of the output's size (a sum of T state updates of d_k products each)."""
    t, dk = 200, 16
    q, k, v, g, beta = inputs(2, t, 2, dk, dk, seed=5)
    want = kda_recurrent(q, k, v, g, beta)
    got = kda_chunked(*(x.float() for x in (q, k, v, g, beta)))
    assert (got.double() - want).abs().max() <= t * dk * EPS32 * want.abs().max()


def test_packed_documents_restart_the_state() -> None:
    """Three documents in a row (one crossing a chunk boundary, one shorter than a chunk): each one's output
    is the recurrence run over it alone, in both forms."""
    lengths = [40, 90, 20]
    q, k, v, g, beta = inputs(2, sum(lengths), 2, 16, 16, seed=1)
    starts = starts_of(lengths, 2)
    packed = kda_chunked(q, k, v, g, beta, starts, chunk=32)
    reference = kda_recurrent(q, k, v, g, beta, starts)
    assert (packed - reference).abs().max() <= 1e3 * EPS64
    begin = 0
    for n in lengths:
        part = slice(begin, begin + n)
        alone = kda_recurrent(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part])
        assert (packed[:, part] - alone).abs().max() <= 1e3 * EPS64 * alone.abs().max()
        begin += n


def fla_stand_in(q, k, v, g, beta, scale=None, cu_seqlens=None, **_):  # noqa: ANN001, ANN201
    """fla's chunk_kda as its documentation states it, for the dispatch's plumbing (fla's kernels need a GPU): q
    times `scale` (default d_k^-1/2), with `cu_seqlens` a batch of one cut into independent sequences; -> (o,
    None)."""
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    if cu_seqlens is None:
        return kda_recurrent(q, k, v, g, beta), None
    assert q.shape[0] == 1, "fla's varlen form takes one flattened sequence"
    cuts = cu_seqlens.tolist()
    parts = [
        kda_recurrent(*(z[:, a:e] for z in (q, k, v, g, beta)))
        for a, e in zip(cuts[:-1], cuts[1:], strict=True)
    ]
    return torch.cat(parts, dim=1), None


@pytest.mark.parametrize("packed", [False, True])
def test_fla_dispatch_computes_the_torch_form(packed: bool) -> None:
    """On a GPU with fla installed the delta rule runs fla's chunk_kda (kda.fla_kda): the arguments handed over
    as fla takes them (q already scaled: scale 1; packed rows flattened into one sequence cut at every row's
    and document's start), checked here with a stand-in of fla's documented semantics against kda_chunked."""
    from dstrain.model.common.kda import fla_kda, kernel_path

    lengths = [40, 90, 20]
    q, k, v, g, beta = inputs(2, sum(lengths), 2, 16, 16, seed=4)
    starts = starts_of(lengths, 2) if packed else None
    got = fla_kda(q, k, v, g, beta, starts, chunk_kda=fla_stand_in)
    want = kda_chunked(q, k, v, g, beta, starts, chunk=32)
    assert (got - want).abs().max() <= 1e3 * EPS64 * want.abs().max()
    assert "fla's kernels need a GPU" in kernel_path(torch.device("cpu"))


def random_kda(lower_bound: float | None, a_log_shape: tuple[int, ...], seed: int = 0) -> KDA:
    torch.manual_seed(seed)
    layer = KDA(64, 2, 16, 4, 1e-5, lower_bound, a_log_shape, chunk=16)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "o_norm.weight":
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name == "A_log":
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            elif name == "dt_bias":
                p.normal_(-2, 1)
            elif "conv1d" in name:
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.15)
    return layer


def test_packed_layer_computes_each_document_alone() -> None:
    """The whole layer (its short convolutions included) on a packed row: each document's output equals the
    document run alone, within fp32 rounding (the chunks fall at other offsets in the two runs)."""
    layer = random_kda(None, (1, 1, 2, 1))
    lengths = [21, 50, 9]
    x = torch.randn(2, sum(lengths), 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        packed = layer(x, starts_of(lengths, 2))
        begin = 0
        for n in lengths:
            alone = layer(x[:, begin : begin + n])
            bound = n * 16 * EPS32 * alone.abs().max()
            assert (packed[:, begin : begin + n] - alone).abs().max() <= bound
            begin += n


def _transformers_layer(lower_bound: float | None):  # noqa: ANN202
    """transformers' KDA layer of that gate form, and dstrain's with its weights."""
    if lower_bound is None:
        from transformers import KimiLinearConfig
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention as Layer

        cfg = KimiLinearConfig(hidden_size=64, linear_attn_config={"num_heads": 2, "head_dim": 16},
                               num_hidden_layers=1, pad_token_id=0, rms_norm_eps=1e-5)  # fmt: skip
        ours = random_kda(None, (1, 1, 2, 1))
    else:
        from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
        from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextLinearAttention as Layer

        cfg = Glm5NextTextConfig(hidden_size=64, linear_num_heads=2, linear_head_dim=16, num_hidden_layers=1,
                                 linear_lower_bound=lower_bound, pad_token_id=0, rms_norm_eps=1e-5)  # fmt: skip
        ours = random_kda(lower_bound, (2,))
    ref = Layer(cfg, 0)
    theirs = {}
    for name, p in ours.state_dict().items():
        if name.startswith(("f_a_proj", "f_b_proj", "A_log", "dt_bias")):
            theirs["forget_gate." + name] = p
        elif "conv1d" not in name:
            theirs[name] = p
    theirs["conv1d.weight"] = torch.cat([ours.q_conv1d.weight, ours.k_conv1d.weight, ours.v_conv1d.weight])
    ref.load_state_dict(theirs)
    return ref, ours


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["kimi", "glm-lower-bound"])
def test_layer_matches_transformers(lower_bound: float | None) -> None:
    """One layer against transformers' torch path (chunks of 64, ours of 16: T 100 crosses both), fp32, and
    the gradient of every weight against transformers' float64 one."""
    ref, ours = _transformers_layer(lower_bound)
    x = torch.randn(2, 100, 64, generator=torch.Generator().manual_seed(7))
    want = ref(x.clone())
    got = ours(x)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    exact_ref = ref.double()
    exact = exact_ref(x.double())
    got.square().sum().backward()
    exact.square().sum().backward()
    theirs = dict(exact_ref.named_parameters())
    for name, p in ours.named_parameters():
        if "conv1d" in name:
            i = "qkv".index(name[0])
            r = theirs["conv1d.weight"].grad.chunk(3)[i]
        else:
            r = theirs[("forget_gate." if name.startswith(("f_", "A_log", "dt_bias")) else "") + name].grad
        # each gradient entry sums the 2 x 100 tokens' terms, each through up to 100 recurrence steps: rounding
        # that grows as a random walk over (tokens x steps) additions stays within sqrt(200 x 100) eps32 of the
        # tensor's size (measured: at most 30 eps32, transformers' own fp32 gradient up to 47)
        bound = (200 * 100) ** 0.5 * EPS32 * r.abs().max()
        assert (p.grad.double() - r.view_as(p)).abs().max() <= bound, name
