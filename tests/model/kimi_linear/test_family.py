"""The Kimi Linear family as the rest of dstrain reaches it: the registry finds it by model_type and config
class, and layout sizes it cannot split are refused in one line before anything is built."""

from __future__ import annotations

import pytest

from dstrain.config.plan import prepare
from dstrain.errors import ConfigError
from dstrain.model import family_of, get_config
from dstrain.model.kimi_linear import FAMILY
from dstrain.model.registry import family_for_type
from tests.helpers.trainer import make_options


def test_the_registry_finds_the_family() -> None:
    assert family_for_type("kimi_linear") is FAMILY
    assert family_of(get_config("tiny-kimi-linear")) is FAMILY


def test_layout_sizes_name_the_attention_kind_they_split() -> None:
    """Sequence and tensor parallelism split MLA's and KDA's heads: a size that does not divide KDA's is
    refused naming it, in one line."""
    cfg = get_config("tiny-kimi-linear")
    heads = cfg.linear_num_heads
    for flag in ("--sp", "--tp"):
        odd = get_config("tiny-kimi-linear").replace(linear_num_heads=heads + 1)
        with pytest.raises(ConfigError, match=f"^{flag} 2 must divide linear_num_heads {heads + 1}$"):
            prepare(make_options(["--model", "tiny-kimi-linear", flag, "2"]), 2, model=odd)
