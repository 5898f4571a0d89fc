"""Hostile tests of the drafter's durable state: kill -9 anywhere in a checkpoint save or a ledger append,
a full disk, a torn ledger tail, an unusable ``latest``, and the ledger's completeness check.

Every test works on real files; the kills are real SIGKILLs of child processes.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common import protocol as P
from tests.messages import welcome
from common.config import DrafterConfig, load_config
from deploy.launcher import Job
from drafter_worker import checkpoint
from drafter_worker import model_setup
from drafter_worker.checkpoint import (
    CheckpointStore, Coverage, Ledger, TrainerState, ledger_name, read_lineage, verify_lineage,
)
from drafter_worker.trainer import make_optimizer
from tests.conftest import ROOT
from tests.drafter_worker.test_checkpoint import one_step
from tests.fixtures import tiny_drafter, write_config

pytestmark = pytest.mark.timeout(240)

TRAIN_SAMPLES = 12
SAMPLES_PER_BATCH = 2
BATCHES_PER_EPOCH = TRAIN_SAMPLES // SAMPLES_PER_BATCH
FINGERPRINT = "f" * 16

# Calls a save or an append is made of; a fault lands before one of them (an os.write: halfway through it).
_OS_WRITE = os.write
FAULT_POINTS = [
    (os, "write"), (os, "fsync"), (os, "replace"), (os, "ftruncate"), (os, "mkdir"), (os, "unlink"),
    (shutil, "rmtree"), (checkpoint, "save_drafter"), (checkpoint, "_torch_save"),
]


def samples_of(batch: int) -> list[int]:
    """The plan: batch b of an epoch holds samples 2k, 2k+1 with k = b mod BATCHES_PER_EPOCH."""
    k = batch % BATCHES_PER_EPOCH
    return list(range(k * SAMPLES_PER_BATCH, (k + 1) * SAMPLES_PER_BATCH))


def new_state(drafter_id: str = "d0") -> TrainerState:
    return TrainerState(0, [Coverage()], drafter_id, "tiny", train_samples=TRAIN_SAMPLES,
                        data_fingerprint=FINGERPRINT, batches_per_epoch=BATCHES_PER_EPOCH)


def train(ledger: Ledger, state: TrainerState, batches) -> None:
    """What the worker records per trained batch (one step each)."""
    for batch in batches:
        state.step += 1
        state.coverage[0].add(batch)
        ledger.trained(state.step, batch, batch // BATCHES_PER_EPOCH, samples_of(batch))


class Drafter:
    """The tiny model, optimizer and generator a checkpoint holds."""

    def __init__(self):
        self.model = tiny_drafter()
        self.optimizer = make_optimizer(DrafterConfig(), self.model)
        one_step(self.model, self.optimizer)
        self.generator = torch.Generator().manual_seed(0)

    def checkpoint(self, store: CheckpointStore, ledger: Ledger, state: TrainerState) -> Path:
        """The worker's order: ledger lines durable first, then the checkpoint that covers them."""
        ledger.make_durable()
        return store.save(state, self.model, self.optimizer, self.generator)


def prepare(run_dir: Path, drafter: Drafter) -> None:
    """Checkpoints 3 and 5 (keep 2) with their ledger lines."""
    store, ledger, state = CheckpointStore(run_dir, "d0", keep=2, writer=True), Ledger(run_dir, "d0"), new_state()
    ledger.resumed(0)
    train(ledger, state, range(0, 3))
    drafter.checkpoint(store, ledger, state)
    train(ledger, state, range(3, 5))
    drafter.checkpoint(store, ledger, state)


def resume_train_save(run_dir: Path, drafter: Drafter) -> None:
    """A (re)start: resume from the latest checkpoint if any, train five batches, checkpoint (which may prune one)."""
    store, ledger = CheckpointStore(run_dir, "d0", keep=2, writer=True), Ledger(run_dir, "d0")
    latest = store.latest()
    state = new_state() if latest is None else store.read_state(latest)
    ledger.resumed(state.step)
    train(ledger, state, range(state.coverage[0].watermark, state.coverage[0].watermark + 5))
    drafter.checkpoint(store, ledger, state)


