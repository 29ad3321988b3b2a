"""dstrain's model against transformers' own DeepSeek-V3/V2 on checkpoints transformers wrote."""

import pytest
import torch

from dstrain.model import from_pretrained
from tests.helpers.hf import make_hf_model, v2_config, v3_config

CASES = {
    "v3_yarn_groups_bias": lambda: v3_config(),
    "v3_q_lora_null": lambda: v3_config(q_lora_rank=None, n_group=1, topk_group=1),
    "v3_no_interleave_no_yarn": lambda: v3_config(
        rope_interleave=False, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}
    ),
    "v3_tied_unnormed": lambda: v3_config(
        tie_word_embeddings=True, norm_topk_prob=False, routed_scaling_factor=1.0
    ),
    "v2_group_limited_yarn": lambda: v2_config(),
    "v2_greedy_q_lora": lambda: v2_config(
        topk_method="greedy", q_lora_rank=20, n_group=None, topk_group=None
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    hf = make_hf_model(CASES[case]())
    hf.save_pretrained(tmp_path)
    ours = from_pretrained(tmp_path, dtype=torch.float32).eval()
    torch.manual_seed(1)
    ids = torch.randint(0, hf.config.vocab_size, (3, 40))
    with torch.no_grad():
        ref = hf(input_ids=ids, use_cache=False).logits
        got = ours(ids).logits
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-5


def test_nonzero_bias_changes_routing(tmp_path):
    """Guards the parity test itself: the random expert bias must actually change the selected experts."""
    hf = make_hf_model(v3_config(), random_bias=True)
    hf.save_pretrained(tmp_path / "a")
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
    hf.save_pretrained(tmp_path / "b")
    ids = torch.randint(0, 320, (2, 24))
    with torch.no_grad():
        la = from_pretrained(tmp_path / "a").eval()(ids).logits
        lb = from_pretrained(tmp_path / "b").eval()(ids).logits
    assert (la - lb).abs().max() > 1e-3
