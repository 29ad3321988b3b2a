"""DeepSeek-V4 causal LM as plain single-device PyTorch: mHC streams, V4 attention, hash and biased MoE, MTP.

Module names are transformers' `DeepseekV4ForCausalLM` names minus `model.` (state_dict.py maps DeepSeek's own);
MTP modules (which transformers does not build) follow DeepSeek's `MTPBlock`. The pieces V4 shares with V3
(fused grouped-GEMM experts, the chunked cross-entropy head, the balance loss, the bias update) are model.py's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dstrain.batch import real_tokens, sequence_halo

from ..common.dsa import SparseControls
from ..common.kernels import Linear
from ..common.layers import (
    EXPERT_BIAS,
    HASH_TABLE,
    MLP,
    Experts,
    Router,
    sequence_balance,
)
from ..common.loss import Head
from ..common.mhc import HyperConnection, HyperHead, expand
from ..common.output import ModelOutput
from ..common.surface import BlockModelSurface, finish_streams, look_ahead, run_layers
from .attention import V4Attention, V4Inputs, V4RMSNorm, V4Rope, document_ids
from .config import V4Config


class V4Router(Router):
    """sqrt(softplus) scores; the selection is the top-k of scores + `e_score_correction_bias`, or on a hash
    layer the frozen token -> experts table `tid2eid` (no bias there); weights are the selected scores
    normalised, times routed_scaling_factor. Router's `_apply` keeps the bias fp32."""

    def __init__(self, cfg: V4Config, hashed: bool) -> None:
        nn.Module.__init__(self)  # Router's own __init__ reads V3 routing fields
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer(
                HASH_TABLE, torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long)
            )
            self.e_score_correction_bias = None
        else:
            self.tid2eid = None
            self.register_buffer(EXPERT_BIAS, torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None):  # noqa: ANN201
        """x (N, D), ids (N,) the tokens (hash layers) -> scores (N, E) fp32, experts (N, k), weights (N, k)."""
        scores = F.softplus(self.logits(x)).sqrt()
        if self.tid2eid is not None:
            idx = self.tid2eid[ids.reshape(-1)]
        else:
            idx = (
                (scores.detach() + self.e_score_correction_bias)
                .topk(self.cfg.num_experts_per_tok, dim=-1, sorted=False)
                .indices
            )
        weights = scores.gather(1, idx)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return scores, idx, weights * self.cfg.routed_scaling_factor


class V4MoE(nn.Module):
    """Routed experts (SwiGLU clamped at swiglu_limit) plus one shared expert (clamped too, as DeepSeek's
    reference and transformers clamp it). The sequence-balance loss and the expert load are a biased layer's
    only: a hash layer's selection is fixed by its table, so neither balancing acts on it."""

    seq_parallel = None

    def __init__(self, cfg: V4Config, layer_idx: int) -> None:
        super().__init__()
        self.hashed = cfg.is_hash_layer(layer_idx)
        self.gate = V4Router(cfg, self.hashed)
        self.experts = Experts(cfg, limit=cfg.swiglu_limit)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size, limit=cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, real: torch.Tensor | None):  # noqa: ANN201
        b, t, d = x.shape
        scores, idx, weights = self.gate(x.reshape(-1, d), ids)
        out = self.experts(x.reshape(-1, d), idx, weights).view(b, t, d) + self.shared_experts(x)
        if self.hashed:
            return out, None, None
        normed = scores / scores.sum(dim=-1, keepdim=True)
        aux, load = sequence_balance(normed.view(b, t, -1), idx.view(b, t, -1), real, self.seq_parallel)
        return out, aux, load


