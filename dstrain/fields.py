"""Options as dataclasses: each field documented by the string literal written under it, read back here
for `--help`, and the type information the flag parsers need. Shared by `dstrain train` and `dstrain data`."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from functools import cache
from typing import Any, Literal


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring literal written under it, for cls and its dataclass bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    for f in dataclasses.fields(cls):
        if f.metadata.get("help"):
            docs[f.name] = f.metadata["help"]
    return docs


def base_type(tp: Any) -> tuple[Any, tuple[Any, ...] | None, bool]:
    """-> (python type, Literal choices or None, optional?) of a resolved annotation."""
    optional = False
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        tp = args[0] if len(args) == 1 else str
        origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        return type(choices[0]), choices, optional
    return tp, None, optional


def converter(tp: Any, name: str):  # noqa: ANN202
    if tp is bool:

        def to_bool(v: Any) -> bool:
            if isinstance(v, bool):
                return v
            s = str(v).lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"{name}={v!r}: expected true or false")

        return to_bool
    if tp in (int, float, str):
        return tp
    return lambda v: v
