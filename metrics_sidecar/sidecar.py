"""The metrics sidecar: receive records, window them, log them (JSONL, W&B, log line).

    sidecar = MetricsSidecar("tcp://127.0.0.1:5557", "runs/r1", "r1")  # binds
    sidecar.run()          # until request_stop() / stop_event; then drains and closes

The receive loop polls with a timeout, so it notices a stop request within
`_POLL_MAX_S`; W&B calls run on the uploader's thread (wandb_uploader.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

import zmq

from common.metric_names import Sidecar
from common.metrics_client import MalformedRecord, parse_metrics_record
from common.durable_io import replace_durably
from common.sockets import SecurityError, SocketFactory, check_bind
from metrics_sidecar.aggregate import WindowAggregator
from metrics_sidecar.jsonl_log import JsonlLog
from metrics_sidecar.wandb_layout import WandbSettings, resolve_wandb_settings
from metrics_sidecar.wandb_uploader import WandbUploader, sync_command

logger = logging.getLogger("metrics_sidecar")

METRICS_FILE = "metrics.jsonl"
STATE_FILE = "metrics_sidecar_state.json"  # window counter, so a restart continues sidecar/window
_POLL_MAX_S = 0.1
# A record is a few hundred bytes (a drafter with 63 acc/pos_k series is under
# 2 KiB); ZeroMQ drops the connection of a peer that sends a larger frame.
_MAX_FRAME_BYTES = 64 << 10
# Per connected producer, which sends about one record per window: this many
# queue only while the sidecar stalls, and cap that peer at 64 MiB.
_RCVHWM = 1000
_MALFORMED_WARNINGS_PER_WINDOW = 20


class SidecarBindError(RuntimeError):
    """The sidecar could not bind its address (usually: port in use)."""


class MetricsSidecar:
    """Receives metric records on a PULL socket and logs one window at a time.

    Single-threaded apart from the W&B uploader: construct, `run()` and
    `close()` from one thread; `request_stop()` (or setting `stop_event`) may
    be called from any thread or a signal handler.
    """

    def __init__(
        self,
        address: str,
        run_dir: str | Path,
        run_name: str,
        *,
        window_s: float = 2.0,
        max_records_per_window: int = 10000,
        wandb_mode: str | None = None,
        wandb_project: str | None = None,
        wandb_entity: str | None = None,
        wandb_group: str | None = None,
        wandb_dir: str | Path | None = None,
        wandb_config: dict[str, Any] | None = None,
        drafter_config: Callable[[str], dict[str, Any]] | None = None,
        max_drafter_runs: int = 16,
        stop_event: threading.Event | None = None,
        stale_after_s: float = 60.0,
        max_sources: int = 1024,
        upload_queue_windows: int = 64,
        wandb_retries: int = 3,
        close_timeout_s: float = 30.0,
        context: zmq.Context | None = None,
        sockets: SocketFactory | None = None,
    ) -> None:
        self._check_args(window_s, max_records_per_window, run_name)
        # Each W&B setting: the value given, else its WANDB_* variable, else the default.
        settings = resolve_wandb_settings(run_dir=run_dir, job_name=run_name, mode=wandb_mode, project=wandb_project,
                                          entity=wandb_entity, dir=wandb_dir, group=wandb_group)
        self.address = address
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        self.window_s = window_s
        self.max_records_per_window = max_records_per_window
        self.close_timeout_s = close_timeout_s
        self.stop_event = stop_event if stop_event is not None else threading.Event()
        self._init_counters()
        sock = self._open_socket(address, context, sockets)
        self._uploader: WandbUploader | None = None
        try:
            self._open_outputs(settings, stale_after_s=stale_after_s, max_sources=max_sources,
                               wandb_config=wandb_config, drafter_config=drafter_config,
                               max_drafter_runs=max_drafter_runs, upload_queue_windows=upload_queue_windows,
                               wandb_retries=wandb_retries)
        except BaseException:
            sock.close(linger=0)
            raise
        self._log_startup(settings)

    @staticmethod
    def _check_args(window_s: float, max_records_per_window: int, run_name: str) -> None:
        """Refuse settings the receive loop cannot work with, before anything is bound or created."""
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if max_records_per_window < 1:
            raise ValueError(f"max_records_per_window must be >= 1, got {max_records_per_window}")
        if not run_name:
            raise ValueError("run_name must not be empty")

    def _init_counters(self) -> None:
        """Zero the lifetime counters (logged as sidecar/*) and the current window's tallies."""
        # Counters (also logged as sidecar/*).
        self.records_received = 0  # every frame, valid or not
        self.records_malformed = 0
        self.records_refused = 0  # valid, but from a new source beyond max_sources
        self.records_dropped_by_producers = 0
        self.windows_logged = 0

        self._closed = False
        self._window_frames = 0
        self._malformed_in_window = 0
        self._refused_in_window = 0
        self._dropped_in_window: dict[str, int] = {}

    def _open_socket(self, address: str, context: zmq.Context | None, sockets: SocketFactory | None) -> zmq.Socket:
        """Bind the PULL socket and register it for polling; the socket, for the caller to close on a later failure."""
        if sockets is None:
            sockets = SocketFactory(context if context is not None else zmq.Context.instance())
        self._sockets = sockets
        sock = self._bind(sockets, address)
        self._sock: zmq.Socket | None = sock
        self._poller = zmq.Poller()
        self._poller.register(sock, zmq.POLLIN)
        return sock

    def _open_outputs(
        self,
        settings: WandbSettings,
        *,
        stale_after_s: float,
        max_sources: int,
        wandb_config: dict[str, Any] | None,
        drafter_config: Callable[[str], dict[str, Any]] | None,
        max_drafter_runs: int,
        upload_queue_windows: int,
        wandb_retries: int,
    ) -> None:
        """Create the run directory, the window aggregator (continuing the saved window count),
        the W&B uploader unless W&B is disabled, and the JSONL log."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._aggregator = WindowAggregator(
            stale_after_s=stale_after_s, max_sources=max_sources, first_window=self._load_next_window()
        )
        if settings.mode != "disabled":
            self._uploader = WandbUploader(
                run_dir=self.run_dir,
                run_name=self.run_name,
                mode=settings.mode,
                project=settings.project,
                entity=settings.entity,
                group=settings.group,
                wandb_dir=settings.dir,
                config=wandb_config,
                drafter_config=drafter_config,
                max_drafter_runs=max_drafter_runs,
                queue_size=upload_queue_windows,
                retries=wandb_retries,
            )
        self._jsonl = JsonlLog(self.run_dir / METRICS_FILE)

    def _log_startup(self, settings: WandbSettings) -> None:
        """One line saying where records come in and where they go (and how to upload an offline W&B run)."""
        if settings.mode == "disabled":
            where = ""
        else:
            where = f" project {settings.project} group {settings.group} in {settings.dir / 'wandb'}"
            if settings.mode == "offline":
                where += f" (upload with: {sync_command(settings.dir)})"
        logger.info(
            "[startup] metrics sidecar listening on %s, run %s in %s, window %.1f s, W&B %s%s",
            self.address, self.run_name, self.run_dir, self.window_s, settings.mode, where,
        )

    @staticmethod
    def _bind(sockets: SocketFactory, address: str) -> zmq.Socket:
        """The PULL socket, under the same rule as the control socket: off-host needs CURVE."""
        try:
            check_bind(address, str(sockets.curve_dir or ""), "metrics socket")
        except SecurityError as exc:
            raise SidecarBindError(f"metrics sidecar: {exc}") from None
        try:
            return sockets.bind(zmq.PULL, address, "metrics socket",
                                LINGER=0, RCVHWM=_RCVHWM, MAXMSGSIZE=_MAX_FRAME_BYTES)
        except SecurityError as exc:
            raise SidecarBindError(
                f"metrics sidecar: {exc}; is another sidecar running there? stop it or choose another metrics address"
            ) from None

    # --- public -------------------------------------------------------------

    @property
    def wandb_run_ids(self) -> dict[str, str]:
        """W&B run id by run ("target", "drafter/<id>"); empty with W&B disabled."""
        return self._uploader.run_ids if self._uploader else {}

    def request_stop(self) -> None:
        """Ask `run()` to drain, log a final window and return. Signal-safe."""
        self.stop_event.set()

    def stats(self) -> dict[str, float]:
        """The sidecar/* counters as they would be logged now."""
        up = self._uploader
        return {
            Sidecar.RECORDS_RECEIVED: self.records_received,
            Sidecar.RECORDS_MALFORMED: self.records_malformed,
            Sidecar.RECORDS_REFUSED: self.records_refused,
            Sidecar.SOURCES_TRACKED: len(self._aggregator.states),
            Sidecar.RECORDS_DROPPED_BY_PRODUCERS: self.records_dropped_by_producers,
            Sidecar.WANDB_CALLS: up.calls if up else 0,
            Sidecar.WANDB_LOG_MS: up.last_log_ms if up else 0.0,
            Sidecar.UPLOAD_BACKLOG: up.backlog if up else 0,
            Sidecar.WINDOWS_DROPPED: up.windows_dropped if up else 0,
            Sidecar.WANDB_RUNS: up.runs_open if up else 0,
        }

    def run(self) -> None:
        """Receive and log windows until stopped, then drain and close."""
        if self._closed:
            raise RuntimeError("MetricsSidecar.run() after close()")
        try:
            if self._uploader is not None:
                self._uploader.start()
            next_window = time.monotonic() + self.window_s
            while not self.stop_event.is_set():
                timeout_s = min(max(next_window - time.monotonic(), 0.0), _POLL_MAX_S)
                if self._poller.poll(timeout_s * 1000.0):
                    self._receive_available()
                if time.monotonic() >= next_window:
                    self._end_window()
                    self._sockets.reload_authorized()  # a revoked CURVE key stops connecting (as on control)
                    next_window = time.monotonic() + self.window_s
            self._drain()
        finally:
            self.close()

    def close(self) -> None:
        """Flush files, finish the W&B run, close the socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._jsonl.close()
            if self._uploader is not None:
                self._uploader.close(self.close_timeout_s)
        finally:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None
            self._sockets.close()
        logger.info(
            "[shutdown] metrics sidecar: %d record(s) received, %d malformed, %d window(s) logged",
            self.records_received, self.records_malformed, self.windows_logged,
        )

    # --- receive loop ---------------------------------------------------------

    def _receive_available(self) -> int:
        """Receive every frame already queued, closing windows that fill up."""
        n = 0
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            n += 1
            self._handle(frames)
            if self._window_frames >= self.max_records_per_window:
                self._end_window()

    def _handle(self, frames: list[bytes]) -> None:
        self.records_received += 1
        self._window_frames += 1
        try:
            if len(frames) != 1:
                raise MalformedRecord(f"expected one frame, got {len(frames)}")
            if len(frames[0]) > _MAX_FRAME_BYTES:  # inproc skips MAXMSGSIZE; never decode a huge frame
                raise MalformedRecord(f"frame of {len(frames[0])} bytes exceeds {_MAX_FRAME_BYTES}")
            record = parse_metrics_record(frames[0])
        except MalformedRecord as exc:
            self.records_malformed += 1
            self._malformed_in_window += 1
            if self._malformed_in_window <= _MALFORMED_WARNINGS_PER_WINDOW:
                logger.warning("malformed metrics record (%d bytes) ignored: %s", sum(map(len, frames)), exc)
            return
        if not self._aggregator.admits(record.source):
            self.records_refused += 1
            self._refused_in_window += 1
            return
        if record.dropped:
            self.records_dropped_by_producers += record.dropped
            self._dropped_in_window[record.source] = self._dropped_in_window.get(record.source, 0) + record.dropped
        self._jsonl.write(record)
        if self._aggregator.add(record):
            logger.info("[source] first record from %s (step %d)", record.source, record.step)

    def _drain(self) -> None:
        """On stop: take what is already queued (bounded), log a final window."""
        budget = 10 * self.max_records_per_window
        while budget > 0:
            got = self._receive_available()
            budget -= got
            if got == 0:
                break
        self._end_window()

    def _end_window(self) -> None:
        self._forget_silent_sources()
        if self._refused_in_window:
            logger.warning(
                "refused %d record(s) from new sources: already tracking %d (the limit); "
                "silent sources are forgotten after %.0f s",
                self._refused_in_window, len(self._aggregator.states), self._aggregator.forget_after_s,
            )
            self._refused_in_window = 0
        if self._malformed_in_window > _MALFORMED_WARNINGS_PER_WINDOW:
            logger.warning(
                "%d more malformed record(s) in this window not shown",
                self._malformed_in_window - _MALFORMED_WARNINGS_PER_WINDOW,
            )
        self._malformed_in_window = 0
        if self._dropped_in_window:
            logger.warning(
                "producers dropped records while the sidecar was away or slow: %s",
                " ".join(f"{src}={n}" for src, n in sorted(self._dropped_in_window.items())),
            )
            self._dropped_in_window = {}
        if self._window_frames == 0:
            self._jsonl.flush()
            return  # nothing new: no W&B call, no line
        self._window_frames = 0
        window = self._aggregator.close_window(self.stats())
        for record in window.composed:  # a multi-rank drafter's own records, made from its ranks'
            self._jsonl.write(record, composed=True)
        self._jsonl.flush()
        # Claim the window number durably before W&B sees it: after a kill the
        # next sidecar never reuses it, so W&B steps stay disjoint across restarts.
        self._save_next_window(self._aggregator.next_index)
        if self._uploader is not None:
            self._uploader.submit(window)
        self.windows_logged += 1
        logger.info("%s", window.line)

    def _forget_silent_sources(self) -> None:
        gone = self._aggregator.forget_silent()
        if gone:
            logger.info(
                "[source] forgot %d source(s) silent for over %.0f s: %s%s",
                len(gone), self._aggregator.forget_after_s, " ".join(gone[:10]), " ..." if len(gone) > 10 else "",
            )

    # --- window counter persistence ---------------------------------------------

    def _load_next_window(self) -> int:
        path = self.run_dir / STATE_FILE
        if not path.exists():
            return 1
        try:
            return max(1, int(json.loads(path.read_text(encoding="utf-8"))["next_window"]))
        except (ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring unreadable %s (%s); window count restarts at 1", path, exc)
            return 1

    def _save_next_window(self, next_window: int) -> None:
        """Replace the state file atomically and durably (file and directory fsynced)."""
        path = self.run_dir / STATE_FILE
        replace_durably(path, (json.dumps({"next_window": next_window}) + "\n").encode(), tmp=path.with_suffix(".tmp"))
