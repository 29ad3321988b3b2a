"""Preference data as users have it (issue 60): the objective decides how pairs are read (DPO: pairs or a
one-line refusal; SFT: the chosen side only), every text is checked like a chat's, prompts and completions
mixed text / message lists, empty completions skipped, the layouts of LLaMA-Factory (its dpo_en_demo.json),
ms-swift (messages + rejected_response) and UltraFeedback binarized, and what a run drops said per source."""

import json
import logging

import pytest

from dstrain.batch import IGNORE_INDEX
from dstrain.cli import main as dstrain_main
from dstrain.data import DataError, DataOptions, build_eval_rows, build_loader, epoch_rows
from dstrain.data.bench import read_docs
from dstrain.data.formats import Skip, normalize_pair
from dstrain.data.sources import resolve_sources
from tests.helpers.data_files import chat_rows, write_jsonl
from tests.helpers.tiny import byte_tokenizer

END = "<|im_end|>"
USER, REPLY = "<|im_start|>user\n", "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def where() -> str:
    return "row 1"


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def trained(batch: dict, tok) -> list[str]:  # noqa: ANN001
    """The text of each run of consecutive targets in a batch."""
    out = []
    for ids, labels in zip(batch["input_ids"].tolist(), batch["labels"].tolist()):
        run: list[int] = []
        for i, lab in zip(ids + [0], labels + [IGNORE_INDEX]):
            if lab != IGNORE_INDEX:
                run.append(i)
            elif run:
                out.append(tok.decode(run))
                run = []
    return out


def one_pass(path: str, tok, objective: str | None) -> dict:  # noqa: ANN001
    """The first row of the loader: every sample of these small files (one stream, no shuffle, one process)."""
    opts = DataOptions(data=path, seq_len=512, shuffle=False, num_workers=0, data_streams=1)
    loader = build_loader(opts, tok, 1, objective=objective)
    batch = next(loader)
    loader.close()
    return batch


# ------------------------------------------------------------------ 60.1 / 60.2: the objective reads the data


def test_dpo_on_data_without_pairs_is_one_line_naming_the_option_and_source(tmp_path, tok, capsys):
    chats = write_jsonl(tmp_path / "chats.jsonl", chat_rows(5))  # `messages` only: no pair in it
    start = f"data: --objective dpo trains on preference pairs, but {chats} reads as chat data (columns ['messages'])"
    for call in (
        lambda: build_loader(DataOptions(data=chats), tok, 1, objective="dpo"),
        lambda: build_eval_rows(DataOptions(data="shakespeare", eval_data=chats), tok, objective="dpo"),
        lambda: epoch_rows(DataOptions(data=chats), tok, objective="dpo"),
    ):
        with pytest.raises(DataError) as e:
            call()
        assert "\n" not in str(e.value) and str(e.value).startswith(start)
    with pytest.raises(DataError, match="but shakespeare reads as text data"):
        build_loader(DataOptions(), tok, 1, objective="dpo")
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(str(tok_dir))
    argv = ["data", "audit", "--data", chats, "--tokenizer", str(tok_dir), "--objective", "dpo"]
    assert dstrain_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dstrain: error: {start}") and err.count("\n") == 1


def test_sft_on_pairs_trains_the_chosen_completions_only_and_says_so(tmp_path, tok, caplog):
    rows = [
        {"prompt": f"Question {i}?", "chosen": f"good answer {i}", "rejected": f"bad {i}"} for i in range(4)
    ]
    path = write_jsonl(tmp_path / "prefs.jsonl", rows)
    with caplog.at_level(logging.WARNING, logger="dstrain.data"):
        batch = one_pass(path, tok, "sft")
    assert sorted(trained(batch, tok)) == [f"good answer {i}{END}" for i in range(4)]
    assert int((batch["labels"] != IGNORE_INDEX).sum()) == sum(len(r["chosen"]) + 1 for r in rows)
    text = tok.decode(batch["input_ids"][0].tolist())
    assert "bad " not in text and f"{USER}Question 0?{END}" in text  # the prompt is context
    said = [r.getMessage() for r in caplog.records if "holds preference pairs" in r.getMessage()]
    assert len(said) == 1 and "never the rejected one" in said[0] and "--objective dpo" in said[0]
    # DPO reads the same file as pairs: both completions are targets, in their own documents
    assert sorted(trained(one_pass(path, tok, "dpo"), tok)) == sorted(
        [f"good answer {i}{END}" for i in range(4)] + [f"bad {i}{END}" for i in range(4)]
    )


# ------------------------------------------------------------------ 60.4 / 60.5: texts and mixed forms


