"""Metrics sidecar: windows, aggregates, malformed frames, W&B offline runs, process lifecycle.

Real sockets on loopback, real W&B offline runs (one per drafter plus the
target run) read back from their transaction logs, and `python -m
metrics_sidecar` as a real process.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq

from common.metrics_client import MetricsPusher, MetricsRecord, encode_metrics_record, make_metrics_record
from metrics_sidecar.aggregate import SourceState, WindowAggregator, pipeline_aggregates
from metrics_sidecar.sidecar import MetricsSidecar, SidecarBindError
from metrics_sidecar.wandb_layout import RUNS_FILE, WandbSettingsError, resolve_wandb_settings
from metrics_sidecar.wandb_reader import (
    find_offline_run_files,
    iter_records,
    offline_run_finished,
    offline_upload_lines,
    read_wandb_offline_history,
    read_wandb_offline_run_ids,
    read_wandb_offline_runs,
)
from metrics_sidecar.wandb_uploader import WandbUploader

REPO_ROOT = Path(__file__).resolve().parents[2]


# --- helpers ----------------------------------------------------------------


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


@pytest.fixture(scope="module", autouse=True)
def wandb_env(tmp_path_factory):
    """Keep W&B offline, quiet and out of the home directory."""
    home = tmp_path_factory.mktemp("wandb_home")
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        "WANDB_ARTIFACT_DIR": str(home / "artifacts"),
        "WANDB_DISABLE_GIT": "true",
    }
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def rec(source: str, step: int, **values) -> MetricsRecord:
    return MetricsRecord(source=source, step=step, time=0.0, values=values, dropped=0)


# --- pure aggregation ---------------------------------------------------------


def test_pipeline_aggregates_over_live_drafters():
    states = {
        "drafter/d0": SourceState(step=40, values={"loss": 2.0, "tokens_per_s": 500.0}, last_seen=100.0),
        "drafter/d1": SourceState(step=37, values={"loss": 4.0, "tokens_per_s": 300.0}, last_seen=100.0),
        "drafter/d2": SourceState(step=1, values={"loss": 9.0}, last_seen=10.0),  # stale
        "target": SourceState(step=90, values={"tokens_per_s": 1100.0}, last_seen=100.0),
    }
    view = pipeline_aggregates(states, now=100.0, stale_after_s=60.0)
    assert view.values == {
        "pipeline/num_drafters": 2,
        "pipeline/step_skew": 3,
        "pipeline/slowest_drafter_step": 37,
        "pipeline/loss_mean": 3.0,
        "pipeline/loss_min": 2.0,
        "pipeline/loss_max": 4.0,
        "pipeline/drafter_tokens_per_s": 800.0,
        "pipeline/num_targets": 1,
        "pipeline/target_tokens_per_s": 1100.0,
        "pipeline/supply_ratio": 1100.0 / 800.0,
    }
    assert view.slowest == "d1" and view.stale == ("d2",)
    assert pipeline_aggregates({}, 0.0, 60.0).values == {"pipeline/num_drafters": 0, "pipeline/num_targets": 0}


def test_window_row_has_latest_values_of_sources_seen_in_window():
    clock = [0.0]
    agg = WindowAggregator(clock=lambda: clock[0])
    agg.add(rec("drafter/d0", 1, loss=5.0, lr=1e-4))
    agg.add(rec("drafter/d0", 2, loss=4.0))
    agg.add(rec("target", 7, tokens_per_s=1000.0, queue_depth=2))
    w1 = agg.close_window({"sidecar/records_received": 3})
    assert w1.index == 1 and set(w1.sources) == {"drafter/d0", "target"}
    assert w1.sources["drafter/d0"] == {"loss": 4.0, "lr": 1e-4, "step": 2}
    assert w1.job["sidecar/window"] == 1 and "drafter/d0/loss" not in w1.job
    assert w1.row["drafter/d0/loss"] == 4.0 and w1.row["drafter/d0/lr"] == 1e-4
    assert w1.row["drafter/d0/step"] == 2 and w1.row["target/step"] == 7
    assert w1.row["sidecar/window"] == 1 and w1.row["sidecar/records_received"] == 3
    assert "d0 step=     2" in w1.line and "queue=" in w1.line and "eal=    -" in w1.line

    agg.add(rec("drafter/d1", 1, loss=6.0))
    w2 = agg.close_window({})
    # d0 did not report: none of its series in this row (no duplicate points on its step axis)
    assert "drafter/d0/loss" not in w2.row and w2.row["drafter/d1/loss"] == 6.0
    assert w2.row["pipeline/step_skew"] == 1 and w2.row["pipeline/loss_mean"] == 5.0
    assert "skew=  1 slowest=d1" in w2.line


# --- the sidecar in a thread, with a real offline W&B run ------------------------


class ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def threaded_run(tmp_path_factory, wandb_env):
    """One sidecar run shared by the tests below (W&B init costs seconds)."""
    run_dir = tmp_path_factory.mktemp("runs") / "thread-run"
    address = free_address()
    handler = ListHandler()
    log = logging.getLogger("metrics_sidecar")
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    sidecar = MetricsSidecar(
        address,
        run_dir,
        "thread-run",
        window_s=0.3,
        wandb_mode="offline",
        close_timeout_s=150.0,  # a loaded machine can take long to start and stop the W&B service
        # A config larger than the 32 KiB log block: the run record spans blocks,
        # so the reader's chunk reassembly is exercised.
        wandb_config={"shared": 1, "notes": "x" * 70_000},
        drafter_config=lambda drafter: {"id": drafter, "learning_rate": {"d0": 2e-4, "d1": 5e-4}[drafter]},
    )
    errors: list[BaseException] = []

    def target():
        try:
            sidecar.run()
        except BaseException as exc:  # surfaced by the tests below
            errors.append(exc)

    thread = threading.Thread(target=target, name="sidecar-under-test")
    thread.start()
    pushers = {s: MetricsPusher(address, s) for s in ("drafter/d0", "drafter/d1", "target")}
    raw = zmq.Context.instance().socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 1000)
    raw.connect(address)
    expected_valid = 0
    try:
        # Phase 1 and 2 land in different windows.
        for phase, steps in enumerate((range(0, 5), range(5, 10))):
            for step in steps:
                assert pushers["drafter/d0"].send({"loss": 5.0 - step * 0.25, "lr": 2e-4, "eal": 1.5}, step)
                if step < 7:
                    assert pushers["drafter/d1"].send({"loss": 6.0 - step * 0.25, "tokens_per_s": 400.0}, step)
                    expected_valid += 1
                assert pushers["target"].send({"tokens_per_s": 1100.0, "queue_depth": 3}, step)
                expected_valid += 2
            if phase == 0:  # dflash-eval --watch measured d0's step-3 checkpoint
                assert pushers["drafter/d0"].send({"eval/tau": 1.25}, 3)
                expected_valid += 1
            wait_for(lambda: sidecar.records_received >= expected_valid, 10, "records to arrive")
            wait_for(lambda: sidecar.windows_logged >= phase + 1, 10, "a window to close")
        # Malformed frames: random bytes, a msgpack list, a map missing "values", two frames.
        raw.send(random.Random(0).randbytes(64))
        raw.send(msgpack.packb([1, 2, 3]))
        bad = make_metrics_record("drafter/d0", 99, {"loss": 0.0})
        del bad["values"]
        raw.send(msgpack.packb(bad))
        raw.send_multipart([b"a", b"b"])
        # A valid record from another producer reporting 7 records it had to drop.
        raw.send(encode_metrics_record(make_metrics_record("eval", 1, {"score": 0.5}, dropped=7)))
        expected_valid += 1
        wait_for(lambda: sidecar.records_received >= expected_valid + 4, 10, "malformed frames to arrive")
        assert thread.is_alive(), f"sidecar died: {errors}"
    finally:
        for p in pushers.values():
            p.close()
        raw.close()
        sidecar.request_stop()
        thread.join(180)
        log.removeHandler(handler)
        log.setLevel(old_level)
    assert not thread.is_alive(), "sidecar did not stop within 180 s"
    yield {
        "run_dir": run_dir,
        "sidecar": sidecar,
        "errors": errors,
        "lines": handler.lines,
        "expected_valid": expected_valid,
    }


@pytest.mark.timeout(240)  # the first one also runs the shared fixture
def test_sidecar_writes_every_valid_record_to_jsonl(threaded_run):
    assert threaded_run["errors"] == []
    records = read_jsonl(threaded_run["run_dir"] / "metrics.jsonl")
    assert len(records) == threaded_run["expected_valid"]
    by_source = {}
    for r in records:
        assert set(r) == {"source", "step", "time", "values", "received_at"}
        by_source.setdefault(r["source"], []).append(r["step"])
    assert by_source == {
        "drafter/d0": [0, 1, 2, 3, 4, 3, 5, 6, 7, 8, 9],  # the eval record carries its checkpoint's step
        "drafter/d1": list(range(7)),
        "target": list(range(10)),
        "eval": [1],
    }


@pytest.mark.timeout(240)  # the first one also runs the shared fixture
def test_sidecar_counts_malformed_frames_and_keeps_running(threaded_run):
    sidecar = threaded_run["sidecar"]
    assert threaded_run["errors"] == []
    assert sidecar.records_malformed == 4
    assert sidecar.records_received == threaded_run["expected_valid"] + 4
    assert sum("malformed metrics record" in line for line in threaded_run["lines"]) == 4
    assert sidecar.records_dropped_by_producers == 7
    assert any("producers dropped records" in line and "eval=7" in line for line in threaded_run["lines"])


@pytest.mark.timeout(240)  # the first one also runs the shared fixture
def test_wandb_has_one_run_per_drafter_and_a_target_run_in_the_jobs_group(threaded_run):
    run_dir = threaded_run["run_dir"]
    sidecar = threaded_run["sidecar"]
    runs = read_wandb_offline_runs(run_dir)
    assert set(runs) == {"thread-run/d0", "thread-run/d1", "thread-run/target"}
    assert {r.group for r in runs.values()} == {"thread-run"} and {r.project for r in runs.values()} == {"dflash"}
    d0, d1, target = runs["thread-run/d0"], runs["thread-run/d1"], runs["thread-run/target"]
    assert (d0.job_type, d1.job_type, target.job_type) == ("drafter", "drafter", "target")
    # Each run: the shared sections, and a drafter run its own [drafter] section.
    assert d0.config["drafter"]["learning_rate"] == 2e-4 and d1.config["drafter"]["learning_rate"] == 5e-4
    assert d1.config["drafter_id"] == "d1" and d1.config["role"] == "drafter" and "drafter" not in target.config
    assert all(r.config["shared"] == 1 and len(r.config["notes"]) == 70_000 for r in runs.values())
    # A drafter's series under their own names, on its own step axis; nothing of the other drafter.
    assert [row["step"] for row in d0.history if "loss" in row][-1] == 9
    assert [row["loss"] for row in d0.history if "loss" in row][-1] == pytest.approx(5.0 - 9 * 0.25)
    assert [row["loss"] for row in d1.history if "loss" in row][-1] == pytest.approx(6.0 - 6 * 0.25)
    assert {k for row in d1.history for k in row} == {"loss", "tokens_per_s", "step", "_step", "_timestamp", "_runtime"}
    assert d0.step_metrics["loss"] == d0.step_metrics["lr"] == "step" and d0.step_metrics["step"] == ""
    # The evaluation series on the evaluated checkpoint's step, its last tau in the summary.
    (evaluated,) = [row for row in d0.history if "eval/tau" in row]
    assert evaluated["eval/step"] == 3 and evaluated["step"] >= 4  # eval never rewinds the training step
    assert d0.step_metrics["eval/tau"] == "eval/step"
    assert d0.summary["eval/tau"] == 1.25 and d0.summary["loss"] == pytest.approx(5.0 - 9 * 0.25)
    # The target run: one row per window, with target/*, pipeline/*, sidecar/* and other sources.
    rows = target.history
    assert sidecar.windows_logged >= 3  # phase 1, phase 2, malformed frames
    assert len(rows) == sidecar.windows_logged, "\n".join(threaded_run["lines"][-20:])
    assert [r["sidecar/window"] for r in rows] == [r["_step"] for r in rows] == list(range(1, len(rows) + 1))
    assert not any(k.startswith("drafter/") for row in rows for k in row)
    final = rows[-1]
    assert final["pipeline/step_skew"] == 3
    assert final["pipeline/slowest_drafter_step"] == 6
    assert final["pipeline/num_drafters"] == 2
    assert final["pipeline/loss_mean"] == pytest.approx(((5.0 - 9 * 0.25) + (6.0 - 6 * 0.25)) / 2)
    assert final["pipeline/drafter_tokens_per_s"] == 400.0
    assert final["sidecar/records_malformed"] == 4
    assert final["sidecar/records_dropped_by_producers"] == 7
    assert final["eval/score"] == 0.5 and final["eval/step"] == 1
    assert final["sidecar/records_received"] == sidecar.records_received
    assert [r["target/queue_depth"] for r in rows if "target/step" in r][-1] == 3
    for source in ("target", "eval"):
        assert target.step_metrics[f"{source}/*"] == f"{source}/step" and target.step_metrics[f"{source}/step"] == ""
    assert target.step_metrics["pipeline/*"] == target.step_metrics["sidecar/*"] == "sidecar/window"
    # Every run logs window N as W&B step N: steps only increase, also across restarts.
    windows = {r["sidecar/window"] for r in rows}
    for run in (d0, d1):
        steps = [row["_step"] for row in run.history]
        assert steps == sorted(set(steps)) and set(steps) <= windows
    # Logged counts lag (windows may queue while W&B starts); the final tally is exact.
    calls = [r["sidecar/wandb_calls"] for r in rows]
    assert calls == sorted(calls)
    assert sidecar.stats()["sidecar/wandb_calls"] == sum(len(r.history) for r in runs.values())
    assert sidecar.stats()["sidecar/wandb_runs"] == 3
    files = find_offline_run_files(run_dir)
    assert len(files) == 3 and all(offline_run_finished(f) for f in files)
    saved = json.loads((run_dir / RUNS_FILE).read_text())
    assert {key: entry["id"] for key, entry in saved["runs"].items()} == sidecar.wandb_run_ids
    assert sorted(read_wandb_offline_run_ids(run_dir)) == sorted(sidecar.wandb_run_ids.values())
    assert saved["runs"]["drafter/d0"]["summary"] == {"eval/tau": 1.25, "eval/step": 3}
    # The job-wide view keeps the names of metrics.jsonl and docs/metrics.md.
    keys = set().union(*read_wandb_offline_history(run_dir))
    assert {"drafter/d0/loss", "drafter/d1/step", "drafter/d0/eval/tau", "target/tokens_per_s", "sidecar/window"} <= keys
    lines = offline_upload_lines(run_dir)
    assert "thread-run/d0, thread-run/d1, thread-run/target" in lines[0]
    assert lines[1] == f"upload them with: WANDB_RESUME=allow wandb sync {run_dir / 'wandb'}"


@pytest.mark.timeout(60)
def test_human_window_lines(threaded_run):
    windows = [line for line in threaded_run["lines"] if line.startswith("[window")]
    assert len(windows) == threaded_run["sidecar"].windows_logged
    assert "d0 step=     9" in windows[-1] and "d1 step=     6" in windows[-1]
    assert "skew=  3 slowest=d1" in windows[-1]
    assert "target step=     9 tok/s=  1100 queue=  3" in windows[-1]


# --- no W&B, windows closed by record count -------------------------------------------


@pytest.mark.timeout(30)
def test_disabled_wandb_and_max_records_per_window(tmp_path):
    address = free_address()
    sidecar = MetricsSidecar(address, tmp_path, "no-wandb", window_s=60.0, max_records_per_window=10, wandb_mode="disabled")
    thread = threading.Thread(target=sidecar.run)
    thread.start()
    try:
        with MetricsPusher(address, "drafter/d0") as pusher:
            for step in range(35):
                assert pusher.send({"loss": 1.0}, step)
            wait_for(lambda: sidecar.records_received >= 35, 10, "records")
    finally:
        sidecar.request_stop()
        thread.join(15)
    assert not thread.is_alive()
    assert sidecar.windows_logged == 4  # 10 + 10 + 10 by count, 5 on stop
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 35
    assert not (tmp_path / "wandb").exists() and sidecar.wandb_run_ids == {}
    sidecar.close()  # idempotent


@pytest.mark.timeout(30)
def test_bind_failure_names_the_address(tmp_path):
    address = free_address()
    first = MetricsSidecar(address, tmp_path / "a", "a", wandb_mode="disabled")
    try:
        with pytest.raises(SidecarBindError, match=address.replace(".", r"\.")):
            MetricsSidecar(address, tmp_path / "b", "b", wandb_mode="disabled")
    finally:
        first.close()


# --- W&B failures never reach the receive loop ------------------------------------------


class FlakyRun:
    def __init__(self, name: str, log_failures: int):
        self.name = name
        self.log_failures = log_failures
        self.logged: list[dict] = []
        self.defined: list[tuple] = []
        self.summary: dict = {}
        self.finished = False

    def define_metric(self, name, step_metric=None):
        self.defined.append((name, step_metric))

    def log(self, row, step=None, commit=None):
        if self.log_failures > 0:
            self.log_failures -= 1
            raise ConnectionError("W&B is down")
        self.logged.append(dict(row))

    def finish(self):
        self.finished = True


class FakeWandb:
    """init_fn for WandbUploader: one FlakyRun per init, by run name."""

    def __init__(self, log_failures: int = 0):
        self.log_failures = log_failures
        self.runs: dict[str, FlakyRun] = {}
        self.inits: list[dict] = []

    def __call__(self, **kwargs):
        self.inits.append(kwargs)
        run = self.runs[kwargs["name"]] = FlakyRun(kwargs["name"], self.log_failures)
        return run


def _windows(n, sources=("drafter/d0",)):
    agg = WindowAggregator()
    out = []
    for i in range(n):
        for source in sources:
            agg.add(rec(source, i, loss=1.0))
        out.append(agg.close_window({}))
    return out


@pytest.mark.timeout(30)
def test_uploader_retries_then_drops_failing_calls(tmp_path, caplog):
    fake = FakeWandb(log_failures=2)
    up = WandbUploader(run_dir=tmp_path / "a", run_name="r", retries=3, backoff_s=0.01, init_fn=fake)
    up.start()
    w1, w2 = _windows(2)
    up.submit(w1)
    up.close(timeout_s=10)
    d0, target = fake.runs["r/d0"], fake.runs["r/target"]
    assert [r["sidecar/window"] for r in target.logged] == [1] and [r["loss"] for r in d0.logged] == [1.0]
    assert up.calls == 2 and up.failures == 4 and up.windows_dropped == 0
    assert ("loss", "step") in d0.defined and ("step", None) in d0.defined
    assert d0.finished and target.finished

    fake = FakeWandb(log_failures=100)
    up = WandbUploader(run_dir=tmp_path / "b", run_name="r", retries=2, backoff_s=0.01, init_fn=fake)
    up.start()
    up.submit(w1)
    up.submit(w2)
    up.close(timeout_s=10)
    assert all(run.logged == [] and run.finished for run in fake.runs.values())
    assert up.calls == 0 and up.failures == 12 and up.windows_dropped == 2  # 2 windows x 2 runs x 3 attempts
    assert "giving up" in caplog.text


@pytest.mark.timeout(30)
def test_uploader_init_failure_discards_windows(tmp_path):
    def broken_init(**kwargs):
        raise OSError("no network")

    up = WandbUploader(run_dir=tmp_path, run_name="r", retries=1, backoff_s=0.01, init_fn=broken_init)
    up.start()
    wait_for(lambda: up.failed, 5, "init to give up")
    for w in _windows(3):
        up.submit(w)
    up.close(timeout_s=5)
    assert up.windows_dropped == 3 and up.calls == 0


@pytest.mark.timeout(30)
def test_drafters_beyond_max_drafter_runs_log_into_the_target_run(tmp_path, caplog):
    # W&B runs are heavy (one wandb.init each): a stream of drafter names must not open runs without bound.
    fake = FakeWandb()
    up = WandbUploader(run_dir=tmp_path, run_name="job", max_drafter_runs=2, backoff_s=0.01, init_fn=fake,
                       config={"shared": 1}, drafter_config=lambda d: {"id": d, "learning_rate": 1.0})
    up.start()
    for w in _windows(2, sources=("drafter/d0", "drafter/d1", "drafter/d2", "drafter/d2/x", "target")):
        up.submit(w)
    up.close(timeout_s=10)
    assert set(fake.runs) == {"job/target", "job/d0", "job/d1"} and up.runs_open == 3
    init = {kw["name"]: kw for kw in fake.inits}
    assert {kw["group"] for kw in fake.inits} == {"job"} and init["job/d1"]["job_type"] == "drafter"
    assert init["job/d1"]["config"] == {"shared": 1, "role": "drafter", "drafter_id": "d1",
                                        "drafter": {"id": "d1", "learning_rate": 1.0}}
    assert init["job/target"]["config"] == {"shared": 1, "role": "target"}
    assert all(kw["resume"] == "allow" and kw["reinit"] == "create_new" for kw in fake.inits)
    target = fake.runs["job/target"].logged
    assert target[-1]["drafter/d2/loss"] == 1.0 and target[-1]["drafter/d2/x/step"] == 1
    assert target[-1]["target/step"] == 1 and "drafter/d0/loss" not in target[-1]
    assert ("drafter/d2/*", "drafter/d2/step") in fake.runs["job/target"].defined
    assert "metrics.wandb_max_drafter_runs" in caplog.text
    # A restart keeps the ids, and still opens no third drafter run.
    fake2 = FakeWandb()
    up = WandbUploader(run_dir=tmp_path, run_name="job", max_drafter_runs=2, backoff_s=0.01, init_fn=fake2)
    up.start()
    for w in _windows(1, sources=("drafter/d2", "drafter/d1")):
        up.submit(w)
    up.close(timeout_s=10)
    assert {kw["name"]: kw["id"] for kw in fake2.inits} == {n: init[n]["id"] for n in ("job/target", "job/d1")}


def test_wandb_settings_come_from_the_config_else_the_environment_else_defaults(tmp_path):
    env = {"WANDB_PROJECT": "env-project", "WANDB_ENTITY": "env-team", "WANDB_MODE": "online",
           "WANDB_DIR": str(tmp_path / "w"), "WANDB_RUN_GROUP": "env-group"}
    from_env = resolve_wandb_settings(run_dir=tmp_path, job_name="job", mode="", project="", entity="", dir="",
                                      group="", env=env)
    assert (from_env.mode, from_env.project, from_env.entity, from_env.dir, from_env.group) == (
        "online", "env-project", "env-team", tmp_path / "w", "env-group")
    from_config = resolve_wandb_settings(run_dir=tmp_path, job_name="job", mode="disabled", project="p", entity="t",
                                         dir="d", group="g", env=env)
    assert (from_config.mode, from_config.project, from_config.entity, from_config.dir, from_config.group) == (
        "disabled", "p", "t", Path("d"), "g")
    default = resolve_wandb_settings(run_dir=tmp_path, job_name="job", env={})
    assert (default.mode, default.project, default.entity, default.dir, default.group) == (
        "offline", "dflash", None, tmp_path, "job")
    assert resolve_wandb_settings(run_dir=tmp_path, job_name="job", env={"WANDB_MODE": "dryrun"}).mode == "offline"
    with pytest.raises(WandbSettingsError, match="WANDB_MODE must be one of offline, online, disabled, got 'loud'"):
        resolve_wandb_settings(run_dir=tmp_path, job_name="job", env={"WANDB_MODE": "loud"})


# --- the process: signals, exit codes, resume ---------------------------------------------


def start_sidecar_process(address: str, run_dir: Path, env: dict, *args: str):
    """Start `python -m metrics_sidecar`; return the process, its stderr lines, and their reader."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "metrics_sidecar", "--address", address, "--run-dir", str(run_dir),
         "--run-name", "proc-run", "--window-s", "0.3", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    return proc, lines, reader


