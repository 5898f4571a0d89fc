"""Metric records on the wire, and the producer side that pushes them.

Every process (target server, drafter workers) reports metrics to the metrics
sidecar as one msgpack map per ZeroMQ frame (docs/architecture.md, "The metrics path"):

    {"type": "metrics", "v": 1, "source": "drafter/d0", "step": 40,
     "time": 1.7e9, "values": {"loss": 2.3, "lr": 1e-4}, "dropped": 0}

`MetricsPusher` sends them on a PUSH socket that never blocks the caller: when
the sidecar is away, records queue up to the high-water mark, then are dropped
and counted, and the count rides on the next record that gets through.

`parse_metrics_record` is the consumer side of the same contract, used by the
sidecar; both live here so the format is defined in one place.
"""

from __future__ import annotations

import logging
import math
import numbers
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping

import msgpack
import zmq

from common.metric_names import DRAFTER_SOURCE, PIPELINE_SOURCE, SIDECAR_SOURCE
from common.sockets import SocketFactory

logger = logging.getLogger(__name__)

METRICS_TYPE = "metrics"
METRICS_VERSION = 1

# Series names the sidecar writes itself; a producer may not claim them.
RESERVED_SOURCES = (SIDECAR_SOURCE, PIPELINE_SOURCE)

Number = int | float


class MalformedRecord(ValueError):
    """A frame on the metrics socket that is not a valid metrics record."""


@dataclass(frozen=True)
class MetricsRecord:
    """One decoded, validated metrics record."""

    source: str
    step: int
    time: float
    values: dict[str, Number]
    dropped: int


def _is_torch_tensor(value: Any) -> bool:
    # Checked without importing torch: processes that never loaded it have no tensors.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return True
    return type(value).__module__.split(".", 1)[0] == "torch"


def to_plain_number(name: str, value: Any) -> Number:
    """Return `value` as a Python int or float, never touching a device.

    Python and numpy numbers are converted; torch tensors are refused with
    TypeError because reading one on the host may synchronize the device (read
    device counters through the pinned-memory path instead, docs/architecture.md, "The metrics path").
    """
    if _is_torch_tensor(value):
        raise TypeError(
            f"metric {name!r} is a torch tensor; metrics must be plain host numbers "
            "(reading a tensor here could synchronize the device)"
        )
    if type(value) is float or type(value) is int:
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "__float__") and getattr(value, "ndim", 0) == 0:
        # 0-d numpy arrays and similar host scalars.
        return float(value)
    raise TypeError(f"metric {name!r} must be an int or float, got {type(value).__name__}")


def make_metrics_record(
    source: str, step: int, values: Mapping[str, Any], *, dropped: int = 0, now: float | None = None
) -> dict[str, Any]:
    """Build the wire map for one record, converting values to plain numbers."""
    if not isinstance(values, Mapping):
        raise TypeError(f"metrics values must be a mapping, got {type(values).__name__}")
    plain: dict[str, Number] = {}
    for key, value in values.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"metric names must be non-empty strings, got {key!r}")
        plain[key] = to_plain_number(key, value)
    if _is_torch_tensor(step):
        raise TypeError("metrics step is a torch tensor; pass the host-side step counter")
    return {
        "type": METRICS_TYPE,
        "v": METRICS_VERSION,
        "source": source,
        "step": int(step),
        "time": time.time() if now is None else float(now),
        "values": plain,
        "dropped": int(dropped),
    }


def encode_metrics_record(record: Mapping[str, Any]) -> bytes:
    return msgpack.packb(record, use_bin_type=True)


def validate_source(source: Any) -> str:
    """Return `source` if a producer may use it, else raise MalformedRecord."""
    if not isinstance(source, str) or not source or source != source.strip() or "*" in source:
        raise MalformedRecord(f"source must be a non-empty string without spaces or '*', got {source!r}")
    if source.split("/", 1)[0] in RESERVED_SOURCES:
        raise MalformedRecord(f"source {source!r} is reserved for the sidecar's own series")
    if source == DRAFTER_SOURCE.prefix:
        raise MalformedRecord(f"source {source!r} has no drafter id")
    return source


