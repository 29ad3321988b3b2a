"""Where documents come from: parse `--data`, resolve files / globs / folders / hub names, read shards.

Every source is a list of shards read through Hugging Face `datasets` streaming (`load_dataset(...,
streaming=True)`): one shard per local file (json/jsonl, parquet, arrow, csv, txt), or the hub data set's own
shards (`IterableDataset.shard`). dstrain tracks its position itself as (shard, row) so that it can name the
file and row of a bad record and resume a shard with `IterableDataset.skip`, which skips whole Arrow tables.

`--data` grammar: comma-separated sources, each optionally weighted by a trailing `:NUMBER`
(`a.jsonl:0.7,b.parquet:0.3`). A source is an existing file, a glob, a folder, a built-in name
(`shakespeare`), or else a hub name `name[:config][@split]` (split defaults to `train`).

Folders: files are collected recursively; only the first family present among parquet, arrow, json/jsonl,
csv, txt is used, so a `save_to_disk` folder reads its `.arrow` files and not its metadata JSON.

A .json file may hold a list of records, JSON lines, or one (pretty-printed) JSON object, which is read as a
one-record data set. CSV columns are read as text (a column of numbers stays text, "NA" is not missing).
`datasets` stores a field whose type varies between records (OpenAI `content` that is a string here and a
list of parts there) as JSON text; `table_columns` decodes it back.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources

from dstrain.errors import DataError

from .options import DataOptions

log = logging.getLogger("dstrain.data")

BUILTIN = {"shakespeare": "tinyshakespeare.txt"}
BUILDERS = {
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".jsonl": "json",
    ".json": "json",
    ".ndjson": "json",
    ".csv": "csv",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
}
FAMILIES = (("parquet",), ("arrow",), ("json",), ("csv",), ("text",))
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".lz4")
HF_METADATA = {"dataset_info.json", "state.json", "dataset_dict.json"}
READ_BATCH = 256
_WEIGHT = re.compile(r"^(.*):([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)$")


@dataclass
class Source:
    spec: str
    weight: float
    files: list[tuple[str, str]] = field(default_factory=list)  # (path, datasets builder)
    hub: tuple[str, str | None, str] | None = None  # (name, config, split)
    n_shards: int = 0
    fmt: str = ""  # text | chat | instruction | preference, set by detection
    columns: list[str] = field(default_factory=list)

    def shard_name(self, shard: int) -> str:
        if self.hub is not None:
            name, config, split = self.hub
            return f"{name}{':' + config if config else ''}@{split} shard {shard}"
        return self.files[shard][0]

    def where(self, shard: int, row: int) -> str:
        return f"{self.shard_name(shard)} row {row + 1}"


def builder_for(path: str) -> str | None:
    name = path.lower()
    for ext in COMPRESSED:
        if name.endswith(ext):
            name = name[: -len(ext)]
    return BUILDERS.get(os.path.splitext(name)[1])


def split_spec(data: str) -> list[tuple[str, float]]:
    """`a.jsonl:0.7,b:0.3` -> [("a.jsonl", 0.7), ("b", 0.3)]; unweighted sources share equally."""
    out: list[tuple[str, float]] = []
    for raw in data.split(","):
        item = raw.strip()
        if not item:
            raise DataError(f"data: empty source in {data!r}")
        weight = 1.0
        m = _WEIGHT.match(item)
        if m and m.group(1) and not os.path.exists(item):
            item, weight = m.group(1), float(m.group(2))
            if weight <= 0:
                raise DataError(f"data: weight of {item!r} must be > 0 (got {weight})")
        out.append((item, weight))
    return out


def _folder_files(folder: str) -> list[str]:
    found: dict[str, list[str]] = {}
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            builder = builder_for(name)
            if builder and not name.startswith(".") and name not in HF_METADATA:
                found.setdefault(builder, []).append(os.path.join(root, name))
    for family in FAMILIES:
        files = [p for b in family for p in found.get(b, [])]
        if files:
            return sorted(files)
    return []


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or builder_for(spec) is not None


def resolve(spec: str, weight: float) -> Source:
    """Turn one source spec into a `Source` with its files or hub coordinates (no format detection yet)."""
    path = os.path.expanduser(spec)
    src = Source(spec=spec, weight=weight)
    if os.path.isfile(path):
        paths = [path]
    elif os.path.isdir(path):
        paths = _folder_files(path)
        if not paths:
            raise DataError(f"data: folder {spec} holds no data files ({', '.join(sorted(BUILDERS))})")
    elif any(c in spec for c in "*?["):
        paths = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not paths:
            raise DataError(f"data: no file matches {spec}")
    elif spec in BUILTIN:
        paths = [str(resources.files("dstrain.data").joinpath("builtin", BUILTIN[spec]))]
    elif _looks_like_path(spec):
        raise DataError(f"data: no such file or folder: {spec}")
    else:
        return _resolve_hub(src)
    for p in paths:
        builder = builder_for(p)
        if builder is None:
            raise DataError(f"data: unsupported file type {p} (use one of {', '.join(sorted(BUILDERS))})")
        src.files.append((p, builder))
    src.n_shards = len(src.files)
    return src


def _resolve_hub(src: Source) -> Source:
    name, _, split = src.spec.partition("@")
    name, _, config = name.partition(":")
    src.hub = (name, config or None, split or "train")
    try:
        ds = _load_hub(src)
    except DataError:
        raise
    except Exception as e:  # network, missing data set, bad config: all one message for the user
        raise DataError(
            f"data: cannot load {src.spec!r} (not a local path; as a hub data set: {_first_line(e)})"
        ) from e
    src.n_shards = max(1, ds.num_shards)
    return src


def _load_hub(src: Source):
    from datasets import load_dataset

    assert src.hub is not None
    name, config, split = src.hub
    return load_dataset(name, config, split=split, streaming=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


@contextmanager
def _no_download_count():
    """`load_dataset` pings the hub to count downloads of its packaged json/parquet/... builders (a HEAD
    request with a 3 s timeout, per call): pointless for local files, and a stall behind a firewall."""
    from datasets import config

    saved = config.HF_UPDATE_DOWNLOAD_COUNTS
    config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        config.HF_UPDATE_DOWNLOAD_COUNTS = saved


class ShardReadError(Exception):
    """A shard could not be read further (corrupt file, I/O error); carries the user-facing message."""


def _load_file(path: str, builder: str, opts: DataOptions):
    """An `IterableDataset` of the file, or a one-row Arrow table for a file that is one JSON object."""
    from datasets import load_dataset

    kwargs: dict = {}
    # "utf8" rather than "utf-8": the json builder only honours encoding_errors for a non-default encoding
    # name. Undecodable bytes become U+FFFD, and documents holding U+FFFD are skipped (or fail with --strict).
    if builder in ("json", "text", "csv"):
        kwargs.update(encoding="utf8", encoding_errors="replace")
    if builder == "text":
        kwargs["sample_by"] = opts.txt_split
    if builder == "csv":
        kwargs.update(keep_default_na=False, features=_csv_text_features(path))
    if builder == "json" and not path.lower().endswith(COMPRESSED):
        record = _json_object(path)
        if record is not None:
            return _one_row(record)
    with _no_download_count():
        return load_dataset(builder, data_files=[path], split="train", streaming=True, **kwargs)


def _json_object(path: str) -> dict | None:
    """The object of a .json file that holds one multi-line JSON object, else None (a list, JSON lines, or
    a one-line object, which `datasets` reads as it is). `datasets` reads a pretty-printed object through
    fallbacks that fail on fields of varying type or turn its list fields into rows."""
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        first = next((line for line in f if line.strip()), "")
        if not first.lstrip().startswith("{"):
            return None
        try:
            json.loads(first)
            return None
        except ValueError:
            pass
        f.seek(0)
        try:
            return json.loads(f.read())
        except ValueError as e:
            raise ShardReadError(
                f"cannot read {path}: neither JSON lines nor one JSON object ({e})"
            ) from None


def _one_row(record: dict):
    """A one-row table of `record`, each field as JSON text (decoded by `table_columns`): Arrow cannot hold
    every JSON object in typed columns (a list of strings and objects)."""
    import pyarrow as pa

    return pa.table(
        {k: pa.array([json.dumps(v, ensure_ascii=False)], type=pa.json_()) for k, v in record.items()}
    )


def _csv_text_features(path: str):
    """Every column of the CSV file as text: pandas would type each chunk on its own (a column of numbers
    becomes int). None when the header cannot be read (then `datasets` guesses)."""
    import csv

    import fsspec
    from datasets import Features, Value

    try:
        with fsspec.open(
            path, "rt", compression="infer", encoding="utf-8-sig", errors="replace", newline=""
        ) as f:
            header = next(csv.reader(f), None)
    except Exception:
        return None
    if not header or len(set(header)) != len(header):
        return None
    return Features({name: Value("string") for name in header})


@functools.lru_cache(maxsize=256)
def _has_json(t) -> bool:
    if getattr(t, "extension_name", None) == "arrow.json":
        return True
    if hasattr(t, "value_type"):  # list types
        return _has_json(t.value_type)
    return any(_has_json(t.field(i).type) for i in range(getattr(t, "num_fields", 0)))


def _decode_json(value, t):
    if value is None or not _has_json(t):
        return value
    if getattr(t, "extension_name", None) == "arrow.json":
        return _json_field(value)
    if isinstance(value, list):
        return [_decode_json(v, t.value_type) for v in value]
    return {k: _decode_json(v, t.field(k).type) for k, v in value.items()}


def _json_field(text: str):
    """A value of a field `datasets` stored as JSON text. It stores a text that parses as JSON to its own
    parser ("7", "1.", "007", "true") as written, unquoted (datasets/utils/json.py, json_encode_field), so a
    text comes back as itself: only a list, an object, a JSON string or null is read as JSON."""
    try:
        value = json.loads(text)
    except ValueError:  # "1.", "007": text its parser took for JSON, not Python's
        return text
    return value if value is None or isinstance(value, (list, dict, str)) else text


def table_columns(table, names: list[str]) -> dict[str, list]:
    """Python values of the named columns of an Arrow table (those it has), JSON-text fields decoded."""
    out = {}
    for name in names:
        if name in table.column_names:
            t = table.schema.field(name).type
            values = table.column(name).to_pylist()
            out[name] = [_decode_json(v, t) for v in values] if _has_json(t) else values
    return out


# A shard whose Arrow tables hold at most this many bytes is kept after its first whole read: a small data set
# (a few chats, a preference set) cycles through many epochs per packing round, and re-opening its reader each
# epoch cost ~1 ms per epoch (README's two-chat example: 7 s of a 2-step run).
SMALL_SHARD_BYTES = 4 << 20


def read_shard(
    src: Source, shard: int, start_row: int, opts: DataOptions, cache: dict | None = None
) -> Iterator:
    """Arrow tables of one shard, starting at `start_row`. Read errors surface as `ShardReadError`.
    `cache` keeps the opened `IterableDataset`s, so later epochs skip `load_dataset`'s set-up."""
    name = src.shard_name(shard)
    cache = {} if cache is None else cache
    if ("tables", shard) in cache:  # a small shard read whole once: later epochs from memory
        for table in cache[("tables", shard)]:
            if start_row < table.num_rows:
                yield table.slice(start_row)
            start_row = max(0, start_row - table.num_rows)
        return
    try:
        if shard in cache:
            ds = cache[shard]
        elif src.hub is not None:
            base = cache["hub"] = cache.get("hub") or _load_hub(src)
            ds = base.shard(num_shards=base.num_shards, index=shard) if base.num_shards > 1 else base
        else:
            if os.path.getsize(src.files[shard][0]) == 0:
                return
            ds = _load_file(*src.files[shard], opts)
        cache[shard] = ds
        if not hasattr(ds, "with_format"):  # a file that is one JSON object: a one-row Arrow table
            tables = iter([ds.slice(start_row)])
        else:
            ds = ds.skip(start_row) if start_row else ds
            tables = iter(ds.with_format("arrow").iter(batch_size=READ_BATCH))
    except ShardReadError:
        raise
    except FileNotFoundError as e:
        raise ShardReadError(f"cannot read {name}: file not found") from e
    except Exception as e:
        raise ShardReadError(f"cannot read {name}: {_first_line(e)}") from e
    kept: list | None = [] if start_row == 0 else None
    while True:
        try:
            table = next(tables)
        except StopIteration:
            if kept is not None:
                cache[("tables", shard)] = kept
            return
        except Exception as e:
            raise ShardReadError(f"cannot read {name}: {_first_line(e)}") from e
        if kept is not None:
            kept.append(table)
            if sum(t.nbytes for t in kept) > SMALL_SHARD_BYTES:
                kept = None
        yield table


