"""dflash-regen (tools/regen.py) on a tiny random target: valid chat JSONL, resumable, no duplicates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tools.regen as regen
from target_server.data import build_dataset, load_conversations


def write_prompts(path: Path) -> None:
    lines = [
        {"prompt": "What is a list?"},
        {"messages": [{"role": "user", "content": "Name a prime."}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "old answer, dropped"}]},
        {"prompt": "Explain 'for' loops."},
        {"prompt": "What does `yield` do?"},
    ]
    text = "\n".join(json.dumps(x) for x in lines[:3]) + "\n\n" + "\n".join(json.dumps(x) for x in lines[3:]) + "\n"
    path.write_text(text)


def run(tiny_llama_dir: Path, prompts: Path, out: Path) -> int:
    return regen.main(["--prompts", str(prompts), "--out", str(out), "--model", str(tiny_llama_dir),
                       "--batch-size", "2", "--max-new-tokens", "5", "--threads", "1"])


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_regen_writes_chat_jsonl_and_resumes_without_duplicates(tiny_llama_dir, tmp_path, monkeypatch):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "data" / "regen.jsonl"
    write_prompts(prompts)

    # First run: killed during its second batch, after the first one was written.
    real = regen.answer_batch
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(regen, "answer_batch", flaky)
    assert run(tiny_llama_dir, prompts, out) == 130
    first = records(out)
    assert [r["prompt_line"] for r in first] == [1, 2]
    # A kill in the middle of a write leaves a partial line behind.
    with open(out, "a") as f:
        f.write('{"messages": [{"role": "user", "content": "Hi"')

    monkeypatch.setattr(regen, "answer_batch", real)
    assert run(tiny_llama_dir, prompts, out) == 0
    done = records(out)
    assert done[:2] == first  # kept as they were
    assert sorted(r["prompt_line"] for r in done) == [1, 2, 3, 5, 6]  # each prompt once (line 4 is blank)
    by_line = {r["prompt_line"]: r for r in done}
    assert by_line[3]["messages"][:2] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for r in done:
        assert r["messages"][-1]["role"] == "assistant" and isinstance(r["messages"][-1]["content"], str)
        assert r["finish_reason"] in ("stop", "length")
        assert r["messages"][-1]["content"] != "old answer, dropped"

    # Nothing left to do: a third run writes nothing.
    assert run(tiny_llama_dir, prompts, out) == 0
    assert records(out) == done

    # The target server reads the file as data.source.
    assert len(load_conversations(str(out), seed=0)) == 5
    from tests.fixtures import smollm2_tokenizer

    dataset = build_dataset(smollm2_tokenizer(), str(out), max_seq_len=128, seed=0, heldout_fraction=0.0)
    assert len(dataset.train) + dataset.num_dropped == 5


def test_regen_refuses_output_of_other_prompts(tiny_llama_dir, tmp_path, capsys):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "regen.jsonl"
    write_prompts(prompts)
    out.write_text(json.dumps({"messages": [{"role": "user", "content": "something else"},
                                            {"role": "assistant", "content": "x"}], "prompt_line": 1}) + "\n")
    assert run(tiny_llama_dir, prompts, out) == 2
    assert "other prompts" in capsys.readouterr().err


@pytest.mark.parametrize("line, message", [
    ("not json", "invalid JSON"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', "no user turn"),
    ('{"text": "x"}', "expected"),
])
def test_regen_rejects_bad_prompt_files(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(regen.RegenError, match=message):
        regen.read_prompts(path)
