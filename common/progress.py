"""Progress of long-running work: a bar on a terminal, a periodic log line otherwise.

Tokenizing a data set, regenerating answers, evaluating or warming up can take
minutes. On a terminal the user gets a tqdm bar; under systemd, tmux logs or a
test, where a bar would be noise, one log line every ``every_s`` seconds says
how far it got, how fast, and when it should end.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

log = logging.getLogger(__name__)


class Progress:
    def __init__(
        self,
        what: str,
        total: int | None = None,
        unit: str = "it",
        every_s: float = 30.0,
        logger: logging.Logger | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.what = what
        self.total = total
        self.unit = unit
        self.every_s = every_s
        self.done = 0
        self._log = logger or log
        self._start = time.monotonic()
        self._last_line = self._start
        stream = stream if stream is not None else sys.stderr
        self._bar = None
        if _is_terminal(stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=what, unit=unit, file=stream, dynamic_ncols=True, leave=False)

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last_line >= self.every_s:
            self._last_line = now
            self._log.info("%s", self.line(now))

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.monotonic()) - self._start, 1e-9)
        rate = self.done / elapsed
        text = f"{self.what}: {self.done}"
        if self.total:
            text += f"/{self.total} {self.unit} ({100.0 * self.done / self.total:.0f}%)"
        else:
            text += f" {self.unit}"
        text += f", {rate:.1f} {self.unit}/s"
        if self.total and rate > 0 and self.done < self.total:
            text += f", about {_duration((self.total - self.done) / rate)} left"
        return text

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 90:
        return f"{seconds}s"
    if seconds < 5400:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{(seconds % 3600) // 60:02d}m"
