"""Every ZeroMQ socket of every process is built here, with the security policy applied.

Policy: the control and metrics sockets bind loopback addresses (or ipc://)
freely. Binding any other address needs ZeroMQ CURVE keys
(``security.curve_dir``, created by ``python -m common.sockets keys DIR``):
servers then encrypt and authenticate, and refuse clients whose public key
is not in ``DIR/authorized_clients/``. The data-plane store has no
authentication of its own, so a non-loopback ``control.store_host`` also
requires CURVE to be configured (and should sit on a trusted network).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from urllib.parse import urlparse

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

SERVER_CERT = "server"
CLIENT_CERT = "client"
AUTHORIZED = "authorized_clients"

_LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


class SecurityError(RuntimeError):
    pass


def is_loopback(address: str) -> bool:
    if address.startswith(("ipc://", "inproc://")):
        return True
    host = urlparse(address).hostname or ""
    return host in _LOOPBACK or host.startswith("127.")


def check_bind(address: str, curve_dir: str, what: str) -> None:
    if not is_loopback(address) and not curve_dir:
        raise SecurityError(
            f"{what} {address} is not a loopback address: binding it needs CURVE keys. "
            "Create them with `python -m common.sockets keys DIR` and set security.curve_dir=DIR, "
            "or bind 127.0.0.1"
        )


class SocketFactory:
    """Builds the sockets of one process from one context and one security setting."""

    def __init__(self, ctx: zmq.Context, curve_dir: str = ""):
        self.ctx = ctx
        self.curve_dir = Path(curve_dir) if curve_dir else None
        self._auth: ThreadAuthenticator | None = None

    def _server_curve(self, sock: zmq.Socket) -> None:
        if self.curve_dir is None:
            return
        if self._auth is None:
            self._auth = ThreadAuthenticator(self.ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(self.curve_dir / AUTHORIZED))
        public, secret = zmq.auth.load_certificate(self._cert(SERVER_CERT, secret=True))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    def _client_curve(self, sock: zmq.Socket) -> None:
        if self.curve_dir is None:
            return
        public, secret = zmq.auth.load_certificate(self._cert(CLIENT_CERT, secret=True))
        server_public, _ = zmq.auth.load_certificate(self._cert(SERVER_CERT, secret=False))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_serverkey = server_public

    def _cert(self, name: str, *, secret: bool) -> Path:
        path = self.curve_dir / (f"{name}.key_secret" if secret else f"{name}.key")
        if not path.exists():
            raise SecurityError(f"CURVE key {path} is missing; create keys with `python -m common.sockets keys {self.curve_dir}`")
        return path

    def bind(self, kind: int, address: str, what: str, **options: int) -> zmq.Socket:
        """A server socket (ROUTER for control, PULL for metrics)."""
        check_bind(address, str(self.curve_dir or ""), what)
        sock = self.ctx.socket(kind)
        for name, value in options.items():
            sock.setsockopt(getattr(zmq, name), value)
        self._server_curve(sock)
        try:
            sock.bind(address)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise SecurityError(f"cannot bind the {what} {address}: {exc.strerror}") from None
        return sock

    def connect(self, kind: int, address: str, **options: int) -> zmq.Socket:
        """A client socket (DEALER for control, PUSH for metrics)."""
        sock = self.ctx.socket(kind)
        for name, value in options.items():
            sock.setsockopt(getattr(zmq, name), value)
        self._client_curve(sock)
        sock.connect(address)
        return sock

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


def create_keys(directory: Path) -> None:
    """Server and client certificates, with the client authorized."""
    directory.mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(directory, SERVER_CERT)
    zmq.auth.create_certificates(directory, CLIENT_CERT)
    (directory / AUTHORIZED).mkdir(exist_ok=True)
    shutil.copy(directory / f"{CLIENT_CERT}.key", directory / AUTHORIZED / f"{CLIENT_CERT}.key")
    for secret in directory.glob("*.key_secret"):
        secret.chmod(0o600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-keys", description="Create ZeroMQ CURVE keys for multi-host use.")
    sub = parser.add_subparsers(dest="command", required=True)
    keys = sub.add_parser("keys", help="create server and client keys in DIR")
    keys.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    create_keys(args.directory)
    print(f"CURVE keys written to {args.directory}; copy the directory to every host and set security.curve_dir")
    return 0


if __name__ == "__main__":
    sys.exit(main())
