"""Record formats: detect them from a source's columns and turn records into documents.

A document is either a string (text format: pretraining) or a chat, a list of `{"role", "content"}` dicts
with roles system / user / assistant / tool (chat and instruction formats: SFT). Assistant messages may carry
OpenAI `tool_calls` and `"weight": 0` (OpenAI fine-tuning; axolotl's `"train": false`: not trained), tool messages `tool_call_id` /
`name`; a chat with tool definitions starts with a `{"role": "tools", "tools": [...]}` entry (`split_tools`
takes it off).

- text: the `--text_field` column (default `text`).
- chat: OpenAI `messages` (`role` / `content`; content may be a list of `{"type": "text", "text"}` parts;
  `tool_calls`, or the older `function_call`) or ShareGPT `conversations` (`from` human|gpt|system|... /
  `value`). LLaMA-Factory's `function_call` / `observation` and ms-swift's `tool_call` / `tool_response`
  turns are assistant tool calls (a JSON `{"name", "arguments"}` or a list of them) and tool results. An
  optional `system` column is the system prompt unless the chat starts with its own; an optional `tools`
  column (a list, or JSON text of one) holds the tool definitions.
- preference (DPO pairs): `chosen` + `rejected` with or without `prompt` (TRL, LLaMA-Factory, UltraFeedback),
  or a chat + `rejected_response` (ms-swift) (`normalize_pair`: the prompt, chosen and rejected messages;
  preference.py describes the layouts and encodes the pairs). Read by an SFT run they are format `chosen`:
  the prompt and the chosen completion as one chat, the rejected completion never read.
- instruction: `instruction` + optional `input` + `output` (Alpaca), or `instruction` + `instances[]` with
  `input` / `output` (Self-Instruct; one sample per instance). The prompt is the instruction, followed by a
  blank line and the input when the input is not empty; the output is the assistant reply. LLaMA-Factory's
  `history` ([instruction, response] pairs) comes first as earlier user / assistant turns.

Bad records: a missing/null field, undecodable text (U+FFFD, which the readers substitute for undecodable
bytes), empty text, a chat without an assistant turn, images / audio / video (content parts that are not
text, or `images` / `videos` / `audios` columns: dstrain trains text-only models) and malformed tool calls
are skipped with a count, or raise `DataError` naming the field, file and row under `--strict`. A column
missing from the whole source is always an error.
"""

from __future__ import annotations

import json
import logging

from dstrain.errors import DataError

from .options import DataOptions

log = logging.getLogger("dstrain.data")

ROLES = {
    "system": "system",
    "developer": "system",  # OpenAI's name for the system prompt of its reasoning models
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
    "tool_response": "tool",
    "ipython": "tool",
}
TOOL_CALL_ROLES = {"function_call", "tool_call"}  # LLaMA-Factory / ms-swift turns that are tool calls
TOOLS_ROLE = "tools"
CHAT_FIELDS = ("messages", "conversations")
MEDIA_FIELDS = ("images", "videos", "audios")  # LLaMA-Factory / ms-swift multimodal columns
TEXT_PARTS = {"text", "input_text", "output_text"}  # content part types that are text (Chat / Responses API)


