"""The pipeline over the shm transport: sidecar, target and two drafters on one host, sharing /dev/shm."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from common.shm_transport import SHM_DIR, sweep_stale
from deploy.launcher import Job
from tests.fixtures import write_config

pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")]

SHM = ("--set", 'transport.kind="shm"')


def segments(target_pid: int) -> set[str]:
    return {p.name for p in SHM_DIR.glob(f"dflash.{target_pid}.*")}


def test_two_drafters_train_over_shm_a_killed_drafter_leaks_nothing_and_all_exit_zero(tmp_path, tiny_llama_dir):
    config = write_config(tmp_path, str(tiny_llama_dir), drafters={"d0": {"learning_rate": 2e-3}, "d1": {"seed": 1}})
    run_dir = tmp_path / "runs" / "it"
    job = Job(config, run_dir)
    try:
        _run(job)
    finally:
        sweep_stale()  # what a failed run's killed target left in /dev/shm
    check_results(job, run_dir)


def _run(job: Job) -> None:
    with job:
        job.start_metrics()
        target = job.start_target(*SHM)
        job.start_drafter("d0", *SHM)
        job.start_drafter("d1", *SHM)
        job.wait_for(
            lambda: all(job.drafter_steps().get(f"drafter/{d}", 0) >= 8 for d in ("d0", "d1")),
            timeout_s=150, what="both drafters to report step 8 over shm",
        )
        # One batch pool and one weights segment for the whole target, whatever the drafters.
        pool = f"dflash.{target.pid}.pool"
        assert segments(target.pid) == {f"dflash.{target.pid}.weights", pool}

        # kill -9 one drafter while it trains: the target drops the registration on the
        # heartbeat timeout and takes back the pool slots it held; the other drafter is not disturbed.
        job.kill("d1")
        job.wait_for(lambda: "silent for" in _target_log(job.run_dir), 30, "the target to drop the killed d1")
        # Read after the drop (a heartbeat timeout later): every record of the killed d1 is in by now.
        before = job.drafter_steps()["drafter/d1"]
        d0_then = job.drafter_steps()["drafter/d0"]
        job.wait_for(lambda: job.drafter_steps()["drafter/d0"] > d0_then, 60, "d0 to keep training")

        # The restarted drafter maps the same pool again and trains past where it was killed.
        job.start_drafter("d1", *SHM)
        job.wait_for(lambda: job.drafter_steps().get("drafter/d1", 0) > before, 120, "d1 to train past its kill")
        assert segments(target.pid) == {f"dflash.{target.pid}.weights", pool}

        codes = {name: job.terminate(name, timeout_s=40) for name in ("d0", "d1", "target", "metrics")}
        assert codes == {"d0": 0, "d1": 0, "target": 0, "metrics": 0}, job.all_consoles()
        assert not segments(target.pid), "the target left shared-memory segments behind"


def _target_log(run: Path) -> str:
    path = run / "logs" / "target.log"
    return path.read_text() if path.exists() else ""


def check_results(job: Job, run_dir: Path) -> None:
    records = job.metrics()
    for drafter in ("d0", "d1"):
        losses = [r["values"]["loss"] for r in records if r["source"] == f"drafter/{drafter}"]
        assert len(losses) >= 3 and all(math.isfinite(v) for v in losses)
        assert (run_dir / "checkpoints" / drafter / "latest").exists()
    target_log = (run_dir / "logs" / "target.log").read_text()
    assert "transport shm" in target_log
    assert "data plane failed" not in target_log
    assert "shm transport: batch pool" in target_log
    d0_log = (run_dir / "logs" / "drafter-d0.log").read_text()
    d1_log = (run_dir / "logs" / "drafter-d1.log").read_text()
    assert d1_log.count("[shm] mapped the target's batch pool") >= 2 and "[resume]" in d1_log
    assert "torn batch" not in d0_log + d1_log, "a slot was rewritten while a live drafter read it"
