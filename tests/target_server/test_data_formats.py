"""Tests for target_server/data_formats.py through build_dataset: every format and source gives the
same samples as the equivalent ``messages`` JSONL; reasoning, tool calls and chat_template_kwargs
reach the template; malformed records are skipped and reported."""

from __future__ import annotations

import json
import logging
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from target_server.data import DataError, build_dataset, load_conversations
from target_server.data_formats import BadRecord, open_source, to_messages
from tests.fixtures import smollm2_tokenizer

# A template in the style of Qwen3's: it renders reasoning, tool calls and tool
# results, and reads an ``enable_thinking`` kwarg (an empty think block in the
# prompt when it is false). The real SmolLM2 template renders none of these.
TOOL_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' %}"
    "{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- elif enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{{- message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<tool_call>\\n' + (call.function | tojson) + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- elif message.role == 'tool' %}{{- '<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- else %}{%- if 'BOOM' in message.content %}{{ raise_exception('this template refuses BOOM') }}{%- endif %}"
    "{{- message.content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

WEATHER_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}

# Conversations every format can express (ShareGPT has no reasoning field).
PLAIN = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green."}],
    [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
     {"role": "tool", "content": "sunny, 21C"}, {"role": "assistant", "content": "Sunny and 21C."}],
] + [[{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer number {i}."}]
     for i in range(9)]
# ... and the ones with reasoning and tool results without content.
RICH = PLAIN + [
    [{"role": "user", "content": "Is 17 prime?"},
     {"role": "assistant", "reasoning_content": "Check divisors up to 4.", "content": "Yes."}],
    [{"role": "user", "content": "Weather in Oslo?"},
     {"role": "assistant", "reasoning_content": "I need the tool.", "content": None,
      "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
                      "id": "call_1"}]},
     {"role": "tool", "tool_call_id": "call_1", "content": None},
     {"role": "assistant", "content": "No answer from the weather service."}],
]


@pytest.fixture
def tool_tokenizer():
    tokenizer = smollm2_tokenizer()
    original = tokenizer.chat_template
    tokenizer.chat_template = TOOL_TEMPLATE
    try:
        yield tokenizer
    finally:
        tokenizer.chat_template = original


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def to_sharegpt(messages) -> dict:
    speaker = {"system": "system", "user": "human", "assistant": "gpt", "tool": "observation"}
    turns = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                     for c in m["tool_calls"]]
            turns.append({"from": "function_call", "value": json.dumps(calls[0] if len(calls) == 1 else calls)})
        else:
            turns.append({"from": speaker[m["role"]], "value": m["content"]})
    return {"conversations": turns}


def build(tokenizer, source, **kwargs):
    return build_dataset(tokenizer, source, **{"max_seq_len": 256, "seed": 0, "heldout_fraction": 0.25, **kwargs})


def assert_same_samples(a, b) -> None:
    for split in ("train", "heldout"):
        left, right = getattr(a, split), getattr(b, split)
        assert len(left) == len(right), split
        for x, y in zip(left, right):
            assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)


def masked_text(tokenizer, sample) -> str:
    return tokenizer.decode(sample.input_ids[sample.loss_mask.bool()].tolist(), skip_special_tokens=False)


# ---------------------------------------------------------------- formats and sources


def test_sharegpt_matches_messages(tmp_path, tool_tokenizer):
    reference = build(tool_tokenizer, write_jsonl(tmp_path / "m.jsonl", [{"messages": m} for m in PLAIN]))
    sharegpt = write_jsonl(tmp_path / "s.jsonl", [to_sharegpt(m) for m in PLAIN])
    assert_same_samples(build(tool_tokenizer, sharegpt), reference)
    assert_same_samples(build(tool_tokenizer, sharegpt, data_format="sharegpt"), reference)
    assert len(reference.heldout) > 0 and len(reference.train) > 0  # both sides of the split compared