def stop_process(proc: subprocess.Popen, signum: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
    proc.send_signal(signum)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
        raise


def segment_summary(path: Path) -> dict:
    """The summary one offline segment (one sidecar start) recorded."""
    summary = {}
    for record in iter_records(path):
        if record.WhichOneof("record_type") == "summary":
            summary.update({(it.key or ".".join(it.nested_key)): json.loads(it.value_json)
                            for it in record.summary.update})
    return summary


JOB_CONFIG = """
[drafter]
learning_rate = 2e-4

[drafters.d1]
learning_rate = 5e-4
seed = 1
"""


@pytest.mark.timeout(90)
def test_process_two_drafters_restart_resumes_the_same_runs_with_config_from_file_and_env(tmp_path, wandb_env):
    # Guards docs/architecture.md "Failure semantics", the sidecar dies: the producers keep their pushers
    # across the restart (ZeroMQ reconnects), and every W&B run resumes under
    # its id with its steps continuing. Also: all drafters shared one run whose
    # config held d0's section only, and WANDB_PROJECT was ignored.
    config = tmp_path / "job.toml"
    config.write_text(JOB_CONFIG)
    run_dir = tmp_path / "proc-run"
    address = free_address()
    env = {**wandb_env, "WANDB_PROJECT": "from-env"}
    pushers = {s: MetricsPusher(address, s) for s in ("drafter/d0", "drafter/d1", "target")}
    try:
        for generation, signum in enumerate((signal.SIGTERM, signal.SIGINT)):
            proc, lines, reader = start_sidecar_process(address, run_dir, env, "--config", str(config))
            try:
                wait_for(lambda: any("[startup]" in line for line in lines), 20, "sidecar start-up")
                steps = range(generation * 10, generation * 10 + 5)
                for step in steps:
                    for source, pusher in pushers.items():
                        pusher.send({"loss": float(step) + (source == "drafter/d1")}, step)
                if generation == 0:
                    pushers["drafter/d0"].send({"eval/tau": 1.5}, 2)
                wait_for(
                    lambda: set(steps) <= {r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")
                                           if r["source"] == "drafter/d1"},
                    20,
                    f"generation {generation} records",
                )
                rc = stop_process(proc, signum)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(5)
            reader.join(5)
            assert rc == 0, "".join(lines)
            assert any("exited cleanly" in line for line in lines), "".join(lines)
    finally:
        for pusher in pushers.values():
            pusher.close()

    runs = read_wandb_offline_runs(run_dir)
    assert set(runs) == {"proc-run/d0", "proc-run/d1", "proc-run/target"}
    assert {(r.group, r.project) for r in runs.values()} == {("proc-run", "from-env")}
    assert runs["proc-run/d0"].config["drafter"]["learning_rate"] == 2e-4
    assert runs["proc-run/d1"].config["drafter"]["learning_rate"] == 5e-4
    assert runs["proc-run/d1"].config["drafter"]["seed"] == 1 and runs["proc-run/d1"].config["drafter"]["id"] == "d1"
    assert runs["proc-run/target"].config["config_file"] == str(config) and "drafter" not in runs["proc-run/target"].config
    saved = json.loads((run_dir / RUNS_FILE).read_text())["runs"]
    for name, run in runs.items():
        key = "target" if name.endswith("/target") else "drafter/" + name.split("/")[1]
        assert run.run_id == saved[key]["id"]
        assert len(run.files) == 2 and all(offline_run_finished(f) for f in run.files)  # one segment per start
        assert read_wandb_offline_run_ids(run_dir).count(run.run_id) == 2
        steps = [row["_step"] for row in run.history]
        assert steps == sorted(set(steps)), f"{name}: steps must continue on restart"
    d1 = [(row["step"], row["loss"]) for row in runs["proc-run/d1"].history]
    assert d1[-1] == (14, 15.0) and [s for s, _ in d1] == sorted(s for s, _ in d1)
    # The last measured tau is in d0's summary, also in the segment written after the restart.
    assert segment_summary(runs["proc-run/d0"].files[-1])["eval/tau"] == 1.5
    assert "eval/tau" not in runs["proc-run/d1"].summary


@pytest.mark.timeout(30)
def test_process_port_in_use_exits_2_with_one_line(tmp_path, wandb_env):
    address = free_address()
    holder = zmq.Context.instance().socket(zmq.PULL)
    holder.setsockopt(zmq.LINGER, 0)
    holder.bind(address)
    try:
        proc, lines, reader = start_sidecar_process(address, tmp_path / "r", wandb_env)
        try:
            rc = proc.wait(20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        reader.join(5)
    finally:
        holder.close()
    assert rc == 2
    text = [line for line in lines if line.strip()]
    assert len(text) == 1 and address in text[0] and "cannot bind" in text[0], lines


def test_eval_records_do_not_rewind_a_drafters_step():
    # Regression: dflash-eval --watch pushes eval/* at a checkpoint's (older) step;
    # that moved the drafter's step back and faked step skew.
    from common.metrics_client import make_metrics_record, parse_metrics_record, encode_metrics_record
    from metrics_sidecar.aggregate import WindowAggregator

    agg = WindowAggregator()
    for source, step, values in [("drafter/d0", 60, {"loss": 1.0}), ("drafter/d1", 60, {"loss": 1.1}),
                                 ("drafter/d0", 40, {"eval/tau": 1.2})]:
        agg.add(parse_metrics_record(encode_metrics_record(make_metrics_record(source, step, values))))
    window = agg.close_window({})
    assert window.row["pipeline/step_skew"] == 0
    assert window.row["drafter/d0/step"] == 60 and window.row["drafter/d0/eval/tau"] == 1.2