def detect_format(requested: str, columns: list[str], text_field: str, where: str, opts: DataOptions) -> str:
    cols = set(columns)
    chat = next((c for c in CHAT_FIELDS if c in cols), None)
    instruction = "instruction" in cols and ("output" in cols or "instances" in cols)
    # TRL's and LLaMA-Factory's `chosen` + `rejected`, or ms-swift's chat + `rejected_response`
    preference = ("chosen" in cols and "rejected" in cols) or (
        chat is not None and "rejected_response" in cols
    )
    half = _half_pair(cols, chat)  # a preference layout recognised, and what it lacks
    if half and requested in ("auto", "preference") and not (preference or chat or instruction):
        raise DataError(f"data: {where}: {half} (columns {listing(cols)})")
    if requested == "auto":
        if preference:  # before chat: UltraFeedback's pairs come with a `messages` column too
            return "preference"
        if chat:
            return "chat"
        if instruction:
            return "instruction"
        if text_field in cols:
            return "text"
        raise DataError(
            f"data: cannot detect the format of {where}: columns {listing(cols)}; expected messages or "
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
    if requested == "preference" and not preference:
        raise DataError(
            f"data: missing field 'chosen' or 'rejected' (or 'messages' + 'rejected_response') in {where} "
            f"(columns {listing(cols)})"
        )
    if requested == "instruction" and not instruction:
        missing = "instruction" if "instruction" not in cols else "output' or 'instances"
        raise DataError(f"data: missing field '{missing}' in {where} (columns {sorted(cols)})")
    return requested


def _half_pair(cols: set, chat: str | None) -> str:
    """What a preference layout recognised by one of its columns lacks, or ''."""
    if "rejected_response" in cols and chat is None:
        return "ms-swift's preference layout (rejected_response) without its chat: missing field 'messages'"
    if ("chosen" in cols) != ("rejected" in cols) and chat is None and "prompt" in cols:
        have, lack = ("chosen", "rejected") if "chosen" in cols else ("rejected", "chosen")
        return f"preference pairs ({have!r} beside 'prompt') without the other side: missing field {lack!r}"
    return ""


def listing(cols) -> str:
    """Column names for a one-line message (a JSON object that is not a record may have hundreds)."""
    names = sorted(cols)
    more = f", ... (+{len(names) - 12} more)" if len(names) > 12 else ""
    return "[" + ", ".join(map(repr, names[:12])) + more + "]"


def needed_columns(fmt: str, columns: list[str], text_field: str) -> list[str]:
    if fmt == "text":
        wanted = [text_field]
    elif fmt == "chat":
        wanted = [*CHAT_FIELDS, "system", "tools", *MEDIA_FIELDS]
    elif fmt in ("preference", "chosen"):
        wanted = ["prompt", "chosen", "rejected", "rejected_response", *CHAT_FIELDS, "instruction", "input"]
        wanted += ["system", *MEDIA_FIELDS]
    else:
        wanted = ["instruction", "input", "output", "instances", "system", "history", *MEDIA_FIELDS]
    return [c for c in wanted if c in columns]


def split_tools(chat: list[dict]) -> tuple[list[dict], list | None]:
    """(the messages of a chat document, its tool definitions or None)."""
    if chat and chat[0]["role"] == TOOLS_ROLE:
        return chat[1:], chat[0]["tools"]
    return chat, None


class Skip(Exception):
    """A record to skip; `reason` is the stats counter to bump, `message` says where and why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.source: int | None = None  # set by the source reader that skipped a record (pipeline.py)


class Normalizer:
    """Record (dict of the needed columns) -> list of documents, raising `Skip` or `DataError`."""

    def __init__(self, fmt: str, opts: DataOptions):
        self.fmt = fmt
        self.text_field = opts.text_field
        self.strip_newlines = opts.txt_split == "paragraph"

    def __call__(self, row: dict, where) -> list:
        if self.fmt == "text":
            return [self._text(row, where)]
        for field in MEDIA_FIELDS:
            if row.get(field):
                raise Skip("skipped_non_text", f"record has {field} (dstrain trains text-only models)")
        if self.fmt == "chat":
            return [self._chat(row, where)]
        if self.fmt == "preference":
            return [normalize_pair(row, where)]
        if self.fmt == "chosen":  # pairs read for SFT: the rejected completion is never a target
            pair = normalize_pair(row, where)
            return [pair["prompt"] + pair["chosen"]]
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
        # a file may mix OpenAI and ShareGPT records: each record uses the field it has
        key = next(
            (k for k in CHAT_FIELDS if row.get(k) is not None),
            "messages" if "messages" in row else "conversations",
        )
        turns = row.get(key)
        if not isinstance(turns, list) or not turns:
            raise Skip("skipped_missing_field", f"missing or empty field {key!r}")
        messages: list[dict] = []
        for i, turn in enumerate(turns):
            if not isinstance(turn, dict):
                raise DataError(f"data: message {i} of {key!r} is not an object in {where()}")
            _add_turn(messages, turn, f"{key}[{i}]", where)
        system = row.get("system")
        if isinstance(system, str) and system.strip() and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})  # the chat's own system prompt wins
        if not any(m["role"] == "assistant" for m in messages):
            raise Skip("skipped_no_assistant", "chat without an assistant turn")
        tools = _tools(row.get("tools"))
        return [{"role": TOOLS_ROLE, "tools": tools}, *messages] if tools else messages

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
        history = _history(row.get("history"), where)
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
            chat += history + [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
            docs.append(chat)
        return docs


def _check_text(text: str, where) -> None:
    if "\ufffd" in text:
        raise Skip("skipped_undecodable", "undecodable bytes (U+FFFD)")


def _completion(value, name: str, where) -> list[dict]:
    """One completion -> its messages: a text (one assistant turn), one message (LLaMA-Factory's
    `{"from": "gpt", "value"}`) or a message list (`normalize_pair` checks that it has a reply to train)."""
    if isinstance(value, dict):
        value = [value]
    if value is None:
        raise Skip("skipped_missing_field", f"missing field {name!r}")
    if value == [] or (isinstance(value, str) and not value.strip()):
        raise Skip("skipped_empty", f"empty {name!r} completion")
    return _pair_turns(value, name, where, "assistant")


def _pair_turns(value, name: str, where, default_role: str) -> list[dict]:
    """A text or a message list -> messages (a text is one turn of `default_role`)."""
    if isinstance(value, str):
        _check_text(value, where)
        return [{"role": default_role, "content": value}]
    if not isinstance(value, list) or not value:
        raise Skip("skipped_missing_field", f"missing or empty field {name!r}")
    messages: list[dict] = []
    for i, turn in enumerate(value):
        if not isinstance(turn, dict):
            raise Skip("skipped_missing_field", f"{name}[{i}] is not a message")
        _add_turn(messages, turn, f"{name}[{i}]", where)
    return messages


def _swift_pair(row: dict, where) -> tuple:
    """ms-swift's layout: `messages` (or `conversations`) ending with the chosen reply, `rejected_response`
    the rejected one -> (prompt messages, chosen, rejected)."""
    key = next((k for k in CHAT_FIELDS if row.get(k) is not None), "messages")
    turns = _pair_turns(row.get(key), key, where, "user")
    if turns[-1]["role"] != "assistant":
        raise Skip(
            "skipped_no_assistant",
            f"ms-swift's layout ({key} + rejected_response) but {key!r} does not end with the chosen reply",
        )
    return (
        turns[:-1],
        _completion(turns[-1:], "chosen", where),
        _completion(row["rejected_response"], "rejected_response", where),
    )


def _prompt_of(row: dict, where) -> tuple[list[dict] | None, bool]:
    """(the record's explicit prompt: a `prompt` column, LLaMA-Factory's `conversations` / `messages` or
    Alpaca's `instruction` + `input`, or None; whether it is a `prompt` message list, which TRL always takes
    as explicit)."""
    prompt = row.get("prompt")
    if prompt is not None:
        return _pair_turns(prompt, "prompt", where, "user"), isinstance(prompt, list)
    key = next((k for k in CHAT_FIELDS if row.get(k) is not None), None)
    if key is not None:
        return _pair_turns(row[key], key, where, "user"), False
    if row.get("instruction") is not None:
        instruction, given = str(row["instruction"]), str(row.get("input") or "")
        text = instruction if not given.strip() else f"{instruction}\n\n{given}"
        return _pair_turns(text, "instruction", where, "user"), False
    return None, False


def normalize_pair(row: dict, where) -> dict:
    """A record -> `{"prompt": [...], "chosen": [...], "rejected": [...]}` messages (raises Skip). The
    layouts: preference.py's docstring."""
    if row.get("chosen") is None and row.get("rejected") is None and row.get("rejected_response") is not None:
        head, c, r = _swift_pair(row, where)
    else:
        c, r = (
            _completion(row.get("chosen"), "chosen", where),
            _completion(row.get("rejected"), "rejected", where),
        )
        head, listed = _prompt_of(row, where)
        # Whole conversations (UltraFeedback, HH-RLHF as chats) carry their prompt: the messages both share
        # from the start (TRL's extract_prompt); a text prompt or a `messages` column beside them is ignored,
        # as TRL's maybe_extract_prompt does. Completions that start with the reply take the record's prompt.
        if (c[0]["role"] != "assistant" or r[0]["role"] != "assistant") and not listed:
            k = 0
            while k < min(len(c), len(r)) and c[k] == r[k]:
                k += 1
            head, c, r = c[:k], c[k:], r[k:]
        elif head is None:
            single = isinstance(row.get("chosen"), dict)
            raise Skip(
                "skipped_missing_field",
                "LLaMA-Factory's layout (chosen / rejected as single messages) without its prompt: missing "
                "field 'conversations' or 'messages'"
                if single
                else "missing field 'prompt' (completions that start with the reply need one)",
            )
    system = row.get("system")
    if isinstance(system, str) and system.strip() and not (head and head[0]["role"] == "system"):
        _check_text(system, where)
        head = [{"role": "system", "content": system}, *head]
    for name, side in (("chosen", c), ("rejected", r)):
        replies = [m for m in side if m["role"] == "assistant"]
        if not replies:
            raise Skip("skipped_no_assistant", f"{name} completion without an assistant turn")
        # `""`, `[]` and an empty reply alike: an end-of-turn-only target teaches nothing of the preference
        if not any(m["content"].strip() or m.get("tool_calls") for m in replies):
            raise Skip("skipped_empty", f"empty {name!r} completion")
    # the prompt's own assistant turns (earlier turns of a conversation) are context, never targets
    head = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in head]
    return {"prompt": head, "chosen": c, "rejected": r}