def test_conversations_with_reasoning_and_tool_calls_match_messages(tmp_path, tool_tokenizer):
    reference = build(tool_tokenizer, write_jsonl(tmp_path / "m.jsonl", [{"messages": m} for m in RICH]))
    conversations = build(tool_tokenizer, write_jsonl(tmp_path / "c.jsonl", [{"conversations": m} for m in RICH]))
    assert_same_samples(conversations, reference)
    # The template saw the reasoning and the tool calls, and the mask holds only what the assistant produced.
    texts = [masked_text(tool_tokenizer, s) for s in reference.train + reference.heldout]
    oslo = next(t for t in texts if "Oslo" in t)
    assert oslo.startswith("<think>\nI need the tool.\n</think>\n\n<tool_call>\n")
    assert '"name": "get_weather"' in oslo and '"city": "Oslo"' in oslo
    assert "No answer from the weather service.<|im_end|>" in oslo
    assert "tool_response" not in oslo and "Weather in Oslo?" not in oslo
    assert any(t.startswith("<think>\nCheck divisors up to 4.\n</think>\n\nYes.") for t in texts)


@pytest.mark.parametrize("kind", ["parquet", "arrow file", "arrow stream"])
def test_table_files_match_messages(tmp_path, tool_tokenizer, kind):
    import pyarrow as pa
    import pyarrow.parquet as pq

    reference = build(tool_tokenizer, write_jsonl(tmp_path / "m.jsonl", [{"messages": m} for m in RICH]))
    # A table fills the keys a message lacks with nulls: they must not reach the template.
    table = pa.Table.from_pylist([{"messages": m} for m in RICH])
    path = tmp_path / ("chats.parquet" if kind == "parquet" else "chats.arrow")
    if kind == "parquet":
        pq.write_table(table, path, row_group_size=5)
    else:
        with pa.OSFile(str(path), "wb") as sink:
            writer = pa.ipc.new_file if kind == "arrow file" else pa.ipc.new_stream
            with writer(sink, table.schema) as out:
                for batch in table.to_batches(max_chunksize=5):
                    out.write_batch(batch)
    assert_same_samples(build(tool_tokenizer, str(path)), reference)


def test_datasets_directories_match_messages(tmp_path, tool_tokenizer):
    datasets = pytest.importorskip("datasets")

    reference = build(tool_tokenizer, write_jsonl(tmp_path / "m.jsonl", [{"messages": m} for m in RICH]))
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"conversations": m} for m in RICH]).save_to_disk(str(saved))
    assert open_source(str(saved)).kind == "datasets"
    assert_same_samples(build(tool_tokenizer, str(saved)), reference)
    # A directory of data files named after splits is read through its train files only.
    files = tmp_path / "files"
    (files / "data").mkdir(parents=True)
    write_jsonl(files / "data" / "train-00000.jsonl", [{"messages": m} for m in RICH[:7]])
    write_jsonl(files / "data" / "train-00001.jsonl", [{"messages": m} for m in RICH[7:]])
    write_jsonl(files / "data" / "test-00000.jsonl", [{"messages": PLAIN[0]}] * 3)
    assert_same_samples(build(tool_tokenizer, str(files)), reference)


def test_hub_datasets_in_the_local_cache_match_messages(tmp_path, tool_tokenizer, monkeypatch):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    reference = build(tool_tokenizer, write_jsonl(tmp_path / "m.jsonl", [{"messages": m} for m in RICH]))
    # A dataset datasets prepared earlier (what load_dataset("acme/chats") leaves in its cache) ...
    datasets.load_dataset("json", data_files={"train": str(tmp_path / "m.jsonl")}, cache_dir=str(tmp_path / "scratch"))
    prepared = next((tmp_path / "scratch" / "json").glob("default-*/0.0.0/*/"))
    cached = tmp_path / "datasets-cache" / "acme___chats" / "default" / "0.0.0" / prepared.name
    shutil.copytree(prepared, cached)
    (cached / "json-train.arrow").rename(cached / "chats-train.arrow")
    info = json.loads((cached / "dataset_info.json").read_text())
    (cached / "dataset_info.json").write_text(json.dumps({**info, "builder_name": "chats", "dataset_name": "chats"}))
    assert open_source("acme/chats").kind == "datasets"
    assert_same_samples(build(tool_tokenizer, "acme/chats"), reference)
    # ... or only its files, downloaded into the hub cache (huggingface-cli download --repo-type dataset).
    snapshot = tmp_path / "hub-cache" / "datasets--acme--files" / "snapshots" / "c0ffee"
    (snapshot / "data").mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("c0ffee")
    shutil.copy(tmp_path / "m.jsonl", snapshot / "data" / "train-00000-of-00001.jsonl")
    assert open_source("acme/files").kind == "files"
    assert_same_samples(build(tool_tokenizer, "acme/files"), reference)


