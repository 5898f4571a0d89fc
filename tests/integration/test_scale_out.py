"""Scale-out with real processes: 2 target replicas, a 2-rank gloo DDP drafter under torchrun, a 1-process drafter.

The tiny random target and CPU gloo everywhere; the plan is one epoch, so
every drafter ends with DONE from both replicas. Mid-epoch a target replica is
killed with SIGKILL (and started again) and, later, one rank of the torchrun
group (torchrun restarts the group from its checkpoint, as generation 2).
Checked from the files the processes leave: each drafter's ledgers over all
its ranks hold every batch of the plan exactly once and every sample of the
epoch; the two ranks end with identical weights; every process exits 0.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import pytest

from common.config import load_config
from deploy.launcher import Job, _descendants
from drafter_worker.checkpoint import verify_lineage
from tests.fixtures import write_config
from tests.ports import free_replica_step

pytestmark = pytest.mark.timeout(420)

def scale_out_config(tmp_path: Path, model: str, *, checkpoint_every: int = 4) -> Path:
    """Two replicas (ports of replica 1 = replica 0's + a free step), drafter g0 for 2 ranks, d1 for one."""
    # g0's cosine runs on its training clock (rank 0's for both ranks, resumed from the checkpoint after a restart).
    # g0 also trains an LM head of its own (drafter.train_draft_head): DDP must reduce its gradient like the rest.
    drafters = {"g0": {"devices": ["cpu", "cpu"], "checkpoint_every_steps": checkpoint_every, "decay_minutes": 0.5,
                       "draft_vocab_size": 64, "train_draft_head": True},
                "d1": {"seed": 1}}
    path = write_config(tmp_path, model, drafters=drafters,
                        sections={"target": ["replicas = 2"], "data": ["num_epochs = 1"]})
    text = path.read_text()
    cfg = load_config(path)
    control, store = int(cfg.control.address.rsplit(":", 1)[1]), cfg.control.store_port
    step = free_replica_step(control, store)
    path.write_text(text.replace("[control]\n", f"[control]\nreplica_port_step = {step}\n", 1))
    return path


def start_job(job: Job, max_restarts: int = 0) -> None:
    job.start_metrics()
    for r in range(2):
        job.start(f"target-{r}", "target_server", "--replica", str(r), log_name=f"target-{r}")
    job.start_command("g0", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "--max-restarts", str(max_restarts), "-m", "drafter_worker", *job.job_args,
                             "--group", "g0"], log_name="torchrun-g0")
    job.start_drafter("d1")


def final_digests(run_dir: Path) -> list[str]:
    digests = []
    for rank in range(2):
        log = (run_dir / "logs" / f"drafter-g0.{rank}.log").read_text()
        digests.append(re.findall(rf"\[group\] rank {rank} of 2 ends at step \d+ with weights (\w+)", log)[-1])
    return digests


def test_a_killed_replica_and_a_killed_rank_lose_and_repeat_nothing(tmp_path, tiny_llama_dir):
    config = scale_out_config(tmp_path, str(tiny_llama_dir), checkpoint_every=2)
    run_dir = tmp_path / "runs" / "it"
    # More data, so the kills land mid-epoch.
    with Job(config, run_dir, overrides=["data.max_samples=120"]) as job:
        start_job(job, max_restarts=3)
        job.wait_for(lambda: _durable_batches(run_dir, "d1") >= 4, 180, "d1 to train a few batches")
        job.kill("target-1")  # SIGKILL: no BYE; its registrations and pinned batches die with it
        job.start("target-1", "target_server", "--replica", "1", log_name="target-1")
        before = _durable_batches(run_dir, "g0.rank1")
        job.wait_for(lambda: _durable_batches(run_dir, "g0.rank1") >= before + 2, 180,
                     "the group to train on after the replica restart")
        os.kill(_rank_pid(job, run_dir, 1), signal.SIGKILL)  # torchrun restarts the whole group
        for drafter in ("g0", "d1"):
            assert job.wait(drafter, 300) == 0, job.all_consoles()
        for name in ("target-0", "target-1", "metrics"):
            assert job.terminate(name, 60) == 0, job.console(name)
    generations = re.findall(r"rank 0 of 2: generation (\d+)", (run_dir / "logs" / "drafter-g0.0.log").read_text())
    assert generations == ["1", "2"], generations
    reports = {d: verify_lineage(run_dir, d) for d in ("g0", "d1")}
    for drafter, report in reports.items():
        assert report.ok and report.finished_epochs == [0], (drafter, report.problems)
        assert report.batches == _batches_per_epoch(run_dir, drafter), report
    assert reports["g0"].world_size == 2 and reports["d1"].world_size == 1
    # The ranks split the work: the group's final lineage has far fewer steps than batches.
    assert reports["g0"].final_step < 0.75 * reports["g0"].batches, reports["g0"]
    # Both ranks end with the same weights: they stepped with the same learning rates, rank 0's clock.
    assert len(set(final_digests(run_dir))) == 1
    resumed = re.findall(r"\[resume\] drafter g0: checkpoint .* training clock ([\d.]+) s",
                         (run_dir / "logs" / "drafter-g0.0.log").read_text())
    # Generation 2 went on from generation 1's clock. The kill can land right after the step-2 checkpoint,
    # whose clock is one step's time (under 0.1 s): the log gives it to the millisecond.
    assert len(resumed) == 1 and float(resumed[0]) > 0, resumed
    assert _final_state(run_dir, "g0").train_seconds > float(resumed[0])
    for r in range(2):  # both replicas served both drafters to the end
        log = (run_dir / "logs" / f"target-{r}.log").read_text()
        assert f"replica {r} of 2 serves" in log
        assert "drafter g0 has been served every batch of this replica" in log
        assert "drafter d1 has been served every batch of this replica" in log


def _durable_batches(run_dir: Path, ledger: str) -> int:
    """Batches a ledger file holds so far (its lines are written at each checkpoint)."""
    path = run_dir / "ledger" / f"{ledger}.jsonl"
    return path.read_text().count('"kind":"step"') if path.exists() else 0


def _final_state(run_dir: Path, drafter: str):
    from drafter_worker.checkpoint import CheckpointStore

    store = CheckpointStore(run_dir, drafter, keep=1)
    return store.read_state(store.latest())


def _batches_per_epoch(run_dir: Path, drafter: str) -> int:
    return _final_state(run_dir, drafter).batches_per_epoch


def _rank_pid(job: Job, run_dir: Path, rank: int) -> int:
    log = (run_dir / "logs" / f"drafter-g0.{rank}.log").read_text()
    pids = re.findall(rf"\[drafter-g0\.{rank} pid=(\d+)\]", log)
    alive = [int(p) for p in pids if int(p) in _descendants(job.procs["g0"].pid)]
    assert alive, f"rank {rank} of g0 is not running"
    return alive[-1]
