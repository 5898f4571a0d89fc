"""Process-wide logging: stderr (journal/tmux) plus ``runs/<name>/logs/<process>.log``."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

try:
    from setproctitle import setproctitle
except ImportError:  # optional: only makes `ps` nicer
    setproctitle = None

# ISO 8601 date and time (local time, no zone: the journal and the files are read on the host).
LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


def setup_logging(process_name: str, log_dir: Path | None = None, level: int = logging.INFO) -> None:
    """Prefix every line with the date and time (local, ``2026-12-03 13:20:01``), the level's
    initial, the process name and pid, so interleaved logs of a days-long job stay readable."""
    fmt = logging.Formatter(
        f"%(asctime)s %(levelname).1s [{process_name} pid={os.getpid()}] %(name)s: %(message)s",
        datefmt=LOG_DATE_FORMAT,
    )
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setFormatter(fmt)
    root.addHandler(stderr)
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        to_file = logging.FileHandler(log_dir / f"{process_name}.log")
        to_file.setFormatter(fmt)
        root.addHandler(to_file)
    root.setLevel(level)
    # Libraries that are chatty at INFO.
    for noisy in ("httpx", "urllib3", "wandb", "filelock", "gguf"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if setproctitle is not None:
        setproctitle(f"dflash-{process_name}")
