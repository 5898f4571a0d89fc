"""dflash-export (tools/export.py): published DFlash layout, AutoModel loading, model card."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import AutoConfig, AutoModel, DynamicCache, PreTrainedModel, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

import drafter_worker.model.modeling_dflash
from drafter_worker.model.dflash_model import (
    DFlashDrafter, build_block_inputs, build_target_layer_ids, load_drafter, make_drafter_config,
)
from drafter_worker.checkpoint import CheckpointStore, Coverage, TrainerState
from tools.export import main as export_main

HIDDEN = 64
VOCAB = 128
LAYERS = 2
TARGET_LAYERS = 8
BLOCK = 8
EXPORTED_FILES = ["README.md", "config.json", "dflash.py", "model.safetensors"]


def make_checkpoint(run_dir: Path, step: int = 20, drafter_id: str = "d0", **config_overrides) -> DFlashDrafter:
    """A randomly initialised drafter saved as checkpoint ``step-<step>`` (with norms off one, so all weights count)."""
    config = make_drafter_config(
        hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        vocab_size=VOCAB, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
        num_hidden_layers=LAYERS, num_target_layers=TARGET_LAYERS,
        target_layer_ids=build_target_layer_ids(TARGET_LAYERS, 3), block_size=BLOCK, mask_token_id=VOCAB - 1,
        **config_overrides,
    )
    torch.manual_seed(step)
    model = DFlashDrafter(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    if model.draft_vocab_size:
        model.set_draft_vocab(torch.randperm(VOCAB)[: model.draft_vocab_size])
    if model.draft_head is not None:
        with torch.no_grad():
            model.draft_head.normal_()
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainerState(step=step, coverage=[Coverage()], drafter_id=drafter_id, model_id="tiny",
                         tokens_trained=step * 1000)
    CheckpointStore(run_dir, drafter_id, keep=2).save(state, model, optimizer, torch.Generator())
    return model


def inputs(model, ctx: int = 6, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(1, ctx, model.feature_size, generator=gen)
    noise = torch.randn(1, model.block_size, HIDDEN, generator=gen)
    return features, noise, torch.arange(ctx + model.block_size)[None]


def block_outputs(model: DFlashDrafter) -> torch.Tensor:
    features, noise, positions = inputs(model)
    dtype = model.fc.weight.dtype
    with torch.no_grad():
        return model(features.to(dtype), noise.to(dtype), positions).float()


@pytest.fixture
def hf_modules(tmp_path, monkeypatch):
    """transformers copies remote code into a modules cache: keep it in the test's directory."""
    import transformers.dynamic_module_utils as dmu

    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path / "hf_modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    return tmp_path / "hf_modules"


def auto_load(directory: Path, monkeypatch, **kwargs) -> PreTrainedModel:
    """Load as users do. ``common`` is made unimportable meanwhile: the shipped code must not need it."""
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "common", None)
        return AutoModel.from_pretrained(directory, trust_remote_code=True, **kwargs)