@contextmanager
def fault_at(n: int, fault):
    """Call ``fault(real, args)`` instead of the n-th call to any of FAULT_POINTS; yields each call's (name, args)."""
    calls: list[tuple[str, tuple]] = []
    saved = [(module, name, getattr(module, name)) for module, name in FAULT_POINTS]

    def counted(name, real):
        def call(*args, **kwargs):
            calls.append((name, args))
            if len(calls) == n:
                return fault(real, args)
            return real(*args, **kwargs)
        return call

    for module, name, real in saved:
        setattr(module, name, counted(name, real))
    try:
        yield calls
    finally:
        for module, name, real in saved:
            setattr(module, name, real)


def sigkill(real, args) -> None:
    if real is _OS_WRITE and len(args[1]) > 1:
        real(args[0], bytes(args[1])[: len(args[1]) // 2])  # a torn write
    os.kill(os.getpid(), signal.SIGKILL)


def _child(run_dir: str, kill_at: int) -> None:
    """Child process: a restart that is SIGKILLed at write-like call ``kill_at`` (0: never); writes the count."""
    drafter = Drafter()
    with fault_at(kill_at, sigkill) as calls:
        resume_train_save(Path(run_dir), drafter)
    Path(run_dir, "calls").write_text(str(len(calls)))


def run_child(ctx, run_dir: Path, kill_at: int) -> int:
    proc = ctx.Process(target=_child, args=(str(run_dir), kill_at))
    proc.start()
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError(f"the child killed at call {kill_at} hung")
    return proc.exitcode


def check_resumes(run_dir: Path, drafter: Drafter, steps: set[int]) -> int:
    """A new start finds a readable checkpoint (step 0: none, only if none ever completed) and a ledger
    whose lineage holds every step it covers."""
    store = CheckpointStore(run_dir, "d0", keep=2, writer=True)
    assert not list(store.root.glob(".tmp-*")) and not (store.root / ".latest.tmp").exists()
    latest = store.latest()
    if latest is None:
        assert 0 in steps
        Ledger(run_dir, "d0").resumed(0)
        assert read_lineage(run_dir / "ledger" / "d0.jsonl", 0) == {}
        return 0
    step = store.read_state(latest).step
    assert step in steps
    store.load(latest, torch.device("cpu"), lambda m: make_optimizer(DrafterConfig(), m))
    Ledger(run_dir, "d0").resumed(step)
    report = verify_lineage(run_dir, "d0")
    assert report.ok, report.problems
    assert sorted(read_lineage(run_dir / "ledger" / "d0.jsonl", step)) == list(range(1, step + 1))
    return step


# ---------------------------------------------------------------------------
# 1. kill -9 anywhere in a save or an append
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("earlier, outcomes", [(True, {5, 10}), (False, {0, 5})], ids=["resumed", "first-save"])
def test_sigkill_at_every_call_of_a_save_and_its_ledger_append_loses_nothing(tmp_path, earlier, outcomes):
    # Guards against a kill leaving a torn ledger line (glued to the next resume line),
    # a half checkpoint that `latest` names, or a checkpoint whose ledger lines are lost.
    drafter = Drafter()
    base = tmp_path / "base"
    base.mkdir()
    if earlier:
        prepare(base, drafter)
    ctx = multiprocessing.get_context("forkserver")
    # Forked from a server that imported these once: a child starts in milliseconds (torch._dynamo: AdamW's first use).
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "tests.hostile.test_durability"])
    clean = tmp_path / "clean"
    shutil.copytree(base, clean)
    assert run_child(ctx, clean, 0) == 0
    total = int((clean / "calls").read_text())
    assert total >= 25, total  # the resume line, five ledger lines, and every step of the save (and the prune)
    assert check_resumes(clean, drafter, outcomes) == max(outcomes)
    resumed_at = set()
    for n in range(1, total + 1):
        run = tmp_path / f"kill-{n}"
        shutil.copytree(base, run)
        assert run_child(ctx, run, n) == -signal.SIGKILL
        resumed_at.add(check_resumes(run, drafter, outcomes))
        resume_train_save(run, drafter)  # and training goes on from there
        assert verify_lineage(run, "d0").ok
        shutil.rmtree(run)
    assert resumed_at == outcomes


