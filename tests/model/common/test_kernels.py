"""The model's CUDA branches on a machine without a GPU: under DSTRAIN_KERNEL_POLICY=cuda, on meta tensors
(their kernels' shape, dtype, stride, alignment and int32-offset rules: torch's meta functions of grouped_mm
and varlen_attn are the CUDA kernels' checks, and a host sync fails there), and against float64 on the CPU
(the varlen kernels replaced by their CPU reference). FakeTensorMode with device="cuda" cannot run autograd
on a CPU build (the engine asks for a CUDA device guard), so meta tensors stand in for it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dstrain.model.common.attention as attention
import dstrain.model.common.kernels as kernels
from dstrain.model.deepseek_v3.attention import MLA, rope_frequencies
from dstrain.model.deepseek_v3.model import MoE
from tests.helpers.tiny import tiny_config

META = torch.device("meta")


@pytest.fixture
def cuda_policy(monkeypatch):
    monkeypatch.setattr(kernels, "KERNEL_POLICY", "cuda")


def _meta_layout(pos: torch.Tensor) -> attention.AttentionLayout:
    layout = attention.attention_layout(pos, *pos.shape, torch.device("cpu"))
    return attention.AttentionLayout(
        layout.causal_only,
        doc=layout.doc.to(META),
        cu_seqlens=layout.cu_seqlens.to(META),
        max_seqlen=pos.shape[1],
    )


@pytest.mark.parametrize("shape", [{}, {"n_shared_experts": 2, "num_experts_per_tok": 3}])
def test_moe_block_runs_the_cuda_grouped_gemm_rules_without_a_host_sync(cuda_policy, shape):
    cfg = tiny_config(hidden_size=64, moe_intermediate_size=32, **shape)
    with META:
        moe = MoE(cfg).to(torch.bfloat16)
    x = torch.empty(2, 24, cfg.hidden_size, dtype=torch.bfloat16, device=META, requires_grad=True)
    out, aux, load = moe(x)
    (out.float().sum() + aux).backward()
    assert out.dtype == torch.bfloat16 and load.shape == (cfg.n_routed_experts,)
    assert moe.gate.weight.grad.dtype == torch.bfloat16  # the router's: fp32 logits, a bf16 weight gradient
    assert moe.experts.gate_up_proj.grad.shape == moe.experts.gate_up_proj.shape
    assert x.grad.dtype == torch.bfloat16


def test_attention_layer_runs_the_varlen_kernel_on_packed_rows(cuda_policy, monkeypatch):
    from torch.nn.attention.varlen import varlen_attn

    calls = []

    def varlen(q, k, v, cq, ck, mq, mk, softmax_scale=None, scale=None, causal=True, window_size=(-1, 0)):  # noqa: ANN001, ANN202
        calls.append((q.dtype, q.shape[-1], cq.dtype, mq))
        return varlen_attn(q, k, v, cq, ck, mq, mk, scale=softmax_scale or scale, window_size=(-1, 0))

    monkeypatch.setattr(attention, "_varlen_reference", varlen)
    cfg = tiny_config(hidden_size=64)
    with META:
        mla = MLA(cfg, 1).to(torch.bfloat16)
    pos = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)
    inv, factor = rope_frequencies(cfg)
    rope = attention.rope_cos_sin(pos.to(META), inv.to(META), factor)
    x = torch.empty(2, 24, cfg.hidden_size, dtype=torch.bfloat16, device=META, requires_grad=True)
    mla(x, rope, _meta_layout(pos)).float().sum().backward()
    # v padded to q's head dim, int32 boundaries, the row length as the bound (no host read, no recompile)
    assert calls == [(torch.bfloat16, cfg.qk_head_dim, torch.int32, 24)]
    assert mla.kv_b_proj.weight.grad.dtype == torch.bfloat16


def test_kernel_choice_follows_the_activations_not_the_embedding(cuda_policy):
    """A pipeline stage without the embedding (its weight on the meta device, fp32) chooses as the others:
    from the activations' dtype (gpu_readiness N4)."""
    cpu = torch.device("cpu")
    assert attention.attention_path(cpu, torch.bfloat16, packed=True).startswith(
        "CPU reference of the varlen"
    )
    assert (
        attention.attention_path(cpu, torch.float32, packed=True) == "SDPA with a (B, 1, T, T) document mask"
    )
    assert attention.attention_path(cpu, torch.bfloat16, packed=False) == "causal SDPA"


