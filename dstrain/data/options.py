"""`DataOptions`: every knob of the data pipeline, validated up front.

The trainer turns each field into a command-line flag and shows the string literal under the field as its
help, so every field keeps a docstring. `field_help()` reads those docstrings back (the `dstrain data` CLI
uses it too).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from dstrain.errors import DataError
from dstrain.fields import add_flags, field_docs

Format = Literal["auto", "text", "chat", "instruction", "preference"]
TxtSplit = Literal["paragraph", "line", "document"]
SftTurns = Literal["all", "last"]
Think = Literal["last", "all", "none"]
Overlong = Literal["drop", "truncate"]
FORMATS, TXT_SPLITS, SFT_TURNS, THINK, OVERLONG = map(get_args, (Format, TxtSplit, SftTurns, Think, Overlong))


@dataclass
class DataOptions:
    data: str = "shakespeare"
    """Training data: comma-separated sources, each a file, glob, folder, the built-in `shakespeare`, or a
    Hugging Face hub data set `name[:config][@split]`; weight a mix with a trailing `:W`
    (`a.jsonl:0.7,b.parquet:0.3`)."""

    data_format: Format = "auto"
    """auto|text|chat|instruction|preference. auto: `chosen` + `rejected` (or a chat + `rejected_response`) ->
    preference (pairs for --objective dpo; SFT trains their chosen side), `messages`/`conversations` -> chat,
    `instruction` -> instruction, else the text field -> text (pretraining)."""

    text_field: str = "text"
    """Column holding the document text for the text format."""

    tokenizer: str | None = None
    """Tokenizer folder, tokenizer.json file, hub name, or `deepseek-v3` (the bundled DeepSeek-V3 tokenizer).
    Default: the model checkpoint's own tokenizer, else `deepseek-v3`."""

    seq_len: int = 64
    """Tokens per packed row (the built-in demo's; `dstrain train` and `dstrain data` share it)."""

    txt_split: TxtSplit = "paragraph"
    """How .txt files split into documents: paragraph (blank-line separated blocks), line, or document (one
    document per file)."""

    add_bos: bool = False
    """Pretraining: prepend the tokenizer's BOS token to every document (EOS is always appended)."""

    sft_turns: SftTurns = "all"
    """SFT: train on all assistant turns, or only the last one."""

    think: Think = "last"
    """SFT reasoning `<think>...</think>` in assistant replies: keep it in the last assistant turn and drop it
    from earlier ones (last), keep it everywhere (all), or drop it everywhere (none)."""

    overlong: Overlong = "drop"
    """SFT samples longer than seq_len: drop or truncate them (counted either way; never split)."""

    strict: bool = False
    """Fail on the first bad record (undecodable text, chat without an assistant turn, ...) instead of
    skipping it with a count."""

    shuffle: bool = True
    """Shuffle shard order every epoch and documents through a buffer (deterministic given the seed)."""

    shuffle_buffer: int = 1000
    """Documents held by each stream's shuffle buffer (saved in the loader state; 0 disables the buffer)."""

    packing: bool = True
    """Pack several documents into each row (pretraining: concatenate and split; SFT: best-fit of whole
    samples). Off: one document per row, padded."""

    pack_buffer: int = 1000
    """SFT samples pooled for each best-fit packing round (saved in the loader state)."""

    num_workers: int = 1
    """Background DataLoader processes per rank that read, tokenize and pack (0: in the training process)."""

    data_streams: int | None = None
    """Streams the training data is split into: each reads its own part of the records, shuffles and packs
    it, and global row g comes from stream g mod data_streams, so the rows of a global batch do not depend on
    the number of ranks. Data-parallel rank r reads streams r, r + dp, ...; dp x max(1, num_workers) must
    divide it. Fixed for a run: a resumed run keeps its checkpoint's. Default: the smallest multiple of
    dp x max(1, num_workers) that is at least 8 (so 1, 2, 4 or 8 ranks can continue one another's runs)."""

    eval_data: str | None = None
    """Held-out evaluation data: sources in --data's syntax, read with --data's format, template and masks."""

    eval_split: float = 0.0
    """Hold out this fraction of the training sources' documents for evaluation, chosen by a hash of each
    document's content: the same documents whatever the seed, rank count or restart, and never trained on.
    Exclusive with --eval_data."""

    eval_tokens: int = 262144
    """Evaluation budget: the eval set is the first rows of the eval data holding this many tokens (0: all
    of it). It is read once, in the same order on every rank."""

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise DataError(message)

        need(isinstance(self.data, str) and self.data.strip() != "", "data must name at least one source")
        for name, allowed in (
            ("data_format", FORMATS),
            ("txt_split", TXT_SPLITS),
            ("sft_turns", SFT_TURNS),
            ("think", THINK),
            ("overlong", OVERLONG),
        ):
            value = getattr(self, name)
            need(value in allowed, f"{name} must be one of {', '.join(allowed)} (got {value!r})")
        need(bool(self.text_field), "text_field must be a column name (got an empty string)")
        need(self.tokenizer is None or bool(self.tokenizer), "tokenizer must be a name or path, or None")
        checked = [("seq_len", 2), ("shuffle_buffer", 0), ("pack_buffer", 1), ("num_workers", 0)]
        if self.data_streams is not None:
            checked.append(("data_streams", 1))
        for name, low in checked:
            value = getattr(self, name)
            need(
                isinstance(value, int) and not isinstance(value, bool) and value >= low,
                f"{name} must be an integer >= {low} (got {value!r})",
            )
        need(
            self.eval_data is None or (isinstance(self.eval_data, str) and self.eval_data.strip() != ""),
            "eval_data must name at least one source",
        )
        need(
            isinstance(self.eval_split, (int, float)) and 0.0 <= self.eval_split < 1.0,
            f"eval_split must be a fraction in [0, 1) (got {self.eval_split!r})",
        )
        need(
            not (self.eval_data and self.eval_split),
            "give --eval_data or --eval_split, not both",
        )
        need(
            isinstance(self.eval_tokens, int) and self.eval_tokens >= 0,
            f"eval_tokens must be an integer >= 0 (got {self.eval_tokens!r})",
        )
        for name in ("add_bos", "strict", "shuffle", "packing"):
            need(isinstance(getattr(self, name), bool), f"{name} must be true or false")

    @property
    def evaluates(self) -> bool:
        """Whether these options define an eval set."""
        return bool(self.eval_data) or self.eval_split > 0


def field_help() -> dict[str, str]:
    """Field name -> its docstring, one line."""
    return field_docs(DataOptions)


def add_arguments(parser) -> None:
    """One `--FIELD` flag per DataOptions field (booleans get `--no-FIELD`), help from the docstrings."""
    add_flags(parser, DataOptions)


def from_args(namespace) -> DataOptions:
    """The options a parser with `add_arguments` read: the flags given, the defaults for the rest."""
    given = {
        f.name: getattr(namespace, f.name)
        for f in dataclasses.fields(DataOptions)
        if hasattr(namespace, f.name)
    }
    return DataOptions(**given)
