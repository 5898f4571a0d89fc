"""Every ZeroMQ socket of every process is built here, with the security policy applied.

Policy: the control and metrics sockets bind loopback addresses (or ipc://)
freely. Binding any other address needs ZeroMQ CURVE keys
(``security.curve_dir``, created by ``python -m common.sockets keys DIR``):
servers then encrypt and authenticate, and refuse clients whose public key
is not in ``DIR/authorized_clients/``. Each host (or drafter) can have a key
of its own (``add-client DIR NAME``, used with ``security.curve_client = NAME``)
and lose it again (``revoke DIR NAME``): servers reread the authorized keys
when the directory changes, so a revoked key cannot connect any more (its open
connections last until they drop; restart the server to cut them at once). The data-plane store has no
authentication of its own, so a non-loopback ``control.store_host`` also
requires CURVE to be configured (and should sit on a trusted network).
"""

from __future__ import annotations

import argparse
import re
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
CLIENTS = "clients"  # per-host/per-drafter key pairs made by add-client
CLIENT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")

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

    def __init__(self, ctx: zmq.Context, curve_dir: str = "", client_name: str = CLIENT_CERT):
        self.ctx = ctx
        self.curve_dir = Path(curve_dir) if curve_dir else None
        self.client_name = client_name
        self._auth: ThreadAuthenticator | None = None
        self._authorized_mtime = 0.0

    def _server_curve(self, sock: zmq.Socket) -> None:
        if self.curve_dir is None:
            return
        if self._auth is None:
            self._auth = ThreadAuthenticator(self.ctx)
            self._auth.start()
            self.reload_authorized()
        public, secret = zmq.auth.load_certificate(self._cert(SERVER_CERT, secret=True))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    def reload_authorized(self) -> None:
        """Reread ``authorized_clients/`` if it changed since the last read (a key added or revoked)."""
        if self._auth is None:
            return
        folder = self.curve_dir / AUTHORIZED
        mtime = folder.stat().st_mtime if folder.is_dir() else 0.0
        if mtime != self._authorized_mtime:
            self._authorized_mtime = mtime
            self._auth.configure_curve(domain="*", location=str(folder))

    def _client_curve(self, sock: zmq.Socket) -> None:
        if self.curve_dir is None:
            return
        public, secret = zmq.auth.load_certificate(self._cert(self.client_name, secret=True))
        server_public, _ = zmq.auth.load_certificate(self._cert(SERVER_CERT, secret=False))
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_serverkey = server_public

    def _cert(self, name: str, *, secret: bool) -> Path:
        filename = f"{name}.key_secret" if secret else f"{name}.key"
        path = self.curve_dir / filename
        if not path.exists() and (self.curve_dir / CLIENTS / filename).exists():
            path = self.curve_dir / CLIENTS / filename
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


def add_client(directory: Path, name: str) -> Path:
    """A key pair of its own for one host or drafter (``clients/NAME.key*``), authorized at once."""
    if not CLIENT_NAME.fullmatch(name):
        raise SecurityError(f"client name must match {CLIENT_NAME.pattern}, got {name!r}")
    clients = directory / CLIENTS
    clients.mkdir(parents=True, exist_ok=True)
    if (clients / f"{name}.key").exists():
        raise SecurityError(f"client {name} already has a key in {clients}; revoke it first to replace it")
    public, secret = zmq.auth.create_certificates(clients, name)
    Path(secret).chmod(0o600)
    (directory / AUTHORIZED).mkdir(exist_ok=True)
    shutil.copy(public, directory / AUTHORIZED / f"{name}.key")
    return Path(secret)


def revoke(directory: Path, name: str) -> None:
    """Servers refuse new connections with NAME's key from their next check of the directory (seconds)."""
    key = directory / AUTHORIZED / f"{name}.key"
    if not key.exists():
        raise SecurityError(f"no authorized key named {name} in {directory / AUTHORIZED}")
    key.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dflash-keys",
        description="Create, add and revoke the ZeroMQ CURVE keys that a job needs to bind non-loopback "
                    "addresses (multi-host use). Point security.curve_dir at DIR on every host.",
        epilog="exit status: 0 done, 2 the directory or key is not usable (the message says why)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    keys = sub.add_parser("keys", help="create the server key and a shared client key in DIR")
    keys.add_argument("directory", type=Path, metavar="DIR", help="key directory, e.g. /etc/dflash/curve")
    add = sub.add_parser("add-client", help="create and authorize a key of its own for one host or drafter")
    add.add_argument("directory", type=Path, metavar="DIR", help="the key directory made by 'keys'")
    add.add_argument("name", metavar="NAME", help="the client's name; set security.curve_client = NAME on that host")
    rev = sub.add_parser("revoke", help="stop accepting a client's key (running servers refuse it within seconds)")
    rev.add_argument("directory", type=Path, metavar="DIR", help="the key directory made by 'keys'")
    rev.add_argument("name", metavar="NAME", help="the client name given to add-client")
    args = parser.parse_args(argv)
    try:
        if args.command == "keys":
            create_keys(args.directory)
            print(f"CURVE keys written to {args.directory}; copy server.key to every host and set security.curve_dir")
        elif args.command == "add-client":
            secret = add_client(args.directory, args.name)
            print(f"client key {secret} authorized; give that host {args.directory}/server.key and "
                  f"{args.directory}/{CLIENTS}/{args.name}.key*, and set security.curve_client = \"{args.name}\"")
        else:
            revoke(args.directory, args.name)
            print(f"revoked {args.name}: servers refuse its new connections within seconds")
    except SecurityError as exc:
        print(f"dflash-keys: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # an unwritable or missing directory
        print(f"dflash-keys: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