# ---------------------------------------------------------------------------
# 2. a full disk
# ---------------------------------------------------------------------------


def enospc(real, args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def resumed_and_trained(run_dir: Path) -> tuple[CheckpointStore, Ledger, TrainerState]:
    store, ledger = CheckpointStore(run_dir, "d0", keep=2, writer=True), Ledger(run_dir, "d0")
    state = store.read_state(store.latest())
    ledger.resumed(state.step)
    train(ledger, state, range(5, 10))
    return store, ledger, state


def test_a_full_disk_at_any_call_of_a_save_keeps_the_last_good_checkpoint(tmp_path):
    # Guards against ENOSPC during a save crashing the worker, losing the pending ledger
    # lines, or leaving a temporary directory and a `latest` that names a half checkpoint.
    drafter = Drafter()
    prepare(tmp_path / "base", drafter)
    shutil.copytree(tmp_path / "base", tmp_path / "count")
    store, ledger, state = resumed_and_trained(tmp_path / "count")
    with fault_at(0, enospc) as calls:
        drafter.checkpoint(store, ledger, state)
    total = len(calls)
    assert total >= 20, total
    # A fault after the rename of `latest` (its directory's fsync) fails a save whose pointer is flipped already.
    flipped = next(i for i, (name, args) in enumerate(calls, 1) if name == "replace" and Path(args[1]).name == "latest")
    for n in range(1, total + 1):
        run = tmp_path / f"full-{n}"
        shutil.copytree(tmp_path / "base", run)
        store, ledger, state = resumed_and_trained(run)
        with fault_at(n, enospc):
            try:
                drafter.checkpoint(store, ledger, state)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
            else:  # the fault hit the prune, after the new checkpoint was in place
                assert store.latest() == store.root / "step-10"
                continue
        kept = "step-10" if n > flipped else "step-5"
        assert (store.root / "latest").read_text() == kept
        assert store.latest() == store.root / kept
        assert not list(store.root.glob(".tmp-*")) and not (store.root / ".latest.tmp").exists()
        # The next period's save writes the ledger lines the failed one could not.
        train(ledger, state, range(10, 12))
        drafter.checkpoint(store, ledger, state)
        report = verify_lineage(run, "d0")
        assert report.ok and report.final_step == 12, (n, report.problems)
        assert report.finished_epochs == [0, 1]
        shutil.rmtree(run)


REAL_FULL_DISK = """
import sys
from pathlib import Path
from drafter_worker.checkpoint import CheckpointStore, Ledger
from tests.hostile.test_durability import Drafter, new_state, train
run = Path(sys.argv[1])
drafter = Drafter()
store, ledger, state = CheckpointStore(run, "d0", keep=2, writer=True), Ledger(run, "d0"), new_state()
ledger.resumed(0)
train(ledger, state, range(5))
drafter.checkpoint(store, ledger, state)
train(ledger, state, range(5, 10))
try:
    drafter.checkpoint(store, ledger, state)
except OSError as exc:
    print("failed:", exc)
assert store.latest() == store.root / "step-5", store.latest()
assert not list(store.root.glob(".tmp-*")), list(store.root.iterdir())
print("ok")
"""


def _can_mount_tmpfs() -> bool:
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.parametrize("size, victim", [("196k", "model.safetensors"), ("256k", "trainer.pt")])
def test_a_real_full_tmpfs_fails_the_save_cleanly(tmp_path, size, victim):
    # torch.save and safetensors report a full disk as RuntimeError / SafetensorError: the
    # store must still see an OSError, clean up, and keep `latest`.
    if shutil.which("unshare") is None or not _can_mount_tmpfs():
        pytest.skip("needs unshare and permission to mount a tmpfs in a private mount namespace")
    run = tmp_path / "run"
    run.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f'mount -t tmpfs -o size={size} tmpfs "$1" && exec "$2" -c "$3" "$1"',
         "sh", str(run), sys.executable, REAL_FULL_DISK],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "No space left on device" in out.stdout and victim in out.stdout, out.stdout
    assert out.stdout.strip().endswith("ok")


