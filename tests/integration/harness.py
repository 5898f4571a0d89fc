"""Start the job's real processes on loopback for integration tests, and always tear them down."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import ROOT, free_ports


def write_config(tmp: Path, model: str, *, drafters: dict[str, dict], extra: str = "",
                 sections: dict[str, list[str]] | None = None) -> Path:
    """The job config of an integration test; ``sections`` adds ``key = value`` lines to a table."""
    control, store, metrics = free_ports(3)
    lines = [
        "[run]", 'name = "it"', f'root_dir = "{tmp / "runs"}"',
        "[control]", f'address = "tcp://127.0.0.1:{control}"', f"store_port = {store}",
        "heartbeat_interval_s = 0.5", "heartbeat_timeout_s = 5.0", "handshake_timeout_s = 10.0",
        "[metrics]", f'address = "tcp://127.0.0.1:{metrics}"', "log_every_steps = 2", "window_s = 0.5",
        "[target]", f'model = "{model}"', "num_captured_layers = 3", "threads = 1",
        "[data]", "max_seq_len = 64", "bucket_lengths = [32, 64]", "tokens_per_batch = 256", "max_samples = 80",
        "[transport]", 'kind = "gloo"', "timeout_s = 20.0",
        "[drafter]", "block_size = 8", "anchors_per_sequence = 3", "threads = 1", "checkpoint_every_steps = 4",
        "warmup_steps = 2", "max_steps = 0",
    ]
    for section, more in (sections or {}).items():
        at = lines.index(f"[{section}]") + 1
        lines[at:at] = more
    for drafter_id, values in drafters.items():
        lines.append(f"[drafters.{drafter_id}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path = tmp / "job.toml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path


class Job:
    """The processes of one job; use as a context manager so they are always killed."""

    def __init__(self, config: Path, run_dir: Path):
        self.config = config
        self.run_dir = run_dir
        self.procs: dict[str, subprocess.Popen] = {}
        run_dir.parent.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, module: str, *args: str) -> subprocess.Popen:
        log = open(self.run_dir.parent / f"{name}.console", "a")
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(
            [sys.executable, "-m", module, "--config", str(self.config), *args],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )
        self.procs[name] = proc
        return proc

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def drafter_steps(self) -> dict[str, int]:
        steps: dict[str, int] = {}
        for rec in self.metrics():
            if rec["source"].startswith("drafter/"):
                steps[rec["source"]] = max(steps.get(rec["source"], 0), rec["step"])
        return steps

    def wait_for(self, predicate, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            for name, proc in self.procs.items():
                if proc.poll() is not None and proc.returncode != 0:
                    raise AssertionError(f"{name} exited with {proc.returncode} while waiting for {what}:\n{self.console(name)}")
            time.sleep(0.3)
        raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}; consoles:\n{self.all_consoles()}")

    def console(self, name: str) -> str:
        path = self.run_dir.parent / f"{name}.console"
        return path.read_text()[-4000:] if path.exists() else ""

    def all_consoles(self) -> str:
        return "\n".join(f"--- {n} ---\n{self.console(n)}" for n in self.procs)

    def terminate(self, name: str, timeout_s: float) -> int:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{name} did not exit within {timeout_s}s of SIGTERM:\n{self.console(name)}")

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
