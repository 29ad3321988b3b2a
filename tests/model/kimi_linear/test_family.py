"""The Kimi Linear family as the rest of dstrain reaches it: the registry finds it by model_type and config
class, and what it does not do yet is refused in one line before anything is built."""

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


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--sp", "2"], "sequence parallelism"),
    ],
)
def test_what_is_not_built_is_refused_in_one_line(flags: list[str], words: str) -> None:
    with pytest.raises(ConfigError, match=f"{flags[0]} {flags[1]}: .*{words}") as err:
        prepare(make_options(["--model", "tiny-kimi-linear", *flags]), 2)
    assert "\n" not in str(err.value)
