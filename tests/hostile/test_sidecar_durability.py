"""The metrics sidecar under kill -9, torn files, floods and off-host binds.

Real `python -m metrics_sidecar` processes (or a sidecar in a thread where its
counters are asserted) on loopback with free ports, W&B in offline mode and
read back from its own transaction logs. Every wait is bounded; no assertion
depends on how fast anything ran.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from common.metrics_client import MetricsPusher, encode_metrics_record, make_metrics_record
from common.sockets import SocketFactory, create_keys
from metrics_sidecar.sidecar import MetricsSidecar, SidecarBindError
from metrics_sidecar.wandb_layout import RUNS_FILE
from metrics_sidecar.wandb_reader import find_offline_run_files, iter_records, read_wandb_offline_run_ids
from metrics_sidecar.wandb_uploader import sync_command
from tests.conftest import ROOT, free_ports

pytestmark = pytest.mark.timeout(300)

RUN_NAME = "durable"


# --- helpers ----------------------------------------------------------------------------------


def loopback_address() -> str:
    return f"tcp://127.0.0.1:{free_ports(1)[0]}"


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def complete_lines(path: Path) -> list[str]:
    """The newline-terminated lines of a file another process may be appending to."""
    if not path.exists():
        return []
    return path.read_bytes().decode("utf-8").split("\n")[:-1]


def sequence_numbers(path: Path) -> list[int]:
    return [int(json.loads(line)["values"]["seq"]) for line in complete_lines(path)]


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (the W&B service a sidecar started), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited while listed
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture
def wandb_env(tmp_path):
    """W&B offline, quiet and out of the home directory, for the processes started here."""
    home = tmp_path / "wandb_home"
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        "WANDB_ARTIFACT_DIR": str(home / "artifacts"),
        "WANDB_DISABLE_GIT": "true",
    }


class SidecarProcess:
    """One `python -m metrics_sidecar` and its stderr lines; `cleanup` always ends what it started."""

    def __init__(self, address: str, run_dir: Path, env: dict, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "metrics_sidecar", "--address", address, "--run-dir", str(run_dir),
             "--run-name", RUN_NAME, *args],
            cwd=ROOT, env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._reader.start()
        self._children: list[int] = []

    def text(self) -> str:
        return "".join(self.lines)

    def wait_started(self) -> None:
        wait_for(lambda: "[startup]" in self.text() or self.proc.poll() is not None, 60, "sidecar start-up")
        assert self.proc.poll() is None, self.text()

    def kill9(self) -> None:
        self._children = child_pids(self.proc.pid)  # its W&B service runs in its own session
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> int:
        self._children = child_pids(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(120)
        self._reader.join(5)
        return rc

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.kill9()
        deadline = time.monotonic() + 30  # the W&B service exits once its parent is gone
        for pid in self._children:
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)


def history_steps(path: Path, axis: str = "sidecar/window") -> list[tuple[int, int]]:
    """(W&B `_step`, `axis`) of each history row in one offline transaction log."""
    rows = []
    for record in iter_records(path):
        if record.WhichOneof("record_type") == "history":
            items = {(it.key or ".".join(it.nested_key)): json.loads(it.value_json) for it in record.history.item}
            rows.append((items["_step"], items[axis]))
    return rows


def run_ids(run_dir: Path) -> dict[str, str]:
    """Run key ("target", "drafter/<id>") -> W&B run id, as the sidecar saved them."""
    return {key: entry["id"] for key, entry in json.loads((run_dir / RUNS_FILE).read_text())["runs"].items()}


# --- 1. kill -9 under a stream -------------------------------------------------------------------


def test_kill_9_mid_stream_loses_at_most_the_open_window_and_duplicates_nothing(tmp_path):
    # Guards: a killed sidecar left a torn line that the restarted one glued its
    # first record to, and could lose more than the window it had open.
    run_dir = tmp_path / RUN_NAME
    jsonl = run_dir / "metrics.jsonl"
    address = loopback_address()
    per_window = 10
    args = ("--wandb-mode", "disabled", "--window-s", "0.2", "--max-records-per-window", str(per_window))
    seq = 0
    pusher = MetricsPusher(address, "drafter/d0", hwm=10_000)

    def send(n: int) -> range:
        nonlocal seq
        sent = range(seq, seq + n)
        for i in sent:
            assert pusher.send({"seq": i}, i)
        seq += n
        return sent

    def wait_logged(sent: range) -> None:
        wait_for(lambda: set(sent) <= set(sequence_numbers(jsonl)), 60, f"records {sent.start}..{sent.stop - 1}")

    first = SidecarProcess(address, run_dir, {}, *args)
    second = None
    try:
        first.wait_started()
        for _ in range(5):
            wait_logged(send(per_window))
        in_flight = send(per_window // 2)  # the open window, then the kill
        first.kill9()
        second = SidecarProcess(address, run_dir, {}, *args)
        second.wait_started()
        after = [send(per_window) for _ in range(5)]
        for sent in after:
            wait_logged(sent)
        assert second.stop() == 0, second.text()
    finally:
        pusher.close()
        first.cleanup()
        if second is not None:
            second.cleanup()

    lines = complete_lines(jsonl)
    assert jsonl.read_bytes().endswith(b"\n")
    seqs = [int(json.loads(line)["values"]["seq"]) for line in lines]  # every line parses
    assert len(seqs) == len(set(seqs)), "a record was written twice"
    missing = set(range(seq)) - set(seqs)
    assert missing <= set(in_flight) and len(missing) < per_window, sorted(missing)


# --- 2. torn tail ---------------------------------------------------------------------------------


def test_start_cuts_a_torn_tail_and_the_next_lines_parse(tmp_path):
    # Guards: a line torn by a kill was glued to the next start's first line.
    run_dir = tmp_path / RUN_NAME
    run_dir.mkdir()
    jsonl = run_dir / "metrics.jsonl"
    good = [json.dumps({"source": "drafter/d0", "step": i, "time": 0.0, "values": {"seq": i}, "received_at": 0.0})
            for i in range(2)]
    fragment = b'{"source":"drafter/d0","step":2,"ti'
    jsonl.write_bytes(("\n".join(good) + "\n").encode() + fragment)
    address = loopback_address()
    sidecar = SidecarProcess(address, run_dir, {}, "--wandb-mode", "disabled", "--window-s", "0.2")
    try:
        sidecar.wait_started()
        assert jsonl.read_bytes() == ("\n".join(good) + "\n").encode()
        assert f"dropped its last {len(fragment)} byte(s)" in sidecar.text()
        with MetricsPusher(address, "drafter/d0") as pusher:
            assert pusher.send({"seq": 3}, 3)
            wait_for(lambda: 3 in sequence_numbers(jsonl), 60, "the new record")
        assert sidecar.stop() == 0, sidecar.text()
    finally:
        sidecar.cleanup()
    assert sequence_numbers(jsonl) == [0, 1, 3]


# --- 3. W&B across kill -9 and restart -------------------------------------------------------------


def test_wandb_segments_across_kill_9_share_the_run_id_with_disjoint_continuing_steps(tmp_path, wandb_env):
    # Guards: a restarted sidecar wrote a second offline directory whose `_step`
    # restarted at 0, so uploading both replaced the first one's history.
    # Also guards: both starts attached to the launcher's W&B service (inherited
    # WANDB_SERVICE), which still held the killed start's stream, so the second
    # start's init failed with "run ID ... is in use". A bogus token fails any
    # sidecar that does not start its own service.
    wandb_env = {**wandb_env, "WANDB_SERVICE": "inherited-from-the-launcher"}
    run_dir = tmp_path / RUN_NAME
    address = loopback_address()
    args = ("--wandb-mode", "offline", "--window-s", "0.2")
    pusher = MetricsPusher(address, "drafter/d0")
    step = 0

    def log_window(sidecar: SidecarProcess) -> None:
        nonlocal step
        logged = sidecar.text().count("[window ")
        assert pusher.send({"loss": float(step)}, step)
        step += 1
        wait_for(lambda: sidecar.text().count("[window ") > logged, 60, f"window of step {step - 1}")

    def on_disk_rows() -> int:  # of the target run (pipeline/*, sidecar/*), which logs every window
        files = find_offline_run_files(run_dir, run_ids(run_dir)["target"])
        return len(history_steps(files[0])) if files else 0

    first = SidecarProcess(address, run_dir, wandb_env, *args)
    second = None
    try:
        first.wait_started()
        # wandb-core writes its log in 32 KiB blocks and an orphaned core exits
        # without flushing: log windows until some are on disk, then kill.
        deadline = time.monotonic() + 120
        while on_disk_rows() == 0:
            assert time.monotonic() < deadline, "W&B wrote no history row within 120 s"
            log_window(first)
        windows_claimed = first.text().count("[window ")
        first.kill9()
        second = SidecarProcess(address, run_dir, wandb_env, *args)
        second.wait_started()
        for _ in range(3):
            log_window(second)
        assert second.stop() == 0, second.text()
    finally:
        pusher.close()
        first.cleanup()
        if second is not None:
            second.cleanup()

    ids = run_ids(run_dir)
    assert set(ids) == {"target", "drafter/d0"}  # the target run and d0's own run, each resumed by id
    segments = read_wandb_offline_run_ids(run_dir)
    # d0's first segment can lack even its run record: kill -9 came before its first 32 KiB block.
    assert segments.count(ids["target"]) == 2 and 1 <= segments.count(ids["drafter/d0"]) <= 2
    before, after = (history_steps(f) for f in find_offline_run_files(run_dir, ids["target"]))
    for rows in (before, after):
        steps = [s for s, _ in rows]
        assert steps == sorted(set(steps)) and all(s == w for s, w in rows), rows  # _step is the window number
    # Disjoint and continuing: the second start's first step follows the last window the first one claimed.
    assert before[-1][0] <= windows_claimed and [s for s, _ in after] == [windows_claimed + i for i in (1, 2, 3)]
    # d0's run: the same steps (the window number), its own step axis continuing too.
    d0_before, d0_after = (history_steps(f, "step") for f in find_offline_run_files(run_dir, ids["drafter/d0"]))
    assert all(s <= windows_claimed for s, _ in d0_before)
    assert d0_after == [(windows_claimed + i, step - 3 + i - 1) for i in (1, 2, 3)], d0_after
    # Each start names the one upload command; resume is what makes W&B append segment 2.
    command = sync_command(run_dir)
    assert command.startswith("WANDB_RESUME=allow wandb sync ")
    assert command in first.text() and command in second.text()
    env = {**os.environ, **wandb_env, "WANDB_RESUME": "allow"}
    for name in ("WANDB_SILENT", "WANDB_SERVICE"):  # the dry run's listing is its only output
        env.pop(name)
    dry = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "sync", "--dry-run", str(run_dir / "wandb")],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert "Would sync 4 run(s)" in dry.stdout + dry.stderr, dry.stdout + dry.stderr  # 2 runs x 2 starts


# --- 4. floods ------------------------------------------------------------------------------------


def test_oversized_frames_and_fresh_source_names_leave_state_bounded(tmp_path):
    # Guards: the PULL socket took 100,000 x 1 MiB frames per peer, and every
    # fresh source name grew the sidecar's per-source state for good.
    # (Forgetting silent sources is tested with a clock in tests/metrics_sidecar.)
    address = loopback_address()
    max_sources = 64
    jsonl = tmp_path / "metrics.jsonl"
    sidecar = MetricsSidecar(address, tmp_path, RUN_NAME, window_s=0.2, wandb_mode="disabled", max_sources=max_sources)
    thread = threading.Thread(target=sidecar.run, name="sidecar-under-flood")
    thread.start()
    ctx = zmq.Context.instance()
    big = ctx.socket(zmq.PUSH)
    big.setsockopt(zmq.LINGER, 0)
    names = ctx.socket(zmq.PUSH)
    names.setsockopt(zmq.LINGER, 0)
    real = MetricsPusher(address, "drafter/d0")
    flood = 5000

    def real_steps() -> set[int]:
        return {json.loads(line)["step"] for line in complete_lines(jsonl) if '"drafter/d0"' in line}

    try:
        assert real.send({"loss": 1.0}, 0)
        wait_for(lambda: real_steps() == {0}, 30, "the real sender's first window")
        big.connect(address)
        names.connect(address)
        for _ in range(20):  # each costs its sender the connection; none reaches the decoder
            big.send(b"\x00" * (1 << 20), zmq.NOBLOCK)
        for i in range(flood):
            names.send(encode_metrics_record(make_metrics_record(f"flood/{i}", 0, {"x": 1.0})))
        wait_for(lambda: sidecar.records_received >= 1 + flood, 60, "the flood")
        for step in range(1, 4):
            assert real.send({"loss": 1.0}, step)
        wait_for(lambda: real_steps() == {0, 1, 2, 3}, 30, "the real sender's windows after the flood")
    finally:
        big.close()
        names.close()
        real.close()
        sidecar.request_stop()
        thread.join(60)
    assert not thread.is_alive()
    assert len(sidecar._aggregator.states) == max_sources  # d0 and the first 63 names
    assert sidecar.stats()["sidecar/sources_tracked"] == max_sources
    assert sidecar.records_refused == flood - (max_sources - 1)
    assert sidecar.records_received == flood + 4 and sidecar.records_malformed == 0
    assert sum('"flood/' in line for line in complete_lines(jsonl)) == max_sources - 1


# --- off-host bind --------------------------------------------------------------------------------


def test_off_host_bind_needs_curve_and_then_only_authorized_clients_get_in(tmp_path):
    # Guards: the sidecar accepted metrics from any host that could reach its port.
    port = free_ports(1)[0]
    with pytest.raises(SidecarBindError, match="CURVE"):
        MetricsSidecar(f"tcp://0.0.0.0:{port}", tmp_path / "plain", RUN_NAME, wandb_mode="disabled")
    keys = tmp_path / "keys"
    create_keys(keys)
    ctx = zmq.Context()  # its own: the CURVE authenticator takes the context's one ZAP endpoint
    sidecar = MetricsSidecar(f"tcp://0.0.0.0:{port}", tmp_path / "curve", RUN_NAME, window_s=0.2,
                             wandb_mode="disabled", sockets=SocketFactory(ctx, str(keys)))
    thread = threading.Thread(target=sidecar.run, name="sidecar-with-curve")
    thread.start()
    address = f"tcp://127.0.0.1:{port}"
    stranger = MetricsPusher(address, "drafter/stranger")  # no keys: its handshake fails
    client_sockets = SocketFactory(ctx, str(keys))
    member = MetricsPusher(address, "drafter/d0", sockets=client_sockets)
    try:
        assert stranger.send({"loss": 9.0}, 0)  # queued; it can never be delivered
        assert member.send({"loss": 1.0}, 0)
        wait_for(lambda: sidecar.records_received >= 1, 30, "the authorized client's record")
    finally:
        stranger.close()
        member.close()
        client_sockets.close()
        sidecar.request_stop()
        thread.join(30)
        ctx.term()
    assert not thread.is_alive()
    assert sidecar.records_received == 1
    logged = complete_lines(tmp_path / "curve" / "metrics.jsonl")
    assert [json.loads(line)["source"] for line in logged] == ["drafter/d0"]
