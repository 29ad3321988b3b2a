"""The memory measurement as a scenario of the test session's pool of ranks (tests/helpers/pool.py): the
layouts of launch/bench_plan.py trained under the allocation tracker, which counts what a block allocates
(nothing alive before it), so a rank that ran other scenarios measures as a fresh one does."""

from __future__ import annotations

import sys

from tests.helpers.tiny import ROOT


def measured(info, names: list[str]) -> dict:  # noqa: ANN001
    """This rank's measured and predicted peaks per layout (bench_plan.measure)."""
    sys.path.insert(0, str(ROOT / "launch"))
    from bench_plan import measure

    return measure(info, names)


V4_LAYOUTS = {  # name -> flags (1 rank): no checkpointing in fp32, full in bf16 ('mhc': test_v4_estimate.py)
    "V4 ZeRO-1": "--config zero1",
    "V4 ZeRO-2 bf16 full": "--config zero2 --precision bf16 --activation_checkpointing full",
}


def v4_config():  # noqa: ANN201 - a dstrain V4Config
    """tests/helpers/tiny.py's DeepSeek-V4 scaled up (hidden 256, 4 streams, 4 heads of 64 dims) so that its
    activations, not the allocator's rounding, make the peak: at bench_plan's 2 x 256 tokens a CSA layer has 64
    entries (top-k 16) behind a hash layer, an HCA layer 32, a sliding one a window of 64 over 4 blocks of rows."""
    from tests.helpers.tiny import tiny_v4_config

    return tiny_v4_config(
        vocab_size=4096, hidden_size=256, moe_intermediate_size=128, num_attention_heads=4, head_dim=64,
        q_lora_rank=64, qk_rope_head_dim=16, n_routed_experts=8, hc_mult=4, sliding_window=64, o_lora_rank=32,
        index_n_heads=8, index_head_dim=32, index_topk=16,
    )  # fmt: skip


def measured_v4(info, names: list[str]) -> dict:  # noqa: ANN001
    """bench_plan.measure of the V4 model's layouts on this rank."""
    sys.path.insert(0, str(ROOT / "launch"))
    from bench_plan import measure

    return measure(info, names, v4_config(), V4_LAYOUTS)


KIMI_LAYOUTS = {  # name -> flags (1 rank), as V4_LAYOUTS
    "Kimi Linear ZeRO-1": "--config zero1",
    "Kimi Linear ZeRO-2 bf16 full": "--config zero2 --precision bf16 --activation_checkpointing full",
}


def kimi_config():  # noqa: ANN201 - a dstrain KimiLinearConfig
    """The tiny-kimi-linear preset (KDA + dense, KDA + MoE, MLA + MoE, KDA + MoE) scaled up (hidden 256, 4 KDA
    heads of 64, 8 experts of 128) so that its activations, KDA's chunked rule most of them, make the peak."""
    from dstrain.model import get_config

    return get_config("tiny-kimi-linear").replace(
        vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, kv_lora_rank=64,
        qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, linear_head_dim=64, linear_num_heads=4,
        max_position_embeddings=1024,
    )  # fmt: skip


def measured_kimi(info, names: list[str]) -> dict:  # noqa: ANN001
    """bench_plan.measure of the Kimi Linear model's layouts on this rank."""
    sys.path.insert(0, str(ROOT / "launch"))
    from bench_plan import measure

    return measure(info, names, kimi_config(), KIMI_LAYOUTS)


GLM_LAYOUTS = {  # name -> flags (1 rank): one layout, bf16 with full checkpointing, to keep the suite's time
    # (docs/memory.md gives ZeRO-1 fp32 without checkpointing too; the saved activations in both modes:
    # test_glm5_next_estimate.py)
    "GLM-5.3-Flash ZeRO-2 bf16 full": "--config zero2 --precision bf16 --activation_checkpointing full",
}


def glm_config():  # noqa: ANN201 - a dstrain Glm5NextConfig
    """The tiny-glm5-next preset (KDA + dense, DSA full + MoE, DSA shared + MoE, KDA + MoE, MTP) scaled up (hidden
    128, 4 streams, 2 KDA heads of 64, 8 experts of 64) so that its activations make the peak: at bench_plan's
    2 x 256 tokens a DSA query attends 16 pools of 4 and its tail (67 of 256 keys)."""
    from dstrain.model import get_config

    return get_config("tiny-glm5-next").replace(
        vocab_size=2048, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, kv_lora_rank=64,
        q_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32, linear_head_dim=64, linear_num_heads=2, hc_mult=4,
        index_topk=64, index_head_dim=32, max_position_embeddings=1024,
    )  # fmt: skip


def measured_glm(info, names: list[str]) -> dict:  # noqa: ANN001
    """bench_plan.measure of the GLM-5.3-Flash model's layouts on this rank."""
    sys.path.insert(0, str(ROOT / "launch"))
    from bench_plan import measure

    return measure(info, names, glm_config(), GLM_LAYOUTS)