class V4Block(nn.Module):
    def __init__(self, cfg: V4Config, layer_idx: int) -> None:
        super().__init__()
        hc = (cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        self.self_attn = V4Attention(cfg, layer_idx)
        self.mlp = V4MoE(cfg, layer_idx)
        self.input_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)
        self.recompute_hc = False  # the mHC weights (fp32 norm, projection, Sinkhorn) recomputed in backward

    def forward(self, streams, inputs):  # noqa: ANN001, ANN201 - called through checkpoint()
        """streams (B, T, n, D), V4Inputs -> (streams, balance loss or None, expert load or None)."""
        post, comb, x = self._hc(self.attn_hc, streams)
        streams = expand(post, comb, self.self_attn(self.input_layernorm(x), inputs), streams)
        post, comb, x = self._hc(self.ffn_hc, streams)
        out, aux, load = self.mlp(self.post_attention_layernorm(x), inputs.ids, inputs.real)
        return expand(post, comb, out, streams), aux, load

    def _hc(self, hc: HyperConnection, streams: torch.Tensor):  # noqa: ANN202
        # Kept for backward otherwise: two fp32 (T, n D) copies of the streams and ~2 iters (n x n) temporaries
        # per token; recomputed, only the streams (held anyway) and the small outputs stay.
        if self.recompute_hc and self.training:
            return checkpoint(hc, streams, use_reentrant=False)
        return hc(streams)


