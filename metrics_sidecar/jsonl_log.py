"""The local metrics log: one JSON line per valid record in runs/<name>/metrics.jsonl.

Plus, for a drafter trained by several ranks, one line per record the sidecar
composed from its ranks' (source `drafter/<id>`, marked `"composed": true`).

Durability contract: lines are buffered for the open window, and `flush`
appends them with one os.write on an O_APPEND descriptor, then fsyncs. A
kill loses at most the open window and can tear only the file's last line;
the next open cuts that fragment off (`repair_torn_tail`), so a restarted
sidecar never glues its first line onto half a line.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from common.durable_io import cut_torn_tail, write_all
from common.metrics_client import MetricsRecord

logger = logging.getLogger(__name__)

def repair_torn_tail(path: str | Path) -> int:
    """Truncate `path` after its last newline; return how many bytes were cut (0: intact or missing)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return 0
    try:
        return cut_torn_tail(fd)
    finally:
        os.close(fd)


class JsonlLog:
    """Appends records to a JSONL file; the caller flushes once per window.

    A restarted sidecar continues the same file. Non-finite values are written
    as the JSON extensions NaN/Infinity, which Python's json module reads back.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        dropped = repair_torn_tail(self.path)
        if dropped:
            logger.warning(
                "[startup] %s ended in a torn line (a killed writer): dropped its last %d byte(s)",
                self.path, dropped,
            )
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._pending: list[bytes] = []

    def write(self, record: MetricsRecord, received_at: float | None = None, *, composed: bool = False) -> None:
        """Buffer one line; `composed`: a drafter record the sidecar made from its ranks' (marked
        `"composed": true`; its `received_at` is when it was composed)."""
        entry = {
            "source": record.source,
            "step": record.step,
            "time": record.time,
            "values": record.values,
            "received_at": time.time() if received_at is None else received_at,
        }
        if composed:
            entry["composed"] = True
        line = json.dumps(entry, separators=(",", ":"))
        self._pending.append(line.encode("utf-8") + b"\n")

    def flush(self) -> None:
        """Append the buffered lines in one write and fsync them."""
        if self._fd is None or not self._pending:
            return
        data = b"".join(self._pending)
        self._pending = []  # a failed write is not retried by close(): the next start repairs the tail
        write_all(self._fd, data)
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is None:
            return
        try:
            self.flush()
        finally:
            os.close(self._fd)
            self._fd = None