def test_export_round_trip_gives_identical_outputs(tmp_path):
    run = tmp_path / "run"
    make_checkpoint(run, step=20)
    trained = make_checkpoint(run, step=40)  # latest
    out = tmp_path / "export"
    assert export_main([str(run), "--drafter", "d0", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == EXPORTED_FILES
    back = load_drafter(out)
    assert torch.equal(block_outputs(back), block_outputs(trained))

    # An older step, cast to bfloat16 as served drafters usually are.
    older = tmp_path / "export-20"
    assert export_main([str(run), "--step", "20", "--dtype", "bfloat16", "--out", str(older)]) == 0
    assert json.loads((older / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(older / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
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
    assert raw["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert raw["dflash_config"] == {"block_size": BLOCK, "mask_token_id": VOCAB - 1,
                                    "target_layer_ids": build_target_layer_ids(TARGET_LAYERS, 3)}
    assert raw["block_size"] == BLOCK and raw["num_target_layers"] == TARGET_LAYERS
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


def test_the_shipped_modeling_file_is_the_repositorys_and_imports_only_torch_and_transformers(tmp_path):
    run = tmp_path / "run"
    make_checkpoint(run)
    out = tmp_path / "export"
    assert export_main([str(run), "--out", str(out)]) == 0
    source = Path(drafter_worker.model.modeling_dflash.__file__).read_text(encoding="utf-8")
    assert (out / "dflash.py").read_text(encoding="utf-8") == source
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "a relative import would not travel with the file"
            roots.add(node.module.split(".")[0])
    assert roots - set(sys.stdlib_module_names) == {"torch", "transformers"}


@pytest.mark.parametrize("overrides", [
    {},
    {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 9},
    {"draft_vocab_size": 40},
    {"draft_vocab_size": 40, "draft_head": True},
], ids=["full", "sliding", "draft-vocab", "draft-head"])
def test_automodel_loads_the_export_and_computes_what_training_computes(tmp_path, hf_modules, monkeypatch, overrides):
    run = tmp_path / "run"
    trained = make_checkpoint(run, **overrides)
    out = tmp_path / f"{tmp_path.name}-export"  # transformers names the module after the directory
    assert export_main([str(run), "--out", str(out)]) == 0

    model = auto_load(out, monkeypatch)
    assert isinstance(model, PreTrainedModel) and type(model).__name__ == "DFlashDraftModel"
    assert type(model).__module__.startswith("transformers_modules.")
    assert (model.block_size, model.mask_token_id, model.target_layer_ids) == \
        (trained.block_size, trained.mask_token_id, trained.target_layer_ids)
    ours, theirs = trained.state_dict(), model.state_dict()
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)

    # Several blocks after one context, with the training mask (a sliding layer's window included).
    gen = torch.Generator().manual_seed(3)
    features = torch.randn(2, 20, trained.feature_size, generator=gen)
    anchors = torch.tensor([[3, 12], [5, 17]])
    ids = torch.randint(0, VOCAB - 1, (2, 20), generator=gen)
    blocks = build_block_inputs(input_ids=ids, loss_mask=torch.ones_like(ids, dtype=torch.bool),
                                lengths=torch.tensor([20, 20]), anchors=anchors,
                                anchor_valid=torch.ones_like(anchors, dtype=torch.bool),
                                block_size=BLOCK, mask_token_id=VOCAB - 1)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    noise = F.embedding(blocks.block_ids, embed)
    with torch.no_grad():
        expected = trained(features, noise, blocks.position_ids, blocks.attention_mask)
        got = model(position_ids=blocks.position_ids, attention_mask=blocks.attention_mask,
                    noise_embedding=noise, target_hidden=features)
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)

        lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)  # the target's, passed as a module
        lm_head.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=gen))
        logits = model.compute_logits(got, lm_head)
        torch.testing.assert_close(logits, trained.draft_logits(expected, lm_head.weight), rtol=1e-6, atol=1e-6)
        if trained.draft_vocab_size:
            assert torch.isinf(logits).sum(-1).eq(VOCAB - trained.draft_vocab_size).all()
        if trained.draft_head is not None:  # the drafter's own head, not the target's rows, scores its drafts
            torch.testing.assert_close(logits[..., trained.draft_vocab], got @ trained.draft_head.T)


