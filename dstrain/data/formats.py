"""Record formats: detect them from a source's columns and turn records into documents.

A document is either a string (text format: pretraining) or a chat, a list of `{"role", "content"}` dicts
with roles system / user / assistant / tool (chat and instruction formats: SFT).

- text: the `--text_field` column (default `text`).
- chat: OpenAI `messages` (`role` / `content`, content may be a list of `{"type": "text", "text"}` parts) or
  ShareGPT `conversations` (`from` human|gpt|system|... / `value`). An optional `system` column is prepended.
- instruction: `instruction` + optional `input` + `output` (Alpaca), or `instruction` + `instances[]` with
  `input` / `output` (Self-Instruct; one sample per instance). The prompt is the instruction, followed by a
  blank line and the input when the input is not empty; the output is the assistant reply.

Bad records: a missing/null field, undecodable text (U+FFFD, which the readers substitute for undecodable
bytes), empty text and a chat without an assistant turn are skipped with a count, or raise `DataError`
naming the field, file and row under `--strict`. A column missing from the whole source is always an error.
"""

from __future__ import annotations

import logging

from dstrain.errors import DataError

from .options import DataOptions

log = logging.getLogger("dstrain.data")

ROLES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "prompter": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "ipython": "tool",
}
CHAT_FIELDS = ("messages", "conversations")


def detect_format(requested: str, columns: list[str], text_field: str, where: str, opts: DataOptions) -> str:
    cols = set(columns)
    chat = next((c for c in CHAT_FIELDS if c in cols), None)
    instruction = "instruction" in cols and ("output" in cols or "instances" in cols)
    if requested == "auto":
        if chat:
            return "chat"
        if instruction:
            return "instruction"
        if text_field in cols:
            return "text"
        raise DataError(
            f"data: cannot detect the format of {where}: columns {sorted(cols)}; expected messages or "
            f"conversations (chat), instruction + output/instances (instruction), or {text_field!r} (text, "
            "see --text_field)"
        )
    if requested == "text" and text_field not in cols:
        raise DataError(
            f"data: missing field {text_field!r} in {where} (columns {sorted(cols)}; see --text_field)"
        )
    if requested == "chat" and not chat:
        raise DataError(
            f"data: missing field 'messages' or 'conversations' in {where} (columns {sorted(cols)})"
        )
    if requested == "instruction" and not instruction:
        missing = "instruction" if "instruction" not in cols else "output' or 'instances"
        raise DataError(f"data: missing field '{missing}' in {where} (columns {sorted(cols)})")
    return requested


def needed_columns(fmt: str, columns: list[str], text_field: str) -> list[str]:
    if fmt == "text":
        wanted = [text_field]
    elif fmt == "chat":
        wanted = [next(c for c in CHAT_FIELDS if c in columns), "system"]
    else:
        wanted = ["instruction", "input", "output", "instances", "system"]
    return [c for c in wanted if c in columns]


class Skip(Exception):
    """A record to skip; `reason` is the stats counter to bump, `message` says where and why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class Normalizer:
    """Record (dict of the needed columns) -> list of documents, raising `Skip` or `DataError`."""

    def __init__(self, fmt: str, opts: DataOptions):
        self.fmt = fmt
        self.text_field = opts.text_field
        self.strip_newlines = opts.txt_split == "paragraph"

    def __call__(self, row: dict, where) -> list:
        if self.fmt == "text":
            return [self._text(row, where)]
        if self.fmt == "chat":
            return [self._chat(row, where)]
        return self._instruction(row, where)

    def _text(self, row: dict, where) -> str:
        text = row.get(self.text_field)
        if text is None:
            raise Skip("skipped_missing_field", f"missing field {self.text_field!r}")
        if not isinstance(text, str):
            raise DataError(
                f"data: field {self.text_field!r} is not text in {where()} (got {type(text).__name__})"
            )
        if self.strip_newlines:
            text = text.strip("\n")
        _check_text(text, where)
        if not text.strip():
            raise Skip("skipped_empty", "empty text")
        return text

    def _chat(self, row: dict, where) -> list[dict]:
        key = "messages" if "messages" in row else "conversations"
        turns = row.get(key)
        if not isinstance(turns, list) or not turns:
            raise Skip("skipped_missing_field", f"missing or empty field {key!r}")
        messages = []
        system = row.get("system")
        if isinstance(system, str) and system.strip():
            messages.append({"role": "system", "content": system})
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict):
                raise DataError(f"data: message {i} of {key!r} is not an object in {where()}")
            raw_role = turn.get("role") if turn.get("role") is not None else turn.get("from")
            if raw_role is None:
                raise Skip("skipped_missing_field", f"missing field 'role' (or 'from') in {key}[{i}]")
            role = ROLES.get(str(raw_role).lower())
            if role is None:
                raise DataError(
                    f"data: unknown role {raw_role!r} in {key}[{i}] in {where()} (known: {', '.join(ROLES)})"
                )
            content = turn.get("content") if turn.get("content") is not None else turn.get("value")
            if isinstance(content, list):  # OpenAI content parts; only text is kept
                content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
            if content is None:
                if role != "assistant" or not turn.get("tool_calls"):
                    raise Skip("skipped_missing_field", f"missing field 'content' in {key}[{i}]")
                content = ""
            if not isinstance(content, str):
                raise DataError(f"data: {key}[{i}] content is not text in {where()}")
            _check_text(content, where)
            messages.append({"role": role, "content": content})
        if not any(m["role"] == "assistant" for m in messages):
            raise Skip("skipped_no_assistant", "chat without an assistant turn")
        return messages

    def _instruction(self, row: dict, where) -> list[list[dict]]:
        instruction = row.get("instruction")
        if instruction is None:
            raise Skip("skipped_missing_field", "missing field 'instruction'")
        if row.get("output") is not None:
            pairs = [(row.get("input"), row["output"], "output")]
        elif isinstance(row.get("instances"), list) and row["instances"]:
            pairs = [
                (inst.get("input"), inst.get("output"), f"instances[{i}].output")
                for i, inst in enumerate(row["instances"])
            ]
        else:
            field = "instances" if "instances" in row else "output"
            raise Skip("skipped_missing_field", f"missing field {field!r}")
        system = row.get("system")
        docs = []
        for given, output, name in pairs:
            if output is None:
                raise Skip("skipped_missing_field", f"missing field {name!r}")
            given, output = str(given or ""), str(output)
            prompt = str(instruction) if not given.strip() else f"{instruction}\n\n{given}"
            for text in (prompt, output):
                _check_text(text, where)
            if not output.strip():
                raise Skip("skipped_empty", f"empty {name!r}")
            chat = (
                [{"role": "system", "content": system}] if isinstance(system, str) and system.strip() else []
            )
            chat += [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
            docs.append(chat)
        return docs


def _check_text(text: str, where) -> None:
    if "\ufffd" in text:
        raise Skip("skipped_undecodable", "undecodable bytes (U+FFFD)")
