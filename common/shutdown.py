"""Graceful stop: signal handlers only set a flag; a watchdog bounds how long stopping may take."""

from __future__ import annotations

import logging
import os
import signal
import threading

logger = logging.getLogger(__name__)


def install_stop_handlers(stop: threading.Event, stop_timeout_s: float, process: str) -> None:
    """SIGTERM/SIGINT set ``stop``; if the process is still alive ``stop_timeout_s`` later, it exits hard.

    The hard exit keeps a wedged process (e.g. a peer that never answers) from
    outliving the service manager's own stop timeout; the normal path
    checkpoints and exits 0 long before.
    """

    def on_signal(_signum, _frame) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def watchdog() -> None:
        stop.wait()
        if stop.wait(0) and not _exited.wait(stop_timeout_s):
            logger.error("[shutdown] %s did not stop within %.0fs; exiting hard", process, stop_timeout_s)
            logging.shutdown()
            os._exit(3)

    threading.Thread(target=watchdog, name="stop-watchdog", daemon=True).start()


_exited = threading.Event()


def mark_exited() -> None:
    """Tell the watchdog the process finished its orderly shutdown."""
    _exited.set()
