"""drafter.init_from: a fresh drafter starts from an exported or published drafter directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common import protocol as P
from common.config import load_config
from drafter_worker.model.dflash_model import DFlashDrafter, build_target_layer_ids, load_drafter, save_drafter
from drafter_worker.checkpoint import CheckpointStore, Coverage, InitFromError, TrainerState, load_init_from
from drafter_worker.trainer import make_optimizer
from tests import messages
from tests.fixtures import TINY_CAPTURED, TINY_HIDDEN as HIDDEN, TINY_TARGET_LAYERS, TINY_VOCAB as VOCAB, tiny_drafter
from tools.export import export_drafter

LAYER_IDS = build_target_layer_ids(TINY_TARGET_LAYERS, TINY_CAPTURED)
MASK = VOCAB - 1


def trained_drafter(seed: int = 7, **overrides) -> DFlashDrafter:
    model = tiny_drafter(seed, **{"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"],
                                  "sliding_window": 8, **overrides})
    with torch.no_grad():  # stands in for training: no weight is at its initial value
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def welcome(**overrides) -> P.Welcome:
    """A WELCOME from the tiny target the drafters above were made for (override to mismatch)."""
    fields = dict(hidden_size=HIDDEN, num_target_layers=TINY_TARGET_LAYERS, target_layer_ids=LAYER_IDS, vocab_size=VOCAB,
                  mask_token_id=MASK, train_samples=10, batches_per_epoch=5, data_fingerprint="f" * 16)
    fields.update(overrides)
    return messages.welcome(**fields)


def make_worker(tmp_path: Path, init_from: Path | str, *extra: str):
    from drafter_worker.worker import DrafterWorker

    return DrafterWorker(load_config(None, [
        f'run.root_dir="{tmp_path}"', 'run.name="w"', 'drafter.id="d0"', "drafter.block_size=4",
        f'drafter.init_from="{init_from}"', *extra,
    ]))


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert torch.equal(sa[name].float(), sb[name].float()), name


def test_init_from_an_export_starts_training_from_its_weights(tmp_path):
    source = trained_drafter()
    exported = tmp_path / "exported"
    save_drafter(exported, source, with_code=True)  # what dflash-export writes
    # num_layers/draft_vocab_size differ from the directory's: the directory's architecture wins.
    worker = make_worker(tmp_path, exported, "drafter.num_layers=1", "drafter.logit_std_init=1.0",
                         "drafter.feature_scale_init=true")
    try:
        worker._ensure_model(welcome())
        model = worker.trainer.model
        assert_same_weights(model, source)
        assert model.fc.weight.dtype == torch.float32
        assert [layer.self_attn.sliding_window for layer in model.layers] == [8, None]
        # Trained weights: the fresh-model scaling (logit std, fc by feature RMS) must not run.
        assert worker._fresh_model is False and worker._scale_features is False
        assert worker.trainer.step == 0 and worker.state.init_from == str(exported.resolve())
        assert worker.state.data_fingerprint == "f" * 16
        # The checkpoint it writes is a plain drafter checkpoint that records where it started.
        state = TrainerState(3, [Coverage()], "d0", "tiny", init_from=worker.state.init_from)
        CheckpointStore(tmp_path / "w", "d0", keep=2, writer=True).save(
            state, model, worker.trainer.optimizer, torch.Generator())
        saved = tmp_path / "w" / "checkpoints" / "d0" / "step-3"
        assert "auto_map" not in json.loads((saved / "config.json").read_text())
        assert json.loads((saved / "trainer_state.json").read_text())["init_from"] == str(exported.resolve())
    finally:
        worker.close()


def test_init_from_a_bfloat16_export_of_a_run(tmp_path):
    # The whole path: a run's checkpoint, dflash-export --dtype bfloat16, init_from in another run.
    source = trained_drafter(draft_vocab_size=16)
    source.set_draft_vocab(torch.arange(16) * 3)
    first = tmp_path / "first"
    CheckpointStore(first, "d0", keep=1).save(TrainerState(9, [Coverage()], "d0", "tiny"), source,
                                              make_optimizer(load_config().drafter, source), torch.Generator())
    exported = export_drafter(first / "checkpoints" / "d0" / "step-9", tmp_path / "exported", dtype="bfloat16")
    worker = make_worker(tmp_path, exported)
    try:
        worker._ensure_model(welcome())
        model = worker.trainer.model
        assert model.fc.weight.dtype == torch.float32  # trained in fp32 from the bf16 values
        assert_same_weights(model, load_drafter(exported))
        assert torch.equal(model.draft_vocab, torch.arange(16) * 3)
    finally:
        worker.close()


@pytest.mark.parametrize("overrides, extra, expected", [
    (dict(hidden_size=48), (), ["hidden size 32, the target's is 48"]),
    (dict(vocab_size=80, mask_token_id=79), (), ["vocabulary size 64, the target's is 80",
                                                 "mask token 63, the target uses 79 (set target.mask_token_id = 63)"]),
    (dict(target_layer_ids=[1, 2]), (), ["target layers [1, 3], the target captures [1, 2] "
                                         "(set target.target_layer_ids = [1, 3])"]),
    ({}, ("drafter.block_size=8",), ["block size 4, drafter.block_size is 8 (set drafter.block_size = 4)"]),
])
def test_init_from_refuses_a_drafter_made_for_another_target(tmp_path, overrides, extra, expected):
    from drafter_worker.worker import FatalError

    exported = tmp_path / "exported"
    save_drafter(exported, trained_drafter(), with_code=True)
    worker = make_worker(tmp_path, exported, *extra)
    try:
        with pytest.raises(FatalError) as refused:
            worker._ensure_model(welcome(**overrides))
        message = str(refused.value)
        assert message.startswith(f"drafter.init_from = '{exported}' was made for another setup: ")
        for text in expected:
            assert text in message
        assert worker.trainer is None
    finally:
        worker.close()


def test_init_from_names_what_is_wrong_with_the_directory(tmp_path):
    with pytest.raises(InitFromError, match="no config.json there"):
        load_init_from(tmp_path / "missing", torch.device("cpu"), hidden_size=HIDDEN, vocab_size=VOCAB,
                       target_layer_ids=LAYER_IDS, mask_token_id=MASK, block_size=4)
    broken = tmp_path / "broken"
    save_drafter(broken, trained_drafter())
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(InitFromError, match="cannot be loaded as a DFlash drafter"):
        load_init_from(broken, torch.device("cpu"), hidden_size=HIDDEN, vocab_size=VOCAB,
                       target_layer_ids=LAYER_IDS, mask_token_id=MASK, block_size=4)


def test_a_published_layout_without_dflash_block_size_loads(tmp_path):
    # Published drafters keep block_size at the top level only, rope_theta in the 4.x
    # place, and ship an auto_map; init_from reads them as they are.
    exported = tmp_path / "published"
    save_drafter(exported, trained_drafter(layer_types=None, sliding_window=0), with_code=True)
    raw = json.loads((exported / "config.json").read_text())
    del raw["dflash_config"]["block_size"]
    raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]
    (exported / "config.json").write_text(json.dumps(raw))
    model = load_init_from(exported, torch.device("cpu"), hidden_size=HIDDEN, vocab_size=VOCAB,
                           target_layer_ids=LAYER_IDS, mask_token_id=MASK, block_size=4)
    assert model.block_size == 4 and model.rotary_emb.theta == 10000.0


def test_sharded_weights_load(tmp_path):
    # Larger published drafters may ship model.safetensors.index.json and shards.
    from safetensors.torch import save_file

    source = trained_drafter()
    exported = tmp_path / "sharded"
    save_drafter(exported, source, with_code=True)
    (exported / "model.safetensors").unlink()
    state = {k: v.contiguous() for k, v in source.state_dict().items()}
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, exported / shard, metadata={"format": "pt"})
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (exported / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model = load_init_from(exported, torch.device("cpu"), hidden_size=HIDDEN, vocab_size=VOCAB,
                           target_layer_ids=LAYER_IDS, mask_token_id=MASK, block_size=4)
    assert_same_weights(model, source)


def test_a_resume_wins_over_init_from(tmp_path):
    own = trained_drafter(seed=1, layer_types=None, sliding_window=0, num_hidden_layers=1)
    CheckpointStore(tmp_path / "w", "d0", keep=1, writer=True).save(
        TrainerState(5, [Coverage()], "d0", "tiny", data_fingerprint="f" * 16), own,
        make_optimizer(load_config().drafter, own), torch.Generator())
    exported = tmp_path / "exported"
    save_drafter(exported, trained_drafter(seed=2), with_code=True)
    worker = make_worker(tmp_path, exported)
    try:
        worker._ensure_model(welcome())
        assert worker.trainer.step == 5
        assert_same_weights(worker.trainer.model, own)
    finally:
        worker.close()
