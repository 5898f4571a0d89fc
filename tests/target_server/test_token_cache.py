"""Tests for target_server/token_cache.py and the parallel tokenization of build_dataset: the cache
skips tokenization on a second load, a corrupt cache file is rebuilt, and the samples do not depend
on the cache or on data.num_proc."""

from __future__ import annotations

import json
import logging
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

import target_server.chat_tokens as chat_tokens
import target_server.data as data_mod
from target_server import token_cache
from target_server.data import build_dataset, fingerprint
from tests.fixtures import smollm2_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


@pytest.fixture
def chats(tmp_path) -> str:
    path = tmp_path / "chats.jsonl"
    records = [{"messages": [{"role": "user", "content": f"Question {i}: what is {i} squared?"},
                             {"role": "assistant", "content": f"{i} squared is {i * i}." + " More." * (i % 7)}]}
               for i in range(40)]
    records.append({"messages": [{"role": "user", "content": "no answer"}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def build(tokenizer, source, **kwargs):
    return build_dataset(tokenizer, source, **{"max_seq_len": 48, "seed": 0, "heldout_fraction": 0.2, **kwargs})


def assert_same(a, b, tokenizer) -> None:
    assert fingerprint(a, tokenizer) == fingerprint(b, tokenizer)
    for split in ("train", "heldout"):
        left, right = getattr(a, split), getattr(b, split)
        assert [s.sample_id for s in left] == [s.sample_id for s in right]
        for x, y in zip(left, right):
            assert x.input_ids.dtype == y.input_ids.dtype == torch.int32
            assert x.loss_mask.dtype == y.loss_mask.dtype == torch.uint8
            assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
    assert (a.num_conversations, a.num_dropped, a.num_truncated, a.stats) == \
           (b.num_conversations, b.num_dropped, b.num_truncated, b.stats)


def no_tokenizing(*args, **kwargs):
    raise AssertionError("tokenized although the cache holds this data set")


def test_second_load_reads_the_cache_and_skips_tokenization(tmp_path, chats, tokenizer, monkeypatch, caplog):
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="target_server.data"):
        first = build(tokenizer, chats, cache_dir=str(cache))
    assert not first.cache_hit and "tokenized cache miss" in caplog.text
    assert first.num_truncated > 0 and first.num_dropped == 1 and first.heldout
    files = list(cache.glob("chats.jsonl-*.dftok"))
    assert [str(f) for f in files] == [first.cache_path]

    caplog.clear()
    monkeypatch.setattr(data_mod, "_tokenize_needed", no_tokenizing)
    monkeypatch.setattr(data_mod, "read_conversations", no_tokenizing)
    with caplog.at_level(logging.INFO, logger="target_server.data"):
        second = build(tokenizer, chats, cache_dir=str(cache), num_proc=3)  # num_proc is not part of the key
    assert second.cache_hit and "tokenized cache hit" in caplog.text
    assert_same(second, first, tokenizer)  # the first one was tokenized: same with and without the cache


def test_cache_key_follows_data_template_kwargs_and_settings(tmp_path, chats, tokenizer):
    cache = str(tmp_path / "cache")
    build(tokenizer, chats, cache_dir=cache)
    assert build(tokenizer, chats, cache_dir=cache).cache_hit
    assert not build(tokenizer, chats, cache_dir=cache, max_seq_len=44).cache_hit
    assert not build(tokenizer, chats, cache_dir=cache, seed=1).cache_hit
    assert not build(tokenizer, chats, cache_dir=cache, max_samples=5).cache_hit
    assert not build(tokenizer, chats, cache_dir=cache, chat_template_kwargs={"enable_thinking": False}).cache_hit
    with open(chats, "a", encoding="utf-8") as handle:  # the data changed
        handle.write(json.dumps({"messages": [{"role": "user", "content": "new"},
                                              {"role": "assistant", "content": "entry"}]}) + "\n")
    assert not build(tokenizer, chats, cache_dir=cache).cache_hit
    original = tokenizer.chat_template
    tokenizer.chat_template = original.replace("You are a helpful AI assistant", "You are an AI assistant")
    try:
        assert not build(tokenizer, chats, cache_dir=cache).cache_hit
    finally:
        tokenizer.chat_template = original


@pytest.mark.parametrize("damage", ["flip a byte", "cut short", "empty", "garbage"])
def test_corrupt_cache_file_is_rebuilt(tmp_path, chats, tokenizer, damage, caplog):
    cache = str(tmp_path / "cache")
    first = build(tokenizer, chats, cache_dir=cache)
    path = first.cache_path
    blob = bytearray(open(path, "rb").read())
    if damage == "flip a byte":
        blob[len(blob) // 2] ^= 0x40
    elif damage == "cut short":
        blob = blob[: len(blob) - 100]
    elif damage == "empty":
        blob = bytearray()
    else:
        blob = bytearray(b"not a cache file at all" * 10)
    with open(path, "wb") as handle:
        handle.write(blob)
    with caplog.at_level(logging.WARNING, logger="target_server.token_cache"):
        rebuilt = build(tokenizer, chats, cache_dir=cache)
    assert not rebuilt.cache_hit and "is corrupt" in caplog.text
    assert_same(rebuilt, first, tokenizer)
    again = build(tokenizer, chats, cache_dir=cache)  # rewritten whole
    assert again.cache_hit
    assert_same(again, first, tokenizer)


def test_cache_file_round_trip_and_checks(tmp_path):
    arrays = {"a": np.arange(5, dtype=np.int32), "b": np.array([1, 0, 1], dtype=np.uint8), "c": np.zeros(0, np.int64)}
    path = tmp_path / "x.dftok"
    assert token_cache.write(path, {"key": "k1", "note": "hi"}, arrays)
    header, back = token_cache.read(path, "k1")
    assert header["note"] == "hi"
    for name, array in arrays.items():
        assert back[name].dtype == array.dtype and np.array_equal(back[name], array)
    assert back["a"].ctypes.data % 8 == 0  # arrays start aligned
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left behind
    assert token_cache.read(path, "another key") is None and not path.exists()  # never trusted, removed


def test_cache_dir_settings(tmp_path, chats, tokenizer, monkeypatch):
    monkeypatch.setenv(token_cache.ENV_CACHE_DIR, str(tmp_path / "from-env"))
    assert token_cache.resolve_cache_dir("") == tmp_path / "from-env"
    assert token_cache.resolve_cache_dir("off") is None
    assert token_cache.resolve_cache_dir(str(tmp_path / "set")) == tmp_path / "set"
    ds = build(tokenizer, chats, cache_dir="")
    assert ds.cache_path.startswith(str(tmp_path / "from-env"))
    assert build(tokenizer, chats, cache_dir="off").cache_path == ""
    monkeypatch.delenv(token_cache.ENV_CACHE_DIR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert token_cache.resolve_cache_dir("") == tmp_path / "xdg" / "dflash" / "tokenized"


def test_unwritable_cache_directory_does_not_stop_the_job(tmp_path, chats, tokenizer, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="target_server.token_cache"):
        ds = build(tokenizer, chats, cache_dir=str(blocker / "cache"))
    assert ds.train and ds.cache_path == "" and "cannot write the tokenized cache" in caplog.text


@pytest.mark.parametrize("max_samples", [0, 7])
def test_samples_do_not_depend_on_num_proc(tmp_path, chats, tokenizer, monkeypatch, max_samples):
    serial = build(tokenizer, chats, num_proc=1, max_samples=max_samples)
    monkeypatch.setattr(chat_tokens, "MIN_CONVERSATIONS_PER_PROCESS", 1)
    monkeypatch.setattr(chat_tokens, "CHUNK_CONVERSATIONS", 3)
    started = []
    real_start = chat_tokens.TokenizerPool._start

    def start(self, processes):
        started.append(processes)
        return real_start(self, processes)

    monkeypatch.setattr(chat_tokens.TokenizerPool, "_start", start)
    parallel = build(tokenizer, chats, num_proc=2, max_samples=max_samples)
    assert started and set(started) == {2}  # worker processes did the tokenizing
    assert_same(parallel, serial, tokenizer)
    if max_samples:
        assert len(parallel.train) == max_samples
