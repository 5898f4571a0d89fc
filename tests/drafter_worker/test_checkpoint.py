"""Tests for drafter_worker/checkpoint.py: coverage, checkpoint store, ledger and lineage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.config import DrafterConfig
from drafter_worker.model.dflash_model import DFlashDrafter
from drafter_worker.checkpoint import CheckpointStore, Coverage, Ledger, TrainerState, read_lineage, verify_lineage
from drafter_worker.trainer import make_optimizer
from tests.fixtures import TINY_HIDDEN as HIDDEN, tiny_drafter


def one_step(model: DFlashDrafter, optimizer: torch.optim.Optimizer) -> None:
    """A real optimizer step so AdamW has state (exp_avg, exp_avg_sq, step)."""
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(1, 6, model.feature_size, generator=gen)
    noise = torch.randn(1, 4, HIDDEN, generator=gen)
    pos = torch.arange(10)[None]
    model(feats, noise, pos).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def state(step: int, coverage: Coverage | None = None) -> TrainerState:
    return TrainerState(step=step, coverage=[coverage or Coverage()], drafter_id="d0",
                        model_id="tiny", tokens_trained=step * 100)


# ---------------------------------------------------------------------------
# Coverage
# ---------------------------------------------------------------------------


def test_coverage_watermark_and_extra():
    cov = Coverage()
    assert (cov.watermark, cov.extra) == (0, set())
    cov.add(0)
    cov.add(1)
    assert (cov.watermark, cov.extra) == (2, set())
    cov.add(4)
    cov.add(3)
    assert (cov.watermark, cov.extra) == (2, {3, 4})
    cov.add(2)  # fills the hole: the watermark jumps past everything contiguous
    assert (cov.watermark, cov.extra) == (5, set())
    cov.add(9)
    assert (cov.watermark, cov.extra) == (5, {9})


def test_coverage_double_add_raises():
    cov = Coverage()
    for i in (0, 1, 5):
        cov.add(i)
    with pytest.raises(ValueError, match="1"):
        cov.add(1)  # below the watermark
    with pytest.raises(ValueError, match="5"):
        cov.add(5)  # in extra
    assert (cov.watermark, cov.extra) == (2, {5})  # a refused add changes nothing


def test_coverage_json_round_trip():
    cov = Coverage()
    for i in (0, 1, 2, 7, 4, 11):
        cov.add(i)
    data = json.loads(json.dumps(cov.to_json()))
    assert data == {"watermark": 3, "extra": [4, 7, 11]}
    back = Coverage.from_json(data)
    assert back == cov
    assert Coverage.from_json(Coverage().to_json()) == Coverage()


# ---------------------------------------------------------------------------
# CheckpointStore
# ---------------------------------------------------------------------------


def test_save_latest_read_state_load_round_trip(tmp_path):
    cfg = DrafterConfig()
    model = tiny_drafter()
    optimizer = make_optimizer(cfg, model)
    one_step(model, optimizer)
    generator = torch.Generator().manual_seed(123)
    torch.rand(5, generator=generator)  # advance it: the saved state is not the seed's
    cov = Coverage()
    for i in (0, 1, 2, 5):
        cov.add(i)

    store = CheckpointStore(tmp_path, "d0", keep=2)
    assert store.latest() is None
    path = store.save(state(7, cov), model, optimizer, generator)
    assert path == tmp_path / "checkpoints" / "d0" / "step-7"
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    assert store.latest() == path

    st = store.read_state(path)
    assert st == state(7, cov)

    model2, opt2, gen_state, rng_state = store.load(path, torch.device("cpu"), lambda m: make_optimizer(cfg, m))
    sd1, sd2 = model.state_dict(), model2.state_dict()
    assert sd1.keys() == sd2.keys()
    for name in sd1:
        assert torch.equal(sd1[name], sd2[name]), name
    assert all(p.dtype == torch.float32 for p in model2.parameters())

    s1, s2 = optimizer.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert s1["state"].keys() == s2["state"].keys() and len(s1["state"]) > 0
    for key, entry in s1["state"].items():
        for name, value in entry.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(s2["state"][key][name])), (key, name)
    # The loaded optimizer drives the loaded model's parameters.
    assert {id(p) for g in opt2.param_groups for p in g["params"]} == {id(p) for p in model2.parameters()}

    restored = torch.Generator()
    restored.set_state(gen_state)
    assert torch.equal(restored.get_state(), generator.get_state())
    assert torch.equal(torch.rand(4, generator=restored), torch.rand(4, generator=generator))
    assert isinstance(rng_state, torch.Tensor) and rng_state.dtype == torch.uint8


def test_training_resumes_identically(tmp_path):
    # The same next step from the live objects and from the checkpoint gives the same weights.
    cfg = DrafterConfig()
    model = tiny_drafter()
    optimizer = make_optimizer(cfg, model)
    one_step(model, optimizer)
    store = CheckpointStore(tmp_path, "d0", keep=1)
    path = store.save(state(1), model, optimizer, torch.Generator().manual_seed(0))
    model2, opt2, _, _ = store.load(path, torch.device("cpu"), lambda m: make_optimizer(cfg, m))
    one_step(model, optimizer)
    one_step(model2, opt2)
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name


def test_pruning_keeps_newest(tmp_path):
    cfg = DrafterConfig()
    model = tiny_drafter()
    optimizer = make_optimizer(cfg, model)
    gen = torch.Generator().manual_seed(0)
    store = CheckpointStore(tmp_path, "d0", keep=2)
    for step in (5, 10, 20, 100):  # 100 sorts before 20 as a string: order must be numeric
        store.save(state(step), model, optimizer, gen)
    names = sorted(p.name for p in store.root.glob("step-*"))
    assert names == ["step-100", "step-20"]
    assert store.latest() == store.root / "step-100"
    assert not list(store.root.glob(".tmp-*"))


def test_resaving_a_step_replaces_it(tmp_path):
    cfg = DrafterConfig()
    model = tiny_drafter()
    optimizer = make_optimizer(cfg, model)
    gen = torch.Generator().manual_seed(0)
    store = CheckpointStore(tmp_path, "d0", keep=3)
    store.save(state(5), model, optimizer, gen)
    store.save(TrainerState(5, [Coverage(9)], "d0", "tiny"), model, optimizer, gen)
    assert store.read_state(store.latest()).coverage[0].watermark == 9


def test_leftover_tmp_directory_does_not_confuse_latest(tmp_path):
    cfg = DrafterConfig()
    model = tiny_drafter()
    optimizer = make_optimizer(cfg, model)
    gen = torch.Generator().manual_seed(0)
    store = CheckpointStore(tmp_path, "d0", keep=2)
    store.save(state(10), model, optimizer, gen)
    # A process killed while writing step 15: a half-written temporary directory.
    junk = store.root / ".tmp-step-15-99999"
    junk.mkdir()
    (junk / "trainer_state.json").write_text(json.dumps({"step": 15}))
    (store.root / ".latest.tmp").write_text("step-15")  # pointer written but never renamed
    assert store.latest() == store.root / "step-10"
    assert store.read_state(store.latest()).step == 10
    # The next save still works and pruning leaves the temporary alone (it is not step-*).
    store.save(state(20), model, optimizer, gen)
    assert store.latest() == store.root / "step-20"


def test_latest_pointing_at_a_missing_checkpoint_is_none(tmp_path):
    store = CheckpointStore(tmp_path, "d0", keep=2)
    store.root.mkdir(parents=True)
    (store.root / "latest").write_text("step-42\n")
    assert store.latest() is None
    (store.root / "step-42").mkdir()  # a directory without trainer_state.json is not a checkpoint
    assert store.latest() is None


def test_stores_of_two_drafters_are_separate(tmp_path):
    cfg = DrafterConfig()
    model = tiny_drafter()
    optimizer = make_optimizer(cfg, model)
    gen = torch.Generator().manual_seed(0)
    CheckpointStore(tmp_path, "d0", keep=2).save(state(3), model, optimizer, gen)
    assert CheckpointStore(tmp_path, "d1", keep=2).latest() is None


# ---------------------------------------------------------------------------
# Ledger and lineage
# ---------------------------------------------------------------------------


class FakeRun:
    """Drives a Ledger the way the worker does: trained() per step, make_durable() before each checkpoint."""

    def __init__(self, run_dir: Path, resume_from: int, run_tag: int):
        self.ledger = Ledger(run_dir, "d0")
        self.ledger.resumed(resume_from)
        self.tag = run_tag
        self.checkpoints: list[int] = []

    def train(self, steps: range, checkpoint_every: int | None = 5) -> None:
        for step in steps:
            batch = step * 100 + self.tag  # the batch id says which run trained it
            self.ledger.trained(step, batch, 0, [batch * 10, batch * 10 + 1])
            if checkpoint_every and step % checkpoint_every == 0:
                self.ledger.make_durable()
                self.checkpoints.append(step)


def test_lineage_after_crash_with_pending_steps(tmp_path):
    first = FakeRun(tmp_path, resume_from=0, run_tag=1)
    first.train(range(1, 11))
    assert first.checkpoints == [5, 10]
    first.train(range(11, 14), checkpoint_every=None)  # pending, never durable: then the crash
    del first

    second = FakeRun(tmp_path, resume_from=10, run_tag=2)
    second.train(range(11, 16))
    assert second.checkpoints == [15]

    lineage = read_lineage(second.ledger.path, 15)
    assert sorted(lineage) == list(range(1, 16))
    for step, entry in lineage.items():
        assert entry["step"] == step
        assert entry["batch_id"] == step * 100 + (1 if step <= 10 else 2)
    samples = [s for e in lineage.values() for s in e["sample_ids"]]
    assert len(samples) == len(set(samples)) == 30


def test_lineage_discards_durable_lines_of_a_checkpoint_never_renamed(tmp_path):
    first = FakeRun(tmp_path, resume_from=0, run_tag=1)
    first.train(range(1, 11))
    first.train(range(11, 16), checkpoint_every=None)
    # make_durable() ran for step 15 but the process died before the rename:
    # the lines are on disk, the checkpoint is not, so a restart resumes from 10.
    first.ledger.make_durable()
    lines = first.ledger.path.read_text().splitlines()
    assert sum(json.loads(line)["kind"] == "step" for line in lines) == 15
    # Before the restart, the file alone says 1..15 (of the dead lineage).
    assert sorted(read_lineage(first.ledger.path, 15)) == list(range(1, 16))

    second = FakeRun(tmp_path, resume_from=10, run_tag=2)
    # Right after the resume line, nothing past 10 survives.
    assert sorted(read_lineage(second.ledger.path, 15)) == list(range(1, 11))
    second.train(range(11, 16))
    lineage = read_lineage(second.ledger.path, 15)
    assert sorted(lineage) == list(range(1, 16))
    for step in range(11, 16):
        assert lineage[step]["batch_id"] == step * 100 + 2  # the second run's, not the dead one's
    for step in range(1, 11):
        assert lineage[step]["batch_id"] == step * 100 + 1


def test_lineage_of_an_earlier_checkpoint(tmp_path):
    run = FakeRun(tmp_path, resume_from=0, run_tag=1)
    run.train(range(1, 16))
    assert sorted(read_lineage(run.ledger.path, 10)) == list(range(1, 11))


def test_several_crashes(tmp_path):
    a = FakeRun(tmp_path, resume_from=0, run_tag=1)
    a.train(range(1, 8))  # durable through 5; 6 and 7 pending, lost
    b = FakeRun(tmp_path, resume_from=5, run_tag=2)
    b.train(range(6, 13))  # durable through 10; 11, 12 lost
    b.ledger.make_durable()  # ...but made durable just before dying (no checkpoint 12)
    c = FakeRun(tmp_path, resume_from=10, run_tag=3)
    c.train(range(11, 16))
    lineage = read_lineage(c.ledger.path, 15)
    assert sorted(lineage) == list(range(1, 16))
    tags = [lineage[s]["batch_id"] % 100 for s in range(1, 16)]
    assert tags == [1] * 5 + [2] * 5 + [3] * 5


def test_make_durable_without_pending_writes_nothing(tmp_path):
    ledger = Ledger(tmp_path, "d0")
    ledger.make_durable()
    assert not ledger.path.exists() or ledger.path.read_text() == ""
    ledger.resumed(0)
    ledger.make_durable()
    assert len(ledger.path.read_text().splitlines()) == 1


def test_lineage_with_several_steps_per_batch(tmp_path):
    # drafter.steps_per_batch = 3: each batch is one ledger entry covering three steps.
    run_dir = tmp_path
    cfg = DrafterConfig()
    model = tiny_drafter()
    optimizer = make_optimizer(cfg, model)
    store = CheckpointStore(run_dir, "d0", keep=2)
    ledger = Ledger(run_dir, "d0")
    ledger.resumed(0)
    for batch in range(4):
        ledger.trained(3 * batch + 3, batch, 0, [batch], first_step=3 * batch + 1)
    ledger.make_durable()
    store.save(state(12, Coverage(4)), model, optimizer, torch.Generator().manual_seed(0))
    report = verify_lineage(run_dir, "d0")
    assert report.ok, report.problems
    assert report.batches == 4 and report.final_step == 12
    # A step no entry covers is reported.
    ledger.trained(14, 9, 0, [9])
    ledger.make_durable()
    store.save(state(14, Coverage(4, {9})), model, optimizer, torch.Generator().manual_seed(0))
    assert "missing" in " ".join(verify_lineage(run_dir, "d0").problems)


def test_trainer_state_of_an_older_checkpoint_has_no_data_identity(tmp_path):
    # Checkpoints written before train_samples / data_fingerprint existed still resume.
    cfg = DrafterConfig()
    model = tiny_drafter()
    store = CheckpointStore(tmp_path, "d0", keep=2)
    path = store.save(state(3), model, make_optimizer(cfg, model), torch.Generator())
    data = json.loads((path / "trainer_state.json").read_text())
    for key in ("train_samples", "data_fingerprint", "batches_per_epoch"):
        del data[key]
    (path / "trainer_state.json").write_text(json.dumps(data))
    st = store.read_state(path)
    assert (st.train_samples, st.data_fingerprint, st.batches_per_epoch) == (0, "", 0)
    full = TrainerState(3, [Coverage(2)], "d0", "tiny", 300, train_samples=8, data_fingerprint="abc",
                        batches_per_epoch=4)
    store.save(full, model, make_optimizer(cfg, model), torch.Generator())
    assert store.read_state(store.latest()) == full


def test_the_training_clock_resumes_and_a_corrupt_one_falls_back_to_the_previous_checkpoint(tmp_path):
    cfg = DrafterConfig()
    model = tiny_drafter()
    store = CheckpointStore(tmp_path, "d0", keep=3)
    store.save(TrainerState(3, [Coverage(2)], "d0", "tiny", train_seconds=61.5), model, make_optimizer(cfg, model),
               torch.Generator())
    assert store.read_state(store.latest()).train_seconds == 61.5
    newer = store.save(TrainerState(5, [Coverage(3)], "d0", "tiny", train_seconds=90.0), model,
                       make_optimizer(cfg, model), torch.Generator())
    data = json.loads((newer / "trainer_state.json").read_text())
    for bad in (float("nan"), -1.0, "soon"):
        (newer / "trainer_state.json").write_text(json.dumps({**data, "train_seconds": bad}))
        with pytest.raises(ValueError, match="train_seconds"):
            store.read_state(newer)
        back = store.latest()  # the step-3 checkpoint, whose clock is intact
        assert back.name == "step-3" and store.read_state(back).train_seconds == 61.5
    del data["train_seconds"]  # a checkpoint from before the clock: it starts at 0
    (newer / "trainer_state.json").write_text(json.dumps(data))
    assert store.read_state(store.latest()).train_seconds == 0.0


def test_a_corrupt_ledger_line_in_the_middle_is_an_error(tmp_path):
    # Only an unfinished last line may be skipped: damage in the middle would hide lost steps.
    ledger = Ledger(tmp_path, "d0")
    ledger.resumed(0)
    ledger.trained(1, 0, 0, [0])
    ledger.make_durable()
    with open(ledger.path, "a") as f:
        f.write('{"kind": "st\n')
    ledger.trained(2, 1, 0, [1])
    ledger.make_durable()
    with pytest.raises(ValueError, match="line 3 is corrupt"):
        read_lineage(ledger.path, 2)