def _worker(tmp_path: Path):
    from drafter_worker.worker import DrafterWorker

    return DrafterWorker(load_config(None, [f'run.root_dir="{tmp_path}"', 'run.name="w"', 'drafter.id="d0"']))


def test_the_worker_keeps_its_checkpoint_step_and_stops_after_repeated_save_failures(tmp_path, monkeypatch, caplog):
    from drafter_worker.worker import MAX_SAVE_FAILURES, CheckpointSaveFailed, TrainingStopped

    drafter = Drafter()
    worker = _worker(tmp_path)
    try:
        worker.state = new_state()
        worker.trainer = SimpleNamespace(model=drafter.model, optimizer=drafter.optimizer,
                                         generator=drafter.generator, step=0)

        def step(batch: int) -> None:
            worker.trainer.step += 1
            worker.state.coverage[0].add(batch)
            worker.ledger.trained(worker.trainer.step, batch, 0, samples_of(batch))

        step(0)
        worker._checkpoint()
        assert worker._checkpoint_step == 1
        real_save = worker.checkpoints.save
        monkeypatch.setattr(worker.checkpoints, "save", lambda *a: enospc(None, a))
        caplog.set_level(logging.ERROR, "drafter_worker.worker")
        for failure in range(1, MAX_SAVE_FAILURES):
            step(failure)
            worker._checkpoint()
            assert worker._checkpoint_step == 1  # what ACKs tell the target: not advanced
        lines = [r.getMessage() for r in caplog.records if r.name == "drafter_worker.worker"]
        assert len(lines) == MAX_SAVE_FAILURES - 1
        assert "No space left on device" in lines[0] and "kept checkpoint step 1" in lines[0]
        assert "retrying at the next checkpoint" in lines[0] and str(worker.checkpoints.root) in lines[0]
        # One more failure stops the worker with exit code 3 (__main__ maps TrainingStopped to 3).
        step(MAX_SAVE_FAILURES)
        with pytest.raises(CheckpointSaveFailed, match="stopping after") as stopped:
            worker._checkpoint()
        assert isinstance(stopped.value, TrainingStopped)
        # A success in between resets the count.
        monkeypatch.setattr(worker.checkpoints, "save", real_save)
        worker._checkpoint()
        assert worker._checkpoint_step == worker.trainer.step and worker._save_failures == 0
    finally:
        worker.close()
    report = verify_lineage(worker.run_dir, "d0")
    assert report.ok and report.batches == MAX_SAVE_FAILURES + 1, report.problems