def test_undecodable_bytes_in_text_pairs_are_a_counted_skip_or_a_strict_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"prompt": "Say hi", "chosen": "hi", "rejected": "no"}).encode()
    path.write_bytes(b'{"prompt": "Say \xff hi", "chosen": "hi", "rejected": "no"}\n' + good + b"\n")
    _, docs, skipped = read_docs(DataOptions(data=str(path)), None)
    assert [d["prompt"] for d, _ in docs] == [[msg("user", "Say hi")]] and skipped["skipped_undecodable"] == 1
    with pytest.raises(DataError, match=r"^data: undecodable bytes \(U\+FFFD\) in .*bad.jsonl row 1"):
        read_docs(DataOptions(data=str(path), strict=True), None)


def test_text_prompt_with_message_completions_and_the_reverse_keep_their_prompt(tmp_path, tok):
    rows = [
        {"prompt": "Say hi", "chosen": [msg("assistant", "hi")], "rejected": [msg("assistant", "no")]},
        {"prompt": [msg("user", "Say hi")], "chosen": "hi", "rejected": "no"},
    ]
    want = {
        "prompt": [msg("user", "Say hi")],
        "chosen": [msg("assistant", "hi")],
        "rejected": [msg("assistant", "no")],
    }
    assert [normalize_pair(r, where) for r in rows] == [want, want]
    batch = one_pass(write_jsonl(tmp_path / "mixed.jsonl", rows), tok, "dpo")
    text = tok.decode(batch["input_ids"][0].tolist())
    assert text.count(f"{USER}Say hi{END}\n{REPLY}") == 4  # both sides of both pairs have the prompt


TURNS = [msg("user", "Say hi"), msg("assistant", "Hello!"), msg("user", "Again")]  # a conversation's prompt


@pytest.mark.parametrize(
    "chosen, rejected",
    [
        ("", "no"),
        ("  ", "no"),
        ([], "no"),
        ([msg("assistant", "")], "no"),
        ([*TURNS, msg("assistant", "")], [*TURNS, msg("assistant", "no")]),  # its earlier reply is context
    ],
)
def test_empty_completions_are_skipped_and_counted_alike(chosen, rejected):
    with pytest.raises(Skip) as e:
        normalize_pair({"prompt": "Say hi", "chosen": chosen, "rejected": rejected}, where)
    assert (e.value.reason, str(e.value)) == ("skipped_empty", "empty 'chosen' completion")


# ------------------------------------------------------------------ 60.6: the ecosystem's layouts

LLAMA_FACTORY = [  # LLaMA-Factory's data/dpo_en_demo.json: ShareGPT prompt, single-message completions
    {
        "conversations": [{"from": "human", "value": "Name a prime number."}],
        "chosen": {"from": "gpt", "value": "7 is prime."},
        "rejected": {"from": "gpt", "value": "8 is prime."},
    },
    {
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!"},
            {"from": "human", "value": "Capital of France?"},
        ],
        "chosen": {"from": "gpt", "value": "Paris."},
        "rejected": {"from": "gpt", "value": "Lyon."},
    },
]
MS_SWIFT = [  # ms-swift's RLHF format: the chat ends with the chosen reply
    {
        "messages": [
            msg("system", "You are a useful and harmless assistant"),
            msg("user", "Tell me tomorrow's weather"),
            msg("assistant", "Tomorrow's weather will be sunny"),
        ],
        "rejected_response": "I don't know",
    }
]
ULTRAFEEDBACK = [  # HuggingFaceH4/ultrafeedback_binarized's columns
    {
        "prompt": "Name a prime number.",
        "prompt_id": "a1b2",
        "chosen": [msg("user", "Name a prime number."), msg("assistant", "7 is prime.")],
        "rejected": [msg("user", "Name a prime number."), msg("assistant", "8 is prime.")],
        "messages": [msg("user", "Name a prime number."), msg("assistant", "7 is prime.")],
        "score_chosen": 8.5,
        "score_rejected": 3.0,
    }
]
SYSTEM = "<|im_start|>system\nYou are a useful and harmless assistant" + END


@pytest.mark.parametrize(
    "rows, suffix, prompts, completions",
    [
        (
            LLAMA_FACTORY,
            ".json",
            [
                f"{USER}Name a prime number.{END}",
                f"{USER}Hi{END}\n{REPLY}Hello!{END}\n{USER}Capital of France?{END}",
            ],
            [("7 is prime.", "8 is prime."), ("Paris.", "Lyon.")],
        ),
        (
            MS_SWIFT,
            ".jsonl",
            [f"{SYSTEM}\n{USER}Tell me tomorrow's weather{END}"],
            [("Tomorrow's weather will be sunny", "I don't know")],
        ),
        (ULTRAFEEDBACK, ".jsonl", [f"{USER}Name a prime number.{END}"], [("7 is prime.", "8 is prime.")]),
        (
            [{"instruction": "Name a prime number.", "input": "Below 10.", "chosen": "7", "rejected": "8"}],
            ".jsonl",  # LLaMA-Factory's Alpaca form of pairs
            [f"{USER}Name a prime number.\n\nBelow 10.{END}"],
            [("7", "8")],
        ),
    ],
    ids=["llama_factory", "ms_swift", "ultrafeedback", "llama_factory_alpaca"],
)
def test_preference_layouts_of_the_ecosystem_read_as_pairs(tmp_path, tok, rows, suffix, prompts, completions):
    path = tmp_path / f"prefs{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(rows, indent=2))
    else:
        write_jsonl(path, rows)
    (src,) = resolve_sources(DataOptions(data=str(path)), "dpo")
    assert src.fmt == "preference"
    batch = one_pass(str(path), tok, "dpo")
    docs = tok.decode(batch["input_ids"][0].tolist())
    for prompt, (chosen, rejected) in zip(prompts, completions):
        assert f"{prompt}\n{REPLY}{chosen}{END}\n" in docs and f"{prompt}\n{REPLY}{rejected}{END}\n" in docs
    # only the completions train: the prompt's own replies (LLaMA-Factory's "Hello!") are context
    assert sorted(trained(batch, tok)) == sorted(f"{t}{END}" for pair in completions for t in pair)


