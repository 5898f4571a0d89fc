"""The target tells a live shm drafter from a dead one by its liveness lock, never by its pid.

Regression: shm slots of a live drafter were freed at once when its pid was not visible
(another PID namespace, which containers give by default), and the drafter then trained
on a torn batch while only logging it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch

from common.packing import BatchLayout
from common.shm_transport import SHM_DIR, liveness_name, segment_name, unlink_segment
from target_server.shm_pool import ShmBatchPool
from tests.conftest import ROOT

pytestmark = [pytest.mark.timeout(60), pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")]

LAYOUTS = [BatchLayout(2, 8, 6, torch.float32)]

# A drafter's side of the pool, as drafter_worker._attach_shm does it: map, then lock.
READER = """
import os, sys, time
from common.shm_transport import ShmRing
ring = ShmRing.attach(sys.argv[1], [int(sys.argv[2])], int(sys.argv[3]))
ring.hold_liveness("d0", 1)
print(os.getpid(), flush=True)
time.sleep(60)
"""


@pytest.fixture
def pool():
    pool = ShmBatchPool(segment_name("test-live", uuid.uuid4().hex[:8]), LAYOUTS, 2)
    yield pool
    unlink_segment(liveness_name(pool.name, "d0", 1))
    pool.close()


def start_reader(pool: ShmBatchPool, prefix: tuple[str, ...] = ()) -> tuple[subprocess.Popen, int]:
    """A real second process holding the pool's liveness lock; returns it and the pid it sees for itself."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-c", textwrap.dedent(READER), pool.name, str(pool.slot_bytes[0]),
         str(pool.slots_per_bucket)],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    line = proc.stdout.readline().strip()
    if not line:
        proc.wait(10)
        raise AssertionError(f"the reader did not start: {proc.stderr.read()}")
    return proc, int(line)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    proc.stdout.close()
    proc.stderr.close()


def wait_gone(pool: ShmBatchPool, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while pool.reader_alive("d0", 1):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_live_reader_is_alive_and_a_sigkilled_one_is_gone_at_once(pool):
    proc, _ = start_reader(pool)
    try:
        assert pool.reader_alive("d0", 1)
        assert pool.reader_alive("d0", 1), "asking must not take the lock over"
    finally:
        kill(proc)
    # The kernel dropped the lock with the process: no heartbeat timeout to wait for.
    assert not pool.reader_alive("d0", 1)
    assert (SHM_DIR / liveness_name(pool.name, "d0", 1)).exists(), "kill -9 leaves the file: only the lock tells"
    pool.forget_reader("d0", 1)
    assert not (SHM_DIR / liveness_name(pool.name, "d0", 1)).exists()


def test_a_liveness_file_that_no_process_locks_is_gone_while_its_creator_lives(pool):
    path = SHM_DIR / liveness_name(pool.name, "d0", 1)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; open(sys.argv[1], 'w'); print('ready', flush=True); time.sleep(60)",
         str(path)], env=env, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert path.exists() and not pool.reader_alive("d0", 1)
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


def _pid_namespaces() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    probe = subprocess.run([unshare, "-Urpf", "--kill-child", "true"], capture_output=True, timeout=10)
    return probe.returncode == 0


@pytest.mark.skipif(not _pid_namespaces(), reason="needs unshare with user and PID namespaces")
def test_a_reader_in_another_pid_namespace_is_alive_and_its_pid_means_nothing(pool):
    # As a drafter in a container: the pid it reports is its own namespace's (1 here),
    # which on this side names another, live process (init): a pid check cannot tell.
    proc, own_pid = start_reader(pool, prefix=("unshare", "-Urpf", "--kill-child"))
    try:
        assert own_pid == 1
        assert pool.reader_alive("d0", 1)
        os.kill(own_pid, 0)  # the reported pid is alive here, whatever happens to the reader
    finally:
        kill(proc)  # --kill-child: the reader gets SIGKILL when unshare dies
    assert wait_gone(pool), "the lock of a reader killed in another PID namespace was not released"
    os.kill(own_pid, 0)
