"""The DeepSeek-V3 family's causal LM (DeepSeek-V2, V3, V3.2, GLM-5, Kimi-K2) as plain single-device PyTorch:
MLA (attention.py), DeepSeekMoE, multi-token prediction.

Module names mirror the Hugging Face layout (minus the `model.` prefix) so the key table (state_dict.py) stays
small; routed experts are fused 3-D tensors so every rank touches every expert parameter (no ZeRO-3 hang), and
they run as grouped GEMMs with no host sync (common/experts.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dstrain.batch import real_pairs, real_tokens, sequence_halo

from ..common.attention import AttentionLayout, attention_layout, rope_cos_sin
from ..common.dsa import SparseControls
from ..common.kernels import Linear
from ..common.layers import MLP, MoE, RMSNorm
from ..common.loss import Head, combine_losses, lm_losses, mtp_depth_loss
from ..common.output import ModelOutput
from ..common.surface import BlockModelSurface, look_ahead, run_layers
from .attention import MLA, rope_frequencies
from .config import ModelConfig


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.recompute: str | None = None  # 'attention' or 'mlp': that sublayer is recomputed in backward
        # set by compile_blocks: torch.compiler.disable imports torch._dynamo (2.5 s), which eager runs skip
        self.eager_checkpoint: Any = None

    def forward(self, x, rope, layout):  # noqa: ANN001 - called through checkpoint()
        x = x + self._sublayer("attention", self._attention, x, rope, layout)
        if isinstance(self.mlp, MoE):
            out, aux, load = self._sublayer("mlp", self._moe, x, layout.real)
            return x + out, aux, load
        return x + self._sublayer("mlp", self._ffn, x), None, None

    def _sublayer(self, name: str, fn, *args):  # noqa: ANN001, ANN202
        if self.recompute == name and self.training:
            if (
                name == "mlp"
                and isinstance(self.mlp, MoE)
                and torch.compiler.is_compiling()
                and self.eager_checkpoint
            ):
                return self.eager_checkpoint(fn, *args)
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def _attention(self, x, rope, layout):  # noqa: ANN001, ANN202
        return self.self_attn(self.input_layernorm(x), rope, layout)

    def _ffn(self, x):  # noqa: ANN001, ANN202
        return self.mlp(self.post_attention_layernorm(x))

    def _moe(self, x, real):  # noqa: ANN001, ANN202 - real: the positions holding a token
        return self.mlp(self.post_attention_layernorm(x), real)


def _checkpointed(fn, *args):  # noqa: ANN001, ANN202
    """A recomputed MoE sublayer inside a compiled block runs eagerly (compile_blocks wraps this in
    torch.compiler.disable): traced by torch.compile (2.13) within activation checkpointing, the routing
    weights' gradient from the experts was dropped when the balance loss also used the router's scores
    (measured: the router's gradient held the balance loss's share only)."""
    return checkpoint(fn, *args, use_reentrant=False)


class MTPLayer(nn.Module):
    """Depth-k multi-token prediction: combine the previous depth's hidden state with the embedding of the
    token k ahead, run one block, predict with the shared head (its own final norm)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.block = Block(cfg, layer_idx)
        self.shared_head_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepSeekLM(BlockModelSurface, SparseControls, nn.Module):
    NAME = "DeepSeek-V2/V3"
    CHECKPOINTING = ("none", "full", "attention", "mlp")

    # Sequence parallelism (dstrain.parallel.sp) sets this on the model, its MLA and MoE layers: then each
    # rank's input_ids / position_ids / labels are its slice of every row plus `halo` tokens after it
    # (`dstrain.batch.sequence_shard`): the targets of its last positions and MTP's look-ahead inputs.
    seq_parallel: Any = None
    # Sparse attention's indexer figures are the whole rows', alike on every sequence-parallel rank.
    indexer_figures_per_slice = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Head(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        n = cfg.num_hidden_layers
        self.mtp = nn.ModuleList(MTPLayer(cfg, n + k) for k in range(cfg.num_nextn_predict_layers))
        self.moe_layer_ids = [i for i in range(n + len(self.mtp)) if cfg.is_moe_layer(i)]
        self.activation_checkpointing = "none"
        self._rope_cache: dict[torch.device, tuple[torch.Tensor, float]] = {}

    # -------------------------------------------------------------- ties and balancing
    def set_activation_checkpointing(self, mode: str | bool) -> None:
        """'full' (or True): every block recomputed in backward; 'attention' / 'mlp': only that sublayer of
        every block; 'none' (or False): nothing recomputed."""
        super().set_activation_checkpointing(mode)
        sublayer = (
            self.activation_checkpointing if self.activation_checkpointing in ("attention", "mlp") else None
        )
        for block in self.blocks():
            block.recompute = sublayer

    def indexers(self) -> list[nn.Module]:
        """Every lightning indexer (DeepSeek Sparse Attention's full layers)."""
        return [b.self_attn.indexer for b in self.blocks() if b.self_attn.indexer is not None]

    def blocks(self) -> list[Block]:
        """Every transformer block: the main model's, then the MTP modules'."""
        return [*self.layers, *(m.block for m in self.mtp)]

    def compile_blocks(self, **options) -> None:  # noqa: ANN003 - torch.compile's
        """Regional compilation (torchtitan's): each transformer block compiled on its own, in place (names and
        state dict unchanged), blocks of one kind sharing a graph, and the head's loss chunks; the rest of the
        model stays eager."""
        eager = torch.compiler.disable(_checkpointed)
        for block in self.blocks():
            block.eager_checkpoint = eager
            block.compile(**options)
        if isinstance(self.lm_head, Head):
            self.lm_head.compile_loss(**options)

    # -------------------------------------------------------------- forward
    def _rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dev = position_ids.device
        if dev not in self._rope_cache:
            inv_freq, factor = rope_frequencies(self.config)
            self._rope_cache[dev] = (inv_freq.to(dev), factor)
        inv_freq, factor = self._rope_cache[dev]
        return rope_cos_sin(position_ids, inv_freq, factor)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        return_logits: bool | None = None,
        token_losses: bool = False,
    ) -> ModelOutput:
        """input_ids (B, T); position_ids (B, T) restarting at 0 per packed document; labels (B, T) unshifted,
        -100 = not a target. Logits are returned when there are no labels (or when asked); `token_losses`
        also returns each position's cross-entropy (`lm_token_loss`, what DPO's sequence log-probs sum)."""
        b, t = input_ids.shape
        if self.seq_parallel is not None:
            t -= self.halo  # this rank's tokens; the halo only feeds targets and look-ahead inputs
            position_ids = (
                position_ids
                if position_ids is not None
                else torch.arange(t + self.halo, device=input_ids.device).expand(b, -1)
            )
        local_pos = position_ids[:, :t] if position_ids is not None else None
        rope, layout = self.rope_and_layout(local_pos, b, t, input_ids.device)
        h, aux, loads = run_layers(self, self.embed_tokens(input_ids[:, :t]), rope, layout)
        ahead = look_ahead(self.embed_tokens, input_ids, t)
        main_loads = torch.stack(loads) if loads else None
        return self.finish(
            h, ahead, rope, layout, position_ids, labels, aux, main_loads, return_logits, token_losses
        )

    def rope_and_layout(
        self, position_ids: torch.Tensor | None, b: int, t: int, device: torch.device
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], AttentionLayout]:
        pos = position_ids if position_ids is not None else torch.arange(t, device=device).expand(b, t)
        sp = self.seq_parallel
        whole = sp.gather(pos) if sp else position_ids  # the mask spans whole rows
        layout = attention_layout(whole, b, t * (sp.size if sp else 1), device)
        layout.real = real_tokens(position_ids)  # this rank's tokens (padding: no token)
        return self._rope(pos), layout

    def selection_width(self, t: int) -> int:
        """Keys of a shared sparse-attention selection over rows of `t` tokens (what a pipeline stage sends on to
        a later shared layer)."""
        return min(self.config.index_topk or 0, t)

    def pipeline_context(self, position_ids: torch.Tensor, input_ids: torch.Tensor | None) -> tuple:
        """What a pipeline stage's blocks and `finish` read besides the hidden states: (rope, layout)."""
        b, t = position_ids.shape
        return self.rope_and_layout(position_ids, b, t, position_ids.device)

    def streams_of(self, embedded: torch.Tensor) -> torch.Tensor:
        """The residual stream at the bottom (one: the embedding itself; DeepSeek-V4 has several)."""
        return embedded

    @property
    def halo(self) -> int:
        return sequence_halo(len(self.mtp))

    def run_block(
        self, block: Block, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], layout: AttentionLayout
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One block (recomputed in backward under activation checkpointing) -> (h, its MoE balance loss,
        its expert load), the last two None for a dense block."""
        if self.activation_checkpointing == "full" and self.training:
            return checkpoint(block, h, rope, layout, use_reentrant=False)
        return block(h, rope, layout)

    def finish(
        self,
        h: torch.Tensor,
        ahead,  # noqa: ANN001 - k -> embeddings of the tokens k ahead (B, T, D)
        rope: tuple[torch.Tensor, torch.Tensor],
        layout: AttentionLayout,
        position_ids: torch.Tensor | None,
        labels: torch.Tensor | None,
        aux: torch.Tensor | None,
        loads: torch.Tensor | None,
        return_logits: bool | None = None,
        token_losses: bool = False,
    ) -> ModelOutput:
        """Final norm, head, losses and the MTP depths, from the last block's output `h`, the summed balance
        loss `aux` and the (main MoE layers, E) expert `loads` of the blocks before (the pipeline's last stage
        calls this too)."""
        cfg = self.config
        t = h.shape[1]
        main_hidden = self.norm(h)
        out = ModelOutput()
        if return_logits or (return_logits is None and labels is None):
            out.logits = self.lm_head(main_hidden)
        run_mtp = labels is not None and len(self.mtp) > 0
        if labels is not None:
            out.lm_loss_sum, out.lm_tokens, rows = lm_losses(
                self.lm_head, main_hidden, labels, position_ids, token_losses
            )
            if rows is not None:  # (B, n): position i's loss predicting labels[:, i + 1]
                out.lm_token_loss = rows
        mtp_loads = []
        if run_mtp:
            sums, counts = [], []
            prev = main_hidden
            for k, mtp in enumerate(self.mtp, start=1):
                x = mtp.eh_proj(torch.cat([mtp.enorm(ahead(k)), mtp.hnorm(prev)], dim=-1))
                # a position whose look-ahead token is padding holds no pair: its router counts nothing
                depth = dataclasses.replace(layout, real=real_pairs(position_ids, h.shape[0], t, k, h.device))
                prev, block_aux, load = self.run_block(mtp.block, x, rope, depth)
                if block_aux is not None:
                    aux = block_aux if aux is None else aux + block_aux
                    mtp_loads.append(load)
                s, c, hits = mtp_depth_loss(
                    self.lm_head, mtp.shared_head_norm(prev), labels, position_ids, k, self.training
                )
                if hits is not None:
                    out.mtp_hits = hits
                sums.append(s)
                counts.append(c)
            out.mtp_loss_sum, out.mtp_tokens = torch.stack(sums), torch.stack(counts)
        if layout.stats:
            out.indexer_stats = torch.stack(list(layout.stats.values())).sum(0)
        if aux is not None:
            out.aux_loss = aux
            rows = ([loads] if loads is not None else []) + ([torch.stack(mtp_loads)] if mtp_loads else [])
            out.expert_load = torch.cat(rows).detach()
        if labels is not None:
            lm = out.lm_loss_sum / out.lm_tokens.clamp(min=1)
            mtp = (out.mtp_loss_sum / out.mtp_tokens.clamp(min=1)).mean() if run_mtp else None
            out.loss = combine_losses(lm, mtp, out.aux_loss, cfg.aux_loss_alpha, cfg.mtp_loss_weight)
        return out