@pytest.mark.parametrize("per_layer", [False, True], ids=["dynamic-cache", "sliding-layer-cache"])
def test_automodel_runs_the_reference_decoding_loop_with_a_transformers_cache(tmp_path, hf_modules, monkeypatch,
                                                                             per_layer):
    # The published loop (z-lab/dflash) passes a DynamicCache that keeps every key and crops
    # the block after verification; drafts must equal a pass given the whole context. Built
    # from the config (as that loop does), the cache keeps only a window on sliding layers.
    run = tmp_path / "run"
    trained = make_checkpoint(run, layer_types=["sliding_attention", "full_attention"], sliding_window=9)
    out = tmp_path / f"{tmp_path.name}-export"
    assert export_main([str(run), "--out", str(out)]) == 0
    model = auto_load(out, monkeypatch).eval()
    gen = torch.Generator().manual_seed(4)
    features = torch.randn(1, 23, trained.feature_size, generator=gen)
    noise = torch.randn(1, BLOCK, HIDDEN, generator=gen)
    cache = DynamicCache()
    if per_layer:
        if not hasattr(DynamicCache, "activate_past_recording"):
            pytest.skip("this transformers has no sliding-window cache layers to roll back")
        cache = DynamicCache(config=model.config)
        cache.activate_past_recording()
    with torch.no_grad():
        for lo, hi in [(0, 9), (9, 14), (14, 23)]:  # the context accepted by three verifications
            got = model(target_hidden=features[:, lo:hi], noise_embedding=noise,
                        position_ids=torch.arange(lo, hi + BLOCK)[None], past_key_values=cache, use_cache=True)
            cache.crop(hi - cache.get_seq_length())  # drop the block, as the reference loop does
            expected = trained(features[:, :hi], noise, torch.arange(hi + BLOCK)[None])
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_export_loads_as_bfloat16(tmp_path, hf_modules, monkeypatch):
    run = tmp_path / "run"
    trained = make_checkpoint(run, layer_types=["full_attention", "sliding_attention"], sliding_window=9)
    out = tmp_path / f"{tmp_path.name}-export"
    assert export_main([str(run), "--dtype", "bfloat16", "--out", str(out)]) == 0
    model = auto_load(out, monkeypatch, dtype="auto")
    assert model.dtype == torch.bfloat16 and model.fc.weight.dtype == torch.bfloat16
    features, noise, positions = inputs(trained)
    with torch.no_grad():
        got = model(position_ids=positions, noise_embedding=noise.bfloat16(), target_hidden=features.bfloat16())
        # What the repository's own loader computes from the same bf16 file.
        same = block_outputs(load_drafter(out))
        torch.testing.assert_close(got.float(), same, rtol=0, atol=0)
    torch.testing.assert_close(got.float(), block_outputs(trained), rtol=0.05, atol=0.05)


def test_model_card(tmp_path):
    run = tmp_path / "run"
    make_checkpoint(run, step=20)
    make_checkpoint(run, step=40, layer_types=["sliding_attention", "full_attention"], sliding_window=9)
    (run / "config.toml").write_text('[target]\nmodel = "smollm2"\n\n[data]\nsource = "data/regen.jsonl"\n')
    report = {"step": 20, "tau": 1.4567, "num_prompts": 16, "prompt_source": "held-out data/regen.jsonl",
              "max_new_tokens": 64, "acceptance_rate": [0.4, 0.2, None, 0.0, 0.0, 0.0, 0.0]}
    (run / "eval" / "d0").mkdir(parents=True)
    (run / "eval" / "d0" / "step-20.json").write_text(json.dumps(report))
    (run / "eval" / "d0" / "step-60.json").write_text(json.dumps({**report, "step": 60, "tau": 9.0}))  # later

    out = tmp_path / "export"
    assert export_main([str(run), "--out", str(out), "--dtype", "bfloat16"]) == 0
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    for text in ("`tiny`", 'target.model = "smollm2"', "`data/regen.jsonl`",
                 "| steps trained | 40 (40,000 trained tokens) |",
                 "| block size | 8 ", "(sliding_attention, full_attention); sliding window 9 positions",
                 "**1.46**", "at step 20 (these weights: step 40)", "16 prompts", "0.40 0.20 - 0.00",
                 'AutoModel.from_pretrained("export", trust_remote_code=True, dtype="auto")', "bfloat16"):
        assert text in card, text
    assert "9.00" not in card

    # The measured step itself, and a run with no report.
    assert export_main([str(run), "--step", "20", "--out", str(tmp_path / "e20")]) == 0
    card = (tmp_path / "e20" / "README.md").read_text()
    assert "**1.46**" in card and "these weights" not in card
    (run / "eval" / "d0" / "step-20.json").unlink()
    assert export_main([str(run), "--out", str(out)]) == 0
    assert f"not measured (run `dflash-eval {run} --drafter d0 --step 40`)" in (out / "README.md").read_text()


def test_export_errors(tmp_path, capsys):
    run = tmp_path / "run"
    assert export_main([str(run), "--out", str(tmp_path / "x")]) == 1
    assert "no checkpoint" in capsys.readouterr().err
    make_checkpoint(run)
    assert export_main([str(run), "--step", "999", "--out", str(tmp_path / "x")]) == 2
    assert "step-999" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export_main([str(run), "--out", str(tmp_path / "x"), "--dtype", "int8"])
