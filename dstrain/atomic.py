"""Files that are either whole or absent: readers never see a half-written one (a crash leaves the old file
or none)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_atomic(path: str | os.PathLike, text: str | bytes) -> None:
    """Write `text` (or bytes) to a temporary sibling, flush it to disk, then rename it over `path`."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: str | os.PathLike, obj: Any, **dumps: Any) -> None:
    write_atomic(path, json.dumps(obj, **dumps) + "\n")
