"""Tests for target_server/data.py: sources, chat-template loss masks, dataset split."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from target_server.data import (
    DataError,
    Sample,
    build_dataset,
    chunk_text,
    conversation_hash,
    load_conversations,
    tokenize_conversation,
)
from common.model_loader import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    # The real SmolLM2 tokenizer and chat template, read from the packaged GGUF.
    return load_tokenizer("smollm2")


def masked_text(tokenizer, ids, mask) -> str:
    return tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)


def write_jsonl(path, lines) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------- sources


def test_pydoc_source_gives_hundreds_of_chat_conversations():
    conversations = load_conversations("pydoc", seed=0)
    assert len(conversations) >= 300
    for messages in conversations:
        assert [m["role"] for m in messages] == ["user", "assistant"]
        assert messages[0]["content"].startswith("Explain the Python topic '")
        assert 0 < len(messages[1]["content"]) <= 1200
    # Deterministic for a seed; the seed only changes the order.
    assert load_conversations("pydoc", seed=0) == conversations
    other = load_conversations("pydoc", seed=1)
    assert other != conversations
    assert sorted(map(json.dumps, other)) == sorted(map(json.dumps, conversations))


def test_chunk_text_respects_limits_and_keeps_the_text():
    text = "\n\n".join(f"paragraph {i} " + "word " * (i * 7) for i in range(40)) + "\n\n" + "x" * 2500
    chunks = chunk_text(text, max_chunk_chars=500, min_chunk_chars=100)
    assert all(0 < len(c) <= 750 for c in chunks)
    assert "".join(chunks).replace("\n", "").replace(" ", "") == text.replace("\n", "").replace(" ", "")


def test_jsonl_source_loads_messages(tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", [
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}),
        "",
        json.dumps({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                                 {"role": "assistant", "content": "4"}], "extra": 1}),
    ])
    conversations = load_conversations(path, seed=0)
    assert len(conversations) == 2
    assert conversations[1] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                                {"role": "assistant", "content": "4"}]


@pytest.mark.parametrize("bad_line, expected", [
    ("{not json", "invalid JSON"),
    (json.dumps({"msgs": []}), '"messages"'),
    (json.dumps({"messages": []}), "non-empty list"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "messages[0].role"),
    (json.dumps({"messages": [{"role": "user", "content": 3}]}), "messages[0].content"),
    (json.dumps({"messages": ["hello"]}), "messages[0] must be an object"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, bad_line, expected):
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, bad_line])
    with pytest.raises(DataError) as info:
        load_conversations(path, seed=0)
    assert f"bad.jsonl:3:" in str(info.value)
    assert expected in str(info.value)


def test_missing_jsonl_says_what_to_pass(tmp_path):
    with pytest.raises(DataError, match="no such file.*'pydoc'"):
        load_conversations(str(tmp_path / "nope.jsonl"), seed=0)


# ---------------------------------------------------------------- loss mask


def test_loss_mask_covers_exactly_assistant_content_and_end_token(tokenizer):
    messages = [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "What does len() return?"},
        {"role": "assistant", "content": "The number of items in a container."},
        {"role": "user", "content": "And for a str?"},
        {"role": "assistant", "content": "The number of characters, e.g. len('abc') == 3."},
    ]
    ids, mask = tokenize_conversation(tokenizer, messages, max_seq_len=4096)
    assert len(ids) == len(mask)
    # Same token ids as the tokenizer's own chat-template tokenization.
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert set(mask) == {0, 1}
    # Masked runs are exactly "<content><|im_end|>" of each assistant turn.
    runs, current = [], []
    for t, m in zip(ids, mask):
        if m:
            current.append(t)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    assert [tokenizer.decode(r) for r in runs] == [
        "The number of items in a container.<|im_end|>",
        "The number of characters, e.g. len('abc') == 3.<|im_end|>",
    ]
    # Nothing of the system/user text or the headers is in the loss.
    unmasked = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert "What does len() return?" in unmasked and "You answer in one line." in unmasked
    assert unmasked.count("<|im_start|>assistant\n") == 2


def test_loss_mask_with_default_system_prompt_and_truncation(tokenizer):
    # SmolLM2's template inserts its own system prompt when there is none.
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there, friend!"}]
    ids, mask = tokenize_conversation(tokenizer, messages, max_seq_len=4096)
    assert masked_text(tokenizer, ids, mask) == "Hi there, friend!<|im_end|>"
    first = mask.index(1)
    short_ids, short_mask = tokenize_conversation(tokenizer, messages, max_seq_len=first + 2)
    assert short_ids == ids[: first + 2] and short_mask == mask[: first + 2]
    none_ids, none_mask = tokenize_conversation(tokenizer, messages, max_seq_len=first)
    assert len(none_ids) == first and not any(none_mask)


# Guards against templates that render a past assistant turn differently once
# later turns exist (Qwen3 drops the reasoning block of earlier turns): the
# prefix renderings are then not prefixes of the full text.
QWEN3_LIKE_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' and loop.last %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_loss_mask_when_template_rewrites_past_turns(tokenizer):
    messages = [
        {"role": "user", "content": "First question?"},
        {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": "Second question?"},
        {"role": "assistant", "content": "Second answer."},
    ]
    original = tokenizer.chat_template
    tokenizer.chat_template = QWEN3_LIKE_TEMPLATE
    try:
        ids, mask = tokenize_conversation(tokenizer, messages, max_seq_len=4096)
    finally:
        tokenizer.chat_template = original
    masked = masked_text(tokenizer, ids, mask)
    assert masked == "First answer.<|im_end|><think>\n\n</think>\n\nSecond answer.<|im_end|>"
    assert "question" not in masked


def test_conversation_without_assistant_has_empty_mask(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, [{"role": "user", "content": "hello?"}], max_seq_len=64)
    assert ids and not any(mask)


# ---------------------------------------------------------------- dataset


def test_pydoc_dataset_split_is_deterministic_and_disjoint(tokenizer):
    ds = build_dataset(tokenizer, "pydoc", max_seq_len=128, seed=0, heldout_fraction=0.05)
    again = build_dataset(tokenizer, "pydoc", max_seq_len=128, seed=0, heldout_fraction=0.05)
    assert len(ds.train) >= 300 and len(ds.heldout) >= 5
    assert [s.sample_id for s in ds.train] == list(range(len(ds.train)))
    assert [s.sample_id for s in ds.heldout] == list(range(len(ds.heldout)))
    for a, b in zip(ds.train, again.train):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    assert len(again.heldout) == len(ds.heldout)
    train_texts = {tuple(s.input_ids.tolist()) for s in ds.train}
    assert not any(tuple(s.input_ids.tolist()) in train_texts for s in ds.heldout)
    for s in ds.train[:50]:
        assert isinstance(s, Sample)
        assert s.input_ids.dtype == torch.int32 and s.loss_mask.dtype == torch.uint8
        assert 0 < len(s) <= 128 and int(s.loss_mask.sum()) > 0
    # The split depends on the content, not on the order: a conversation's side
    # is the same whatever the shuffle seed of the source.
    conversations = load_conversations("pydoc", seed=3)
    held = [c for c in conversations if conversation_hash(c, 0) < 0.05]
    assert len(held) == len(ds.heldout)


def test_max_samples_and_dropping(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chats.jsonl", [
        json.dumps({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}]})
        for i in range(20)
    ] + [json.dumps({"messages": [{"role": "user", "content": "no answer"}]})])
    ds = build_dataset(tokenizer, path, max_seq_len=64, seed=0, heldout_fraction=0.0)
    assert len(ds.train) == 20 and ds.heldout == [] and ds.num_dropped == 1
    assert masked_text(tokenizer, ds.train[7].input_ids.tolist(), ds.train[7].loss_mask.tolist()) == "answer 7<|im_end|>"
    limited = build_dataset(tokenizer, path, max_seq_len=64, seed=0, heldout_fraction=0.0, max_samples=5)
    assert len(limited.train) == 5