def test_json_array_file_matches_messages(tmp_path, tool_tokenizer):
    reference = build(tool_tokenizer, write_jsonl(tmp_path / "m.jsonl", [{"messages": m} for m in PLAIN]))
    (tmp_path / "a.json").write_text(json.dumps([{"messages": m} for m in PLAIN]), encoding="utf-8")
    assert_same_samples(build(tool_tokenizer, str(tmp_path / "a.json")), reference)


def test_sharegpt_roles_and_function_calls():
    record = {"system": "You are terse.", "conversations": [
        {"from": "human", "value": "hi"}, {"from": "chatgpt", "value": "hello"},
        {"from": "function_call", "value": '{"name": "lookup", "arguments": {"q": "x"}}'},
        {"from": "observation", "value": "found"}, {"from": "function", "value": None},
        {"from": "bing", "value": "done"},
    ]}
    assert to_messages(record, "sharegpt") == [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {"q": "x"}}}]},
        {"role": "tool", "content": "found"}, {"role": "tool", "content": ""},
        {"role": "assistant", "content": "done"},
    ]
    with pytest.raises(BadRecord, match=r"conversations\[0\].from must be one of"):
        to_messages({"conversations": [{"from": "narrator", "value": "x"}]}, "sharegpt")
    with pytest.raises(BadRecord, match="must be JSON"):
        to_messages({"conversations": [{"from": "function_call", "value": "call it"}]}, "sharegpt")


def test_auto_detection_names_the_file_when_it_cannot_tell(tmp_path):
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"messages": PLAIN[0]}, to_sharegpt(PLAIN[1])])
    with pytest.raises(DataError, match=r"cannot tell the format of .*mixed\.jsonl.*messages at .*mixed\.jsonl:1.*"
                                        r"sharegpt at .*mixed\.jsonl:2.*data\.format"):
        load_conversations(mixed, seed=0, strict=False)
    # An explicit format settles it: the other record is skipped, not fatal.
    assert load_conversations(mixed, seed=0, data_format="sharegpt", strict=False) == [
        [{"role": m["role"], "content": m["content"]} for m in PLAIN[1]]]
    unknown = write_jsonl(tmp_path / "unknown.jsonl", [{"text": "plain text"}])
    with pytest.raises(DataError, match=r"cannot tell the format of .*unknown\.jsonl.*\['text'\]"):
        load_conversations(unknown, seed=0, strict=False)


def test_uncached_hub_dataset_is_a_clear_error(monkeypatch):
    datasets = pytest.importorskip("datasets")
    # Offline for that call only, even in a process that may use the network.
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    with pytest.raises(DataError, match="neither a file nor a dataset in the local Hugging Face cache.*nothing is downloaded"):
        open_source("dflash-tests/no-such-dataset-anywhere")
    assert "HF_HUB_OFFLINE" not in os.environ and datasets.config.HF_HUB_OFFLINE is False  # restored


# ---------------------------------------------------------------- template kwargs


