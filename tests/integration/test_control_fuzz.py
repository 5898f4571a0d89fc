"""Hostile input on the control socket while a drafter trains.

The target must neither crash nor stall the drafter it serves, must answer
ERROR where it can, and must still register and serve a fresh drafter.
"""

from __future__ import annotations

import random
import time

import msgpack
import pytest
import zmq

from common import protocol as P
from tests import messages
from common.config import load_config
from deploy.launcher import Job
from tests.fixtures import write_config

pytestmark = pytest.mark.timeout(300)


def _hostile_frames(rng: random.Random, config_hash: str) -> list[list[bytes]]:
    valid = messages.hello("fuzz", config_hash).encode()
    frames: list[list[bytes]] = []
    for i in range(400):
        kind = i % 10
        if kind == 0:
            frames.append([rng.randbytes(rng.randint(0, 300))])
        elif kind == 1:
            frames.append([valid[: rng.randint(0, len(valid) - 1)]])
        elif kind == 2:
            frames.append([msgpack.packb(rng.choice([[1, 2, 3], "HELLO", 42, None, {"no": "type"}]))])
        elif kind == 3:
            frames.append([msgpack.packb({"type": rng.choice(["NOPE", "BATCH", "WELCOME", ""]), "v": P.PROTOCOL_VERSION})])
        elif kind == 4:
            frames.append([msgpack.packb({"type": "HELLO", "v": rng.choice([0, 2, "1", True, None])})])
        elif kind == 5:
            body = {"type": "HELLO", "v": P.PROTOCOL_VERSION, "drafter_id": rng.choice(["", "x" * 500, "../etc", 7]), "rank": rng.choice([-1, 5, "0"]),
                    "config_hash": config_hash, "transport": "gloo", "pid": 1}
            frames.append([msgpack.packb(body)])
        elif kind == 6:
            frames.append([valid, valid])  # two frames
        elif kind == 7:
            frames.append([msgpack.packb({"type": "ACK", "v": P.PROTOCOL_VERSION, "batch_ids": [1], "step": 1, "checkpoint_step": 0})])
        elif kind == 8:
            frames.append([msgpack.packb(msgpack.ExtType(1, b"\x80\x04pickle"))])
        else:
            frames.append([messages.hello("fuzz", "wrong-hash").encode()])
    return frames


def test_target_survives_fuzzing_and_serves_a_fresh_drafter(tmp_path, tiny_llama_dir):
    config = write_config(tmp_path, str(tiny_llama_dir), drafters={})
    cfg = load_config(config)
    run_dir = tmp_path / "runs" / "it"
    ctx = zmq.Context()
    with Job(config, run_dir) as job:
        job.start_target()
        job.start_drafter("d0")
        ckpt = run_dir / "checkpoints" / "d0" / "latest"
        job.wait_for(ckpt.exists, 120, "d0 to checkpoint")

        rng = random.Random(7)
        errors = 0
        attackers = []
        try:
            for n, frames in enumerate(_hostile_frames(rng, cfg.shared_hash())):
                if n % 40 == 0:
                    sock = ctx.socket(zmq.DEALER)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.connect(cfg.control.address)
                    attackers.append(sock)
                attackers[-1].send_multipart(frames)
            # An oversized frame: the target refuses it without holding it.
            big = ctx.socket(zmq.DEALER)
            big.setsockopt(zmq.LINGER, 0)
            big.connect(cfg.control.address)
            big.send(b"\x00" * (cfg.control.max_message_bytes + 10))
            attackers.append(big)
            # A HELLO flood of distinct ids that never form their pair, and a peer that registers and never reads.
            flood = ctx.socket(zmq.DEALER)
            flood.setsockopt(zmq.LINGER, 0)
            flood.connect(cfg.control.address)
            for i in range(30):
                flood.send(messages.hello(f"flood{i}", cfg.shared_hash()).encode())
            attackers.append(flood)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                for sock in attackers[:-1]:
                    while sock.poll(0):
                        msg = P.decode(sock.recv())
                        errors += isinstance(msg, P.Error)
                time.sleep(0.1)
        finally:
            for sock in attackers:
                sock.close(linger=0)
        assert errors >= 100, f"the target answered only {errors} ERRORs"

        # Training went on, and the target still serves a new drafter.
        step_before = int((run_dir / "checkpoints" / "d0" / "latest").read_text().split("-")[1])
        job.wait_for(
            lambda: int((run_dir / "checkpoints" / "d0" / "latest").read_text().split("-")[1]) > step_before,
            60, "d0 to keep checkpointing after the fuzzing",
        )
        job.start_drafter("d1")
        job.wait_for((run_dir / "checkpoints" / "d1" / "latest").exists, 90, "a fresh drafter to train")
        assert job.procs["target"].poll() is None
        log = (run_dir / "logs" / "target.log").read_text()
        # One line per offending peer, not one per message.
        assert log.count("[bad-message]") <= 40, log.count("[bad-message]")
        assert job.terminate("d0", 40) == 0 and job.terminate("d1", 40) == 0
        assert job.terminate("target", 40) == 0
    ctx.term()