def _add_turn(messages: list[dict], turn: dict, name: str, where) -> None:
    """Append one chat turn to `messages` as an OpenAI message (a tool-call turn joins the assistant turn
    it follows: ms-swift writes an assistant reply and then its calls, or parallel calls one per turn)."""
    raw_role = turn.get("role") if turn.get("role") is not None else turn.get("from")
    if raw_role is None:
        raise Skip("skipped_missing_field", f"missing field 'role' (or 'from') in {name}")
    content = turn.get("content") if turn.get("content") is not None else turn.get("value")
    if str(raw_role).lower() in TOOL_CALL_ROLES:
        calls = _calls_from_text(content, name)
        if messages and messages[-1]["role"] == "assistant":
            messages[-1].setdefault("tool_calls", []).extend(calls)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": calls})
        return
    role = ROLES.get(str(raw_role).lower())
    if role is None:
        raise DataError(f"data: unknown role {raw_role!r} in {name} in {where()} (known: {', '.join(ROLES)})")
    calls = _openai_calls(turn, name) if role == "assistant" else []
    message = {"role": role, "content": _content(content, name, where, bool(calls))}
    if calls:
        message["tool_calls"] = calls
    # A reply not to train on: OpenAI fine-tuning's `"weight": 0`, axolotl's `"train": false`
    if role == "assistant" and (turn.get("weight") == 0 or turn.get("train") is False):
        message["weight"] = 0
    for field in ("tool_call_id", "name") if role == "tool" else ():
        if isinstance(turn.get(field), str):
            message[field] = turn[field]
    messages.append(message)


