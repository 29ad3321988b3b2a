"""SFT data as users have it (LLaMA-Factory, axolotl, ms-swift, OpenAI): each shape trains on exactly the
assistant text + end-of-turn, or is a counted skip with a reason, or a one-line error naming the file.
Fixtures follow the real files' shapes, a few records each: LLaMA-Factory's data/glaive_toolcall_en_demo.json,
alpaca_en_demo.json, mllm_demo.json and dataset_info.json, ms-swift's agent format, OpenAI chat messages."""

import json
from collections import Counter

import pytest

from dstrain.batch import IGNORE_INDEX
from dstrain.data import DataError, DataOptions, bench, build_loader, load_tokenizer
from dstrain.data.bench import read_docs, run_stats
from dstrain.data.chat import ChatEncoder
from dstrain.data.formats import Skip
from dstrain.data.sources import resolve_sources
from tests.helpers.data_files import write_jsonl, write_parquet
from tests.helpers.tiny import byte_tokenizer

END = "<|im_end|>"
EOS = "<｜end▁of▁sentence｜>"
# ChatML that renders tools and tool calls (the shape of Qwen2.5's template, much reduced)
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{%- for c in m.get('tool_calls') or [] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {{ c['function']['arguments'] | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def tool_tok():
    return byte_tokenizer(chat_template=TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def deepseek():
    return load_tokenizer("deepseek-v3")


def one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value)
    return str(e.value)


def trained_runs(tok, enc) -> list[str]:
    """Decoded maximal runs of trained tokens."""
    runs, cur = [], []
    for i, label in zip(enc.ids.tolist(), enc.labels.tolist()):
        if label != IGNORE_INDEX:
            cur.append(i)
        elif cur:
            runs, cur = runs + [tok.decode(cur)], []
    return runs + [tok.decode(cur)] if cur else runs


def trained(path, tok, **kw) -> tuple[list[list[str]], Counter, list]:
    """Read `path` as training does (file -> records -> chats -> tokens): the trained runs of each sample,
    the skip counts, and the encoded samples."""
    opts = DataOptions(data=str(path), **kw)
    _, docs, skipped = read_docs(opts, None)
    encoded = ChatEncoder(tok, opts.sft_turns, opts.think).encode([d for d, _ in docs], keep_text=True)
    runs = []
    for enc in encoded:
        if isinstance(enc, Skip):
            skipped[enc.reason] += 1
        else:
            runs.append(trained_runs(tok, enc))
    return runs, skipped, [e for e in encoded if not isinstance(e, Skip)]


def write_json(path, obj, indent=2) -> str:
    path.write_text(json.dumps(obj, indent=indent, ensure_ascii=False))
    return str(path)


# 1. A .json file that holds one object ----------------------------------------------------------------


def test_json_file_holding_one_conversation_is_a_one_record_data_set(tmp_path, tok, monkeypatch):
    # pretty-printed, with content that is a string in one message and a list of parts in another
    # (`datasets` failed on this; a plain one hung `dstrain data stats`)
    openai = write_json(
        tmp_path / "one.json",
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": "Hello there."},
            ]
        },
    )
    sharegpt = write_json(
        tmp_path / "conv.json",
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hey."}]},
        indent=None,
    )
    assert trained(openai, tok)[:2] == ([["Hello there." + END]], Counter())
    assert trained(sharegpt, tok)[:2] == ([["Hey." + END]], Counter())
    # the training loader cycles it (it used to stop with "no usable sample in a whole epoch")
    loader = build_loader(DataOptions(data=openai, seq_len=64, num_workers=0), tok, 2)
    for _ in range(3):
        batch = next(loader)
        labels = batch["labels"][0][batch["labels"][0] != IGNORE_INDEX].tolist()
        assert tok.decode(labels) == "Hello there." + END
    monkeypatch.setattr(bench, "MIN_TIMED_TOKENS", 2000)
    assert run_stats(DataOptions(data=openai, seq_len=64, num_workers=0), tok, rounds=1)["documents"] == 1


def test_json_object_that_is_not_a_record_is_one_line_error(tmp_path, tok):
    # LLaMA-Factory's data/dataset_info.json: one object of data set descriptions
    info = write_json(
        tmp_path / "dataset_info.json", {f"set_{i:02}": {"file_name": f"{i}.json"} for i in range(20)}
    )
    with pytest.raises(DataError) as e:
        build_loader(DataOptions(data=info), tok, 1)
    assert one_line(e).startswith(f"data: cannot detect the format of {info}: columns ['set_00', ")
    assert "... (+8 more)]" in str(e.value)
    # pretty-printed objects one after the other: neither JSON lines nor one JSON object
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "text": "a"\n}\n{\n  "text": "b"\n}\n')
    with pytest.raises(DataError) as e:
        build_loader(DataOptions(data=str(bad)), tok, 1)
    assert one_line(e).startswith(
        f"data: cannot read {bad}: neither JSON lines nor one JSON object (Extra data"
    )