FULL_AFTER_FIRST_SAVE = """
import errno, os, sys
from drafter_worker import checkpoint
real, saves = checkpoint._torch_save, []
def full_disk(obj, path):
    saves.append(path)
    if len(saves) > 1:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    real(obj, path)
checkpoint._torch_save = full_disk
from drafter_worker.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(180)
def test_a_drafter_process_whose_disk_is_full_stops_with_exit_code_3(tmp_path, tiny_llama_dir):
    from drafter_worker.worker import MAX_SAVE_FAILURES

    config = write_config(tmp_path, str(tiny_llama_dir), drafters={"d0": {"checkpoint_every_steps": 2}})
    run_dir = tmp_path / "runs" / "it"
    with Job(config, run_dir) as job:
        job.start_metrics()
        job.start_target()
        job.start_command("d0", [sys.executable, "-c", FULL_AFTER_FIRST_SAVE, "--config", str(config), "--id", "d0"],
                          log_name="drafter-d0")
        assert job.procs["d0"].wait(150) == 3, job.all_consoles()
        assert job.terminate("target", 40) == 0
        assert job.terminate("metrics", 40) == 0
    log = (run_dir / "logs" / "drafter-d0.log").read_text()
    assert log.count("retrying at the next checkpoint") == MAX_SAVE_FAILURES - 1, log
    assert log.count(f"stopping after {MAX_SAVE_FAILURES} failures in a row") == 1, log
    store = CheckpointStore(run_dir, "d0", keep=2)
    assert store.latest() == store.root / "step-2"
    assert not list(store.root.glob(".tmp-*"))
    report = verify_lineage(run_dir, "d0")
    assert report.ok and report.final_step == 2, report.problems


# ---------------------------------------------------------------------------
# 3. a torn ledger tail
# ---------------------------------------------------------------------------


def test_a_torn_ledger_tail_is_cut_on_resume(tmp_path, caplog):
    # Guards against the resume line being glued to a fragment a kill left (read_lineage then raised).
    drafter = Drafter()
    prepare(tmp_path, drafter)
    path = tmp_path / "ledger" / "d0.jsonl"
    whole = path.read_bytes()
    fragment = b'{"kind":"step","step":6,"batch_'
    with open(path, "ab") as f:
        f.write(fragment)
    with caplog.at_level(logging.WARNING, "drafter_worker.checkpoint"):
        assert sorted(read_lineage(path, 5)) == [1, 2, 3, 4, 5]  # the fragment is skipped when reading
        ledger = Ledger(tmp_path, "d0")
    assert path.read_bytes() == whole
    assert any(f"dropped its {len(fragment)} bytes" in r.getMessage() for r in caplog.records)
    ledger.resumed(5)
    assert path.read_bytes().count(b"\n") == whole.count(b"\n") + 1
    report = verify_lineage(tmp_path, "d0")
    assert report.ok and report.final_step == 5, report.problems


# ---------------------------------------------------------------------------
# 4. an unusable `latest`
# ---------------------------------------------------------------------------


def _garbage(root: Path) -> None:
    (root / "latest").write_bytes(b"\xff\xfe\x00garbage")


def _deleted(root: Path) -> None:
    shutil.rmtree(root / "step-10")


def _truncated_state(root: Path) -> None:
    state = root / "step-10" / "trainer_state.json"
    state.write_text(state.read_text()[:20])


def _no_weights(root: Path) -> None:
    (root / "step-10" / "model.safetensors").unlink()


def _not_a_step(root: Path) -> None:
    (root / "latest").write_text("../../etc")


@pytest.mark.parametrize("damage, says, fallback", [
    (_garbage, "cannot be read", "step-10"), (_not_a_step, "not a step-N name", "step-10"),
    (_deleted, "names step-10, which lacks", "step-5"),
    (_truncated_state, "unreadable trainer_state.json", "step-5"), (_no_weights, "lacks model.safetensors", "step-5"),
])
def test_an_unusable_latest_falls_back_to_the_newest_readable_step(tmp_path, caplog, damage, says, fallback):
    # Guards against a restart loop on a `latest` that cannot be used.
    drafter = Drafter()
    store, ledger, state = CheckpointStore(tmp_path, "d0", keep=3), Ledger(tmp_path, "d0"), new_state()
    ledger.resumed(0)
    for batches in (range(0, 5), range(5, 10)):
        train(ledger, state, batches)
        drafter.checkpoint(store, ledger, state)
    damage(store.root)
    with caplog.at_level(logging.WARNING, "drafter_worker.checkpoint"):
        assert store.latest() == store.root / fallback
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and says in warnings[0] and f"falling back to {fallback}" in warnings[0], warnings


def test_a_missing_latest_after_the_first_rename_falls_back_and_no_checkpoint_is_none(tmp_path, caplog):
    drafter = Drafter()
    store, ledger, state = CheckpointStore(tmp_path, "d0", keep=2), Ledger(tmp_path, "d0"), new_state()
    assert store.latest() is None
    train(ledger, state, range(3))
    drafter.checkpoint(store, ledger, state)
    (store.root / "latest").unlink()  # killed between the rename and the pointer of the first save
    with caplog.at_level(logging.WARNING, "drafter_worker.checkpoint"):
        assert store.latest() == store.root / "step-3"
    assert "is missing; falling back to step-3" in caplog.text


def test_the_writer_removes_stale_temporaries_and_readers_leave_them(tmp_path):
    drafter = Drafter()
    prepare(tmp_path, drafter)
    root = tmp_path / "checkpoints" / "d0"
    (root / ".tmp-step-9-12345").mkdir()
    (root / ".tmp-step-9-12345" / "trainer.pt").write_bytes(b"half")
    (root / ".latest.tmp").write_text("step-9")
    CheckpointStore(tmp_path, "d0", keep=2)  # a reader (export, verify) may race a live save
    assert (root / ".tmp-step-9-12345").exists()
    CheckpointStore(tmp_path, "d0", keep=2, writer=True)
    assert not (root / ".tmp-step-9-12345").exists() and not (root / ".latest.tmp").exists()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-3", "step-5"]


# ---------------------------------------------------------------------------
# Data identity
# ---------------------------------------------------------------------------


def _welcome(fingerprint: str) -> P.Welcome:
    return welcome(train_samples=TRAIN_SAMPLES, batches_per_epoch=BATCHES_PER_EPOCH, data_fingerprint=fingerprint)


def test_a_checkpoint_made_on_other_data_refuses_to_resume(tmp_path):
    from drafter_worker.worker import FatalError

    drafter = Drafter()
    run_dir = tmp_path / "w"
    store, ledger, state = CheckpointStore(run_dir, "d0", keep=2), Ledger(run_dir, "d0"), new_state()
    train(ledger, state, range(2))
    drafter.checkpoint(store, ledger, state)
    worker = _worker(tmp_path)
    try:
        with pytest.raises(FatalError) as refused:
            worker._ensure_model(_welcome("0123456789abcdef"))
        assert FINGERPRINT in str(refused.value) and "0123456789abcdef" in str(refused.value)
        assert "new run" in str(refused.value) and "restore the data" in str(refused.value)
    finally:
        worker.close()


def test_an_older_checkpoint_without_a_fingerprint_adopts_the_targets(tmp_path):
    drafter = Drafter()
    run_dir = tmp_path / "w"
    store, ledger = CheckpointStore(run_dir, "d0", keep=2), Ledger(run_dir, "d0")
    state = TrainerState(0, [Coverage()], "d0", "tiny")
    train(ledger, state, range(2))
    drafter.checkpoint(store, ledger, state)
    worker = _worker(tmp_path)
    try:
        model_setup.check_data(worker.state, _welcome(FINGERPRINT), "checkpoint")
        assert (worker.state.data_fingerprint, worker.state.train_samples) == (FINGERPRINT, TRAIN_SAMPLES)
    finally:
        worker.close()


# ---------------------------------------------------------------------------
# 5. completeness
# ---------------------------------------------------------------------------


def _lineage(run_dir: Path, drafter_id: str, batches, drop_sample: int | None = None) -> None:
    drafter = Drafter()
    store, ledger = CheckpointStore(run_dir, drafter_id, keep=1), Ledger(run_dir, drafter_id)
    state = new_state(drafter_id)
    ledger.resumed(0)
    for batch in batches:
        state.step += 1
        state.coverage[0].add(batch)
        samples = [s for s in samples_of(batch) if not (batch < BATCHES_PER_EPOCH and s == drop_sample)]
        ledger.trained(state.step, batch, batch // BATCHES_PER_EPOCH, samples)
    drafter.checkpoint(store, ledger, state)


def test_a_complete_epoch_is_clean_and_a_missing_sample_is_reported(tmp_path):
    _lineage(tmp_path / "a", "d0", range(BATCHES_PER_EPOCH + 2))
    report = verify_lineage(tmp_path / "a", "d0")
    assert report.ok and report.finished_epochs == [0], report.problems
    assert report.samples_per_epoch == {0: TRAIN_SAMPLES, 1: 4}
    _lineage(tmp_path / "b", "d0", range(BATCHES_PER_EPOCH + 2), drop_sample=7)
    report = verify_lineage(tmp_path / "b", "d0")
    assert report.problems == [f"epoch 0: 1 of {TRAIN_SAMPLES} samples never trained: [7]"]


def test_a_batch_the_checkpoint_counts_but_no_ledger_holds_is_reported(tmp_path):
    _lineage(tmp_path, "d0", range(BATCHES_PER_EPOCH))
    store = CheckpointStore(tmp_path, "d0", keep=1)
    state = store.read_state(store.latest())
    state.coverage = [Coverage(BATCHES_PER_EPOCH + 1)]  # claims a batch it never recorded
    Drafter().checkpoint(store, Ledger(tmp_path, "d0"), state)
    problems = " ".join(verify_lineage(tmp_path, "d0").problems)
    assert "are in no ledger (lost): [6]" in problems


def _ranks_lineage(run_dir: Path, rounds: list[tuple[int | None, int | None]], replicas: int = 2) -> None:
    """Two ranks of one drafter over ``replicas`` target replicas; each round is (rank 0's batch, rank 1's
    batch), None for a zero-gradient step. Rank 0 writes the checkpoint with the drafter's coverage."""
    store = CheckpointStore(run_dir, "d0", keep=1, writer=True)
    ledgers = [Ledger(run_dir, ledger_name("d0", r, 2)) for r in range(2)]
    state = new_state()
    state.coverage, state.world_size = [Coverage() for _ in range(replicas)], 2
    for ledger in ledgers:
        ledger.resumed(0)
    for batches in rounds:
        state.step += 1
        for rank, batch in enumerate(batches):
            if batch is None:
                ledgers[rank].idle(state.step, state.step)
                continue
            if batch // replicas not in state.coverage[batch % replicas]:  # a batch trained twice is covered once
                state.coverage[batch % replicas].add(batch // replicas)
            ledgers[rank].trained(state.step, batch, batch // BATCHES_PER_EPOCH, samples_of(batch), rank=rank)
    for ledger in ledgers[1:]:
        ledger.make_durable()
    Drafter().checkpoint(store, ledgers[0], state)


def test_the_ranks_of_a_drafter_are_checked_over_all_their_ledgers_and_replicas(tmp_path):
    # Replica 1 (odd indices) runs ahead of replica 0; rank 1's stream ends first (a zero-gradient step).
    rounds = [(0, 1), (3, 2), (5, 4), (None, 6), (7, None)]
    _ranks_lineage(tmp_path / "ok", rounds)
    report = verify_lineage(tmp_path / "ok", "d0")
    assert report.ok and report.finished_epochs == [0] and report.world_size == 2, report.problems
    assert report.batches == BATCHES_PER_EPOCH + 2 and report.samples_per_epoch == {0: TRAIN_SAMPLES, 1: 4}
    # Two ranks training one batch, and a step rank 1's ledger lacks, are both caught.
    _ranks_lineage(tmp_path / "twice", [(0, 1), (3, 2), (5, 4), (6, 6), (7, None)])
    problems = " ".join(verify_lineage(tmp_path / "twice", "d0").problems)
    assert "batches trained twice: [6]" in problems
    (tmp_path / "twice" / "ledger" / "d0.rank1.jsonl").write_text('{"kind": "resume", "from_step": 0}\n')
    problems = " ".join(verify_lineage(tmp_path / "twice", "d0").problems)
    assert "d0.rank1: durable steps missing from the ledger: [1, 2, 3, 4, 5]" in problems


def test_a_slow_save_keeps_heartbeating_and_its_failure_still_counts(tmp_path, monkeypatch):
    """A checkpoint longer than the heartbeat timeout must not make the target drop the drafter."""
    drafter = Drafter()
    worker = _worker(tmp_path)
    try:
        worker.state = new_state()
        worker.trainer = SimpleNamespace(model=drafter.model, optimizer=drafter.optimizer,
                                         generator=drafter.generator, step=1)
        worker.state.coverage[0].add(0)
        worker.ledger.trained(1, 0, 0, samples_of(0))
        real_save = worker.checkpoints.save
        released = threading.Event()

        def slow_save(*args):
            assert released.wait(30), "the save thread was never released"
            return real_save(*args)

        beats: list[float] = []

        def heartbeat() -> None:
            beats.append(time.monotonic())
            if len(beats) == 5:
                released.set()  # the save ends only after five heartbeats went out meanwhile

        monkeypatch.setattr(worker.checkpoints, "save", slow_save)
        monkeypatch.setattr(worker, "_pump", lambda links, wait_ms: heartbeat())  # what keeps the targets hearing
        worker._checkpoint()
        assert len(beats) >= 5 and worker._checkpoint_step == 1

        monkeypatch.setattr(worker.checkpoints, "save", lambda *a: enospc(None, a))
        worker.trainer.step = 2
        worker._checkpoint()  # the error crosses the thread
        assert worker._checkpoint_step == 1 and worker._save_failures == 1
    finally:
        worker.close()
