"""Read an offline W&B run back from its transaction log (run-<id>.wandb).

wandb 0.31 no longer ships a Python reader for its transaction log, so this is
a small one. The file is a LevelDB-style log: a 7-byte header (":W&B", magic
0xBEE1 little-endian, version 0), then 32 KiB blocks of chunks, each chunk a
7-byte header (CRC-32/IEEE of type byte + payload, little-endian uint32;
payload length, uint16; type: 1 full, 2 first, 3 middle, 4 last) and the
payload. Joined payloads are `wandb_internal_pb2.Record` protobufs; a
`history` record is one `log` call.
"""

from __future__ import annotations

import json
import logging
import struct
import zlib
from pathlib import Path
from typing import Any, Iterator

logger = logging.getLogger(__name__)

_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
_BLOCK = 32768
_CHUNK = struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def find_offline_run_files(run_dir: str | Path) -> list[Path]:
    """The run-*.wandb files under run_dir/wandb/offline-run-*/, oldest first.

    Ordered by the start time in each file's run record (directory names only
    have one-second resolution: a quick restart gets a "-1" suffix).
    """
    base = Path(run_dir) / "wandb"
    return sorted(base.glob("offline-run-*/run-*.wandb"), key=lambda p: (_start_time(p), p.parent.name))


def _start_time(path: Path) -> tuple[int, int]:
    for record in iter_records(path):
        if record.WhichOneof("record_type") == "run":
            return record.run.start_time.seconds, record.run.start_time.nanos
    return (0, 0)


def iter_record_payloads(path: str | Path) -> Iterator[bytes]:
    """Yield each record's bytes; stop quietly at a torn tail (killed writer)."""
    data = Path(path).read_bytes()
    if data[: len(_HEADER)] != _HEADER:
        raise ValueError(f"{path}: not a W&B transaction log (header {data[:7]!r})")
    off = len(_HEADER)
    parts: list[bytes] = []
    while off + _CHUNK.size <= len(data):
        left = _BLOCK - off % _BLOCK
        if left < _CHUNK.size:  # block trailer padding
            off += left
            continue
        crc, length, kind = _CHUNK.unpack_from(data, off)
        start = off + _CHUNK.size
        payload = data[start : start + length]
        if kind == 0 and length == 0 and crc == 0:  # zero padding up to the block end
            off += left
            continue
        if len(payload) < length or zlib.crc32(bytes([kind]) + payload) != crc:
            logger.warning("%s: torn or corrupt record at byte %d; stopping there", path, off)
            return
        off = start + length
        if kind == _FULL:
            yield payload
        elif kind == _FIRST:
            parts = [payload]
        elif kind == _MIDDLE:
            parts.append(payload)
        elif kind == _LAST:
            parts.append(payload)
            yield b"".join(parts)
            parts = []
        else:
            raise ValueError(f"{path}: unknown chunk type {kind} at byte {off}")


def iter_records(path: str | Path) -> Iterator[Any]:
    """Yield `wandb_internal_pb2.Record` messages from one transaction log."""
    from wandb.proto import wandb_internal_pb2 as pb

    for payload in iter_record_payloads(path):
        record = pb.Record()
        record.ParseFromString(payload)
        yield record


def _item_key(item: Any) -> str:
    return item.key or ".".join(item.nested_key)


def read_wandb_offline_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every history row (one per `log` call) of the offline runs under run_dir.

    Rows of successive offline runs (a resumed run writes a new
    offline-run-* directory) are concatenated, oldest first. Each row maps
    series name to its JSON-decoded value, including W&B's own `_step`,
    `_timestamp` and `_runtime`.
    """
    rows: list[dict[str, Any]] = []
    for path in find_offline_run_files(run_dir):
        for record in iter_records(path):
            if record.WhichOneof("record_type") == "history":
                rows.append({_item_key(it): json.loads(it.value_json) for it in record.history.item})
    return rows


def read_wandb_offline_run_ids(run_dir: str | Path) -> list[str]:
    """The run id in each offline run under run_dir, oldest first."""
    ids = []
    for path in find_offline_run_files(run_dir):
        for record in iter_records(path):
            if record.WhichOneof("record_type") == "run":
                ids.append(record.run.run_id)
                break
    return ids


def read_wandb_offline_step_metrics(run_dir: str | Path) -> dict[str, str]:
    """Metric name or glob -> its step metric, from the define_metric calls recorded."""
    out: dict[str, str] = {}
    for path in find_offline_run_files(run_dir):
        for record in iter_records(path):
            if record.WhichOneof("record_type") == "metric":
                m = record.metric
                out[m.glob_name or m.name] = m.step_metric
    return out


def offline_run_finished(path: str | Path) -> bool:
    """Whether the transaction log ends the run (an `exit` record: finish() ran)."""
    return any(r.WhichOneof("record_type") == "exit" for r in iter_records(path))
