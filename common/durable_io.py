"""Writes a kill or a full disk cannot tear into something a reader misparses.

Shared by the drafter's ledger and checkpoints, the sidecar's metrics log and
the run keys: whole writes, fsync of files and directories, and the repair of
an append-only text file whose last line a kill cut short.
"""

from __future__ import annotations

import os
from pathlib import Path

_TAIL_CHUNK_BYTES = 1 << 16


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until done: a short write (a full disk) is followed by one that raises."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (which makes the names created or renamed in it durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if Path(path).is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def end_of_last_line(fd: int) -> int:
    """Offset just past the file's last newline (0 if it has none): what a torn tail is cut back to."""
    end = os.fstat(fd).st_size
    while end > 0:
        start = max(0, end - _TAIL_CHUNK_BYTES)
        newline = os.pread(fd, end - start, start).rfind(b"\n")
        if newline >= 0:
            return start + newline + 1
        end = start
    return 0


def cut_torn_tail(fd: int) -> int:
    """Truncate an open line-oriented file after its last newline; return how many bytes were cut."""
    size = os.fstat(fd).st_size
    keep = end_of_last_line(fd)
    if keep < size:
        os.ftruncate(fd, keep)
        os.fsync(fd)
    return size - keep


def write_durably(path: Path, data: bytes) -> None:
    """Create or truncate ``path``, write ``data`` whole, fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(path: Path, data: bytes, tmp: Path | None = None) -> None:
    """Replace ``path`` with ``data`` so a reader sees the old or the new content, never a mix, even after a crash."""
    tmp = tmp or path.with_name(f".{path.name}.tmp")
    write_durably(tmp, data)
    os.replace(tmp, path)
    fsync_path(path.parent)
