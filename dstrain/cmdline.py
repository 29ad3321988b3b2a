"""What every `dstrain` subcommand's parser shares: usage mistakes are ConfigErrors, so they end as the one
line `dstrain: error: ...` that `dstrain.cli` prints for every user error, and `--debug` asks for the
traceback. Dataclass options become flags through `fields.add_flags`."""

from __future__ import annotations

import argparse
from typing import NoReturn

from dstrain.errors import ConfigError


class ArgumentParser(argparse.ArgumentParser):
    """argparse without its usage dump and exit code 2 of its own: an unknown flag or a bad value raises."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def add_debug(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="on an error, show the traceback too")


def command_parser(prog: str, description: str | None = None, **kw: object) -> ArgumentParser:
    """A subcommand's parser with --debug."""
    parser = ArgumentParser(prog=prog, description=description, **kw)  # type: ignore[arg-type]
    add_debug(parser)
    return parser