def test_stats_on_a_record_longer_than_seq_len_fails_instead_of_hanging(tmp_path, tok):
    # the hang: nothing was packed, so the timed runs repeated the data 200000 / 0 tokens times
    path = write_json(
        tmp_path / "long.json",
        {"messages": [{"role": "user", "content": "q" * 200}, {"role": "assistant", "content": "a"}]},
    )
    with pytest.raises(DataError) as e:
        run_stats(DataOptions(data=path, seq_len=32, num_workers=0), tok, rounds=1)
    assert (
        one_line(e)
        == f"data: no usable sample in a whole epoch of {path} (skipped: 1 dropped (longer than --seq_len 32))"
    )


# 2. OpenAI content parts ------------------------------------------------------------------------------


def test_openai_content_parts_are_joined_and_non_text_parts_skip_the_record(tmp_path, tok):
    rows = [
        {
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "color."}],
                },
                {
                    "role": "assistant",
                    "content": [{"type": "text", "text": "Red"}, {"type": "text", "text": "."}],
                },
            ]
        },
        {"messages": [{"role": "user", "content": "plain"}, {"role": "assistant", "content": "text"}]},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                    ],
                },
                {"role": "assistant", "content": "A cat."},
            ]
        },
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}}],
                },
                {"role": "assistant", "content": "Hi."},
            ]
        },  # fmt: skip
    ]
    path = write_jsonl(tmp_path / "parts.jsonl", rows)
    runs, skipped, encoded = trained(path, tok)
    assert runs == [["Red." + END], ["text" + END]]
    assert skipped == Counter(skipped_non_text=2)
    assert encoded[0].text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a color.<|im_end|>\n"
        "<|im_start|>assistant\nRed.<|im_end|>\n"
    )
    with pytest.raises(DataError) as e:
        read_docs(DataOptions(data=path, strict=True), None)
    assert one_line(e) == (
        "data: messages[0] has a content part of type 'image_url' (dstrain trains text-only models) "
        f"in {path} row 3"
    )


def test_openai_fine_tuning_weight_zero_is_not_trained(tmp_path, tok, deepseek):
    # OpenAI's fine-tuning format: `"weight": 0` excludes an assistant message; "developer" is the system role
    row = {
        "messages": [
            {"role": "developer", "content": "Be terse."},
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris, I think, or maybe Lyon.", "weight": 0},
            {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": "Paris.", "weight": 1},
        ]
    }
    path = write_jsonl(tmp_path / "ft.jsonl", [row])
    runs, _, encoded = trained(path, tok)
    assert runs == [["Paris." + END]] and encoded[0].text.startswith("<|im_start|>system\nBe terse.")
    _, docs, _ = read_docs(DataOptions(data=path), None)
    scanned = ChatEncoder(deepseek).encode([d for d, _ in docs])[0]  # DeepSeek: the special-token scan path
    assert trained_runs(deepseek, scanned) == ["Paris." + EOS]
    assert trained(path, tok, sft_turns="last")[0] == [["Paris." + END]]
    # axolotl's per-message `"train": false` means the same
    row["messages"][2] = {"role": "assistant", "content": "Paris, I think.", "train": False}
    axolotl = write_jsonl(tmp_path / "axolotl.jsonl", [row])
    assert trained(axolotl, tok)[0] == [["Paris." + END]]


def test_llamafactory_multimodal_records_are_counted_skips(tmp_path, tok):
    # LLaMA-Factory's mllm_demo.json: <image> placeholders and an "images" column
    rows = [
        {
            "messages": [
                {"content": "<image>Who are they?", "role": "user"},
                {"content": "They're Kane and Gretzka.", "role": "assistant"},
            ],
            "images": ["mllm_demo_data/1.jpg"],
        },
        {
            "messages": [{"content": "Who?", "role": "user"}, {"content": "Nobody.", "role": "assistant"}],
            "images": [],
        },
    ]
    path = write_json(tmp_path / "mllm_demo.json", rows)
    runs, skipped, _ = trained(path, tok)
    assert runs == [["Nobody." + END]] and skipped == Counter(skipped_non_text=1)


# 3. Tool use ------------------------------------------------------------------------------------------

GLAIVE = {  # LLaMA-Factory sharegpt with tools (data/glaive_toolcall_en_demo.json)
    "conversations": [
        {"from": "human", "value": "Area of a 5 by 3 rectangle?"},
        {
            "from": "function_call",
            "value": '{"name": "calculate_area", "arguments": {"shape": "rectangle", "dimensions": [5, 3]}}',
        },  # fmt: skip
        {"from": "observation", "value": '{"area": 15}'},
        {"from": "gpt", "value": "It is 15 square units."},
    ],
    "tools": '[{"name": "calculate_area", "description": "Area of a shape", "parameters": {"type": "object", "properties": {"shape": {"type": "string"}}, "required": ["shape"]}}]',  # fmt: skip
}
OPENAI_TOOLS = {  # OpenAI chat completions: arguments as JSON text, content null, tool results by id
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }  # fmt: skip
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
}
SWIFT = {  # ms-swift agent format: parallel calls as consecutive tool_call turns, tools as JSON text
    "tools": '[{"type": "function", "function": {"name": "aqi", "description": "Air quality", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]',  # fmt: skip
    "messages": [
        {"role": "user", "content": "Air in Beijing and Shanghai?"},
        {"role": "tool_call", "content": '{"name": "aqi", "arguments": {"city": "Beijing"}}'},
        {"role": "tool_call", "content": '{"name": "aqi", "arguments": {"city": "Shanghai"}}'},
        {"role": "tool_response", "content": '{"aqi": 10}'},
        {"role": "tool_response", "content": '{"aqi": 72}'},
        {"role": "assistant", "content": "Beijing 10, Shanghai 72."},
    ],
}


