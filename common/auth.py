"""Who may register a drafter id, and who may read STATUS: keys in the run directory.

A run has one secret, ``<run_dir>/auth/control.key`` (32 random bytes, hex, mode
0600), created atomically by whichever process of the run starts first. A HELLO
carries ``HMAC(key, "hello:" + drafter_id)``, so only a process that can read the
run directory registers (or takes over, after a restart) a drafter id; a peer
without it is refused and the live drafter keeps training. STATUS needs
``HMAC(key, "status")``, which is also written on its own to
``<run_dir>/auth/status.key``: an operator given that file can read STATUS and
cannot register anything.

Drafters on other hosts need a copy of ``control.key`` in their run directory
(the control socket then needs CURVE too, which encrypts the proof on the wire).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from common.durable_io import fsync_path

CONTROL_KEY = "control.key"
STATUS_KEY = "status.key"


def auth_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "auth"


def _sign(key: str, purpose: str) -> str:
    return hmac.new(key.encode(), purpose.encode(), hashlib.sha256).hexdigest()


def hello_proof(key: str, drafter_id: str) -> str:
    return _sign(key, f"hello:{drafter_id}")


def status_proof(key: str) -> str:
    return _sign(key, "status")


def proof_ok(expected: str, given: str) -> bool:
    return hmac.compare_digest(expected.encode(), given.encode())


def _write_once(path: Path, text: str) -> None:
    """Create ``path`` holding ``text`` (mode 0600) unless it exists; never visible half-written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic, and fails if another process created it first
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    fsync_path(path.parent)


def load_or_create_control_key(run_dir: Path) -> str:
    """The run's control key, created on first use together with its status key."""
    folder = auth_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / CONTROL_KEY
    if not path.exists():
        _write_once(path, secrets.token_hex(32))
    key = read_key(path)
    if not (folder / STATUS_KEY).exists():
        _write_once(folder / STATUS_KEY, status_proof(key))
    return key


def read_key(path: Path) -> str:
    """A key file's content; raises OSError/ValueError when it is missing or is not a key."""
    text = Path(path).read_text().strip()
    if not 32 <= len(text) <= 128 or not all(c in "0123456789abcdef" for c in text):
        raise ValueError(f"{path} does not hold a key (hex, 32-128 characters)")
    return text


def status_credential(run_dir: Path) -> str:
    """What an operator tool sends with STATUS_REQUEST: the status key, or one derived from the control key."""
    folder = auth_dir(run_dir)
    if (folder / STATUS_KEY).exists():
        return read_key(folder / STATUS_KEY)
    return status_proof(read_key(folder / CONTROL_KEY))
