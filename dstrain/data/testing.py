"""Offline helpers for tests (dstrain's own and the trainer's): a tiny byte-level tokenizer built in memory
and writers for small data files. Nothing here touches the network."""

from __future__ import annotations

import json
import os

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# a template that rewrites contents (trims them): forces dstrain's render-and-search path
TRIMMING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}### {{ m['role'] }}: {{ m['content'] | trim }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
)
SPECIALS = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]


def byte_tokenizer(
    eos: bool = True, pad: bool = True, bos: bool = True, chat_template: str | None = CHATML_TEMPLATE
):
    """One token per UTF-8 byte (ids 0-255) plus special tokens <s> </s> <pad> <|im_start|> <|im_end|>
    (ids 256-260), as a `PreTrainedTokenizerFast`. Fast to build, deterministic, with exact offsets."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>" if bos else None,
        eos_token="</s>" if eos else None,
        pad_token="<pad>" if pad else None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    if chat_template:
        tok.chat_template = chat_template
    return tok


def write_jsonl(path: str | os.PathLike, rows: list[dict]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def write_parquet(path: str | os.PathLike, rows: list[dict], row_group_size: int = 64) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path), row_group_size=row_group_size)
    return str(path)


def text_rows(n: int, prefix: str = "doc", words: int = 12) -> list[dict]:
    """`n` documents of varying length whose text starts with a unique id `{prefix}{i}:`."""
    return [
        {"text": f"{prefix}{i}: " + " ".join(f"w{(i * 7 + k) % 50}" for k in range(words + i % 9))}
        for i in range(n)
    ]


def chat_rows(n: int, turns: int = 2, style: str = "openai") -> list[dict]:
    """`n` chats with `turns` user/assistant exchanges; assistant replies are `answer {i}.{t}`."""
    rows = []
    for i in range(n):
        msgs = []
        for t in range(turns):
            msgs.append(("user", f"question {i}.{t}" + " pad" * (i % 5)))
            msgs.append(("assistant", f"answer {i}.{t}" + " more" * (i % 7)))
        if style == "openai":
            rows.append({"messages": [{"role": r, "content": c} for r, c in msgs]})
        else:
            rows.append(
                {"conversations": [{"from": "human" if r == "user" else "gpt", "value": c} for r, c in msgs]}
            )
    return rows


def varied_chats(n: int) -> list[dict]:
    """`n` one-turn chats whose replies run 0..60 words: the spread of sample lengths real chat data has."""
    return [
        {
            "messages": [
                {"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": "ab " * ((i * 37) % 61)},
            ]
        }
        for i in range(n)
    ]