def _content(content, name: str, where, has_calls: bool) -> str:
    if isinstance(content, list):
        content = _join_parts(content, name, where)
    if content is None:
        if has_calls:  # an assistant turn that only calls tools
            return ""
        raise Skip("skipped_missing_field", f"missing field 'content' in {name}")
    if not isinstance(content, str):
        raise DataError(f"data: {name} content is not text in {where()}")
    _check_text(content, where)
    return content


def _join_parts(parts: list, name: str, where) -> str:
    """The text of OpenAI content parts; a part that is not text skips the record (never dropped silently)."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, (dict, str)):
            raise DataError(f"data: {name} content part {j} is not an object in {where()}")
        kind = (part.get("type") or "text") if isinstance(part, dict) else "text"
        if kind not in TEXT_PARTS:
            raise Skip(
                "skipped_non_text",
                f"{name} has a content part of type {kind!r} (dstrain trains text-only models)",
            )
        text = part if isinstance(part, str) else part.get("text")
        if not isinstance(text, str):
            raise Skip("skipped_missing_field", f"missing field 'text' in {name} content part {j}")
        texts.append(text)
    # No separator: OpenAI's own renderer (openai/harmony, src/encoding.rs) writes the text contents of a
    # message one right after the other, so the parts are pieces of one text, not paragraphs.
    return "".join(texts)


def _openai_calls(turn: dict, name: str) -> list[dict]:
    raw = turn.get("tool_calls")
    if raw is None and isinstance(turn.get("function_call"), dict):  # OpenAI's older function calling
        raw = [turn["function_call"]]
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise Skip("skipped_bad_tool_call", f"{name} tool_calls is not a list")
    return [_tool_call(call, f"{name}.tool_calls[{j}]") for j, call in enumerate(raw)]


def _calls_from_text(value, name: str) -> list[dict]:
    """The calls of a LLaMA-Factory `function_call` / ms-swift `tool_call` turn: JSON of a call or a list."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise Skip("skipped_bad_tool_call", f"{name} is not a JSON tool call") from None
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise Skip("skipped_bad_tool_call", f"{name} holds no tool call")
    return [_tool_call(call, name) for call in calls]


