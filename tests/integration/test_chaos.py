"""Faults while training: kill -9 a drafter twice, the sidecar once and the target once.

The run must still complete its epoch, and the ledger must show every sample
trained exactly once in the lineage of each drafter's final checkpoint.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from common.shm_transport import SHM_DIR, sweep_stale
from deploy.launcher import Job
from drafter_worker.checkpoint import verify_lineage
from tests.fixtures import write_config

pytestmark = pytest.mark.timeout(420)


def _latest_step(job: Job, source: str) -> int:
    step = 0
    for rec in job.metrics():
        if rec["source"] == source:
            step = rec["step"]
    return step


def _check_exactly_once(run_dir: Path, drafter: str) -> tuple[int, int]:
    # Every durable step in the ledger, no batch twice, every sample of the epoch exactly once.
    report = verify_lineage(run_dir, drafter)
    assert report.ok, report.problems
    assert report.finished_epochs == [0], "the epoch was not checked for completeness"
    return report.final_step, report.samples_per_epoch[0]


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_kills_and_restarts_lose_nothing_and_repeat_nothing(tmp_path, tiny_llama_dir, transport):
    if transport == "shm" and not SHM_DIR.is_dir():
        pytest.skip("needs /dev/shm")
    rng = random.Random(1234)
    config = write_config(
        tmp_path, str(tiny_llama_dir), drafters={"d0": {}, "d1": {"seed": 1}},
        extra="",
    )
    # One epoch of 400 samples of 256 tokens (one sample a batch, 400 steps): every
    # fault below has landed by about step 130 (a third of it), so both drafters
    # still have work when the last one lands, even on a slow CI machine; the
    # guard before the target's kill says so if not. Checkpoints every 3 steps.
    text = (config.read_text()
            .replace("max_samples = 80", "max_samples = 400\nnum_epochs = 1")
            .replace("max_seq_len = 64", "max_seq_len = 256")
            .replace("bucket_lengths = [32, 64]", "bucket_lengths = [128, 256]")
            .replace("checkpoint_every_steps = 4", "checkpoint_every_steps = 3")
            .replace('kind = "gloo"', f'kind = "{transport}"'))
    config.write_text(text)
    run_dir = tmp_path / "runs" / "it"
    try:
        with Job(config, run_dir) as job:
            job.start_metrics()
            job.start_target()
            job.start_drafter("d0")
            job.start_drafter("d1")

            for _ in range(2):
                floor = _latest_step(job, "drafter/d1") + 6
                job.wait_for(lambda: _latest_step(job, "drafter/d1") >= floor, 120, f"d1 to reach step {floor}")
                time.sleep(rng.uniform(0.0, 0.8))
                job.kill("d1")
                # The survivor keeps training while d1 is down.
                before = _latest_step(job, "drafter/d0")
                job.wait_for(lambda: _latest_step(job, "drafter/d0") > before, 30, "d0 to keep training while d1 is down")
                job.start_drafter("d1")

            job.kill("metrics")
            time.sleep(1.0)
            job.start_metrics()

            # The new sidecar appends to the same metrics.jsonl: wait for it to log
            # a drafter record (from whichever drafter is still training).
            seen = len(job.metrics())
            job.wait_for(lambda: any(r["source"].startswith("drafter/") for r in job.metrics()[seen:]), 60,
                         "a drafter's metrics to reach the restarted sidecar")
            assert any(p.poll() is None for n, p in job.procs.items() if n in ("d0", "d1")), \
                "both drafters finished before the target could be killed: the epoch is too short for this test"
            job.kill("target")
            time.sleep(2.0)
            job.start_target()

            # Both drafters finish the epoch (DONE) and exit 0 on their own.
            for name in ("d0", "d1"):
                code = job.procs[name].wait(240)
                assert code == 0, job.all_consoles()
            assert job.terminate("target", 40) == 0
            assert job.terminate("metrics", 40) == 0
    finally:
        sweep_stale()  # shm: the segments of the target killed above

    steps0, samples0 = _check_exactly_once(run_dir, "d0")
    steps1, samples1 = _check_exactly_once(run_dir, "d1")
    assert samples0 == samples1 and steps0 == steps1, "both groups must see the whole epoch"
    log = (run_dir / "logs" / "drafter-d1.log").read_text()
    assert log.count("[resume]") >= 2, "d1 should have resumed from a checkpoint after each kill"
    assert "target" in (run_dir / "logs" / "drafter-d0.log").read_text()
    for drafter in ("d0", "d1"):
        assert "torn batch" not in (run_dir / "logs" / f"drafter-{drafter}.log").read_text()
