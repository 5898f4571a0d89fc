"""Metrics sidecar: windows, aggregates, malformed frames, W&B offline runs, process lifecycle.

Real sockets on loopback, real W&B offline runs read back from the
transaction log, and `python -m metrics_sidecar` as a real process.
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
from metrics_sidecar.wandb_reader import (
    find_offline_run_files,
    offline_run_finished,
    read_wandb_offline_history,
    read_wandb_offline_run_ids,
    read_wandb_offline_step_metrics,
)
from metrics_sidecar.wandb_uploader import WandbUploader, stable_run_id

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
    }
    assert view.slowest == "d1" and view.stale == ("d2",)
    assert pipeline_aggregates({}, 0.0, 60.0).values == {"pipeline/num_drafters": 0}


def test_window_row_has_latest_values_of_sources_seen_in_window():
    clock = [0.0]
    agg = WindowAggregator(clock=lambda: clock[0])
    agg.add(rec("drafter/d0", 1, loss=5.0, lr=1e-4))
    agg.add(rec("drafter/d0", 2, loss=4.0))
    agg.add(rec("target", 7, tokens_per_s=1000.0, queue_depth=2))
    w1 = agg.close_window({"sidecar/records_received": 3})
    assert w1.index == 1 and set(w1.sources) == {"drafter/d0", "target"}
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
        wandb_config={"lr": 2e-4, "notes": "x" * 70_000},
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
        "drafter/d0": list(range(10)),
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
def test_wandb_offline_run_has_one_row_per_window(threaded_run):
    run_dir = threaded_run["run_dir"]
    sidecar = threaded_run["sidecar"]
    rows = read_wandb_offline_history(run_dir)
    assert sidecar.windows_logged >= 3  # phase 1, phase 2, malformed frames
    assert len(rows) == sidecar.windows_logged, "\n".join(threaded_run["lines"][-20:])
    assert [r["sidecar/window"] for r in rows] == list(range(1, len(rows) + 1))
    last_d0 = [r for r in rows if "drafter/d0/loss" in r][-1]
    last_d1 = [r for r in rows if "drafter/d1/loss" in r][-1]
    assert last_d0["drafter/d0/loss"] == pytest.approx(5.0 - 9 * 0.25)
    assert last_d0["drafter/d0/step"] == 9
    assert last_d1["drafter/d1/loss"] == pytest.approx(6.0 - 6 * 0.25)
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
    # Logged counts lag (windows may queue while W&B starts); the final tally is exact.
    calls = [r["sidecar/wandb_calls"] for r in rows]
    assert calls == sorted(calls) and sidecar.stats()["sidecar/wandb_calls"] == len(rows)
    (path,) = find_offline_run_files(run_dir)
    assert offline_run_finished(path)
    metrics = read_wandb_offline_step_metrics(run_dir)
    for source in ("drafter/d0", "drafter/d1", "target"):
        assert metrics[f"{source}/*"] == f"{source}/step" and metrics[f"{source}/step"] == ""
    assert metrics["pipeline/*"] == metrics["sidecar/*"] == "sidecar/window"
    assert read_wandb_offline_run_ids(run_dir) == [stable_run_id("thread-run")]
    assert (run_dir / "wandb_run_id").read_text().strip() == stable_run_id("thread-run")


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
    assert not (tmp_path / "wandb").exists() and sidecar.wandb_run_id is None
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
    def __init__(self, log_failures: int):
        self.log_failures = log_failures
        self.logged: list[dict] = []
        self.defined: list[tuple] = []
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


def _windows(n):
    agg = WindowAggregator()
    out = []
    for i in range(n):
        agg.add(rec("drafter/d0", i, loss=1.0))
        out.append(agg.close_window({}))
    return out


@pytest.mark.timeout(30)
def test_uploader_retries_then_drops_failing_calls(tmp_path, caplog):
    run = FlakyRun(log_failures=2)
    up = WandbUploader(run_dir=tmp_path, run_name="r", retries=3, backoff_s=0.01, init_fn=lambda **kw: run)
    up.start()
    w1, w2 = _windows(2)
    up.submit(w1)
    up.close(timeout_s=10)
    assert [r["sidecar/window"] for r in run.logged] == [1] and up.calls == 1 and up.failures == 2
    assert ("drafter/d0/*", "drafter/d0/step") in run.defined and run.finished

    run = FlakyRun(log_failures=100)
    up = WandbUploader(run_dir=tmp_path, run_name="r", retries=2, backoff_s=0.01, init_fn=lambda **kw: run)
    up.start()
    up.submit(w1)
    up.submit(w2)
    up.close(timeout_s=10)
    assert run.logged == [] and up.calls == 0 and up.failures == 6 and run.finished
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


# --- the process: signals, exit codes, resume ---------------------------------------------


def start_sidecar_process(address: str, run_dir: Path, env: dict):
    """Start `python -m metrics_sidecar`; return the process, its stderr lines, and their reader."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "metrics_sidecar", "--address", address, "--run-dir", str(run_dir),
         "--run-name", "proc-run", "--window-s", "0.3"],
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


@pytest.mark.timeout(60)
def test_process_stops_cleanly_on_signals_and_restart_resumes_same_run(tmp_path, wandb_env):
    # Guards DESIGN section 7 "sidecar dies": the producer keeps its pusher
    # across the restart (ZeroMQ reconnects), and the W&B run resumes under
    # the same id with the window axis continuing.
    run_dir = tmp_path / "proc-run"
    address = free_address()
    pusher = MetricsPusher(address, "drafter/d0")
    try:
        for generation, signum in enumerate((signal.SIGTERM, signal.SIGINT)):
            proc, lines, reader = start_sidecar_process(address, run_dir, wandb_env)
            try:
                wait_for(lambda: any("[startup]" in line for line in lines), 20, "sidecar start-up")
                steps = range(generation * 10, generation * 10 + 5)
                for step in steps:
                    pusher.send({"loss": float(step)}, step)
                wait_for(
                    lambda: set(steps) <= {r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")},
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
        pusher.close()

    files = find_offline_run_files(run_dir)
    assert len(files) == 2 and all(offline_run_finished(f) for f in files)
    assert read_wandb_offline_run_ids(run_dir) == [stable_run_id("proc-run")] * 2
    rows = read_wandb_offline_history(run_dir)
    windows = [r["sidecar/window"] for r in rows]
    assert windows == sorted(windows) and len(set(windows)) == len(windows), "window axis must continue on restart"
    assert [r for r in rows if "drafter/d0/loss" in r][-1]["drafter/d0/loss"] == 14.0


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
