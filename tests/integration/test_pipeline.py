"""The whole pipeline as real processes on loopback: sidecar, target, two drafters over gloo."""

from __future__ import annotations

import math
import subprocess
import sys

import msgpack
import pytest
import zmq

from common import protocol as P
from common.auth import auth_dir, hello_proof, read_key
from common.config import load_config
from drafter_worker.model.dflash_model import load_drafter
from deploy.launcher import Job
from metrics_sidecar.wandb_reader import read_wandb_offline_history
from tests.conftest import ROOT
from tests import messages
from tests.fixtures import write_config
from tests.integration.catalog import catalog_series

pytestmark = pytest.mark.timeout(240)


def test_two_drafters_train_and_everything_exits_zero_on_sigterm(tmp_path, tiny_llama_dir):
    config = write_config(tmp_path, str(tiny_llama_dir), drafters={"d0": {"learning_rate": 2e-3}, "d1": {"learning_rate": 5e-4, "seed": 1}})
    run_dir = tmp_path / "runs" / "it"
    with Job(config, run_dir) as job:
        job.start_metrics()
        job.start_target()
        job.start_drafter("d0")
        job.start_drafter("d1")
        job.wait_for(
            lambda: all(job.drafter_steps().get(f"drafter/{d}", 0) >= 8 for d in ("d0", "d1")),
            timeout_s=150, what="both drafters to report step 8",
        )
        # A registration whose data plane never forms (a drafter that re-sent its HELLO while the
        # target was loading leaves one): its link waits up to transport.timeout_s (60 s) in gloo's
        # rendezvous, which must not hold up the target's exit (SIGKILL after 40 s below).
        _register_without_pairing(job, config, run_dir, "d2")
        # Drafters first (they checkpoint and say BYE), then target, then sidecar (flushes W&B).
        codes = {name: job.terminate(name, timeout_s=40) for name in ("d0", "d1", "target", "metrics")}
        assert codes == {"d0": 0, "d1": 0, "target": 0, "metrics": 0}, job.all_consoles()
        assert "not waiting for link-d2.0" in (run_dir / "logs" / "target.log").read_text()

    records = job.metrics()
    for drafter in ("d0", "d1"):
        losses = [r["values"]["loss"] for r in records if r["source"] == f"drafter/{drafter}"]
        assert len(losses) >= 3 and all(math.isfinite(v) for v in losses)
        # The shutdown checkpoint loads back into a drafter.
        latest = (run_dir / "checkpoints" / drafter / "latest").read_text().strip()
        model = load_drafter(run_dir / "checkpoints" / drafter / latest)
        assert model.target_layer_ids == [1, 2, 3] or len(model.target_layer_ids) == 3
    assert any(r["source"] == "target" and r["values"]["tokens_per_s"] > 0 for r in records)

    history = read_wandb_offline_history(run_dir)
    keys = set().union(*(row.keys() for row in history))
    for key in ("drafter/d0/loss", "drafter/d1/loss", "drafter/d0/lr", "drafter/d1/step", "target/tokens_per_s", "target/queue_depth"):
        assert key in keys, f"{key} missing from the W&B offline run (have {sorted(keys)[:40]})"
    # Every series of the catalog (docs/metrics.md) made it into the W&B run.
    missing = catalog_series(["d0", "d1"], block_size=8, num_buckets=2) - keys
    assert not missing, f"catalog series missing from the W&B offline run: {sorted(missing)}"
    d0 = [row["drafter/d0/loss"] for row in history if "drafter/d0/loss" in row]
    assert all(math.isfinite(v) for v in d0)
    # Different learning rates: two experiments, not one run logged twice.
    d1 = [row["drafter/d1/loss"] for row in history if "drafter/d1/loss" in row]
    assert d0 != d1


def _register_without_pairing(job: Job, config, run_dir, drafter_id: str) -> None:
    """A valid HELLO over gloo, answered by WELCOME, from a drafter that never joins its pair."""
    cfg = load_config(config)
    body = msgpack.unpackb(messages.hello(drafter_id, cfg.shared_hash(), "gloo").encode())
    body["auth"] = hello_proof(read_key(auth_dir(run_dir) / "control.key"), drafter_id)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(cfg.control.address)
        sock.send(msgpack.packb(body))
        assert sock.poll(10_000), "the target did not answer the HELLO"
        answer = P.decode(sock.recv())
        assert isinstance(answer, P.Welcome), answer
    finally:
        ctx.destroy(linger=0)


def test_drafter_with_a_different_config_is_refused_with_a_clear_message(tmp_path, tiny_llama_dir):
    config = write_config(tmp_path, str(tiny_llama_dir), drafters={})
    run_dir = tmp_path / "runs" / "it"
    with Job(config, run_dir) as job:
        job.start_target()
        # A different data set changes the shared config hash.
        proc = job.start_drafter("d0", "--set", "data.max_samples=7")
        code = proc.wait(120)
        assert code == 2, job.console("d0")
        assert "config hash mismatch" in job.console("d0")
        job.procs.pop("d0")
        # The target is still serving: a matching drafter registers and trains.
        job.start_drafter("d1")
        job.wait_for(lambda: (run_dir / "checkpoints" / "d1" / "latest").exists(), 120, "d1 to checkpoint")
        assert job.terminate("target", 30) == 0


def test_port_in_use_and_bad_config_end_in_one_clear_line(tmp_path, tiny_llama_dir):
    config = write_config(tmp_path, str(tiny_llama_dir), drafters={})
    run_dir = tmp_path / "runs" / "it"
    with Job(config, run_dir) as job:
        job.start_target()
        job.wait_for_log("target", "serving on", 90)
        second = subprocess.run(
            [sys.executable, "-m", "target_server", "--config", str(config)],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )
        assert second.returncode == 2
        assert "cannot bind the control socket" in second.stderr and "Traceback" not in second.stderr
        assert job.terminate("target", 30) == 0

    bad = subprocess.run(
        [sys.executable, "-m", "drafter_worker", "--config", str(config), "--set", "drafter.block_size=1"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert bad.returncode == 2 and "drafter.block_size must be >= 2" in bad.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "target_server", "--config", str(config), "--set", f'target.model="{tmp_path}/nope"'],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, missing.stderr
    assert "nope" in missing.stderr
