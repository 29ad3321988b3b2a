"""Writers of small data files and rows of each format, for the data tests (offline)."""

from __future__ import annotations

import json
import os


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