def test_tool_calls_are_trained_tool_results_are_not(tmp_path, tool_tok):
    glaive = write_json(tmp_path / "glaive_toolcall.json", [GLAIVE, {**GLAIVE, "tools": "[]"}])
    runs, skipped, encoded = trained(glaive, tool_tok)
    args = '{"shape": "rectangle", "dimensions": [5, 3]}'
    call = f'<tool_call>{{"name": "calculate_area", "arguments": {args}}}</tool_call>'
    assert runs == [[call + END, "It is 15 square units." + END]] * 2 and not skipped
    # the tool definitions reach the template (LLaMA-Factory's bare function, in OpenAI's form)
    assert encoded[0].text.startswith(
        '<|im_start|>system\n# Tools\n{"type": "function", "function": {"name": "calculate_area"'
    )
    assert '<|im_start|>tool\n{"area": 15}<|im_end|>' in encoded[0].text
    assert not encoded[1].text.startswith("<|im_start|>system")  # "[]": no tools
    # OpenAI's JSON-text arguments and ms-swift's parallel calls; --sft_turns last trains the final reply
    openai = write_jsonl(tmp_path / "openai.jsonl", [OPENAI_TOOLS, SWIFT])
    runs, skipped, _ = trained(openai, tool_tok)
    assert runs == [
        [
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' + END,
            "Sunny." + END,
        ],
        [
            '<tool_call>{"name": "aqi", "arguments": {"city": "Beijing"}}</tool_call>'
            '<tool_call>{"name": "aqi", "arguments": {"city": "Shanghai"}}</tool_call>' + END,
            "Beijing 10, Shanghai 72." + END,
        ],
    ]
    assert trained(openai, tool_tok, sft_turns="last")[0] == [
        ["Sunny." + END],
        ["Beijing 10, Shanghai 72." + END],
    ]


def test_deepseek_template_renders_tool_calls_but_not_tool_definitions(tmp_path, deepseek):
    # a second round of calls: the template (its namespace flags are never reset) renders it without
    # `<｜Assistant｜><｜tool▁calls▁begin｜>`, unlike what the model sees when it generates: skipped
    second_round = {"messages": OPENAI_TOOLS["messages"] + OPENAI_TOOLS["messages"]}
    path = write_jsonl(
        tmp_path / "tools.jsonl", [OPENAI_TOOLS, {**OPENAI_TOOLS, "tools": GLAIVE["tools"]}, second_round]
    )
    runs, skipped, encoded = trained(path, deepseek)
    # DeepSeek's template concatenates the arguments: they go in as JSON text, exactly as written
    assert runs == [
        [
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
            '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>' + EOS,
            "Sunny." + EOS,
        ]
    ]
    assert "<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>" in encoded[0].text
    assert skipped == Counter(
        skipped_tools=1, skipped_template=1
    )  # tool definitions: this template drops them


