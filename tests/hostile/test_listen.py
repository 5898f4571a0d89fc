"""Every process of a running job listens only on the address it was configured with.

Regression: with ``control.store_host = "127.0.0.1"`` the target's TCPStore listened on
``*:<store_port>`` (torch hands its store daemon only the port), so any host that could
reach the port could write unbounded keys into the target's memory and join or spoof
the pairs.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import tomllib
from pathlib import Path

import pytest

from common.shm_transport import SHM_DIR, sweep_stale
from common.transport import TransportError, connect_store, host_store
from deploy.launcher import Job
from tests.conftest import free_ports
from tests.fixtures import write_config

pytestmark = pytest.mark.timeout(240)

HOST = "127.0.0.1"  # what write_config configures every address with
LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp*


def _address(hex_addr: str) -> str:
    """``/proc/net/tcp*`` address (host-order 32-bit words) as text."""
    raw = bytes.fromhex(hex_addr)
    host_order = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(host_order))


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed since listed
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return inodes


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` holds in LISTEN state."""
    inodes = _socket_inodes(pid)
    found = set()
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == LISTEN and inode in inodes:
                addr, port = local.split(":")
                found.add((_address(addr), int(port, 16)))
    return found


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (helpers a library may spawn listen too)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        ppid = int(text.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def test_address_parsing_matches_the_kernel_format():
    assert _address("0100007F") == "127.0.0.1"
    assert _address("00000000") == "0.0.0.0"
    assert _address("00000000000000000000000001000000") == "::1"


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize("host", ["127.0.0.1", pytest.param("::1", marks=pytest.mark.skipif(
    not _has_ipv6_loopback(), reason="no IPv6 loopback"))])
def test_the_store_listens_on_its_host_only_and_serves(host):
    port = free_ports(1)[0]
    before = listening(os.getpid())
    store = host_store(host, port, timeout_s=10)
    client = connect_store(host, port, timeout_s=10)
    client.set("k", "v")
    assert store.get("k") == b"v"
    assert listening(os.getpid()) - before == {(host, port)}


def test_a_taken_store_port_is_a_clear_error():
    port = free_ports(1)[0]
    with socket.socket() as squatter:  # on every address: the store's own address is taken too
        squatter.bind(("0.0.0.0", port))
        squatter.listen()
        with pytest.raises(TransportError, match=rf"127\.0\.0\.1:{port} .*change control\.store_port"):
            host_store("127.0.0.1", port, timeout_s=5)


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_every_listening_socket_of_the_job_is_on_the_configured_host(tmp_path, tiny_llama_dir, transport):
    if transport == "shm" and not SHM_DIR.is_dir():
        pytest.skip("needs /dev/shm")
    config = write_config(tmp_path, str(tiny_llama_dir), drafters={"d0": {}},
                          sections={"control": [f'store_host = "{HOST}"']})
    kind = ("--set", f'transport.kind="{transport}"')
    run_dir = tmp_path / "runs" / "it"
    try:
        with Job(config, run_dir) as job:
            job.start_metrics()
            job.start_target(*kind)
            job.start_drafter("d0", *kind)
            # Training means the store, the pair (gloo) and every control socket are up.
            job.wait_for(lambda: job.drafter_steps().get("drafter/d0", 0) >= 4, 150, f"d0 to train over {transport}")
            sockets = {
                f"{name}[{pid}]": listening(pid)
                for name, proc in job.procs.items() for pid in _descendants(proc.pid)
            }
            codes = {name: job.terminate(name, timeout_s=40) for name in ("d0", "target", "metrics")}
    finally:
        sweep_stale()  # what a failed shm run's killed target left in /dev/shm
    assert codes == {"d0": 0, "target": 0, "metrics": 0}, job.all_consoles()
    store_port = tomllib.loads(config.read_text())["control"]["store_port"]
    target = next(found for name, found in sockets.items() if name.startswith("target["))
    assert (HOST, store_port) in target, f"the target's store is not listening on {HOST}:{store_port}: {target}"
    elsewhere = {name: sorted(a for a in found if a[0] != HOST) for name, found in sockets.items()}
    assert not any(elsewhere.values()), f"listening beyond {HOST}: {elsewhere}"
