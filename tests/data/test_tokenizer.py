"""The model folder's tokenizer, and generation_config.json's EOS where it differs from the tokenizer's."""

import json
import logging

import pytest

from dstrain.data import DataError, load_tokenizer
from dstrain.data.tokenizer import PretrainEncoder
from tests.helpers.ranks import run_python
from tests.helpers.tiny import byte_tokenizer


def test_generation_config_eos_ends_documents(tmp_path, caplog):
    folder = tmp_path / "model"
    byte_tokenizer().save_pretrained(folder)
    plain = load_tokenizer(None, model_path=str(folder))
    assert plain.eos_token == "</s>"
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [260, 7]}))  # <|im_end|> first
    with caplog.at_level(logging.WARNING, logger="dstrain.data"):
        tok = load_tokenizer(None, model_path=str(folder))
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 260
    assert "generation_config.json's eos_token_id" in caplog.text
    assert PretrainEncoder(tok).encode(["ab"])[0].tolist()[-1] == 260
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 260]}))
    assert load_tokenizer(None, model_path=str(folder)).eos_token == "</s>"  # the tokenizer's is one of them
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 99999}))
    with pytest.raises(DataError, match="eos_token_id=99999 is not a token"):
        load_tokenizer(None, model_path=str(folder))


def test_special_token_strings_in_a_document_stay_text_and_the_tokenizer_is_left_as_it_was():
    """The encoder reads special-token strings as text for its own call only, on the tokenizer's own Rust
    tokenizer (no copy: copying a 128K vocabulary took 0.6 s per tokenizer and process)."""
    tok = load_tokenizer(None)
    encoder = PretrainEncoder(tok)
    assert encoder.backend is tok.backend_tokenizer
    ids = encoder.encode([f"a{tok.eos_token}b"])[0].tolist()
    assert ids.count(tok.eos_token_id) == 1 and ids[-1] == tok.eos_token_id  # only the document's end
    assert not tok.backend_tokenizer.encode_special_tokens
    assert tok(tok.eos_token, add_special_tokens=False)["input_ids"] == [tok.eos_token_id]
    bos = PretrainEncoder(tok, add_bos=True).encode([tok.bos_token])[0].tolist()
    assert bos[0] == tok.bos_token_id and bos.count(tok.bos_token_id) == 1


def test_the_bundled_tokenizer_loads_without_transformers_model_registry():
    """A run on the bundled tokenizer imports no `transformers.models` (AutoTokenizer's import scans every model
    transformers ships: ~0.6 s of every `dstrain train` process); a folder's tokenizer still goes through it."""
    code = (
        "import sys\n"
        "from dstrain.data.tokenizer import load_tokenizer\n"
        "assert load_tokenizer(None).is_fast\n"
        "assert 'transformers.models' not in sys.modules, 'imported'\n"
    )
    run = run_python(code)
    assert run.returncode == 0, run.stderr[-3000:]