class V4MTPLayer(nn.Module):
    """Depth-k MTP (DeepSeek's MTPBlock): the embedding of the token k ahead and the previous depth's streams
    (before the main HC head) projected and added per stream, one block, its own HC head and norm, the shared
    head."""

    def __init__(self, cfg: V4Config, layer_idx: int) -> None:
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.e_proj = Linear(d, d, bias=False)
        self.h_proj = Linear(d, d, bias=False)
        self.enorm = V4RMSNorm(d, eps)
        self.hnorm = V4RMSNorm(d, eps)
        self.norm = V4RMSNorm(d, eps)
        self.hc_head = HyperHead(d, cfg.hc_mult, cfg.hc_eps, eps)
        self.block = V4Block(cfg, layer_idx)

    def inputs(self, embedded: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        return self.e_proj(self.enorm(embedded)).unsqueeze(2) + self.h_proj(self.hnorm(streams))

    def hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """The depth's streams collapsed by its own HC head and normed: what the shared head reads."""
        return self.norm(self.hc_head(streams))


class DeepSeekV4LM(BlockModelSurface, SparseControls, nn.Module):
    """The V4 model with DeepSeekLM's surface: forward -> ModelOutput, blocks(), routers(),
    update_expert_bias(), set_activation_checkpointing(), the CSA indexers' stages (SparseControls)."""

    NAME = "DeepSeek-V4"
    CHECKPOINTING = ("none", "full", "mhc")

    # Sequence parallelism (dstrain.parallel.sp) sets this as on DeepSeekLM: each rank's rows are its slice
    # plus the halo; attention gathers the whole rows' keys and compressor inputs (V4Inputs.whole).
    seq_parallel: Any = None
    # Each sequence-parallel rank's indexer figures are its own queries' (DSA's are the whole rows', alike).
    indexer_figures_per_slice = True

    def __init__(self, cfg: V4Config) -> None:
        super().__init__()
        self.config = cfg
        n = cfg.num_hidden_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(V4Block(cfg, i) for i in range(n))
        self.norm = V4RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hc_head = HyperHead(cfg.hidden_size, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps)
        self.lm_head = Head(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(V4MTPLayer(cfg, n + k) for k in range(cfg.num_nextn_predict_layers))
        self.moe_layer_ids = [i for i, b in enumerate(self.blocks()) if not b.mlp.hashed]
        self.activation_checkpointing = "none"
        self.rope = V4Rope(cfg)

    def blocks(self) -> list[V4Block]:
        return [*self.layers, *(m.block for m in self.mtp)]

    def indexers(self) -> list[nn.Module]:
        """Every CSA layer's lightning indexer."""
        return [b.self_attn.compressor.indexer for b in self.blocks() if b.self_attn.sparse is not None]

    def routers(self) -> list[V4Router]:
        """The routers whose expert load the forward reports (biased layers: main, then MTP), in that order."""
        return [b.mlp.gate for b in self.blocks() if not b.mlp.hashed]

    def set_activation_checkpointing(self, mode: str | bool) -> None:
        """'full' (or True): every block recomputed in backward; 'mhc': the mHC weights of every sublayer
        recomputed; 'none' (or False): nothing."""
        super().set_activation_checkpointing(mode)
        for block in self.blocks():
            block.recompute_hc = self.activation_checkpointing == "mhc"

    def run_block(self, block: V4Block, streams: torch.Tensor, inputs: V4Inputs):  # noqa: ANN201
        """One block (recomputed in backward under 'full' activation checkpointing) -> (streams, its balance
        loss, its expert load), the last two None for a hash layer."""
        if self.activation_checkpointing == "full" and self.training:
            return checkpoint(block, streams, inputs, use_reentrant=False)
        return block(streams, inputs)

    def context(
        self, position_ids: torch.Tensor | None, input_ids: torch.Tensor, t: int | None = None
    ) -> V4Inputs:
        """What every block of a forward of the first `t` tokens reads (a pipeline stage makes it from what
        travels); under sequence parallelism the documents and positions of the whole rows too."""
        b, t = input_ids.shape[0], t or input_ids.shape[1]
        ids, sp = input_ids[:, :t], self.seq_parallel
        if position_ids is None:
            pos = torch.arange(t, device=input_ids.device).expand(b, t)
            return V4Inputs(self.rope, pos, None, ids)
        pos = position_ids[:, :t]
        if sp is None:
            return V4Inputs(self.rope, pos, document_ids(pos), ids, real_tokens(pos))
        whole = sp.gather(pos)
        doc = document_ids(whole)
        return V4Inputs(self.rope, pos, doc, ids, real_tokens(pos), {}, sp, sp.rank * t, whole)

    def pipeline_context(self, position_ids: torch.Tensor, input_ids: torch.Tensor) -> tuple[V4Inputs]:
        return (self.context(position_ids, input_ids),)

    @property
    def halo(self) -> int:
        return sequence_halo(len(self.mtp))

    def streams_of(self, embedded: torch.Tensor) -> torch.Tensor:
        """The residual streams at the bottom: n copies of the embedding (B, T, n, D)."""
        return embedded.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_logits: bool | None = None,
        token_losses: bool = False,
    ) -> ModelOutput:
        """As DeepSeekLM.forward: input_ids (B, T); position_ids restarting at 0 per packed document (-1:
        padding); labels unshifted, -100 not a target; `token_losses`: each position's cross-entropy too
        (`lm_token_loss`, what DPO's sequence log-probabilities sum)."""
        t = input_ids.shape[1]
        if self.seq_parallel is not None:
            t -= self.halo  # this rank's tokens; the halo only feeds targets and look-ahead inputs
        inputs = self.context(position_ids, input_ids, t)
        streams, aux, loads = run_layers(self, self.streams_of(self.embed_tokens(input_ids[:, :t])), inputs)
        ahead = look_ahead(self.embed_tokens, input_ids, t)
        main_loads = torch.stack(loads) if loads else None
        return self.finish(
            streams, ahead, inputs, position_ids, labels, aux, main_loads, return_logits, token_losses
        )

    def finish(
        self,
        streams: torch.Tensor,
        ahead,  # noqa: ANN001 - k -> embeddings of the tokens k ahead (B, T, D)
        inputs: V4Inputs,
        position_ids: torch.Tensor | None,
        labels: torch.Tensor | None,
        aux: torch.Tensor | None,
        loads: torch.Tensor | None,
        return_logits: bool | None = None,
        token_losses: bool = False,
    ) -> ModelOutput:
        """The HC head, norm, head and losses, and the MTP depths, from the last block's streams, the summed
        balance loss and the (biased main layers, E) loads before (a pipeline's last stage calls this too)."""
        return finish_streams(self, self.hc_head, streams, ahead, inputs, position_ids, labels, aux, loads,
                              return_logits, token_losses)  # fmt: skip