def parse_metrics_record(frame: bytes) -> MetricsRecord:
    """Decode and validate one frame; raise MalformedRecord saying what is wrong."""
    try:
        rec = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise MalformedRecord(f"not msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(rec, dict):
        raise MalformedRecord(f"expected a msgpack map, got {type(rec).__name__}")
    if rec.get("type") != METRICS_TYPE:
        raise MalformedRecord(f"type must be {METRICS_TYPE!r}, got {rec.get('type')!r}")
    if rec.get("v") != METRICS_VERSION:
        raise MalformedRecord(f"protocol version {rec.get('v')!r} is not supported (sidecar speaks v{METRICS_VERSION})")
    missing = [k for k in ("source", "step", "time", "values", "dropped") if k not in rec]
    if missing:
        raise MalformedRecord(f"missing field(s) {', '.join(missing)}")
    source = validate_source(rec["source"])
    step, t, dropped, values = rec["step"], rec["time"], rec["dropped"], rec["values"]
    if type(step) is not int:
        raise MalformedRecord(f"step must be an int, got {type(step).__name__}")
    if type(t) not in (int, float) or not math.isfinite(t):
        raise MalformedRecord(f"time must be a finite number, got {t!r}")
    if type(dropped) is not int or dropped < 0:
        raise MalformedRecord(f"dropped must be an int >= 0, got {dropped!r}")
    if not isinstance(values, dict):
        raise MalformedRecord(f"values must be a map, got {type(values).__name__}")
    clean: dict[str, Number] = {}
    for key, value in values.items():
        if not isinstance(key, str) or not key or "*" in key:
            raise MalformedRecord(f"value name must be a non-empty string without '*', got {key!r}")
        if type(value) is bool:
            value = int(value)
        elif type(value) not in (int, float):
            raise MalformedRecord(f"value {key!r} must be an int or float, got {type(value).__name__}")
        clean[key] = value
    return MetricsRecord(source=source, step=step, time=float(t), values=clean, dropped=dropped)


class MetricsPusher:
    """Pushes metric records to the sidecar without ever blocking the caller.

    A ZeroMQ PUSH socket connected to `address` with send high-water mark
    `hwm`. `send` never waits: if the socket's queue is full (sidecar away or
    slow) the record is dropped, counted, and the count is reported in the
    `dropped` field of the next record that gets through. ZeroMQ reconnects on
    its own when the sidecar comes back.

    Not thread-safe (ZeroMQ sockets are not): use one pusher per thread.
    """

    def __init__(
        self,
        address: str,
        source: str,
        *,
        hwm: int = 1000,
        context: zmq.Context | None = None,
        linger_ms: int = 0,
        sockets: "SocketFactory | None" = None,
    ) -> None:
        try:
            self.source = validate_source(source)
        except MalformedRecord as exc:
            raise ValueError(f"MetricsPusher: {exc}") from None
        if hwm < 1:
            raise ValueError(f"MetricsPusher hwm must be >= 1, got {hwm}")
        self.address = address
        self.sent = 0
        self.dropped_total = 0
        self._dropped_since_sent = 0
        if sockets is None:
            sockets = SocketFactory(context if context is not None else zmq.Context.instance())
        try:
            self._sock: zmq.Socket | None = sockets.connect(zmq.PUSH, address, SNDHWM=hwm, LINGER=linger_ms)
        except zmq.ZMQError as exc:
            raise ValueError(f"MetricsPusher cannot connect to {address!r}: {exc}") from None

    @property
    def dropped_pending(self) -> int:
        """Records dropped since the last record that got through."""
        return self._dropped_since_sent

    def send(self, values: Mapping[str, Any], step: int) -> bool:
        """Queue one record; return False (and count it) if it had to be dropped.

        `values` maps short names ("loss", "lr", "acc/pos_1") to plain numbers;
        torch tensors raise TypeError.
        """
        if self._sock is None:
            raise RuntimeError(f"MetricsPusher for {self.source!r} is closed")
        record = make_metrics_record(self.source, step, values, dropped=self._dropped_since_sent)
        try:
            self._sock.send(encode_metrics_record(record), zmq.NOBLOCK)
        except zmq.Again:
            self._dropped_since_sent += 1
            self.dropped_total += 1
            if self.dropped_total == 1 or self.dropped_total % 10000 == 0:
                logger.warning(
                    "metrics: %s dropped %d record(s) so far; is the metrics sidecar at %s running?",
                    self.source, self.dropped_total, self.address,
                )
            return False
        self.sent += 1
        self._dropped_since_sent = 0
        return True

    def close(self) -> None:
        """Close the socket (queued records are discarded after LINGER). Idempotent."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> "MetricsPusher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
