"""Read a job's offline W&B runs back from their transaction logs (run-<id>.wandb).

    runs = read_wandb_offline_runs("runs/demo")      # {"demo/d0": OfflineRun, ..., "demo/target": ...}
    runs["demo/d1"].config["drafter"]["learning_rate"], runs["demo/d1"].history[-1]["loss"]
    read_wandb_offline_history("runs/demo")          # every row, series named as in metrics.jsonl

The job's runs are the ones `wandb_runs.json` in the run directory names
(wandb_layout.py), found in the W&B directory it records (default
<run dir>/wandb/).

wandb 0.31 no longer ships a Python reader for its transaction log, so this
is a small one. The file is a LevelDB-style log: a 7-byte header (":W&B", magic
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from common.metric_names import DRAFTER_SOURCE, RANK_SOURCE
from metrics_sidecar.wandb_layout import TARGET_RUN, parse_rank_key, read_runs_file
from metrics_sidecar.wandb_uploader import sync_command

logger = logging.getLogger(__name__)

_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
_BLOCK = 32768
_CHUNK = struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_dir_of(run_dir: str | Path) -> Path:
    """The directory holding the job's offline-run-* directories (what the sidecar recorded)."""
    recorded = read_runs_file(run_dir) or {}
    return Path(recorded["wandb_dir"]) if recorded.get("wandb_dir") else Path(run_dir) / "wandb"


def find_offline_run_files(run_dir: str | Path, run_id: str | None = None) -> list[Path]:
    """The run-*.wandb files of the job's offline runs (or of the run `run_id`), oldest first.

    Ordered by the start time in each file's run record (directory names only
    have one-second resolution: a quick restart gets a "-1" suffix). A
    WANDB_DIR shared by several jobs holds other runs too: only those whose
    id the run directory's wandb_runs.json names are the job's.
    """
    recorded = read_runs_file(run_dir) or {}
    ids = {run_id} if run_id else {e["id"] for e in recorded.get("runs", {}).values()}
    files = [p for p in wandb_dir_of(run_dir).glob("offline-run-*/run-*.wandb")
             if not ids or p.stem[len("run-"):] in ids]
    return sorted(files, key=lambda p: (_start_time(p), p.parent.name))


def _start_time(path: Path) -> tuple[int, int]:
    for record in iter_records(path):
        if record.WhichOneof("record_type") == "run":
            return record.run.start_time.seconds, record.run.start_time.nanos
    return (0, 0)


def iter_record_payloads(path: str | Path) -> Iterator[bytes]:
    """Yield each record's bytes; stop quietly at a torn tail (killed writer)."""
    data = Path(path).read_bytes()
    if len(data) < len(_HEADER) and _HEADER.startswith(data):  # killed before its first block reached disk
        return
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


def _items(items: Any) -> dict[str, Any]:
    return {_item_key(it): json.loads(it.value_json) for it in items}


@dataclass
class OfflineRun:
    """One W&B run of the job as its offline segments recorded it (one segment per sidecar start)."""

    run_id: str
    name: str
    group: str
    job_type: str
    project: str
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)  # one row per log call, oldest segment first
    summary: dict[str, Any] = field(default_factory=dict)  # the summary updates, folded in order
    step_metrics: dict[str, str] = field(default_factory=dict)  # series or glob -> its x axis ("" for none)
    files: list[Path] = field(default_factory=list)  # its segments, oldest first

    @property
    def source(self) -> str | None:
        """The metrics source a drafter run logs (`drafter/<id>`); None for the target run."""
        drafter = self.config.get("drafter_id")
        return DRAFTER_SOURCE(drafter) if self.job_type == "drafter" and drafter else None


def read_wandb_offline_runs(run_dir: str | Path) -> dict[str, OfflineRun]:
    """The job's offline runs by name (`<job>/target`, `<job>/<drafter id>`), each with all its segments."""
    runs: dict[str, OfflineRun] = {}
    by_id: dict[str, OfflineRun] = {}
    for path in find_offline_run_files(run_dir):
        run: OfflineRun | None = None
        for record in iter_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                r = record.run
                run = by_id.get(r.run_id)
                if run is None:
                    run = by_id[r.run_id] = OfflineRun(run_id=r.run_id, name=r.display_name, group=r.run_group,
                                                       job_type=r.job_type, project=r.project)
                    runs[run.name or run.run_id] = run
                run.config.update(_items(r.config.update))
                run.files.append(path)
            elif run is None:
                continue
            elif kind == "config":
                run.config.update(_items(record.config.update))
            elif kind == "history":
                run.history.append(_items(record.history.item))
            elif kind == "summary":
                run.summary.update(_items(record.summary.update))
            elif kind == "metric":
                m = record.metric
                run.step_metrics[m.glob_name or m.name] = m.step_metric
    return runs


def read_wandb_offline_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every history row (one per `log` call) of the job's offline runs, series named job-wide.

    A drafter run's series (`loss`, `step`, `eval/tau`) come back under the
    names metrics.jsonl and docs/metrics.md use (`drafter/<id>/loss`, ...), its
    ranks' (`rank/<k>/loss`) as `rank/<id>.<k>/loss`; the target run's are
    already. Runs one after the other (each oldest segment first); every row
    keeps W&B's own `_step`, `_timestamp` and `_runtime`.
    """
    rows: list[dict[str, Any]] = []
    for run in read_wandb_offline_runs(run_dir).values():
        source = run.source
        drafter = DRAFTER_SOURCE.parse(source) if source else None

        def name(key: str, source: str | None = source, drafter: str | None = drafter) -> str:
            if key.startswith("_") or source is None:
                return key
            ranked = parse_rank_key(key)
            if ranked is not None and drafter is not None:
                return f"{RANK_SOURCE(f'{drafter}.{ranked[0]}')}/{ranked[1]}"
            return f"{source}/{key}"

        for row in run.history:
            rows.append({name(k): v for k, v in row.items()})
    return rows


def read_wandb_offline_run_ids(run_dir: str | Path) -> list[str]:
    """The run id in each offline segment of the job, oldest first."""
    ids = []
    for path in find_offline_run_files(run_dir):
        for record in iter_records(path):
            if record.WhichOneof("record_type") == "run":
                ids.append(record.run.run_id)
                break
    return ids


def offline_run_finished(path: str | Path) -> bool:
    """Whether the transaction log ends the run (an `exit` record: finish() ran)."""
    return any(r.WhichOneof("record_type") == "exit" for r in iter_records(path))


def offline_upload_lines(run_dir: str | Path) -> list[str]:
    """What a launcher prints about the job's offline W&B runs: which, where, and the upload command."""
    recorded = read_runs_file(run_dir)
    wandb_dir = wandb_dir_of(run_dir)
    if not recorded or not any(wandb_dir.glob("offline-run-*")):
        return []
    names = sorted((entry.get("name", key) for key, entry in recorded.get("runs", {}).items()),
                   key=lambda name: (name.endswith(f"/{TARGET_RUN}"), name))
    return [
        f"W&B offline runs (group {recorded.get('group', '?')}): {', '.join(names)} in {wandb_dir}",
        f"upload them with: {sync_command(wandb_dir.parent)}",
    ]
