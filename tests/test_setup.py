"""launch/setup.sh's hand-over of pip's settings to uv (launch/uv_args.py): the same indexes, local folders and
constraints, pip's precedence between its sources, and pip itself for a setting uv would read otherwise."""

from __future__ import annotations

import sys

from tests.helpers.tiny import ROOT

sys.path.insert(0, str(ROOT / "launch"))
from uv_args import uv_args  # noqa: E402

LISTED = """\
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/elsewhere'
global.index-url='https://mirror.example/simple'
install.index-url='https://install.example/simple'
"""


def test_pip_s_settings_become_uv_s_options_with_pip_s_precedence():
    cert, args = uv_args(LISTED)
    assert cert == "/etc/ssl/certs/ca-certificates.crt"
    pairs = sorted(zip(args[::2], args[1::2]))
    assert pairs == sorted([
        ("--index-strategy", "unsafe-best-match"),
        ("--find-links", "/opt/wheels"),  # the environment's, over [global]'s
        ("--constraint", "/etc/xdg/pip/constraints.txt"),
        ("--extra-index-url", "file:///opt/pypi/simple"),
        ("--extra-index-url", "file:///opt/pypi-more/simple"),
        ("--index-url", "https://install.example/simple"),  # [install]'s, over [global]'s
    ])  # fmt: skip


def test_no_settings_is_uv_s_defaults_and_an_unknown_one_is_left_to_pip():
    assert uv_args("") == ("", ["--index-strategy", "unsafe-best-match"])
    assert uv_args(LISTED + "global.trusted-host='mirror.example'\n") is None
    assert uv_args(":env:.no-index='1'\n") is None