def test_no_varlen_kernel_below_ampere(cuda_policy, monkeypatch):
    """V100 / T4 (sm70, sm75): FlashAttention needs sm80; packed rows take SDPA with a mask (N8)."""
    monkeypatch.setattr(attention, "cuda_capability", lambda device: (7, 5))
    assert attention.varlen_kernel(torch.device("cpu"), torch.bfloat16) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_rows_on_the_cuda_branch_match_float64(cuda_policy, dtype):
    """bf16 packed rows through the varlen kernels' CPU reference, fp32 through SDPA with the mask."""
    from tests.model.common.test_attention import _inputs, _packed, _reference, _rel

    b, t = 2, 70
    q, k, v, dout = _inputs(b, t, 3, 16, 8, dtype)
    pos, mask = _packed(b, t)
    out = attention.attend(q, k, v, 0.25, attention.attention_layout(pos, b, t, torch.device("cpu")))
    out.backward(dout)
    want = _reference(q, k, v, dout, 0.25, mask)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for name, a, w in zip(("out", "dq", "dk", "dv"), (out.detach(), q.grad, k.grad, v.grad), want):
        assert _rel(a, w) <= tol, name


def test_an_idle_experts_weight_gradient_is_exactly_zero(cuda_policy, monkeypatch):
    """On GPUs without torch's fast grouped GEMM the per-group loop runs, reading the offsets once per layer
    (forward and backward); an expert without rows gets exactly zero weight gradient on every path."""
    import dstrain.model.common.experts as experts
    from tests.model.common.test_experts import _inputs

    reads = []
    real = experts.Offsets.host

    def counted(self):  # noqa: ANN001, ANN202
        if self._host is None:
            reads.append(1)
        return real(self)

    monkeypatch.setattr(experts.Offsets, "host", counted)
    for capability in ((8, 0), (9, 0)):
        monkeypatch.setattr(experts, "cuda_capability", lambda device, c=capability: c)
        reads.clear()
        x, idx, w, gate_up, down = _inputs(dtype=torch.bfloat16, d=16, i=8)  # expert 2 gets no token
        out = experts.routed_experts(x, idx, w, gate_up, down)
        F.mse_loss(out.float(), torch.zeros_like(out, dtype=torch.float32)).backward()
        assert torch.equal(gate_up.grad[2], torch.zeros_like(gate_up.grad[2]))
        assert torch.equal(down.grad[2], torch.zeros_like(down.grad[2]))
        assert len(reads) == (1 if capability == (8, 0) else 0)


@pytest.mark.parametrize("native", [False, True], ids=["emulated", "native"])
def test_cpu_bf16_path_is_the_one_forced_and_named(native, monkeypatch):
    """Either CPU bf16 path is taken whatever this CPU has (kernels.CPU_NATIVE_BF16): the compute dtype of a bf16
    CPU tensor follows it (the CUDA policy computes in bf16 either way), and `cpu_bf16_path` names it."""
    monkeypatch.setattr(kernels, "CPU_NATIVE_BF16", native)
    monkeypatch.setattr(kernels, "CPU_BF16", "native" if native else "emulated")
    x = torch.ones(2, 3, dtype=torch.bfloat16)
    want = torch.bfloat16 if native or kernels.KERNEL_POLICY == "cuda" else torch.float32
    assert kernels.compute_dtype(x) == want and kernels.compute_dtype(x.float()) == torch.float32
    path = kernels.cpu_bf16_path()
    assert path.startswith("native bf16" if native else "emulated: fp32 compute")
    assert path.endswith(f"forced by DSTRAIN_CPU_BF16={'native' if native else 'emulated'})")


def test_dstrain_cpu_bf16_is_read_at_start_and_a_wrong_value_is_one_line(monkeypatch):
    """The variable sets the path of a whole process, read when the module loads (run afresh here, the loaded
    module untouched); a value it does not know is a ValueError naming it."""
    import runpy

    for value, native in (("emulated", False), ("native", True)):
        monkeypatch.setenv("DSTRAIN_CPU_BF16", value)
        fresh = runpy.run_path(kernels.__file__)
        assert fresh["CPU_NATIVE_BF16"] is native
        assert fresh["cpu_bf16_path"]().endswith(f"forced by DSTRAIN_CPU_BF16={value})")
    monkeypatch.setenv("DSTRAIN_CPU_BF16", "fast")
    with pytest.raises(ValueError, match="DSTRAIN_CPU_BF16='fast': expected auto, native or emulated"):
        runpy.run_path(kernels.__file__)
