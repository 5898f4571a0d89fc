"""The job's W&B runs (one per drafter, one for the target), fed from a worker thread.

Every W&B call (init, define_metric, log, finish) happens on the uploader's own
thread, so the sidecar's receive loop never waits on W&B. Windows wait in a
bounded queue (its length is `sidecar/upload_backlog`); when it is full the
oldest window is dropped. A failing call is retried with exponential backoff a
few times, then dropped with a log line; W&B failing never stops the sidecar.

Runs (wandb_layout.py): the target run is opened at start; a drafter's run
when its first series (or its ranks') arrive, up to `max_drafter_runs` (the
series of a drafter without a run of its own go to the target run under
`drafter/<id>/`, its ranks' under `rank/<id>.<k>/`). All runs live in one process (`reinit="create_new"`) and
one W&B group.

Restarts: every sidecar start opens the same run ids (`wandb_runs.json` in
the run directory) with resume="allow", and logs window i as W&B step i in
every run (the window counter survives restarts, see sidecar.py), so the
history segments of successive starts hold disjoint, increasing `_step`
ranges. Online, W&B resumes the runs on the spot. Offline, each start writes
one wandb/offline-run-*/ directory per run, and W&B does not record the
resume setting in them: the upload must run with resume set,
`sync_command(dir)`, so that each later segment is appended after the history
already uploaded instead of overwriting it from line 0 (docs/metrics.md).
"""

from __future__ import annotations

import logging
import queue
import shlex
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from common.metric_names import EVAL_PREFIX, PIPELINE_PREFIX, SIDECAR_PREFIX, STEP, Sidecar
from common.metrics_client import Number
from metrics_sidecar.aggregate import Window
from metrics_sidecar.wandb_layout import (
    TARGET_RUN,
    RunRegistry,
    RunSpec,
    WandbSettings,
    drafter_id_of,
    drafter_step_metric,
    split_window,
)

logger = logging.getLogger(__name__)

_STOP = object()


def sync_command(wandb_dir: str | Path) -> str:
    """The command that uploads every offline segment of every run under `wandb_dir`/wandb."""
    return f"WANDB_RESUME=allow wandb sync {shlex.quote(str(Path(wandb_dir) / 'wandb'))}"


def _default_init(**kwargs: Any) -> Any:
    import wandb  # imported here: slow to import, and unused in disabled mode

    settings = wandb.Settings(
        console="off",  # never wrap this process's stdout/stderr
        silent=True,
        disable_git=True,
        disable_code=True,
        x_disable_stats=True,  # the sidecar's own CPU/GPU stats are noise
    )
    return wandb.init(settings=settings, **kwargs)


@dataclass
class _OpenRun:
    spec: RunSpec
    run: Any
    defined: set[str] = field(default_factory=set)  # series (drafter run) or sources (target run) with an x axis