def first_table(src: Source, opts: DataOptions):
    """The first non-empty table of the source (for format detection); DataError when there is none."""
    for shard in range(src.n_shards):
        try:
            for table in read_shard(src, shard, 0, opts):
                if table.num_rows:
                    return table
        except ShardReadError as e:
            if opts.strict or shard == src.n_shards - 1:
                raise DataError(f"data: {e}") from None
            log.warning("%s; trying the next file", e)
    what = f"{src.n_shards} file{'s' if src.n_shards != 1 else ''}" if src.hub is None else "hub data set"
    raise DataError(f"data: source {src.spec!r} is empty ({what}, no records)")


def check_local_sources(opts: DataOptions) -> None:
    """Every local source of --data and --eval_data exists and holds data files (DataError otherwise), checked
    before a run allocates anything; hub data sets are left to the run (asking the hub is slow and may fail
    for reasons that deserve their own message)."""
    for spec in filter(None, (opts.data, opts.eval_data)):
        for one, weight in split_spec(spec):
            path = os.path.expanduser(one)
            if (
                os.path.exists(path)
                or any(c in one for c in "*?[")
                or one in BUILTIN
                or _looks_like_path(one)
            ):
                resolve(one, weight)


def resolve_sources(opts: DataOptions, objective: str | None = None) -> list[Source]:
    """All sources of `opts.data` with their format detected; the formats must agree on pretrain vs SFT.
    `objective` (a run's --objective; None: the data tools, which read the data as it is): `dpo` refuses a
    source that is not preference pairs, `sft` reads preference pairs' chosen side only (format `chosen`)."""
    from .formats import detect_format, listing

    sources = [resolve(spec, weight) for spec, weight in split_spec(opts.data)]
    for src in sources:
        table = first_table(src, opts)
        src.columns = list(table.column_names)
        src.fmt = detect_format(opts.data_format, src.columns, opts.text_field, src.shard_name(0), opts)
        if objective == "dpo" and src.fmt != "preference":
            raise DataError(
                f"data: --objective dpo trains on preference pairs, but {src.spec} reads as {src.fmt} data "
                f"(columns {listing(src.columns)}): give pairs (`chosen` + `rejected`, or `messages` + "
                "`rejected_response`: docs/training.md, preference tuning) or drop --objective dpo"
            )
        if objective == "sft" and src.fmt == "preference":
            # SFT on the preferred completions, the first stage of DPO without an SFT model: never the rejected
            src.fmt = "chosen"
            _say_once(
                f"data: {src.spec} holds preference pairs and this run is SFT: it trains each pair's prompt "
                "and chosen completion, never the rejected one (--objective dpo trains on the pairs)"
            )
    kinds = {src.fmt if src.fmt in ("text", "preference") else "sft" for src in sources}  # chosen: SFT
    if len(kinds) > 1:
        listing = ", ".join(f"{s.spec}={s.fmt}" for s in sources)
        raise DataError(
            f"data: cannot mix pretraining text, chat/instruction and preference sources ({listing})"
        )
    return sources


_said: set[str] = set()


def _say_once(line: str) -> None:
    """A note on the data, once per process (the training and eval sets resolve the same sources)."""
    if line not in _said:
        _said.add(line)
        log.warning("%s", line)
