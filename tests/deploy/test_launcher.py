"""deploy/launcher.py on small stand-in processes: consoles, stop and kill, failures while waiting, no strays."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from deploy.launcher import Job, JobError, read_jsonl

pytestmark = pytest.mark.timeout(60)

# Prints its pid and the pid of a helper it spawned, then waits for a signal. With IGNORE_TERM it ignores SIGTERM.
PARENT = """
import os, signal, subprocess, sys, time
if "IGNORE_TERM" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("pids", os.getpid(), helper.pid, flush=True)
time.sleep(60)
"""


def alive(pid: int) -> bool:
    """Running (a zombie does not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def gone(pid: int, timeout_s: float = 10.0) -> bool:
    """Dead within ``timeout_s`` (a SIGKILL is delivered asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def start_parent(job: Job, name: str, *flags: str) -> tuple[int, int]:
    """Start PARENT as ``name`` and wait until it is ready (its console may hold earlier incarnations)."""
    pids = lambda: [x.split()[1:] for x in job.console(name).splitlines() if x.startswith("pids")]  # noqa: E731
    before = len(pids())
    job.start_command(name, [sys.executable, "-c", PARENT, *flags])
    job.wait_for(lambda: len(pids()) > before, 30, f"{name} to start its helper")
    parent, helper = pids()[-1]
    return int(parent), int(helper)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_failed_block_leaves_no_process_behind(tmp_path):
    # Regression: the test, benchmark and demo launchers each killed only the processes they started,
    # so a helper those spawned (a tokenizer pool, W&B's service) outlived a failed test.
    with pytest.raises(RuntimeError, match="the test failed"):
        with Job(None, tmp_path / "run") as job:
            parent, helper = start_parent(job, "parent")
            raise RuntimeError("the test failed")
    assert gone(parent) and gone(helper)


def test_stop_is_sigterm_then_sigkill_and_terminate_insists_on_sigterm(tmp_path):
    with Job(None, tmp_path / "run") as job:
        start_parent(job, "polite")
        start_parent(job, "deaf", "IGNORE_TERM")
        assert job.stop(["polite", "deaf", "never-started"], timeout_s=1.0) == {
            "polite": -signal.SIGTERM, "deaf": -signal.SIGKILL}
        start_parent(job, "deaf", "IGNORE_TERM")
        with pytest.raises(JobError, match="did not exit within 1s of SIGTERM"):
            job.terminate("deaf", timeout_s=1.0)


def test_waiting_fails_on_a_failed_process_but_not_on_one_killed_on_purpose(tmp_path):
    with Job(None, tmp_path / "run") as job:
        start_parent(job, "victim")
        assert job.kill("victim") == -signal.SIGKILL  # a fault injected by the test: no failure
        job.start_command("crash", [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"])
        with pytest.raises(JobError, match=r"crash exited with 3 while waiting for godot:\nboom"):
            job.wait_for(lambda: False, 30, "godot")
        job.procs.pop("crash")  # an expected failure, looked at: out of the way of later waits
        job.start_command("done", [sys.executable, "-c", "pass"])
        assert job.finish("done", 30) == 0
        with pytest.raises(JobError, match="done exited with 0"):
            job.check("measuring", running=["done"])  # a process that had to keep running


def test_restart_runs_the_same_command_and_appends_to_its_console(tmp_path):
    with Job(None, tmp_path / "run", env={"GREETING": "hello"}) as job:
        job.run("echo", [sys.executable, "-c", "import os; print(os.environ['GREETING'], os.getcwd())"], 30)
        job.restart("echo")
        assert job.finish("echo", 30) == 0
        lines = (tmp_path / "run" / "logs" / "echo.console").read_text().splitlines()
        root = str(Path(__file__).resolve().parents[2])
        assert lines == [f"hello {root}"] * 2
        assert job.console("echo") == "\n".join(lines) + "\n"
        with pytest.raises(ValueError, match="no config"):
            job.start_target()
    assert os.environ.get("GREETING") is None  # the job's environment is its own


def test_start_all_starts_the_sidecar_the_target_then_each_drafter_with_its_watcher(tmp_path, monkeypatch):
    with Job("job.toml", tmp_path / "run", overrides=["run.seed=1"]) as job:
        started = []
        monkeypatch.setattr(job, "start_command",
                            lambda name, argv, *, log_name=None: started.append((name, list(argv), log_name)))
        job.start_all(["d0", "d1"], eval_watch_args=["--every-s", "5"])
        assert [name for name, _, _ in started] == ["metrics", "target", "d0", "eval-d0", "d1", "eval-d1"]
        job_args = ["--config", "job.toml", "--set=run.seed=1"]
        assert started[0] == ("metrics", [sys.executable, "-m", "metrics_sidecar", *job_args], None)
        assert started[2] == ("d0", [sys.executable, "-m", "drafter_worker", *job_args, "--id", "d0"], "drafter-d0")
        assert started[3][1][-2:] == ["--every-s", "5"]
        started.clear()
        job.start_all(["d0"])  # no watchers
        assert [name for name, _, _ in started] == ["metrics", "target", "d0"]


def test_read_jsonl_leaves_out_a_line_still_being_written(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_jsonl(path) == []
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ValueError):
        read_jsonl(path)  # a complete line that is not JSON is a bug, not a torn write
