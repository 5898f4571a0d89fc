"""Socket security policy: loopback is free, anything else needs CURVE, unauthenticated peers are refused."""

from __future__ import annotations

import zmq
import zmq.auth
import pytest

from common.sockets import SecurityError, SocketFactory, add_client, create_keys, is_loopback, revoke
from tests.conftest import free_ports


def test_loopback_detection():
    assert is_loopback("tcp://127.0.0.1:5555") and is_loopback("tcp://localhost:1") and is_loopback("ipc:///tmp/x")
    assert not is_loopback("tcp://0.0.0.0:5555") and not is_loopback("tcp://10.1.2.3:5555")


def test_binding_a_public_address_without_keys_is_refused():
    ctx = zmq.Context()
    try:
        with pytest.raises(SecurityError, match="needs CURVE keys"):
            SocketFactory(ctx).bind(zmq.ROUTER, "tcp://0.0.0.0:5999", "control socket")
    finally:
        ctx.term()


def _roundtrip(server: zmq.Socket, client: zmq.Socket) -> bool:
    client.send(b"ping")
    return bool(server.poll(1500))


def test_curve_server_accepts_authorized_clients_and_refuses_others(tmp_path):
    keys = tmp_path / "keys"
    create_keys(keys)
    (port,) = free_ports(1)
    ctx = zmq.Context()
    factory = SocketFactory(ctx, str(keys))
    server = factory.bind(zmq.PULL, f"tcp://0.0.0.0:{port}", "metrics socket", LINGER=0)
    try:
        good = factory.connect(zmq.PUSH, f"tcp://127.0.0.1:{port}", LINGER=0)
        assert _roundtrip(server, good) and server.recv() == b"ping"
        good.close()

        plain = ctx.socket(zmq.PUSH)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(f"tcp://127.0.0.1:{port}")
        assert not _roundtrip(server, plain), "a client without CURVE keys got through"
        plain.close()

        stranger_pub, stranger_secret = zmq.curve_keypair()
        server_pub, _ = zmq.auth.load_certificate(keys / "server.key")
        stranger = ctx.socket(zmq.PUSH)
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.curve_publickey, stranger.curve_secretkey, stranger.curve_serverkey = stranger_pub, stranger_secret, server_pub
        stranger.connect(f"tcp://127.0.0.1:{port}")
        assert not _roundtrip(server, stranger), "a client with an unknown key got through"
        stranger.close()
    finally:
        server.close(linger=0)
        factory.close()
        ctx.term()


def test_per_host_keys_connect_and_a_revoked_one_is_refused(tmp_path):
    keys = tmp_path / "keys"
    create_keys(keys)
    add_client(keys, "host-a")
    add_client(keys, "host-b")
    with pytest.raises(SecurityError, match="already has a key"):
        add_client(keys, "host-a")
    (port,) = free_ports(1)
    ctx = zmq.Context()
    server_factory = SocketFactory(ctx, str(keys))
    server = server_factory.bind(zmq.PULL, f"tcp://0.0.0.0:{port}", "metrics socket", LINGER=0)
    try:
        for name in ("host-a", "host-b"):
            client = SocketFactory(ctx, str(keys), name).connect(zmq.PUSH, f"tcp://127.0.0.1:{port}", LINGER=0)
            assert _roundtrip(server, client), f"{name} with its own authorized key was refused"
            server.recv()
            client.close()

        revoke(keys, "host-a")
        server_factory.reload_authorized()  # what the target does every heartbeat
        revoked = SocketFactory(ctx, str(keys), "host-a").connect(zmq.PUSH, f"tcp://127.0.0.1:{port}", LINGER=0)
        assert not _roundtrip(server, revoked), "a revoked key got through"
        revoked.close()
        kept = SocketFactory(ctx, str(keys), "host-b").connect(zmq.PUSH, f"tcp://127.0.0.1:{port}", LINGER=0)
        assert _roundtrip(server, kept), "revoking host-a also refused host-b"
        kept.close()
    finally:
        server.close(linger=0)
        server_factory.close()
        ctx.term()
