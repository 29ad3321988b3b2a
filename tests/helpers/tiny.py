"""The small things every test floor shares: the repository root, a very small model config, the torch.compile
backend of the model tests and a byte-level tokenizer built in memory (nothing touches the network)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 256


# torch.compile's backend that captures without generating code: Dynamo's whole graph (a graph break or host sync
# is an error with fullgraph=True), AOTAutograd's backward through Inductor's decompositions and partitioner
CAPTURE_BACKEND = "aot_eager_decomp_partition"


def compile_backend() -> str:
    """torch.compile's backend for the model tests: Inductor, but under the CUDA policy (the GPU branches run on
    the CPU) capture only. Inductor on a CPU writes C++, not the Triton a GPU runs, so it would check nothing of
    the GPU's kernels there, and each of its graphs costs 20-80 s of C++ compilation on a machine whose cache is
    cold (CI's); what the CUDA branches must pass, one graph with no host sync and a traceable backward, the
    capture checks."""
    from dstrain.model.common.kernels import KERNEL_POLICY

    return CAPTURE_BACKEND if KERNEL_POLICY == "cuda" else "inductor"


def tiny_config(**kw: Any):  # noqa: ANN201 - a dstrain ModelConfig
    """A model that trains in milliseconds with every feature on: MLA with q compression, one dense and one
    MoE layer (4 routed experts, top-2, 1 shared), MTP depth 1, nonzero balance loss and bias speed."""
    from dstrain.model import ModelConfig

    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        num_nextn_predict_layers=1,
        bias_update_speed=0.01,
        aux_loss_alpha=0.01,
        mtp_loss_weight=0.3,
    )
    base.update(kw)
    return ModelConfig(**base)


def tiny_kimi_linear_config(**kw: Any):  # noqa: ANN201 - a dstrain KimiLinearConfig
    """The tiny-kimi-linear preset (KDA + dense, KDA + MoE, NoPE MLA + MoE, KDA + MoE) with the test rows'
    vocabulary."""
    from dstrain.model import get_config

    return get_config("tiny-kimi-linear").replace(vocab_size=VOCAB, **kw)


def tiny_glm5_next_config(**kw: Any):  # noqa: ANN201 - a dstrain Glm5NextConfig
    """The tiny-glm5-next preset (KDA + dense, DSA + MoE, shared DSA + MoE, KDA + MoE, MTP; 2 mHC streams; a
    top-k of 16 tokens in pools of 4, so that rows of 32 select) with the test rows' vocabulary."""
    from dstrain.model import get_config

    return get_config("tiny-glm5-next").replace(vocab_size=VOCAB, **kw)


def tiny_v4_config(**kw: Any):  # noqa: ANN201 - a dstrain V4Config
    """A DeepSeek-V4 model of the same scale, every V4 part on at the test rows' 32 tokens: a CSA layer (8
    entries of rate 4 against a top-k of 3) behind a hash layer, an HCA layer (rate 8), a sliding one (a window
    of 8), 2 residual streams, MTP depth 1, nonzero balance loss and bias speed."""
    from dstrain.model import V4Config

    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        head_dim=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        mlp_layer_types=["hash_moe", "moe", "moe"],
        hc_mult=2,
        sliding_window=8,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=8,
        index_head_dim=8,
        index_topk=3,
        num_nextn_predict_layers=1,
        bias_update_speed=0.01,
        aux_loss_alpha=0.01,
        mtp_loss_weight=0.3,
    )
    base.update(kw)
    return V4Config(**base)


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# a template that rewrites contents (trims them): forces dstrain's render-and-search path
TRIMMING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}### {{ m['role'] }}: {{ m['content'] | trim }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
)
SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]


def byte_tokenizer(
    eos: bool = True, pad: bool = True, bos: bool = True, chat_template: str | None = CHATML_TEMPLATE
):
    """One token per UTF-8 byte (ids 0-255) plus special tokens <s> </s> <pad> <|im_start|> <|im_end|>
    (ids 256-260), as a `PreTrainedTokenizerFast`. Fast to build, deterministic, with exact offsets."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>" if bos else None,
        eos_token="</s>" if eos else None,
        pad_token="<pad>" if pad else None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    if chat_template:
        tok.chat_template = chat_template
    return tok


def tiny_dsa_config(**kw: Any):  # noqa: ANN201 - a dstrain ModelConfig
    """`tiny_config` with DeepSeek Sparse Attention: each query attends 8 keys (rows of the tests are longer),
    4 indexer heads of 16 dims; `glm=True`: GLM-5's, the second layer sharing the first one's selection."""
    glm = kw.pop("glm", False)
    base = dict(model_type="glm_moe_dsa" if glm else "deepseek_v32", index_topk=8, index_n_heads=4,
                index_head_dim=16, indexer_rope_interleave=glm, indexer_types=["full", "shared"] if glm else None)  # fmt: skip
    return tiny_config(**{**base, **kw})