def test_chat_template_kwargs_reach_every_rendering(tmp_path, tool_tokenizer, monkeypatch):
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": m} for m in PLAIN])
    plain = build(tool_tokenizer, path, heldout_fraction=0.0)
    calls = []
    render = tool_tokenizer.apply_chat_template

    def spy(conversation, **kwargs):
        calls.append(kwargs)
        return render(conversation, **kwargs)

    monkeypatch.setattr(tool_tokenizer, "apply_chat_template", spy)
    off = build(tool_tokenizer, path, heldout_fraction=0.0, num_proc=1, chat_template_kwargs={"enable_thinking": False})
    # Every rendering got it: the full conversation and the prefix renders of the loss mask.
    assert len(calls) > 2 * len(PLAIN) and all(c.get("enable_thinking") is False for c in calls)
    for a, b in zip(plain.train, off.train):
        assert "<think>\n\n</think>\n\n" in tool_tokenizer.decode(b.input_ids.tolist(), skip_special_tokens=False)
        assert "<think>" not in tool_tokenizer.decode(a.input_ids.tolist(), skip_special_tokens=False)
        # The empty think block the kwarg adds is prompt, not loss.
        assert masked_text(tool_tokenizer, a) == masked_text(tool_tokenizer, b)


# ---------------------------------------------------------------- malformed records


def test_malformed_records_are_skipped_and_reported(tmp_path, tool_tokenizer, caplog):
    good = [json.dumps({"messages": m}) for m in PLAIN]
    lines = good[:2] + [
        "{not json",                                                                  # line 3
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}),                # line 4
        "",                                                                           # blank: not a record
        json.dumps({"messages": [{"role": "user", "content": 3}]}),                   # line 6
        json.dumps({"messages": [{"role": "user", "content": "BOOM"},
                                 {"role": "assistant", "content": "x"}]}),            # line 7: the template refuses it
    ] + good[2:]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        ds = build(tool_tokenizer, str(path), heldout_fraction=0.0)
    assert len(ds.train) == len(PLAIN) and ds.num_skipped == 4 and ds.num_records == len(PLAIN) + 4
    text = caplog.text
    assert f"skipped {path}:3: invalid JSON" in text
    assert f"skipped {path}:4: messages[0].role must be one of" in text
    assert f"skipped {path}:6: messages[0].content must be a string" in text
    assert f"skipped {path}:7: the chat template cannot render it" in text and "refuses BOOM" in text
    assert f"4 of {len(PLAIN) + 4} records skipped: " in text
    # The strict reader (prompt files, tools) still stops at the first one.
    with pytest.raises(DataError, match=r"bad\.jsonl:3: invalid JSON"):
        load_conversations(str(path), seed=0)


def test_all_records_bad_is_a_data_error_with_reasons(tmp_path, tool_tokenizer):
    path = write_jsonl(tmp_path / "all-bad.jsonl", [{"messages": [{"role": "user", "content": 3}]}] * 4)
    with pytest.raises(DataError, match=r"every one of its 4 records was skipped; the first: .*all-bad\.jsonl:1: "
                                        r"messages\[0\]\.content must be a string"):
        build(tool_tokenizer, path)
    refused = write_jsonl(tmp_path / "refused.jsonl",
                          [{"messages": [{"role": "user", "content": "BOOM"}, {"role": "assistant", "content": "x"}]}] * 2)
    with pytest.raises(DataError, match=r"every one of its 2 records was skipped.*refused\.jsonl:1: the chat template"):
        build(tool_tokenizer, refused)


def test_bad_rows_of_a_table_are_reported_by_row(tmp_path, tool_tokenizer, caplog):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": m} for m in PLAIN[3:6]]
    rows.insert(1, {"messages": [{"role": "narrator", "content": "Once upon a time"}]})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    with caplog.at_level(logging.WARNING):
        ds = build(tool_tokenizer, str(tmp_path / "t.parquet"), heldout_fraction=0.0)
    assert len(ds.train) == 3 and ds.num_skipped == 1
    assert f"skipped {tmp_path / 't.parquet'}:row 1: messages[0].role must be one of" in caplog.text
    assert "1 of 4 records skipped: 1 bad message" in caplog.text
