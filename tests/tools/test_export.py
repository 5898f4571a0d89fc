"""dflash-export (tools/export.py): published DFlash layout and a lossless round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

from common.dflash_model import DFlashDrafter, build_target_layer_ids, load_drafter, make_drafter_config
from drafter_worker.checkpoint import CheckpointStore, Coverage, TrainerState
from tools.export import main as export_main

HIDDEN = 64
VOCAB = 128
LAYERS = 2
TARGET_LAYERS = 8


def make_checkpoint(run_dir: Path, step: int = 20) -> DFlashDrafter:
    config = make_drafter_config(
        hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
        num_hidden_layers=LAYERS, num_target_layers=TARGET_LAYERS,
        target_layer_ids=build_target_layer_ids(TARGET_LAYERS, 3), block_size=8, mask_token_id=VOCAB - 1,
    )
    torch.manual_seed(step)
    model = DFlashDrafter(config)
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainerState(step=step, coverage=Coverage(), drafter_id="d0", group="d0", model_id="tiny")
    CheckpointStore(run_dir, "d0", keep=2).save(state, model, optimizer, torch.Generator())
    return model


def block_outputs(model: DFlashDrafter) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(1, 6, model.feature_size, generator=gen)
    noise = torch.randn(1, model.block_size, HIDDEN, generator=gen)
    with torch.no_grad():
        return model(features.to(model.fc.weight.dtype), noise.to(model.fc.weight.dtype),
                     torch.arange(6 + model.block_size)[None]).float()


def test_export_round_trip_gives_identical_outputs(tmp_path):
    run = tmp_path / "run"
    make_checkpoint(run, step=20)
    trained = make_checkpoint(run, step=40)  # latest
    out = tmp_path / "export"
    assert export_main([str(run), "--drafter", "d0", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    back = load_drafter(out)
    assert torch.equal(block_outputs(back), block_outputs(trained))

    # An older step, cast to bfloat16 as served drafters usually are.
    older = tmp_path / "export-20"
    assert export_main([str(run), "--step", "20", "--dtype", "bfloat16", "--out", str(older)]) == 0
    assert json.loads((older / "config.json").read_text())["dtype"] == "bfloat16"
    back20 = load_drafter(older)
    assert back20.fc.weight.dtype == torch.bfloat16
    reference = load_drafter(run / "checkpoints" / "d0" / "step-20")
    torch.testing.assert_close(block_outputs(back20), block_outputs(reference), rtol=0.05, atol=0.05)


def test_export_matches_the_published_layout(tmp_path):
    run = tmp_path / "run"
    make_checkpoint(run)
    out = tmp_path / "export"
    assert export_main([str(run), "--out", str(out)]) == 0

    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["model_type"] == "qwen3"
    assert raw["dflash_config"] == {"block_size": 8, "mask_token_id": VOCAB - 1,
                                    "target_layer_ids": build_target_layer_ids(TARGET_LAYERS, 3)}
    assert raw["block_size"] == 8 and raw["num_target_layers"] == TARGET_LAYERS
    assert raw["is_causal"] is False and raw["tie_word_embeddings"] is False
    assert raw["dtype"] == "float32"

    # What the reference DFlashDraftModel builds from this config: transformers'
    # own Qwen3 decoder layers (same submodule names), norm, fc, hidden_norm and
    # a Qwen3 rotary embedding. Every name and shape must match the file.
    config = AutoConfig.from_pretrained(out)
    assert isinstance(config, Qwen3Config)
    layer_ids = config.dflash_config["target_layer_ids"]
    expected: dict[str, tuple[int, ...]] = {
        "norm.weight": (HIDDEN,),
        "hidden_norm.weight": (HIDDEN,),
        "fc.weight": (HIDDEN, len(layer_ids) * HIDDEN),
    }
    for i in range(config.num_hidden_layers):
        for name, tensor in Qwen3DecoderLayer(config, i).state_dict().items():
            expected[f"layers.{i}.{name}"] = tuple(tensor.shape)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        found = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert found == expected
    rotary = Qwen3RotaryEmbedding(config)
    torch.testing.assert_close(rotary.inv_freq, load_drafter(out).rotary_emb.inv_freq)


def test_export_errors(tmp_path, capsys):
    run = tmp_path / "run"
    assert export_main([str(run), "--out", str(tmp_path / "x")]) == 1
    assert "no checkpoint" in capsys.readouterr().err
    make_checkpoint(run)
    assert export_main([str(run), "--step", "999", "--out", str(tmp_path / "x")]) == 2
    assert "step-999" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export_main([str(run), "--out", str(tmp_path / "x"), "--dtype", "int8"])