class WandbUploader:
    """Owns the job's W&B runs; `submit` hands it windows without ever blocking."""

    def __init__(
        self,
        *,
        run_dir: str | Path,
        run_name: str,
        mode: str = "offline",
        project: str = "dflash",
        entity: str | None = None,
        group: str | None = None,
        wandb_dir: str | Path | None = None,
        config: dict[str, Any] | None = None,
        drafter_config: Callable[[str], dict[str, Any]] | None = None,
        max_drafter_runs: int = 16,
        queue_size: int = 64,
        retries: int = 3,
        backoff_s: float = 0.5,
        init_fn: Callable[..., Any] | None = None,
    ) -> None:
        if mode not in ("offline", "online"):
            raise ValueError(f"WandbUploader mode must be 'offline' or 'online', got {mode!r}")
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        self.settings = WandbSettings(
            mode=mode,
            project=project,
            entity=entity or None,  # "" in the config means the default entity
            dir=Path(wandb_dir) if wandb_dir else self.run_dir,
            group=group or run_name,
        )
        self.config = dict(config or {})  # the job's shared sections
        self.drafter_config = drafter_config  # drafter id -> its resolved [drafter] section
        self.retries = retries
        self.backoff_s = backoff_s
        self.settings.dir.mkdir(parents=True, exist_ok=True)
        self._registry = RunRegistry(self.run_dir, run_name, self.settings, max_drafter_runs)
        self._registry.spec(TARGET_RUN)  # the target run's id exists from the start
        self._registry.save()  # records where this start's offline runs go
        self._init_fn = init_fn or _default_init
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._runs: dict[str, _OpenRun] = {}  # run key -> open run (uploader thread only)
        self._no_run: set[str] = set()  # drafter sources whose init gave up (at most max_drafter_runs)
        self._warned_full = False
        self.failed = False  # the target run's init gave up: windows are discarded
        # Counters read by the receive thread (plain ints/floats: atomic to read).
        self.calls = 0
        self.failures = 0
        self.last_log_ms = 0.0
        self.windows_dropped = 0
        self.runs_open = 0

    @property
    def backlog(self) -> int:
        return self._queue.qsize()

    @property
    def run_ids(self) -> dict[str, str]:
        """Run key ("target", "drafter/<id>") -> W&B run id, of every run the job has had."""
        return self._registry.ids

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="wandb-uploader", daemon=True)
            self._thread.start()

    def submit(self, window: Window) -> None:
        """Queue a window for logging; if the queue is full, drop the oldest."""
        if self.failed:
            self.windows_dropped += 1
            return
        self._put_dropping_oldest(window)

    def _put_dropping_oldest(self, item: Any) -> None:
        while True:
            try:
                self._queue.put_nowait(item)
                return
            except queue.Full:
                pass
            try:
                old = self._queue.get_nowait()
            except queue.Empty:
                continue
            self.windows_dropped += 1
            logger.warning(
                "[wandb] upload backlog full (%d windows): dropped window %d",
                self._queue.maxsize, old.index,
            )

    def close(self, timeout_s: float = 30.0) -> None:
        """Log what is queued, finish the runs, stop the thread. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self._thread is None:
            return
        self._put_dropping_oldest(_STOP)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error(
                "[shutdown] W&B uploader did not finish within %.0f s; %d window(s) not logged",
                timeout_s, self.backlog,
            )

    # --- worker thread -------------------------------------------------

    def _retry(self, what: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        delay = self.backoff_s
        for attempt in range(1, self.retries + 2):
            try:
                return True, fn()
            except Exception as exc:  # any W&B failure: retry, then drop, never crash
                self.failures += 1
                if attempt > self.retries:
                    logger.error("[wandb] %s failed %d times, giving up: %s", what, attempt, exc, exc_info=True)
                    return False, None
                logger.warning("[wandb] %s failed (attempt %d): %s; retrying in %.1f s", what, attempt, exc, delay)
                self._closing.wait(delay)  # no waiting once we are shutting down
                delay *= 2
        return False, None

    def _run_config(self, spec: RunSpec) -> dict[str, Any]:
        """The shared sections, plus for a drafter run its id and its own resolved [drafter] section."""
        config = {**self.config, "role": spec.job_type}
        if spec.drafter_id is None:
            return config
        config["drafter_id"] = spec.drafter_id
        if self.drafter_config is not None:
            try:
                config["drafter"] = self.drafter_config(spec.drafter_id)
            except Exception as exc:  # a run without its drafter section beats no run
                logger.error("[wandb] cannot resolve the [drafter] section of %s: %s", spec.drafter_id, exc)
        return config

    def _open(self, key: str) -> bool:
        """Open (or resume) the run of `key`; False if it has none (over the limit) or init gave up."""
        spec = self._registry.spec(key)
        if spec is None:
            return False
        s = self.settings
        config = self._run_config(spec)
        ok, run = self._retry(
            f"init of run {spec.name}",
            lambda: self._init_fn(
                project=s.project,
                entity=s.entity,
                group=s.group,
                job_type=spec.job_type,
                name=spec.name,
                id=spec.run_id,
                resume="allow",
                dir=str(s.dir),
                mode=s.mode,
                config=config,
                reinit="create_new",  # one process, several live runs
            ),
        )
        if not ok:
            return False
        if spec.summary:  # what a resumed segment would otherwise lack: the last measured tau
            self._retry(f"summary of run {spec.name}", lambda: run.summary.update(spec.summary))
        opened = self._runs[key] = _OpenRun(spec, run)
        self.runs_open = len(self._runs)
        if key == TARGET_RUN:
            self._retry(f"define_metric of run {spec.name}", lambda: self._define_target_axes(opened))
        logger.info("[wandb] run %s (%s, id %s, group %s, %s) in %s",
                    spec.name, spec.job_type, spec.run_id, s.group, s.mode, s.dir / "wandb")
        return True

    @staticmethod
    def _define_target_axes(opened: _OpenRun) -> None:
        opened.run.define_metric(Sidecar.WINDOW)
        opened.run.define_metric(f"{PIPELINE_PREFIX}*", step_metric=Sidecar.WINDOW)
        opened.run.define_metric(f"{SIDECAR_PREFIX}*", step_metric=Sidecar.WINDOW)

    def _has_own_run(self, source: str) -> bool:
        if drafter_id_of(source) is None:  # the target and other sources: the target run
            return False
        if source in self._runs:
            return True
        if source in self._no_run:
            return False
        if source not in self._registry.ids and not self._registry.has_room():
            if not self._warned_full:
                self._warned_full = True
                logger.warning(
                    "[wandb] %d drafters have W&B runs already (metrics.wandb_max_drafter_runs); %s and any "
                    "later drafter log into the target run as drafter/<id>/...",
                    self._registry.max_drafter_runs, source,
                )
            return False
        if self._open(source):
            return True
        self._no_run.add(source)  # its id is registered, so this set stays within max_drafter_runs
        return False

    def _define(self, opened: _OpenRun, row: dict[str, Number], folded: list[str]) -> None:
        """Give each new series its x axis (before its first point, so charts use it)."""
        run = opened.run
        if opened.spec.key == TARGET_RUN:
            for source in folded:
                if source not in opened.defined:
                    run.define_metric(f"{source}/{STEP}")
                    run.define_metric(f"{source}/*", step_metric=f"{source}/{STEP}")
                    opened.defined.add(source)
            return
        for key in sorted(row, key=lambda k: drafter_step_metric(k) is not None):  # the axes first
            if key not in opened.defined:
                axis = drafter_step_metric(key)
                if axis is None:
                    run.define_metric(key)
                else:
                    run.define_metric(key, step_metric=axis)
                opened.defined.add(key)

    def _log(self, window: Window) -> None:
        split = split_window(window, self._has_own_run)
        dropped = False
        for key, row in split.rows.items():
            opened = self._runs[key]

            def call(opened: _OpenRun = opened, row: dict[str, Number] = row) -> None:
                self._define(opened, row, split.folded)
                # W&B step = window number, which continues across restarts. commit:
                # with an explicit step W&B would hold the row until the next window.
                opened.run.log(row, step=window.index, commit=True)

            start = time.perf_counter()
            ok, _ = self._retry(f"log of window {window.index} to {opened.spec.name}", call)
            if not ok:
                dropped = True
                continue
            self.calls += 1
            self.last_log_ms = (time.perf_counter() - start) * 1000.0
            if key != TARGET_RUN:
                evals = {k: v for k, v in row.items() if k.startswith(EVAL_PREFIX)}
                if evals:
                    self._registry.remember_summary(key, evals)
        if dropped:
            self.windows_dropped += 1

    def _work(self) -> None:
        if not self._open(TARGET_RUN):
            self.failed = True
            logger.error("[wandb] no W&B run: metrics go to metrics.jsonl and the log only")
            self._discard_queue()
            return
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            self._log(item)
        # Drafter runs first: the target run, opened first, is finished last.
        for opened in sorted(self._runs.values(), key=lambda o: o.spec.key == TARGET_RUN):
            ok, _ = self._retry(f"finish of run {opened.spec.name}", opened.run.finish)
            if ok:
                logger.info("[shutdown] W&B run %s finished", opened.spec.name)
        logger.info("[shutdown] W&B: %d run(s), %d log call(s)", len(self._runs), self.calls)

    def _discard_queue(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                self.windows_dropped += 1
