"""The drafter's sans-I/O connection core: handshake replies, credits, liveness, DONE.

Messages go through encode/decode (the protocol's checks apply); time is passed in.
"""

from __future__ import annotations

import pytest

from common import protocol as P
from drafter_worker.connection import Connection, FatalError, TargetUnavailable, handshake_reply
from tests.messages import welcome


def wire(msg: P.Message) -> P.Message:
    return P.decode(msg.encode())


def batch(i: int) -> P.Batch:
    return P.Batch(batch_id=i, epoch=0, bucket=0, sample_ids=[i], batch_size=1, seq_len=32, feature_dim=64,
                   dtype="float32", nbytes=100, tag=i + 1, num_tokens=10)


def connection(credits: int = 2, max_steps: int = 0, steps_per_batch: int = 1) -> Connection:
    return Connection(credits=credits, steps_per_batch=steps_per_batch, max_steps=max_steps, heartbeat_interval_s=1.0,
                      heartbeat_timeout_s=10.0, label="target", now=0.0)


def test_handshake_replies():
    assert handshake_reply(wire(welcome())).model_id == "tiny"
    assert handshake_reply(None) is None  # a frame that failed to decode: keep waiting
    with pytest.raises(FatalError, match="config hash"):
        handshake_reply(wire(P.Error(P.E_CONFIG, "config hash a != b")))
    with pytest.raises(TargetUnavailable, match="busy"):
        handshake_reply(wire(P.Error(P.E_BUSY, "re-registers too fast")))


def test_credits_stay_at_the_configured_number_in_flight():
    conn = connection(credits=2)
    assert [m.credits for m in conn.start()] == [2]
    got = [conn.on_message(wire(batch(i)), 1.0) for i in (0, 1)]
    assert [b.batch_id for b in got] == [0, 1] and conn.inflight == 2 and conn.granted == 0
    out = conn.on_trained(0, step=1, checkpoint_step=0)
    assert [type(m) for m in out] == [P.Ack, P.Request] and out[1].credits == 1
    assert conn.inflight + conn.granted == 2


def test_no_request_past_max_steps():
    conn = connection(credits=2, max_steps=4, steps_per_batch=2)
    conn.start()
    conn.on_message(wire(batch(0)), 1.0)
    conn.on_message(wire(batch(1)), 1.0)
    out = conn.on_trained(0, step=2, checkpoint_step=0)
    assert [type(m) for m in out] == [P.Ack]  # batch 1 (2 more steps) already reaches max_steps
    assert conn.outcome(step=2) is None and conn.outcome(step=4) == "max_steps"


def test_done_waits_for_what_is_still_in_flight():
    conn = connection()
    conn.start()
    conn.on_message(wire(batch(7)), 1.0)
    conn.on_message(wire(P.Done(batches_served=8)), 1.0)
    assert conn.outcome(step=3) is None  # batch 7 is still to be trained
    conn.on_trained(7, step=4, checkpoint_step=0)
    assert conn.outcome(step=4) == "done"


def test_heartbeats_are_sent_on_their_interval():
    conn = connection()
    assert [m.step for m in conn.heartbeat(0.0, step=5)] == [5]
    assert conn.heartbeat(0.5, step=5) == []
    assert len(conn.heartbeat(1.0, step=6)) == 1


@pytest.mark.parametrize("msg, reason", [
    (P.Heartbeat(step=1, capture_stalled_s=75.0), "no progress for 75s"),
    (P.Bye(reason="target shutting down"), "BYE"),
    (P.Error(P.E_STATE, "ACK before HELLO"), "no longer knows"),
])
def test_a_target_that_is_gone_or_forgot_us_means_reconnect(msg, reason):
    conn = connection()
    conn.start()
    with pytest.raises(TargetUnavailable, match=reason):
        conn.on_message(wire(msg), 1.0)


def test_silence_past_the_timeout_means_reconnect_and_any_frame_counts_as_heard():
    conn = connection()
    conn.start()
    conn.on_message(None, 9.0)  # a frame that did not decode still shows the target is there
    conn.check_alive(18.0)
    with pytest.raises(TargetUnavailable, match="silent for 10.5s"):
        conn.check_alive(19.5)


def test_other_errors_are_logged_not_fatal():
    conn = connection()
    conn.start()
    assert conn.on_message(wire(P.Error(P.E_MALFORMED, "odd frame")), 1.0) is None
    assert conn.outcome(step=0) is None
