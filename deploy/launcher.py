"""Start the processes of a job as real subprocesses, wait for them, stop them, leave none behind.

The one process harness of the project: the demo, the quality recipe and the
soak (``deploy/``), the pipeline benchmark (``bench/``) and the integration
tests start their target server, drafter workers, metrics sidecar and eval
watchers through ``Job``:

    with Job(config, run_dir) as job:
        job.start_metrics()
        job.start_target()
        job.start_drafter("d0")
        job.wait_for(lambda: job.drafter_steps().get("drafter/d0", 0) >= 8, 150, "d0 to train")
        codes = job.stop(["d0", "target", "metrics"], timeout_s=60)

A job process is ``python -m <module> --config FILE [--set KEY=VALUE ...]``,
started in the repository root with the repository on ``PYTHONPATH`` and
unbuffered output. Its stdout and stderr are appended to
``<run_dir>/logs/<log name>.console`` (``target``, ``metrics``,
``drafter-<id>``, ``eval-<id>``): what it prints before its logging is set up,
a crash on import say. The process itself writes ``<log name>.log`` next to it
and sets its process title ``dflash-<log name>`` (``common/logging_setup.py``).
The children stay in the launcher's process group, so Ctrl-C in a terminal
reaches every one of them, as with processes started by hand.

``stop`` is SIGTERM, a bounded wait, then SIGKILL; ``kill`` is kill -9 of one
process (a fault to inject); ``restart`` starts a process again with the same
command. Leaving the ``with`` block SIGKILLs whatever still runs, with the
processes it spawned, so a failed test or a crashed launcher leaves nothing
behind.

It lives in ``deploy/``, next to the launchers, and not in ``common/``: the
services never start processes, and ``common/`` is what they are installed
with. Tests and benchmarks run from a checkout and import it from there.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

ROOT = Path(__file__).resolve().parent.parent

logger = logging.getLogger(__name__)

CONSOLE_TAIL_CHARS = 4000  # of a console shown in an error


class JobError(RuntimeError):
    """A process of the job failed, or did not do what was waited for in time; the message has its console."""


@dataclass(frozen=True)
class _Command:
    argv: tuple[str, ...]
    log_name: str  # <run_dir>/logs/<log_name>.console and .log


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc (Linux; none elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone since listed
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _kill_tree(proc: subprocess.Popen) -> int:
    """SIGKILL ``proc`` and every process below it; reap ``proc`` and return its exit code."""
    if proc.poll() is None:
        below = _descendants(proc.pid)  # read while proc is alive: its orphans are no longer found under it
        proc.kill()  # first, so it cannot replace the helpers killed next (a pool respawns its workers)
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # exited on its own meanwhile
    return proc.wait()


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file being appended to: a last line still being written is left out."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines.pop()  # torn: the writer is in the middle of it (or was killed there)
    return [json.loads(line) for line in lines if line.strip()]


def query_status(address: str, run_dir: Path, ctx, timeout_s: float = 1.0):
    """The target's STATUS (``protocol.Status``), or None while it cannot answer (starting, or no run keys yet)."""
    import zmq

    from common import protocol as P
    from common.auth import status_credential

    try:
        credential = status_credential(run_dir)
    except (OSError, ValueError):
        return None  # the target has not created the run's keys yet
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(P.StatusRequest(auth=credential).encode())
        if sock.poll(int(timeout_s * 1000)):
            msg = P.decode(sock.recv())
            return msg if isinstance(msg, P.Status) else None
        return None
    finally:
        sock.close()


