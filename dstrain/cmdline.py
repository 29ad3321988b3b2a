"""What every `dstrain` subcommand's parser shares: usage mistakes are ConfigErrors, so they end as the one
line `dstrain: error: ...` that `dstrain.cli` prints for every user error, and `--debug` asks for the
traceback. Dataclass options become flags through `fields.add_flags`."""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Sequence
from typing import Any, NoReturn

from dstrain.errors import ConfigError


class ArgumentParser(argparse.ArgumentParser):
    """argparse without its usage dump and exit code 2 of its own: an unknown flag or a bad value raises, with
    the nearest flag when there is one. No prefixes (`--max_step` is not `--max_steps`: a flag added later
    would change what an old command means); `--lora-r` and `--lora_r` are the same flag."""

    def __init__(self, *args: Any, near_flags: dict[str, str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.near_flags = near_flags or {}  # another tool's flag -> what to use here instead

    def _flags(self, shown: bool = False) -> list[str]:
        """Every long flag; `shown`: those the help lists (a hidden one is not a suggestion)."""
        return [
            o
            for a in self._actions
            for o in a.option_strings
            if o.startswith("--") and not (shown and a.help == argparse.SUPPRESS)
        ]

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        if args is not None:
            args = [self._spelled(a) for a in args]
        return super().parse_known_args(args, namespace)

    def _spelled(self, arg: str) -> str:
        """`--lora-r` -> `--lora_r` (and `--no_plots` -> `--no-plots`) when only the other spelling is a flag."""
        name, eq, value = arg.partition("=")
        if not name.startswith("--") or name in self._flags():
            return arg
        for other in (name[:2] + name[2:].replace("-", "_"), name[:2] + name[2:].replace("_", "-")):
            if other in self._flags():
                return other + eq + value
        return arg

    def error(self, message: str) -> NoReturn:
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        if unknown:
            hints = []
            for word in unknown.group(1).split():
                flag = word.partition("=")[0]
                near = (
                    difflib.get_close_matches(flag, self._flags(shown=True), n=1, cutoff=0.75)
                    if flag[:2] == "--"
                    else []
                )
                if flag in self.near_flags:
                    hints.append(f"{flag}: {self.near_flags[flag]}")
                elif near:
                    hints.append(f"{flag}: did you mean {near[0]}?")
            if hints:
                message += " (" + "; ".join(hints) + ")"
        raise ConfigError(message)


def add_debug(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="on an error, show the traceback too")


def command_parser(prog: str, description: str | None = None, **kw: object) -> ArgumentParser:
    """A subcommand's parser with --debug."""
    parser = ArgumentParser(prog=prog, description=description, **kw)  # type: ignore[arg-type]
    add_debug(parser)
    return parser
