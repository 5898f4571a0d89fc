"""The single W&B run of a training run, fed from a worker thread.

Every W&B call (init, define_metric, log, finish) happens on the uploader's own
thread, so the sidecar's receive loop never waits on W&B. Windows wait in a
bounded queue (its length is `sidecar/upload_backlog`); when it is full the
oldest window is dropped. A failing call is retried with exponential backoff a
few times, then dropped with a log line; W&B failing never stops the sidecar.

Restarts: every sidecar start opens the same run id (`wandb_run_id` in the run
directory) with resume="allow", and logs window i as W&B step i (the window
counter survives restarts, see sidecar.py), so the history segments of
successive starts hold disjoint, increasing `_step` ranges. Online, W&B
resumes the run on the spot. Offline, each start writes its own
wandb/offline-run-*/ directory, and W&B does not record the resume setting in
it: the upload must run with resume set, `sync_command(run_dir)`, so that each
later segment is appended after the history already uploaded instead of
overwriting it from line 0 (docs/metrics.md, "Durability, restarts and limits").
"""

from __future__ import annotations

import hashlib
import logging
import queue
import re
import shlex
import threading
import time
from pathlib import Path
from typing import Any, Callable

from metrics_sidecar.aggregate import WINDOW_KEY, Window

logger = logging.getLogger(__name__)

RUN_ID_FILE = "wandb_run_id"
WANDB_MODES = ("offline", "online", "disabled")

_STOP = object()


def stable_run_id(run_name: str) -> str:
    """A W&B run id derived from the run name only: readable prefix + hash."""
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", run_name).strip("-")[:48] or "run"
    digest = hashlib.sha1(run_name.encode("utf-8")).hexdigest()[:8]
    return f"{slug}-{digest}"


def load_or_create_run_id(run_dir: str | Path, run_name: str) -> str:
    """The run id saved in run_dir/wandb_run_id, written there on first use.

    The saved id wins over the derived one, so a restarted sidecar always
    resumes the run that this run directory started.
    """
    path = Path(run_dir) / RUN_ID_FILE
    if path.exists():
        saved = path.read_text(encoding="utf-8").strip()
        if saved:
            return saved
    run_id = stable_run_id(run_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(run_id + "\n", encoding="utf-8")
    tmp.replace(path)
    return run_id


def sync_command(run_dir: str | Path) -> str:
    """The command that uploads every offline segment of the run as one history."""
    return f"WANDB_RESUME=allow wandb sync {shlex.quote(str(Path(run_dir) / 'wandb'))}"


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


class WandbUploader:
    """Owns the W&B run; `submit` hands it windows without ever blocking."""

    def __init__(
        self,
        *,
        run_dir: str | Path,
        run_name: str,
        mode: str = "offline",
        project: str = "dflash",
        entity: str | None = None,
        config: dict[str, Any] | None = None,
        queue_size: int = 64,
        retries: int = 3,
        backoff_s: float = 0.5,
        init_fn: Callable[..., Any] | None = None,
    ) -> None:
        if mode not in ("offline", "online"):
            raise ValueError(f"WandbUploader mode must be 'offline' or 'online', got {mode!r}")
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        self.mode = mode
        self.project = project
        self.entity = entity or None  # "" in the config means the default entity
        self.config = dict(config or {})
        self.retries = retries
        self.backoff_s = backoff_s
        self.run_id = load_or_create_run_id(self.run_dir, run_name)
        self._init_fn = init_fn or _default_init
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._run: Any = None
        self._defined: set[str] = set()
        self.failed = False  # init gave up: windows are discarded
        # Counters read by the receive thread (plain ints/floats: atomic to read).
        self.calls = 0
        self.failures = 0
        self.last_log_ms = 0.0
        self.windows_dropped = 0

    @property
    def backlog(self) -> int:
        return self._queue.qsize()

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
        """Log what is queued, finish the run, stop the thread. Idempotent."""
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

    def _init(self) -> bool:
        ok, run = self._retry(
            "init",
            lambda: self._init_fn(
                project=self.project,
                entity=self.entity,
                name=self.run_name,
                id=self.run_id,
                resume="allow",
                dir=str(self.run_dir),
                mode=self.mode,
                config=self.config,
            ),
        )
        if not ok:
            return False
        self._run = run
        run.define_metric(WINDOW_KEY)
        run.define_metric("pipeline/*", step_metric=WINDOW_KEY)
        run.define_metric("sidecar/*", step_metric=WINDOW_KEY)
        if self.mode == "offline":
            logger.info("[wandb] run %s (offline) in %s; upload with: %s",
                        self.run_id, self.run_dir / "wandb", sync_command(self.run_dir))
        else:
            logger.info("[wandb] run %s (online) in %s", self.run_id, self.run_dir / "wandb")
        return True

    def _log(self, window: Window) -> None:
        def call() -> None:
            for source in window.sources:
                if source not in self._defined:
                    self._run.define_metric(f"{source}/step")
                    self._run.define_metric(f"{source}/*", step_metric=f"{source}/step")
                    self._defined.add(source)
            # W&B step = window number, which continues across restarts. commit:
            # with an explicit step W&B would hold the row until the next window.
            self._run.log(window.row, step=window.index, commit=True)

        start = time.perf_counter()
        ok, _ = self._retry(f"log of window {window.index}", call)
        if ok:
            self.calls += 1
            self.last_log_ms = (time.perf_counter() - start) * 1000.0

    def _work(self) -> None:
        if not self._init():
            self.failed = True
            logger.error("[wandb] no W&B run: metrics go to metrics.jsonl and the log only")
            self._discard_queue()
            return
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            self._log(item)
        ok, _ = self._retry("finish", lambda: self._run.finish())
        if ok:
            logger.info("[shutdown] W&B run %s finished: %d log call(s)", self.run_id, self.calls)

    def _discard_queue(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                self.windows_dropped += 1
