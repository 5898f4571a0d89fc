"""The local metrics log: one JSON line per valid record in runs/<name>/metrics.jsonl."""

from __future__ import annotations

import json
import time
from pathlib import Path

from common.metrics_client import MetricsRecord


class JsonlLog:
    """Appends records to a JSONL file; the caller flushes once per window.

    Opened in append mode, so a restarted sidecar continues the same file.
    Non-finite values are written as the JSON extensions NaN/Infinity, which
    Python's json module reads back.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, record: MetricsRecord, received_at: float | None = None) -> None:
        line = json.dumps(
            {
                "source": record.source,
                "step": record.step,
                "time": record.time,
                "values": record.values,
                "received_at": time.time() if received_at is None else received_at,
            },
            separators=(",", ":"),
        )
        self._file.write(line + "\n")

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()