class Job:
    """The processes of one job, by name (``target``, ``metrics``, a drafter's id, ``eval-<id>``).

    ``config`` and ``overrides`` become every job process's ``--config``/``--set``
    arguments; ``env`` adds to the inherited environment. ``procs`` maps each
    name to the ``Popen`` of its current incarnation.
    """

    def __init__(self, config: str | Path | None, run_dir: Path, *, overrides: Sequence[str] = (),
                 env: Mapping[str, str] | None = None):
        self.config = config
        self.run_dir = Path(run_dir)
        self.log_dir = self.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.job_args: list[str] = [] if config is None else ["--config", str(config)]
        self.job_args += [f"--set={o}" for o in overrides]
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
        self.procs: dict[str, subprocess.Popen] = {}
        self._commands: dict[str, _Command] = {}
        self._started: list[subprocess.Popen] = []  # every incarnation, so none escapes close()
        self._expected_exit: set[str] = set()  # stopped or killed by this Job: their exit is no failure
        self._zmq = None

    # -- starting ----------------------------------------------------------

    def start(self, name: str, module: str, *args: str, log_name: str | None = None) -> subprocess.Popen:
        """``python -m module --config ... *args`` as process ``name`` (console ``<log_name or name>.console``)."""
        if not self.job_args:
            raise ValueError("this Job has no config: start job processes from a Job made with one")
        return self.start_command(name, [sys.executable, "-m", module, *self.job_args, *args], log_name=log_name)

    def start_target(self, *args: str) -> subprocess.Popen:
        return self.start("target", "target_server", *args)

    def start_metrics(self, *args: str) -> subprocess.Popen:
        return self.start("metrics", "metrics_sidecar", *args)

    def start_drafter(self, drafter_id: str, *args: str) -> subprocess.Popen:
        return self.start(drafter_id, "drafter_worker", "--id", drafter_id, *args, log_name=f"drafter-{drafter_id}")

    def start_all(self, drafter_ids: Iterable[str], *, eval_watch_args: Sequence[str] | None = None) -> None:
        """The whole job: the metrics sidecar, the target, then each drafter (``start_drafter``).

        The sidecar comes first so it hears everyone's first records, and the
        target before the drafters that register with it. With
        ``eval_watch_args`` each drafter is followed by its ``dflash-eval --watch``
        process (``start_eval_watch(drafter_id, *eval_watch_args)``).
        """
        self.start_metrics()
        self.start_target()
        for drafter_id in drafter_ids:
            self.start_drafter(drafter_id)
            if eval_watch_args is not None:
                self.start_eval_watch(drafter_id, *eval_watch_args)

    def start_eval_watch(self, drafter_id: str, *args: str) -> subprocess.Popen:
        """``dflash-eval --watch`` of one drafter over this run directory, as ``eval-<id>``."""
        argv = [sys.executable, "-m", "tools.eval", str(self.run_dir), "--watch", "--drafter", drafter_id, *args]
        return self.start_command(f"eval-{drafter_id}", argv)

    def start_command(self, name: str, argv: Sequence[str], *, log_name: str | None = None) -> subprocess.Popen:
        """Any command as process ``name``, with the job's environment, directory and console."""
        running = self.procs.get(name)
        if running is not None and running.poll() is None:
            raise JobError(f"{name} is already running (pid {running.pid}); stop or kill it first")
        command = _Command(tuple(argv), log_name or name)
        with open(self.console_path(name, command), "a", encoding="utf-8") as console:
            proc = subprocess.Popen(list(argv), stdout=console, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)
        self._commands[name] = command
        self.procs[name] = proc
        self._started.append(proc)
        self._expected_exit.discard(name)
        logger.info("[launch] %s started, pid %d: %s", name, proc.pid, " ".join(argv))
        return proc

    def restart(self, name: str) -> subprocess.Popen:
        """Start ``name`` again with the command it was last started with (its console is appended to)."""
        command = self._commands[name]
        return self.start_command(name, command.argv, log_name=command.log_name)

    # -- signals and stopping ----------------------------------------------

    def poll(self, name: str) -> int | None:
        """Exit code of ``name``, None while it runs."""
        return self.procs[name].poll()

    def send_signal(self, name: str, signum: int) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(signum)

    def signal_all(self, signum: int) -> None:
        for name in self.procs:
            self.send_signal(name, signum)

    def wait(self, name: str, timeout_s: float) -> int:
        """Exit code of ``name`` once it exits by itself; JobError if it still runs after ``timeout_s``."""
        try:
            return self.procs[name].wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise JobError(f"{name} still running after {timeout_s:.0f}s:\n{self.console(name)}") from None

    def finish(self, name: str, timeout_s: float) -> int:
        """Exit code of ``name`` once it ends by itself; past ``timeout_s`` it is killed (code -9)."""
        try:
            return self.wait(name, timeout_s)
        except JobError:
            logger.warning("[launch] %s still running after %.0fs: killing it", name, timeout_s)
            self._expected_exit.add(name)
            return _kill_tree(self.procs[name])

    def run(self, name: str, argv: Sequence[str], timeout_s: float) -> int:
        """A one-shot command (an evaluation, an export) run to its end like ``finish``: its exit code."""
        self.start_command(name, argv)
        return self.finish(name, timeout_s)

    def kill(self, name: str) -> int:
        """``kill -9`` of ``name`` alone (a crash, the OOM killer: what it spawned sees its parent die); its exit code."""
        self._expected_exit.add(name)
        proc = self.procs[name]
        if proc.poll() is None:
            proc.kill()
        return proc.wait()

    def stop(self, names: Iterable[str], timeout_s: float) -> dict[str, int]:
        """SIGTERM every named process at once, wait for all of them together for up to ``timeout_s``,
        SIGKILL those still running. Exit codes by name (names never started are left out)."""
        return self._stop(names, timeout_s)[0]

    def terminate(self, name: str, timeout_s: float) -> int:
        """``stop`` of one process that must honour SIGTERM: JobError if it had to be killed."""
        codes, killed = self._stop([name], timeout_s)
        if killed:
            raise JobError(f"{name} did not exit within {timeout_s:.0f}s of SIGTERM:\n{self.console(name)}")
        return codes[name]

    def _stop(self, names: Iterable[str], timeout_s: float) -> tuple[dict[str, int], list[str]]:
        names = [n for n in names if n in self.procs]
        for name in names:
            self._expected_exit.add(name)
            self.send_signal(name, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        codes, killed = {}, []
        for name in names:
            proc = self.procs[name]
            try:
                codes[name] = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("[launch] %s did not exit within %.0fs of SIGTERM: killing it", name, timeout_s)
                codes[name] = _kill_tree(proc)
                killed.append(name)
        return codes, killed

    def close(self) -> None:
        """SIGKILL everything this Job started that still runs, with what it spawned."""
        for proc in self._started:
            _kill_tree(proc)
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- waiting -----------------------------------------------------------

    def check(self, what: str, *, running: Iterable[str] = ()) -> None:
        """JobError if a process failed (exited non-zero by itself) or one of ``running`` exited at all."""
        must_run = set(running)
        for name, proc in self.procs.items():
            code = proc.poll()
            if code is None:
                continue
            if name in must_run or (code != 0 and name not in self._expected_exit):
                raise JobError(f"{name} exited with {code} while {what}:\n{self.console(name)}")

    def wait_for(self, predicate: Callable[[], object], timeout_s: float, what: str, *,
                 running: Iterable[str] = (), interval_s: float = 0.3) -> None:
        """Poll ``predicate`` until true; JobError (with the consoles) on timeout or when ``check`` fails."""
        running = list(running)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if predicate():
                return
            self.check(f"waiting for {what}", running=running)
            time.sleep(interval_s)
        raise JobError(f"timed out after {timeout_s:.0f}s waiting for {what}; consoles:\n{self.all_consoles()}")

    def wait_for_log(self, name: str, text: str, timeout_s: float) -> None:
        """Wait until ``text`` appears in the log file of ``name`` (e.g. the target's ``serving on``)."""
        self.wait_for(lambda: text in self.log(name), timeout_s, f"{name} to log {text!r}")

    def status(self, address: str, timeout_s: float = 1.0):
        """The target's STATUS over its control socket, or None while it cannot answer."""
        if self._zmq is None:
            import zmq

            self._zmq = zmq.Context()
        return query_status(address, self.run_dir, self._zmq, timeout_s)

    # -- reading what the processes wrote ----------------------------------

    def _log_name(self, name: str) -> str:
        command = self._commands.get(name)
        return command.log_name if command is not None else name

    def console_path(self, name: str, command: _Command | None = None) -> Path:
        return self.log_dir / f"{command.log_name if command is not None else self._log_name(name)}.console"

    def console(self, name: str) -> str:
        """The end of what ``name`` printed (all its incarnations)."""
        path = self.console_path(name)
        return path.read_text(encoding="utf-8", errors="replace")[-CONSOLE_TAIL_CHARS:] if path.exists() else ""

    def all_consoles(self) -> str:
        return "\n".join(f"--- {n} ---\n{self.console(n)}" for n in self.procs)

    def log(self, name: str) -> str:
        """The whole log file ``name`` writes through its logging (``<run_dir>/logs/<name>.log``), or ''."""
        path = self.log_dir / f"{self._log_name(name)}.log"
        return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""

    def metrics(self) -> list[dict]:
        """The records of the run's ``metrics.jsonl`` so far."""
        return read_jsonl(self.run_dir / "metrics.jsonl")

    def drafter_steps(self) -> dict[str, int]:
        """Highest step in ``metrics.jsonl`` per drafter source (``drafter/<id>``)."""
        steps: dict[str, int] = {}
        for rec in self.metrics():
            if rec["source"].startswith("drafter/"):
                steps[rec["source"]] = max(steps.get(rec["source"], 0), rec["step"])
        return steps
