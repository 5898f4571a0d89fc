"""Multi-host, simulated: the target, the drafter and the sidecar each in a network namespace of their own.

Three namespaces on one bridge stand for three hosts (each process also gets a
PID namespace and a private /dev/shm, so nothing keyed by pid or shared memory
can cross); CURVE is on, every address is non-loopback, the run directory is
shared (as on shared storage). The job trains to the end of its plan across
them. A peer in a fourth namespace on the same bridge can neither register
(its HELLO without an authorized CURVE key gets no answer at all) nor join a
data-plane pair (it can reach the store, but not the pair names, which only
travel in WELCOME over CURVE).

Skipped with the reason where the machine does not allow network namespaces
(not root, no ``ip``, no ``unshare``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.auth import hello_proof, load_or_create_control_key
from common.config import load_config
from common.sockets import create_keys
from drafter_worker.checkpoint import verify_lineage
from tests import messages
from deploy.launcher import ROOT, _descendants
from tests.fixtures import write_config

pytestmark = pytest.mark.timeout(400)

SUBNET = "10.237.{}.{}"


def _can_use_netns() -> str | None:
    """Why namespaces cannot be used here, or None."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"needs the {tool} command"
    name = f"dflcheck{secrets.token_hex(3)}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


class Hosts:
    """Namespaces on one bridge: host i has address 10.237.<net>.<i+1>."""

    def __init__(self, names: list[str]):
        tag = secrets.token_hex(2)
        self.net = int(tag, 16) % 200 + 20
        self.bridge = f"dflbr{tag}"
        self.ns = {name: f"dfl{tag}{name}" for name in names}
        self.addr = {name: SUBNET.format(self.net, i + 1) for i, name in enumerate(names)}
        self._run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._run(["ip", "link", "set", self.bridge, "up"])
        for i, (name, ns) in enumerate(self.ns.items()):
            veth, peer = f"dfv{tag}{i}", f"dfb{tag}{i}"
            self._run(["ip", "netns", "add", ns])
            self._run(["ip", "link", "add", veth, "type", "veth", "peer", "name", peer])
            self._run(["ip", "link", "set", veth, "netns", ns])
            self._run(["ip", "link", "set", peer, "master", self.bridge, "up"])
            self._run(["ip", "-n", ns, "addr", "add", f"{self.addr[name]}/24", "dev", veth])
            self._run(["ip", "-n", ns, "link", "set", veth, "up"])
            self._run(["ip", "-n", ns, "link", "set", "lo", "up"])

    @staticmethod
    def _run(argv: list[str]) -> None:
        subprocess.run(argv, check=True, capture_output=True)

    def command(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` inside ``host``'s network namespace, in a PID namespace of its own with a private /dev/shm."""
        script = 'mount -t tmpfs tmpfs /dev/shm && exec "$@"'
        return ["ip", "netns", "exec", self.ns[host], "unshare", "--mount", "--propagation", "private", "--pid",
                "--fork", "--mount-proc", "sh", "-c", script, "sh", *argv]

    def close(self) -> None:
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


@pytest.fixture
def hosts():
    why = _can_use_netns()
    if why:
        pytest.skip(why)
    made = Hosts(["target", "drafter", "metrics", "stranger"])
    yield made
    made.close()


def test_a_job_across_three_hosts_trains_and_a_fourth_cannot_join(tmp_path, tiny_llama_dir, hosts):
    keys = tmp_path / "curve"
    create_keys(keys)
    config = write_config(tmp_path, str(tiny_llama_dir), drafters={"d0": {}}, sections={"data": ["num_epochs = 1"]},
                          extra=f'[security]\ncurve_dir = "{keys}"\n')
    target, metrics = hosts.addr["target"], hosts.addr["metrics"]
    overrides = [f'control.address="tcp://{target}:5555"', f'control.store_host="{target}"', "control.store_port=5556",
                 f'metrics.address="tcp://{metrics}:5557"', "target.stop_timeout_s=60", "drafter.stop_timeout_s=60"]
    cfg = load_config(config, overrides)
    run_dir = cfg.run.path
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    sets = [f"--set={o}" for o in overrides]
    procs: dict[str, subprocess.Popen] = {}

    def start(host: str, name: str, module: str, *args: str) -> None:
        console = open(tmp_path / f"{name}.console", "w")
        argv = hosts.command(host, [sys.executable, "-m", module, "--config", str(config), *sets, *args])
        procs[name] = subprocess.Popen(argv, stdout=console, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def consoles() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in tmp_path.glob("*.console"))

    try:
        start("metrics", "metrics", "metrics_sidecar")
        start("target", "target", "target_server")
        start("drafter", "d0", "drafter_worker", "--id", "d0")
        _stranger_is_refused(hosts, cfg, run_dir, tmp_path)
        assert procs["d0"].wait(300) == 0, consoles()
        for name in ("target", "metrics"):
            # To the process itself (PID 1 of its namespace): `ip netns exec` and unshare do not pass signals on.
            for pid in _descendants(procs[name].pid):
                os.kill(pid, signal.SIGTERM)
            assert procs[name].wait(90) == 0, consoles()
    finally:
        for proc in procs.values():
            if proc.poll() is None:  # the process itself too: a SIGKILL of `ip netns exec` leaves it running
                for pid in [proc.pid, *_descendants(proc.pid)]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                proc.wait(10)
    report = verify_lineage(run_dir, "d0")
    assert report.ok and report.finished_epochs == [0], report.problems
    target_log = (run_dir / "logs" / "target.log").read_text()
    assert "registered as epoch" in target_log and "drafter d0" in target_log
    assert "stranger" not in target_log  # no registration, not even an ERROR reply: CURVE stopped it first


def _stranger_is_refused(hosts: Hosts, cfg, run_dir: Path, tmp_path: Path) -> None:
    """From the fourth namespace: a HELLO over plain TCP, and a pair formation with a guessed name."""
    key = load_or_create_control_key(run_dir)  # even a stranger who stole the run key gets nowhere
    hello = messages.hello("stranger", cfg.shared_hash(), auth=hello_proof(key, "stranger")).encode()
    probe = f"""
import sys, time, zmq
from common.transport import PairGroup, TransportError, connect_store, DRAFTER_RANK
import torch
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER); s.setsockopt(zmq.LINGER, 0)
s.connect("{cfg.control.address}")
deadline = time.monotonic() + 20
while time.monotonic() < deadline:  # the target may still be loading: keep knocking
    try:
        s.send({hello!r}, zmq.NOBLOCK)  # no CURVE handshake, no pipe to queue on: a blocking send would hang
    except zmq.Again:
        pass
    if s.poll(2000):
        print("ANSWERED", s.recv(), flush=True); sys.exit(1)
print("no answer to HELLO without a CURVE key", flush=True)
try:
    store = connect_store("{cfg.control.store_host}", {cfg.control.store_port}, 10.0)
    PairGroup(kind="gloo", store=store, prefix="pair/0123456789abcdef0123456789abcdef/1", rank=DRAFTER_RANK,
              device=torch.device("cpu"), timeout_s=5.0, local_host="{hosts.addr['stranger']}")
    print("JOINED A PAIR", flush=True); sys.exit(1)
except TransportError as exc:
    print("pair refused:", str(exc)[:200], flush=True)
"""
    try:
        out = subprocess.run(hosts.command("stranger", [sys.executable, "-c", probe]), capture_output=True, text=True,
                             timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the stranger's probe hung: {exc.stdout!r} {exc.stderr!r}")
    (tmp_path / "stranger.out").write_text(out.stdout + out.stderr)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no answer to HELLO without a CURVE key" in out.stdout and "pair refused" in out.stdout, out.stdout
