"""deploy/tmux/launch.sh driven for real: start, train, restart one drafter, capture panes, stop, nothing left."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.fixtures import write_config
from tests.tools.test_report import assert_real_png

pytestmark = [
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux; .ci/run does)"),
    pytest.mark.timeout(300),
]

LAUNCH = ROOT / "deploy" / "tmux" / "launch.sh"
SESSION = "dflash-it"  # dflash-<run name>


class Launcher:
    """launch.sh on a private tmux server (tmux -L), so a developer's own tmux is never touched."""

    def __init__(self, config: Path, run_dir: Path):
        self.config = config
        self.run_dir = run_dir
        self.socket = f"dflash-test-{os.getpid()}"
        self.env = dict(os.environ, DFLASH_TMUX_SOCKET=self.socket, DFLASH_TMUX_ATTACH="0",
                        DFLASH_VENV=str(Path(sys.executable).parent.parent))
        self.env.pop("TMUX", None)
        self.env.pop("DFLASH_ENV_FILE", None)
        self.seen_pids: set[int] = set()

    def launch(self, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(LAUNCH), *args], capture_output=True, text=True,
                              timeout=timeout_s, env=self.env, cwd=ROOT)

    def tmux(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=30)

    def pane(self, window: str, fmt: str, pane: int | None = None) -> str:
        target = f"={SESSION}:={window}" + (f".{pane}" if pane is not None else "")
        return self.tmux("display-message", "-p", "-t", target, fmt).stdout.strip()

    def pid(self, window: str, pane: int | None = None) -> int:
        pid = int(self.pane(window, "#{pane_pid}", pane))
        self.seen_pids.add(pid)
        return pid

    def capture(self, window: str, pane: int | None = None) -> str:
        target = f"={SESSION}:={window}" + (f".{pane}" if pane is not None else "")
        return self.tmux("capture-pane", "-p", "-J", "-S", "-200", "-t", target).stdout

    def all_panes(self) -> str:
        out = []
        for window in self.tmux("list-windows", "-t", f"={SESSION}", "-F", "#{window_name}").stdout.split():
            out.append(f"--- {window} ---\n{self.capture(window)[-3000:]}")
        return "\n".join(out)

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        records = []
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                pass  # the line being written
        return records

    def wait_for(self, predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.5)
        raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}; panes:\n{self.all_panes()}")

    def cleanup(self) -> None:
        """Whatever the test did: end this test's tmux server and any process it started."""
        self.tmux("kill-server")
        for pid in self.seen_pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Running (a zombie left to a non-reaping init in a container does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_tmux_session_restart_one_drafter_and_stop(tmp_path, tiny_llama_dir):
    config = write_config(tmp_path, str(tiny_llama_dir), drafters={"0": {}, "1": {"learning_rate": 5e-4, "seed": 1}})
    run_dir = tmp_path / "runs" / "it"
    job = Launcher(config, run_dir)
    try:
        started = job.launch("start", str(config))
        assert started.returncode == 0, started.stderr
        windows = job.tmux("list-windows", "-t", f"={SESSION}", "-F", "#{window_name}").stdout.split()
        assert windows == ["overview", "metrics", "target", "drafter-0", "drafter-1"]
        assert job.launch("start", str(config)).returncode == 1, "a second session for the same run is refused"

        def steps() -> dict[str, int]:
            out: dict[str, int] = {}
            for rec in job.metrics():
                out[rec["source"]] = max(out.get(rec["source"], 0), rec["step"])
            return out

        job.wait_for(lambda: all(steps().get(f"drafter/{d}", 0) >= 4 for d in ("0", "1")), 150, "both drafters to train")
        target_pid, drafter0_pid, old_pid = job.pid("target"), job.pid("drafter-0"), job.pid("drafter-1")
        job.pid("metrics"), job.pid("overview", 0), job.pid("overview", 1)

        restarted = job.launch("restart-drafter", str(config), "1")
        assert restarted.returncode == 0, restarted.stdout + restarted.stderr
        assert "drafter-1 exited with status 0" in restarted.stdout
        new_pid = job.pid("drafter-1")
        assert new_pid != old_pid and not alive(old_pid)
        # Nothing else was touched.
        assert job.pid("target") == target_pid and alive(target_pid)
        assert job.pid("drafter-0") == drafter0_pid and alive(drafter0_pid)

        # The new process registers again (dflash-status sees its pid) and trains on.
        def registered() -> dict[str, dict]:
            status = subprocess.run([sys.executable, "-m", "tools.status", "--config", str(config), "--json"],
                                    capture_output=True, text=True, timeout=60, cwd=ROOT)
            assert status.returncode == 0, status.stderr
            return {d["id"]: d for d in json.loads(status.stdout)["drafters"]}

        job.wait_for(lambda: registered().get("1", {}).get("pid") == new_pid, 120, "the restarted drafter to register")
        registered_at = time.time()
        job.wait_for(lambda: any(r["source"] == "drafter/1" and r["time"] > registered_at for r in job.metrics()),
                     120, "the restarted drafter to report metrics")
        assert {d: r["pid"] for d, r in registered().items()} == {"0": drafter0_pid, "1": new_pid}

        # Each window shows its process's log (stderr), prefixed with the process name and pid.
        target_pane = job.capture("target")
        assert f"[target pid={target_pid}]" in target_pane and "serving on" in target_pane
        drafter_pane = job.capture("drafter-1")
        assert f"[drafter-1 pid={new_pid}]" in drafter_pane and "[resume]" in drafter_pane
        job.wait_for(lambda: "dflash status" in job.capture("overview", 0) and "training" in job.capture("overview", 0),
                     30, "the status view")
        overview = job.capture("overview", 0)
        assert all(f"\n{d} " in overview for d in ("0", "1")), overview
        job.wait_for(lambda: "[window" in job.capture("overview", 1), 30, "the sidecar log tail")
        assert "[metrics pid=" in job.capture("overview", 1)

        # The same lines land in runs/<name>/logs/<process>.log; a restart appends.
        logs = run_dir / "logs"
        assert {p.name for p in logs.glob("*.log")} >= {"target.log", "metrics.log", "drafter-0.log", "drafter-1.log"}
        assert f"[target pid={target_pid}]" in (logs / "target.log").read_text()
        drafter_log = (logs / "drafter-1.log").read_text()
        assert f"[drafter-1 pid={old_pid}]" in drafter_log and f"[drafter-1 pid={new_pid}]" in drafter_log

        stopped = job.launch("stop", str(config))
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        for window in ("drafter-0", "drafter-1", "target", "metrics"):
            assert f"{window} exited with status 0" in stopped.stdout, stopped.stdout
        assert job.tmux("has-session", "-t", f"={SESSION}").returncode != 0
        left = [pid for pid in job.seen_pids if alive(pid)]
        assert not left, f"still running after stop: {left}"
        assert "shutdown" in (logs / "drafter-0.log").read_text().splitlines()[-1]

        # The curves of that run, without uploading anything.
        report = subprocess.run([sys.executable, "-m", "tools.report", str(run_dir)], capture_output=True, text=True,
                                timeout=120, cwd=ROOT)
        assert report.returncode == 0, report.stderr
        pngs = [Path(p) for p in report.stdout.split()]
        assert {p.name for p in pngs} >= {"drafter-0.png", "drafter-1.png", "target.png", "pipeline.png"}
        for png in pngs:
            assert_real_png(png)
    finally:
        job.cleanup()


def test_launcher_errors_are_one_clear_line(tmp_path):
    env = dict(os.environ, DFLASH_TMUX_SOCKET=f"dflash-test-{os.getpid()}-err", DFLASH_TMUX_ATTACH="0")
    config = write_config(tmp_path, "unused", drafters={"0": {}})

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(LAUNCH), *args], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)

    missing = run("start", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr and missing.stderr.count("\n") == 1
    no_session = run("restart-drafter", str(config), "0")
    assert no_session.returncode == 2 and "no tmux session dflash-it" in no_session.stderr
    nothing = run("stop", str(config))
    assert nothing.returncode == 0 and "nothing to stop" in nothing.stdout