def test_a_layout_recognised_without_what_it_needs_is_a_one_line_skip(tmp_path):
    lacks_prompt = {"chosen": {"from": "gpt", "value": "7"}, "rejected": {"from": "gpt", "value": "8"}}
    with pytest.raises(
        Skip, match=r"^LLaMA-Factory's layout .* missing field 'conversations' or 'messages'$"
    ):
        normalize_pair(lacks_prompt, where)
    swift = {"messages": [msg("user", "Weather?")], "rejected_response": "I don't know"}
    with pytest.raises(
        Skip, match=r"^ms-swift's layout \(messages \+ rejected_response\) but 'messages' does not"
    ):
        normalize_pair(swift, where)
    path = write_jsonl(tmp_path / "swift.jsonl", [swift])
    with pytest.raises(DataError, match="every record .* was skipped .* 1 skipped_no_assistant"):
        read_docs(DataOptions(data=path), None)
    # recognised by the columns: the whole source is refused in one line
    old_swift = write_jsonl(
        tmp_path / "q.jsonl", [{"query": "Weather?", "response": "Sunny.", "rejected_response": "?"}]
    )
    with pytest.raises(DataError) as e:
        resolve_sources(DataOptions(data=old_swift), "dpo")
    assert str(e.value) == (
        f"data: {old_swift}: ms-swift's preference layout (rejected_response) without its chat: missing field "
        "'messages' (columns ['query', 'rejected_response', 'response'])"
    )
    one_side = write_jsonl(tmp_path / "c.jsonl", [{"prompt": "Say hi", "chosen": "hi"}])
    with pytest.raises(
        DataError, match=r"\('chosen' beside 'prompt'\) without the other side: missing field 'rejected'"
    ):
        resolve_sources(DataOptions(data=one_side, data_format="preference"))


# ------------------------------------------------------------------ 60.8: what a run drops, said per source


def test_a_run_says_each_drop_and_each_sources_first_pass_counts(tmp_path, tok, caplog):
    pairs = [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(6)]
    long = {"prompt": "long " * 40, "chosen": "x", "rejected": "y"}
    side = len(tok.encode(f"{USER}{'long ' * 40}{END}\n{REPLY}x{END}\n", add_special_tokens=False))
    a = write_jsonl(tmp_path / "a.jsonl", [*pairs, long, {"prompt": "q", "chosen": "", "rejected": "n"}])
    b = write_jsonl(tmp_path / "b.jsonl", [*pairs, {"prompt": "q", "rejected": "n"}])
    loader = build_loader(DataOptions(data=f"{a},{b}", seq_len=128, num_workers=0), tok, 2, objective="dpo")
    with caplog.at_level(logging.WARNING, logger="dstrain.data"):
        for _ in range(8):
            next(loader)
    loader.close()
    lines = [r.getMessage() for r in caplog.records]
    (dropping,) = [x for x in lines if x.startswith("data: dropping: ")]  # the first one, once
    assert dropping.startswith(
        f"data: dropping: a pair of {2 * side} tokens, longer than --seq_len 128 in {a} row 7"
    )
    assert "--overlong truncate keeps them" in dropping
    assert any(x.startswith(f"data: skipping: missing field 'chosen' in {b} row 7") for x in lines)
    assert sorted(x for x in lines if x.startswith("data: first pass over ")) == [
        f"data: first pass over {a}: 8 records -> 6 samples; skipped: 1 skipped_empty, "
        "1 dropped (longer than --seq_len 128)",
        f"data: first pass over {b}: 7 records -> 6 samples; skipped: 1 skipped_missing_field",
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dstrain.data"):  # --epochs' count: the whole pass, first
        epoch_rows(DataOptions(data=a, seq_len=128), tok, objective="dpo")
    assert [r.getMessage() for r in caplog.records if "first pass" in r.getMessage()] == [
        f"data: first pass over {a}: 8 records -> 6 samples; skipped: 1 skipped_empty, "
        "1 dropped (longer than --seq_len 128)"
    ]