def _tool_call(call, name: str) -> dict:
    """OpenAI's form `{"type": "function", "function": {"name", "arguments"}}`. Arguments stay as given, a
    JSON object or JSON text: the chat encoder gives the template the form it renders."""
    fn = call.get("function") if isinstance(call, dict) and isinstance(call.get("function"), dict) else call
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise Skip("skipped_bad_tool_call", f"{name} is not a tool call with a function name")
    args = fn.get("arguments") if fn.get("arguments") is not None else fn.get("parameters")
    args = {} if args is None else args
    if not isinstance(args, (str, dict)):
        raise Skip("skipped_bad_tool_call", f"{name} arguments are neither a JSON object nor JSON text")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def _tools(raw) -> list | None:
    """Tool definitions in OpenAI's form (LLaMA-Factory lists bare functions, as JSON text), or None."""
    if isinstance(raw, str):
        if not raw.strip():
            return None
        try:
            raw = json.loads(raw)
        except ValueError:
            raise Skip("skipped_bad_tool_call", "field 'tools' is not JSON") from None
    if raw is None:
        return None
    raw = [raw] if isinstance(raw, dict) else raw
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise Skip("skipped_bad_tool_call", "field 'tools' is not a list of tool definitions")
    return [t if "function" in t else {"type": "function", "function": t} for t in raw] or None


def _history(raw, where) -> list[dict]:
    """LLaMA-Factory's `history`: [instruction, response] pairs before the current turn, as chat turns."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise DataError(f"data: field 'history' is not a list in {where()}")
    turns = []
    for i, pair in enumerate(raw):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise DataError(f"data: history[{i}] is not an [instruction, response] pair in {where()}")
        if pair[0] is None or pair[1] is None:
            raise Skip("skipped_missing_field", f"missing text in history[{i}]")
        for role, text in zip(("user", "assistant"), map(str, pair)):
            _check_text(text, where)
            turns.append({"role": role, "content": text})
    return turns