def test_template_without_tool_support_skips_tool_chats_with_a_count(tmp_path, tok):
    plain = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}
    path = write_jsonl(tmp_path / "mixed.jsonl", [OPENAI_TOOLS, plain, {**GLAIVE, "tools": ""}])
    runs, skipped, _ = trained(path, tok)  # tests' CHATML_TEMPLATE prints content only
    assert runs == [["Hello." + END]] and skipped == Counter(skipped_tools=2)
    bad_call = {
        "conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "calc(1)"}]
    }
    bad = write_jsonl(tmp_path / "bad.jsonl", [bad_call, plain])
    assert trained(bad, tok)[:2] == ([["Hello." + END]], Counter(skipped_bad_tool_call=1))


# 4. Alpaca with system and history ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "sft_turns, expected", [("all", ["2" + END, "4" + END, "6" + END]), ("last", ["6" + END])]
)
def test_alpaca_history_is_earlier_turns(tmp_path, tok, sft_turns, expected):
    row = {
        "instruction": "And 3+3?",
        "input": "",
        "output": "6",
        "system": "Be terse.",
        "history": [["1+1?", "2"], ["2+2?", "4"]],
    }
    path = write_json(tmp_path / "alpaca.json", [row, {"instruction": "Hi", "input": "", "output": "Yo"}])
    runs, skipped, encoded = trained(path, tok, sft_turns=sft_turns)
    assert runs == [expected, ["Yo" + END]] and not skipped
    assert encoded[0].text == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n"
        "<|im_start|>assistant\n2<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n6<|im_end|>\n"
    )


# 5. Small files with nothing usable --------------------------------------------------------------------


def test_small_file_with_nothing_usable_names_file_and_reasons(tmp_path, tok):
    rows = [
        {"messages": [{"role": "user", "content": "anyone?"}]},
        {"messages": [{"role": "user", "content": "q" * 100}, {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": "r" * 100}, {"role": "assistant", "content": "b"}]},
    ]
    path = write_jsonl(tmp_path / "x.jsonl", rows)
    loader = build_loader(DataOptions(data=path, seq_len=64, num_workers=0), tok, 1)
    with pytest.raises(DataError) as e:
        next(loader)
    assert one_line(e) == (
        f"data: no usable sample in a whole epoch of {path} "
        "(skipped: 1 skipped_no_assistant, 2 dropped (longer than --seq_len 64))"
    )
    with pytest.raises(DataError) as e:
        run_stats(DataOptions(data=path, seq_len=64, num_workers=0), tok, rounds=1)
    assert one_line(e).endswith("(skipped: 1 skipped_no_assistant, 2 dropped (longer than --seq_len 64))")
    # every record skipped while reading: the reader names the reason
    none = write_jsonl(tmp_path / "n.jsonl", rows[:1] * 2)
    with pytest.raises(DataError) as e:
        next(build_loader(DataOptions(data=none, num_workers=0), tok, 1))
    assert one_line(e) == (
        f"data: every record of source {none} was skipped in a whole epoch (skipped: 2 skipped_no_assistant)"
    )


def test_one_record_file_trains(tmp_path, tok):
    path = write_jsonl(tmp_path / "one.jsonl", [{"instruction": "Hi", "input": "", "output": "Yo"}])
    loader = build_loader(DataOptions(data=path, seq_len=32, pack_buffer=4, num_workers=0), tok, 2)
    for _ in range(5):
        labels = next(loader)["labels"]
        assert [tok.decode(r[r != IGNORE_INDEX].tolist()) for r in labels] == ["Yo" + END] * 2


# 6. Plain text corpora ---------------------------------------------------------------------------------


def test_text_corpora_as_jsonl_parquet_and_csv(tmp_path, tok):
    texts = ["hello, world", "multi\nline", "NA", "123", "null"]
    write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    write_parquet(tmp_path / "t.parquet", [{"text": t} for t in texts])
    # CSV (with a byte order mark): every column is text (pandas would make "123" an int and "NA" / "null"
    # missing); an empty cell is an empty document (skipped with a count)
    (tmp_path / "t.csv").write_text(
        '\ufeffid,text\n1,"hello, world"\n2,"multi\nline"\n3,NA\n4,123\n5,null\n6,\n'
    )
    for name in ("t.jsonl", "t.parquet", "t.csv"):
        opts = DataOptions(data=str(tmp_path / name))
        [src] = resolve_sources(opts)
        _, docs, skipped = read_docs(opts, None)
        assert src.fmt == "text" and [d for d, _ in docs] == texts, name
        assert skipped == (Counter(skipped_empty=1) if name == "t.csv" else Counter()), name
    (tmp_path / "i.csv").write_text("instruction,input,output\nAdd,1 2,3\n")
    assert trained(tmp_path / "i.csv", tok)[0] == [["3" + END]]
