"""MetricsPusher: never blocks, counts drops, refuses device tensors."""

from __future__ import annotations

import socket
import time

import msgpack
import numpy as np
import pytest
import torch
import zmq

from common.metrics_client import (
    METRICS_VERSION,
    MalformedRecord,
    MetricsPusher,
    encode_metrics_record,
    make_metrics_record,
    parse_metrics_record,
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recv_all(sock: zmq.Socket, quiet_s: float = 0.3, deadline_s: float = 10.0) -> list[dict]:
    """Receive until nothing arrives for quiet_s (bounded by deadline_s)."""
    out = []
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and sock.poll(int(quiet_s * 1000)):
        out.append(msgpack.unpackb(sock.recv(), raw=False))
    return out


@pytest.mark.timeout(30)
def test_send_never_blocks_without_sidecar_and_reports_drops():
    # Guards against the training loop stalling when the sidecar is down: a
    # PUSH socket with no peer must queue up to HWM, then drop and count.
    address = f"tcp://127.0.0.1:{free_port()}"
    pusher = MetricsPusher(address, "drafter/d0", hwm=100)
    try:
        start = time.monotonic()
        results = [pusher.send({"loss": 1.0, "step_time_s": 0.1}, step) for step in range(5000)]
        elapsed = time.monotonic() - start
        assert elapsed < 20.0, f"5000 sends took {elapsed:.1f} s"
        assert results.count(False) >= 5000 - 1000, "most records must be dropped with no listener"
        assert pusher.dropped_total == results.count(False) == pusher.dropped_pending

        ctx = zmq.Context.instance()
        pull = ctx.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.bind(address)
        try:
            # ZeroMQ reconnects on its own; keep sending until one gets through.
            deadline = time.monotonic() + 10.0
            step = 5000
            while not pusher.send({"loss": 0.5}, step):
                assert time.monotonic() < deadline, "no record got through after the listener appeared"
                time.sleep(0.02)
                step += 1
            assert pusher.dropped_pending == 0
            received = recv_all(pull)
        finally:
            pull.close()
        assert received, "nothing received"
        # Every drop is reported exactly once, in the first record through after it.
        assert sum(r["dropped"] for r in received) == pusher.dropped_total
        last = received[-1]
        assert last["step"] == step and last["dropped"] > 0
        assert all(r["source"] == "drafter/d0" and r["v"] == METRICS_VERSION for r in received)
    finally:
        pusher.close()
        pusher.close()  # idempotent


@pytest.mark.timeout(30)
def test_rejects_torch_tensors_and_converts_numpy():
    # Guards against a hidden device sync: float(tensor) on CUDA waits for the device.
    address = f"tcp://127.0.0.1:{free_port()}"
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(address)
    with MetricsPusher(address, "target") as pusher:
        with pytest.raises(TypeError, match="torch tensor"):
            pusher.send({"loss": torch.tensor(1.0)}, 1)
        with pytest.raises(TypeError, match="torch tensor"):
            pusher.send({"loss": 1.0}, torch.tensor(3))
        with pytest.raises(TypeError, match="int or float"):
            pusher.send({"name": "x"}, 1)
        assert pusher.dropped_total == 0
        assert pusher.send(
            {"a": np.float32(0.5), "b": np.int64(7), "c": np.array(2.5), "d": True, "e": 3}, 2
        )
        (rec,) = recv_all(pull)
    pull.close()
    assert rec["values"] == {"a": 0.5, "b": 7, "c": 2.5, "d": 1, "e": 3}
    assert type(rec["values"]["a"]) is float and type(rec["values"]["b"]) is int
    with pytest.raises(RuntimeError, match="closed"):
        pusher.send({"a": 1.0}, 3)


def test_record_round_trip():
    rec = make_metrics_record("drafter/d1", 12, {"loss": 2.5, "acc/pos_1": 0.25}, dropped=3, now=100.0)
    parsed = parse_metrics_record(encode_metrics_record(rec))
    assert parsed.source == "drafter/d1" and parsed.step == 12 and parsed.time == 100.0
    assert parsed.values == {"loss": 2.5, "acc/pos_1": 0.25} and parsed.dropped == 3


def _valid(**changes):
    rec = make_metrics_record("drafter/d0", 1, {"loss": 1.0}, now=1.0)
    rec.update(changes)
    return rec


@pytest.mark.parametrize(
    "frame",
    [
        b"\xc1\x00garbage",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({k: v for k, v in _valid().items() if k != "values"}),
        msgpack.packb(_valid(v=2)),
        msgpack.packb(_valid(type="hello")),
        msgpack.packb(_valid(step=1.5)),
        msgpack.packb(_valid(values={"loss": "high"})),
        msgpack.packb(_valid(values=[1.0])),
        msgpack.packb(_valid(dropped=-1)),
        msgpack.packb(_valid(source="sidecar")),
        msgpack.packb(_valid(source="pipeline/x")),
        msgpack.packb(_valid(source="")),
    ],
)
def test_parse_rejects_malformed(frame):
    with pytest.raises(MalformedRecord):
        parse_metrics_record(frame)


def test_pusher_refuses_reserved_source():
    with pytest.raises(ValueError, match="reserved"):
        MetricsPusher("tcp://127.0.0.1:1", "sidecar")
