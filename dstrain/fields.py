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
        if dataclasses.is_dataclass(klass):
            docs.update(_class_docs(klass))
    for f in dataclasses.fields(cls):
        if f.metadata.get("help"):
            docs[f.name] = f.metadata["help"]
    return docs


def _class_docs(klass: type) -> dict[str, str]:
    """The docstrings under `klass`'s fields, from its module's source parsed once for all its classes
    (inspect.getsource parses the whole module again for each class: 0.2 s of each command's start)."""
    module = inspect.getmodule(klass)
    path = getattr(module, "__file__", None)
    found = _module_class_docs(path).get(klass.__qualname__) if path else None
    if found is not None:
        return found
    try:  # a class defined in a function (its qualname holds <locals>), or with no source file
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError):
        return {}
    return _docs_in(tree.body[0].body)  # type: ignore[attr-defined]


@cache
def _module_class_docs(path: str) -> dict[str, dict[str, str]]:
    """Qualified name -> field docs of every class written at a module's top level (or inside such a class)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, UnicodeDecodeError):
        return {}
    out: dict[str, dict[str, str]] = {}
    todo = [(node, "") for node in tree.body]
    while todo:
        node, prefix = todo.pop()
        if isinstance(node, ast.ClassDef):
            name = prefix + node.name
            out[name] = _docs_in(node.body)
            todo += [(child, name + ".") for child in node.body]
    return out


def _docs_in(body: list[ast.stmt]) -> dict[str, str]:
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
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


def add_flags(
    parser: Any,
    cls: type,
    defaults: dict[str, Any] | None = None,
    aliases: dict[str, tuple[str, ...]] | None = None,
) -> None:
    """One `--FIELD` flag per field of the dataclass `cls` on `parser` (a parser or an argument group): help
    from the field's docstring and its default (`defaults` overrides what the help shows), booleans as
    --FIELD / --no-FIELD, Literal types as choices, a field with metadata "bare" as --FIELD [MODE] (a bare flag
    means metadata["bare"], --no-FIELD metadata["negated"]), metadata "hidden" without help. Only the flags
    given reach the namespace (argparse.SUPPRESS), so they can override a recipe or a file. `aliases`: field
    -> other names of its flag (`--ALIAS` sets the field)."""
    import argparse

    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, choices, _ = base_type(hints[f.name])
        default = (defaults or {}).get(f.name, f.default if f.default is not dataclasses.MISSING else None)
        text = docs.get(f.name, "").replace("%", "%%")
        if f.metadata.get("hidden"):
            text = argparse.SUPPRESS
        elif default is not None:
            text += f" (default: {default})"
        kw: dict[str, Any] = {"dest": f.name, "help": text, "default": argparse.SUPPRESS}
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif "bare" in f.metadata:
            kw.update(nargs="?", const=f.metadata["bare"], choices=choices, metavar="MODE")
            parser.add_argument(
                f"--no-{f.name}",
                dest=f.name,
                action="store_const",
                const=f.metadata["negated"],
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS,
            )
        else:
            kw.update(type=converter(tp, f.name), metavar=f.name.upper())
            if choices:
                kw.update(choices=choices, metavar="{" + ",".join(map(str, choices)) + "}")
        parser.add_argument(f"--{f.name}", *(f"--{a}" for a in (aliases or {}).get(f.name, ())), **kw)
