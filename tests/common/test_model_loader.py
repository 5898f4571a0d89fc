"""Tests for common/model_loader.py: source resolution, loading, mask token."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gguf
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from common import gguf_cache
from common.model_loader import (
    SMOLLM2_GGUF,
    ModelLoadError,
    embedding_weights,
    load_target,
    load_tokenizer,
    pick_mask_token_id,
    resolve_model_source,
    resolve_tokenizer_source,
)
from target_server.token_cache import tokenizer_digest

SMOLLM2_VOCAB = 49152


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2_tokenizer, tmp_path_factory):
    # Saved once as tokenizer.json so load_target tests skip the GGUF parse.
    path = tmp_path_factory.mktemp("smollm2-tokenizer")
    smollm2_tokenizer.save_pretrained(path)
    return str(path)


def tiny_llama_dir(path, *, vocab_size=SMOLLM2_VOCAB, tie=True, layers=2) -> str:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tie)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


# ---------------------------------------------------------------- resolve


def test_resolve_smollm2_alias_and_gguf_path():
    directory, gguf = resolve_model_source("smollm2")
    assert gguf == SMOLLM2_GGUF and os.path.isfile(os.path.join(directory, gguf))
    assert resolve_model_source(os.path.join(directory, gguf)) == (directory, gguf)
    assert resolve_model_source("SmolLM2") == (directory, gguf)


def test_resolve_missing_path_is_one_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match=r"no such file.*'smollm2', a \.gguf file"):
        resolve_model_source(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        resolve_model_source(str(tmp_path / "missing-dir"))


def test_resolve_directory_without_config_json(tmp_path):
    with pytest.raises(ModelLoadError, match="without config.json"):
        resolve_model_source(str(tmp_path))
    (tmp_path / "model.Q4.gguf").write_bytes(b"GGUF" + b"\0" * 16)
    with pytest.raises(ModelLoadError, match="pass one of them: .*model.Q4.gguf"):
        resolve_model_source(str(tmp_path))
    with pytest.raises(ModelLoadError, match="no tokenizer files"):
        resolve_tokenizer_source(str(tmp_path))


def test_resolve_non_gguf_file(tmp_path):
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"PK\x03\x04not gguf")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        resolve_model_source(str(path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_resolve_unreadable_gguf(tmp_path):
    path = tmp_path / "locked.gguf"
    path.write_bytes(b"GGUF")
    path.chmod(0)
    with pytest.raises(ModelLoadError, match="cannot be read"):
        resolve_model_source(str(path))


def test_resolve_hub_id_only_when_cached(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"not a local path, and no hub id.*local\s+Hugging Face cache.*huggingface-cli download"):
        resolve_model_source("no-such-org/no-such-model")
    # A hub cache entry with config.json makes the id usable (offline).
    repo = tmp_path / "models--some-org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    assert resolve_model_source("some-org/tiny") == ("some-org/tiny", None)


def test_resolve_rejects_empty_and_garbage():
    with pytest.raises(ModelLoadError, match="empty"):
        resolve_model_source("  ")
    with pytest.raises(ModelLoadError, match="no such file or directory"):
        resolve_model_source("not a model")


# ---------------------------------------------------------------- load


def test_load_tiny_llama_with_separate_tokenizer(tmp_path, tokenizer_dir, caplog):
    model_dir = tiny_llama_dir(tmp_path / "tiny")
    with caplog.at_level(logging.INFO, logger="common.model_loader"):
        target = load_target(model_dir, tokenizer_source=tokenizer_dir)
    assert any("loaded" in r.getMessage() for r in caplog.records)
    assert target.model_id == "tiny"
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (2, 64, SMOLLM2_VOCAB)
    assert target.config.num_hidden_layers == 2
    assert not target.model.training
    assert all(not p.requires_grad for p in target.model.parameters())
    assert next(target.model.parameters()).dtype == torch.float32
    assert target.pad_token_id == target.tokenizer.pad_token_id == 2
    ids = target.tokenizer("def f(x): return x", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    assert len(out.hidden_states) == 3 and out.hidden_states[-1].shape == (1, ids.shape[1], 64)


def test_load_bfloat16(tmp_path, tokenizer_dir):
    target = load_target(tiny_llama_dir(tmp_path / "tiny"), dtype=torch.bfloat16, tokenizer_source=tokenizer_dir)
    assert next(target.model.parameters()).dtype == torch.bfloat16


def test_model_dir_without_tokenizer_asks_for_target_tokenizer(tmp_path):
    with pytest.raises(ModelLoadError, match="set target.tokenizer"):
        load_target(tiny_llama_dir(tmp_path / "tiny", vocab_size=256, layers=1))


def test_tokenizer_larger_than_embedding_is_refused(tmp_path, tokenizer_dir):
    with pytest.raises(ModelLoadError, match="49152 tokens but the model's embedding has only 256 rows"):
        load_target(tiny_llama_dir(tmp_path / "tiny", vocab_size=256, layers=1), tokenizer_source=tokenizer_dir)


def test_embedding_weights_tied_and_untied(tmp_path):
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    tied_model = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "tie_word_embeddings": True}))
    embed, head, tied = embedding_weights(tied_model)
    assert tied and embed.shape == head.shape == (256, 64) and not embed.requires_grad
    untied_model = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "tie_word_embeddings": False}))
    embed, head, tied = embedding_weights(untied_model)
    assert not tied and embed.shape == head.shape == (256, 64)
    assert embed.data_ptr() == untied_model.model.embed_tokens.weight.data_ptr()  # a view, not a copy


# ---------------------------------------------------------------- mask token


def test_pick_mask_token_id_for_smollm2(smollm2_tokenizer):
    tok = smollm2_tokenizer
    mask_id = pick_mask_token_id(tok, None)
    assert tok.convert_ids_to_tokens(mask_id) == "<empty_output>"
    assert mask_id not in tok.all_special_ids
    assert tok.convert_ids_to_tokens(mask_id) not in tok.chat_template
    assert pick_mask_token_id(tok, -1) == mask_id
    assert pick_mask_token_id(tok, 123) == 123
    with pytest.raises(ModelLoadError, match="target.mask_token_id=49152 is out of range"):
        pick_mask_token_id(tok, SMOLLM2_VOCAB)
    assert pick_mask_token_id(tok, 50000, vocab_size=50304) == 50000


# ---------------------------------------------------------------- real model


@pytest.mark.slow
def test_load_real_smollm2_gguf(caplog, monkeypatch, tmp_path):
    session_cache = os.environ.get(gguf_cache.ENV_CACHE_DIR, "off")  # tests/conftest.py's
    monkeypatch.setenv(gguf_cache.ENV_CACHE_DIR, str(tmp_path))
    parsed = []  # every GGUF metadata parse (common/gguf_parse_once.py: one per load, not three)
    real_reader = gguf.GGUFReader

    def counting_reader(path, mode="r"):
        parsed.append(path)
        return real_reader(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="common.model_loader"):
        target = load_target("smollm2")
    elapsed = time.monotonic() - started
    assert len(parsed) == 1 and gguf.GGUFReader is counting_reader
    logging.getLogger(__name__).info("SmolLM2 GGUF loaded in %.1fs", elapsed)
    assert "de-quantizing the GGUF" in caplog.text
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, SMOLLM2_VOCAB)
    assert target.model_id == "SmolLM2-135M-Instruct.Q4_1"
    embed, head, tied = embedding_weights(target.model)
    assert tied and embed.shape == (SMOLLM2_VOCAB, 576)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = target.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = target.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    assert len(out.hidden_states) == 31
    assert out.logits.shape == (1, ids.shape[1], SMOLLM2_VOCAB)
    assert torch.isfinite(out.logits).all()
    # The de-quantized model is a real chat model: the next token is sensible.
    next_token = target.tokenizer.decode(out.logits[0, -1].argmax().item())
    assert next_token.strip() != ""

    # The load left its conversion in the cache; the next load reads it instead of the GGUF, and gets
    # the same tensors bit for bit and a tokenizer with the same definition (the data fingerprint's part).
    (entry,) = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="common.model_loader"):
        again = load_target("smollm2")
    assert "de-quantizing the GGUF" not in caplog.text and str(entry) in caplog.text
    assert again.model_id == target.model_id and again.config.to_diff_dict().keys() <= {
        *target.config.to_diff_dict().keys(), "_name_or_path"}
    original, reloaded = target.model.state_dict(), again.model.state_dict()
    assert original.keys() == reloaded.keys()
    assert all(torch.equal(original[name], reloaded[name]) for name in original)
    assert embedding_weights(again.model)[2]  # still tied
    assert tokenizer_digest(again.tokenizer) == tokenizer_digest(target.tokenizer)
    with torch.no_grad():
        assert torch.equal(again.model(input_ids=ids).logits, out.logits)
    # A tokenizer alone comes from the conversion too.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="common.model_loader"):
        assert tokenizer_digest(load_tokenizer("smollm2")) == tokenizer_digest(target.tokenizer)
    assert "de-quantizing" not in caplog.text

    # Handed on to the session: its later processes that load SmolLM2 (the demo's) skip the conversion.
    if session_cache != "off" and not (Path(session_cache) / entry.name).exists():
        shutil.move(entry, Path(session_cache) / entry.name)


def test_a_damaged_conversion_is_deleted_and_an_unwritable_cache_stops_nothing(tmp_path, caplog):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.fixtures import make_tiny_target

    tiny = make_tiny_target(tmp_path / "tiny", num_layers=1)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    entry = tmp_path / "cache" / "tiny-0123"
    gguf_cache.store(entry, model, tokenizer)
    assert gguf_cache.lookup(entry) == entry and not [p for p in entry.parent.iterdir() if p.name.startswith(".")]
    reloaded = AutoModelForCausalLM.from_pretrained(entry)
    assert all(torch.equal(t, reloaded.state_dict()[name]) for name, t in model.state_dict().items())
    gguf_cache.store(entry, model, tokenizer)  # converted by another process meanwhile: kept as it is
    assert gguf_cache.lookup(entry) == entry

    # A copy cut short: the manifest's sizes catch it, and the entry goes so the next load rebuilds it.
    weights = entry / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with caplog.at_level(logging.WARNING, logger="common.gguf_cache"):
        assert gguf_cache.lookup(entry) is None
    assert "damaged (model.safetensors)" in caplog.text and not entry.exists()

    # A cache directory that cannot be written is logged and leaves nothing behind.
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="common.gguf_cache"):
        gguf_cache.store(blocked / "entry", model, tokenizer)
    assert "could not cache the converted model" in caplog.text and blocked.read_text() == ""
