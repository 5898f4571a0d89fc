"""Attacks on the target's control socket while a real drafter trains over shm.

One job (target + drafter d0, transport shm, loopback, free ports) serves every
test of this module, in order: each attack must leave d0 registered and
training, and the target alive. What an attacker knows is stated per test:
a stranger has network access only; an insider also holds the run's control
key (a buggy or hostile drafter of the same run).
"""

from __future__ import annotations

import os
import re
import signal
import time

import msgpack
import pytest
import zmq

from common import protocol as P
from tests import messages
from common.auth import auth_dir, hello_proof, read_key, status_credential
from common.config import load_config
from common.shm_transport import SHM_DIR, sweep_stale
from deploy.launcher import Job
from drafter_worker.checkpoint import verify_lineage
from tests.fixtures import write_config

pytestmark = [pytest.mark.timeout(600), pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")]

SHM = ("--set", 'transport.kind="shm"')
ACK_TIMEOUT_S = 8.0


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("hostile-control")
    config = write_config(tmp, str(tiny_llama_dir), drafters={},
                          sections={"control": [f"ack_timeout_s = {ACK_TIMEOUT_S}"]})
    run_dir = tmp / "runs" / "it"
    ctx = zmq.Context()
    try:
        with Job(config, run_dir) as job:
            job.start_target(*SHM)
            job.start_drafter("d0", *SHM)
            job.wait_for(lambda: _checkpoint_step(run_dir) > 0, 120, "d0 to checkpoint")
            job.cfg = load_config(config)
            job.ctx = ctx
            job.key = read_key(auth_dir(run_dir) / "control.key")
            yield job
    finally:
        ctx.destroy(linger=0)
        sweep_stale()


def _checkpoint_step(run_dir) -> int:
    latest = run_dir / "checkpoints" / "d0" / "latest"
    return int(latest.read_text().split("-")[1]) if latest.exists() else 0


def _target_log(job) -> str:
    return (job.run_dir / "logs" / "target.log").read_text()


def _dealer(job) -> zmq.Socket:
    sock = job.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(job.cfg.control.address)
    return sock


def _answer(sock: zmq.Socket, timeout_s: float = 10.0) -> P.Message:
    assert sock.poll(int(timeout_s * 1000)), "the target did not answer"
    return P.decode(sock.recv())


def _still_training(job, what: str) -> None:
    """d0 was not dropped and its checkpoints advance after the attack; the target lives."""
    before = _checkpoint_step(job.run_dir)
    job.wait_for(lambda: _checkpoint_step(job.run_dir) > before, 90, f"d0 to keep checkpointing after {what}")
    assert job.procs["target"].poll() is None
    drops = [line for line in _target_log(job).splitlines() if "[drop] drafter d0 " in line]
    assert not drops, drops


def _hello(job, drafter_id: str, *, auth: str | None = None, **fields) -> bytes:
    body = msgpack.unpackb(messages.hello(drafter_id, job.cfg.shared_hash(), "shm", pid=1234).encode())
    body["auth"] = hello_proof(job.key, drafter_id) if auth is None else auth
    body.update(fields)
    return msgpack.packb(body)


def test_well_formed_hostile_hellos_are_refused_and_the_target_serves_on(job):
    """An insider's HELLOs with values no honest drafter sends: each gets an ERROR, none reaches state."""
    hostile = [
        _hello(job, "evil", covered_watermark=-1),  # made the capture thread ask for plan index -1
        _hello(job, "evil", covered_extra=[2**62]),  # built a range under the scheduler lock
        _hello(job, "evil", covered_extra=[P.MAX_COVERAGE_SPAN + 1]),  # too far past the watermark
        _hello(job, "evil", pid=2**31),  # OverflowError in the control thread
        _hello(job, "x" * 300),
        _hello(job, "d0", covered_watermark=-1),  # even for a live id, with its valid proof
        _hello(job, "evil", step=-3),
    ]
    codes = []
    for frame in hostile:
        sock = _dealer(job)
        sock.send(frame)
        msg = _answer(sock)
        sock.close()
        assert isinstance(msg, P.Error), msg
        codes.append(msg.code)
    assert set(codes) <= {P.E_RANGE, P.E_MALFORMED}, codes
    _still_training(job, "hostile HELLOs")
    log = _target_log(job)
    assert "capture thread failed" not in log and "Traceback" not in log


def test_a_stranger_cannot_take_over_a_live_drafter_id(job):
    sock = _dealer(job)
    for auth in ("", "0" * 64, hello_proof("f" * 64, "d0")):
        sock.send(_hello(job, "d0", auth=auth))
        msg = _answer(sock)
        assert isinstance(msg, P.Error) and msg.code == P.E_AUTH, msg
    sock.close()
    _still_training(job, "a hijack attempt")
    assert "replaced by a new registration" not in _target_log(job)


def test_status_needs_the_status_key(job):
    sock = _dealer(job)
    sock.send(P.StatusRequest().encode())
    msg = _answer(sock)
    assert isinstance(msg, P.Error) and msg.code == P.E_AUTH
    sock.send(P.StatusRequest(auth=status_credential(job.run_dir)).encode())
    msg = _answer(sock)
    sock.close()
    assert isinstance(msg, P.Status) and [d.id for d in msg.drafters] == ["d0"]
    mode = os.stat(auth_dir(job.run_dir) / "control.key").st_mode & 0o777
    assert mode == 0o600, oct(mode)


def test_an_ack_flood_from_several_sockets_does_not_silence_the_real_drafter(job):
    """ACKs of a million ids just under control.max_message_bytes (about 0.5 s each to validate in
    full), and HELLO-sized frames, from six sockets for five seconds."""
    huge = P.Ack(batch_ids=[i % 128 for i in range(1_000_000)], step=1, checkpoint_step=0).encode()
    large = msgpack.packb({"type": "HELLO", "v": P.PROTOCOL_VERSION, "pad": "x" * (P.INBOUND_BYTES["HELLO"] - 100)})
    assert len(huge) < job.cfg.control.max_message_bytes
    socks = [_dealer(job) for _ in range(6)]
    for sock in socks:
        sock.setsockopt(zmq.SNDHWM, 64)
    deadline = time.monotonic() + 5.0
    sent = 0
    while time.monotonic() < deadline:
        for i, sock in enumerate(socks):
            try:
                sock.send(huge if i % 2 else large, flags=zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
            while sock.poll(0):
                sock.recv()
    for sock in socks:
        sock.close()
    assert sent > 100
    _still_training(job, "an ACK flood")
    assert "silent for" not in _target_log(job)


def test_a_registration_that_holds_batches_without_acking_is_dropped(job):
    """An insider registers, takes every credit, heartbeats, and never ACKs: it loses its batches."""
    sock = _dealer(job)
    sock.send(_hello(job, "hog"))
    welcome = _answer(sock)
    assert isinstance(welcome, P.Welcome), welcome
    sock.send(P.Request(credits=P.MAX_CREDITS).encode())
    batches = 0
    deadline = time.monotonic() + 4 * ACK_TIMEOUT_S
    while time.monotonic() < deadline and "without an ACK" not in _target_log(job):
        sock.send(P.Heartbeat(step=0).encode())
        while sock.poll(200):
            batches += isinstance(P.decode(sock.recv()), P.Batch)
    sock.close()
    assert batches >= 1
    assert re.search(r"\[drop\] drafter hog .* without an ACK", _target_log(job))
    _still_training(job, "a registration hoarding batches")


def test_a_drafter_stopped_past_the_heartbeat_timeout_trains_no_torn_batch(job):
    """SIGSTOP d0 beyond the heartbeat timeout (the target drops it and, after the grace, reuses its
    slots), SIGCONT: d0 discards anything it read from a rewritten slot and registers again."""
    d0 = job.procs["d0"]
    d0.send_signal(signal.SIGSTOP)
    try:
        job.wait_for(lambda: "[drop] drafter d0 " in _target_log(job), 60, "the target to drop the stopped d0")
        time.sleep(2 * job.cfg.control.heartbeat_timeout_s)  # past the grace: its slots are recaptured
    finally:
        d0.send_signal(signal.SIGCONT)
    step = _checkpoint_step(job.run_dir)
    job.wait_for(lambda: _checkpoint_step(job.run_dir) > step, 120, "d0 to train again after SIGCONT")
    assert job.terminate("d0", 60) == 0
    report = verify_lineage(job.run_dir, "d0")
    assert report.ok, report.problems
    log = (job.run_dir / "logs" / "drafter-d0.log").read_text()
    assert "trained on a torn batch" not in log
    assert job.terminate("target", 60) == 0
