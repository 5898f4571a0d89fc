"""Data plane on one host: slots of shared memory, written by the target and copied out by drafters.

The target keeps its batch buffers in one such segment (``target_server/shm_pool.py``)
and its frozen embedding/LM-head weights in another.

A segment is a file in ``/dev/shm`` (tmpfs) mapped ``MAP_SHARED`` by both
sides; :meth:`ShmRing.payload` is a zero-copy ``torch.uint8`` view of one slot.
Layout (every offset a multiple of 64)::

    ring header (64 B): magic, total bytes, slots per bucket, buckets, reserved
    for each bucket b, for each slot i:
        slot header (64 B): int64 sequence tag
        payload: slot_bytes[b] rounded up to 64

The writer fills a payload, then stores its tag (:meth:`ShmRing.publish`); the
reader polls the tag (:meth:`ShmRing.wait_ready`) and reads the payload where it lies.
The control plane says which slot and tag to expect (``BATCH.slot``/``tag``)
and frees the slot (``ACK``), so a slot is never written while it is read;
a reader that checks the tag again after reading detects a slot that was
(wrongly) rewritten under it, because the writer zeroes the tag first.

Lifetime, without a resource tracker (``multiprocessing.shared_memory``
registers segments with a tracker that unlinks them when *any* attaching
process exits; plain files avoid that):

- The creator (the target) names the segment, holds a shared ``flock`` on it
  for as long as it lives, and unlinks it when it stops serving it. The
  kernel drops the lock when the creator dies, even by SIGKILL, so
  :func:`sweep_stale` (run at target start-up) can tell a leaked segment
  from a live one and unlink it; that also holds across PID namespaces.
- An attacher maps it and closes its descriptor; it never unlinks. Its
  mapping stays valid after an unlink and is released by the OS when the last
  view of it is freed (or the process exits).
- A segment appears under its final name only once it is sized and its
  header written (created under ``<name>.tmp``, then renamed), so an attacher
  never maps a half-built one.
- A reader proves it is alive with an exclusive ``flock`` on a liveness file
  (:class:`LivenessLock`, ``dflash-live.<ring>.<reader>.<epoch>``), taken before
  it reads any slot and held until it closes the ring. The owner asks
  :func:`holder_alive` before reusing slots the reader may still be on: the
  kernel drops the lock when the reader dies, so this needs no pid (pids are
  not visible across PID namespaces and get reused) and works wherever the two
  share /dev/shm.
- Its pages are reserved with ``posix_fallocate`` (:meth:`ShmRing.reserve`),
  so a /dev/shm too small for it (docker's default is 64 MiB) is a clear
  error instead of a SIGBUS at the first write past the limit.

Memory ordering: the payload stores must be visible before the tag store.
x86-64 (TSO) guarantees that for plain stores; on weakly ordered CPUs both
sides pass a lock acquire/release between the payload and the tag (see
:func:`_fence`), which is the strongest barrier reachable from Python.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import struct
import threading
import time
from pathlib import Path

import torch

from common.transport import TransportError

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "dflash."
LIVENESS_PREFIX = "dflash-live."
_ALIGN = 64
_HEADER = 64
_MAGIC = 0x314D48534C464644  # b"DFLFSHM1" little-endian
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
_FENCE_LOCK = threading.Lock()
# Ring header fields (int64 each): magic, total bytes, slots per bucket, buckets, reserved.
_RING_FIELDS = struct.Struct("<qqqqq")
_TAG = struct.Struct("<q")


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _fence() -> None:
    with _FENCE_LOCK:
        pass


def _reserve(fd: int, total: int) -> None:
    try:
        os.posix_fallocate(fd, 0, total)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
            raise
        free = os.statvfs(SHM_DIR)
        raise TransportError(
            f"{SHM_DIR} has no room for a {total / 2**20:.1f} MiB shared-memory segment "
            f"({free.f_bavail * free.f_frsize / 2**20:.1f} MiB free); lower transport.shm_slots_per_bucket, "
            "target.ready_batches or data.tokens_per_batch, or enlarge /dev/shm (docker: --shm-size)"
        ) from None


def segment_name(*parts: object) -> str:
    """``dflash.<part>.<part>...`` with every unsafe character replaced: a valid /dev/shm file name."""
    name = SEGMENT_PREFIX + ".".join(_UNSAFE.sub("_", str(p)) for p in parts)
    return name[:200]


def _path(name: str) -> Path:
    if not _NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"shared-memory segment name must match {_NAME.pattern}, got {name!r}")
    if not SHM_DIR.is_dir():
        raise TransportError(f"the shm transport needs {SHM_DIR} (Linux); use transport.kind = \"gloo\" or \"nccl\"")
    return SHM_DIR / name


def ring_nbytes(slot_bytes: list[int], slots_per_bucket: int) -> int:
    """Total size of a ring segment (headers included)."""
    return _HEADER + slots_per_bucket * sum(_HEADER + _round_up(b) for b in slot_bytes)


def unlink_segment(name: str) -> bool:
    """Remove a segment's name (idempotent). Mappings of it stay valid. True if it existed."""
    try:
        os.unlink(_path(name))
        return True
    except FileNotFoundError:
        return False


def sweep_stale(shm_dir: Path | None = None) -> list[str]:
    """Unlink segments and liveness files whose holder is gone (nobody holds their lock); returns their names.

    A segment of a live creator (a liveness file of a live reader) is locked and
    kept, so this is safe to run while other targets on the host are serving.
    Another user's files are skipped.
    """
    directory = shm_dir or SHM_DIR
    removed: list[str] = []
    if not directory.is_dir():
        return removed
    for entry in sorted(directory.iterdir()):
        if not entry.name.startswith((SEGMENT_PREFIX, LIVENESS_PREFIX)):
            continue
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            logger.debug("sweep: skipping %s (%s)", entry.name, exc)
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live creator holds it
            try:
                os.unlink(entry)
            except OSError as exc:
                logger.debug("sweep: cannot unlink %s (%s)", entry.name, exc)
                continue
            removed.append(entry.name)
        finally:
            os.close(fd)
    if removed:
        logger.info("[shm] removed %d shared-memory segments left by dead processes: %s", len(removed), ", ".join(removed))
    return removed


def liveness_name(ring_name: str, reader_id: str, epoch: int) -> str:
    """The liveness file of one reader registration of ring ``ring_name``; ValueError for an unsafe part.

    Built from values both sides know (WELCOME's ring name, the drafter id and
    registration epoch), so no message carries it.
    """
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise ValueError(f"liveness epoch must be a non-negative int, got {epoch!r}")
    for part in (ring_name, reader_id):
        _path(part)  # a safe file name on its own: no '/', not '.' or '..'
    name = f"{LIVENESS_PREFIX}{ring_name}.{reader_id}.{epoch}"
    _path(name)
    return name


def _same_file(path: Path, fd: int) -> bool:
    try:
        named = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def _try_lock(path: Path) -> int | None:
    """A descriptor of ``path`` (created 0600 if missing) holding its exclusive lock, or None
    when someone else holds the lock or the file was unlinked before we locked it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if os.fstat(fd).st_uid != os.getuid():
            raise TransportError(f"liveness file {path} belongs to another user; remove it or pick another drafter id")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        if not _same_file(path, fd):  # a sweep unlinked it between our open and our lock
            os.close(fd)
            return None
    except BaseException:
        os.close(fd)
        raise
    return fd


class LivenessLock:
    """A reader's proof of life: an exclusive ``flock`` on its liveness file, held until :meth:`release`.

    The kernel drops the lock when the process dies (SIGKILL included), in
    whatever PID namespace it runs; :func:`holder_alive` is the owner's check.
    """

    def __init__(self, name: str, fd: int) -> None:
        self.name = name
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, name: str, timeout_s: float = 1.0) -> "LivenessLock":
        """Create (or reuse) the file and lock it. Waits ``timeout_s`` at most: the owner's
        check and a sweep hold the lock for microseconds, a second live reader for good."""
        path = _path(name)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fd = _try_lock(path)
            except OSError as exc:
                raise TransportError(f"cannot create the liveness file {path}: {exc}") from None
            if fd is not None:
                return cls(name, fd)
            if time.monotonic() >= deadline:
                raise TransportError(
                    f"liveness file {path} is locked by another process: is this drafter running twice?"
                )
            time.sleep(0.01)

    def release(self) -> None:
        """Remove the file if it is still ours (the owner may have removed it already) and drop the lock."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            path = _path(self.name)
            if _same_file(path, fd):
                # The owner can unlink it between the check and here (it sweeps the pool's files when
                # it drops the pool): gone is what we wanted.
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        finally:
            os.close(fd)  # drops the lock


def holder_alive(name: str) -> bool:
    """Whether a live process holds the liveness lock ``name`` (the owner's check; never creates it).

    False when the file is missing (the reader never attached, so it never read a
    slot, or it closed) or its lock is free (the reader died). True when the lock
    is held, and when the file cannot be opened: not knowing keeps slots longer.
    """
    try:
        fd = os.open(_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError as exc:
        logger.warning("[shm] cannot check liveness file %s (%s); treating its reader as alive", name, exc)
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the lock we may have just taken
    return False


class ShmRing:
    """``slots_per_bucket`` slots for each bucket's packed-batch size, in one shared-memory segment.

    Build with :meth:`create` (owner: the target) or :meth:`attach` (the drafter).
    """

    def __init__(self, name: str, slot_bytes: list[int], slots_per_bucket: int, mm: mmap.mmap,
                 lock_fd: int | None) -> None:
        self.name = name
        self.slot_bytes = list(slot_bytes)
        self.slots_per_bucket = slots_per_bucket
        self.owner = lock_fd is not None
        self._mm: mmap.mmap | None = mm
        self._lock_fd = lock_fd
        self._liveness: LivenessLock | None = None
        self._tag_offsets: list[list[int]] = []
        self._payloads: list[list[torch.Tensor]] = []
        mem = torch.frombuffer(mm, dtype=torch.uint8)  # zero copy; keeps the mapping alive
        offset = _HEADER
        for nbytes in self.slot_bytes:
            tags, views = [], []
            for _ in range(slots_per_bucket):
                tags.append(offset)
                views.append(mem[offset + _HEADER: offset + _HEADER + nbytes])
                offset += _HEADER + _round_up(nbytes)
            self._tag_offsets.append(tags)
            self._payloads.append(views)

    # ---------------------------------------------------------------- construction
    @staticmethod
    def _check(slot_bytes: list[int], slots_per_bucket: int) -> None:
        if not slot_bytes or any(b <= 0 for b in slot_bytes):
            raise ValueError(f"slot_bytes must be a non-empty list of positive sizes, got {slot_bytes!r}")
        if slots_per_bucket < 1:
            raise ValueError(f"slots_per_bucket must be >= 1, got {slots_per_bucket}")

    @classmethod
    def create(cls, name: str, slot_bytes: list[int], slots_per_bucket: int, reserve: bool = True) -> "ShmRing":
        """Create the segment (all slot tags 0) and lock it as its owner.

        With ``reserve`` its memory is reserved now (:meth:`reserve`); without, creation
        takes microseconds whatever the size, and the caller reserves later, off a
        latency-critical thread.
        """
        cls._check(slot_bytes, slots_per_bucket)
        path = _path(name)
        tmp = path.with_name(path.name + ".tmp")
        total = ring_nbytes(slot_bytes, slots_per_bucket)
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise TransportError(f"shared-memory segment {tmp} already exists") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.ftruncate(fd, total)
            if reserve:
                _reserve(fd, total)
            mm = mmap.mmap(fd, total)
            _RING_FIELDS.pack_into(mm, 0, _MAGIC, total, slots_per_bucket, len(slot_bytes), 0)
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        logger.debug("[shm] created %s: %d buckets x %d slots, %d bytes", name, len(slot_bytes), slots_per_bucket, total)
        return cls(name, slot_bytes, slots_per_bucket, mm, fd)

    def reserve(self) -> None:
        """Allocate every page of the segment now (owner only), so a full /dev/shm fails here
        with a TransportError instead of killing a process with SIGBUS at a later write."""
        if self._lock_fd is None:
            raise TransportError(f"only the creator of shm ring {self.name} reserves its memory")
        _reserve(self._lock_fd, self.nbytes)

    @classmethod
    def attach(cls, name: str, slot_bytes: list[int], slots_per_bucket: int, timeout_s: float = 0.0,
               stop: threading.Event | None = None) -> "ShmRing":
        """Map an existing segment; wait up to ``timeout_s`` for it to appear. Never unlinks it."""
        cls._check(slot_bytes, slots_per_bucket)
        path = _path(name)
        total = ring_nbytes(slot_bytes, slots_per_bucket)
        deadline = time.monotonic() + timeout_s
        pause = 0.005
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
                break
            except FileNotFoundError:
                if time.monotonic() >= deadline or (stop is not None and stop.is_set()):
                    waited = f" (waited {timeout_s:.1f}s)" if timeout_s > 0 else ""
                    raise TransportError(
                        f"shared-memory segment {path} does not exist{waited}: its creator removed it already, "
                        "or this process does not share its /dev/shm (the shm transport needs target and drafter "
                        "on one host sharing /dev/shm; containers: --ipc=host; else use transport.kind = \"gloo\" "
                        "or \"nccl\")"
                    ) from None
                time.sleep(pause)
                pause = min(pause * 2, 0.1)
        try:
            size = os.fstat(fd).st_size
            if size != total:
                raise TransportError(f"shared-memory segment {name} has {size} bytes, this side expects {total}")
            mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        magic, nbytes, slots, buckets, _ = _RING_FIELDS.unpack_from(mm, 0)
        if (magic, nbytes, slots, buckets) != (_MAGIC, total, slots_per_bucket, len(slot_bytes)):
            raise TransportError(
                f"shared-memory segment {name} has a different layout ({buckets} buckets x {slots} slots, "
                f"{nbytes} bytes) than this side expects ({len(slot_bytes)} x {slots_per_bucket}, {total})"
            )
        return cls(name, slot_bytes, slots_per_bucket, mm, None)

    # ---------------------------------------------------------------- data path
    @property
    def nbytes(self) -> int:
        return ring_nbytes(self.slot_bytes, self.slots_per_bucket)

    def _live(self) -> mmap.mmap:
        mm = self._mm
        if mm is None:
            raise TransportError(f"shm ring {self.name} is closed")
        return mm

    def payload(self, bucket: int, index: int) -> torch.Tensor:
        """The slot's bytes as a uint8 tensor that aliases the shared memory (no copy)."""
        self._live()
        return self._payloads[bucket][index]

    def tag(self, bucket: int, index: int) -> int:
        return _TAG.unpack_from(self._live(), self._tag_offsets[bucket][index])[0]

    def publish(self, bucket: int, index: int, tag: int) -> None:
        """Mark the slot's payload (already written) as carrying ``tag``."""
        mm = self._live()
        _fence()
        _TAG.pack_into(mm, self._tag_offsets[bucket][index], tag)

    def wait_ready(self, bucket: int, index: int, tag: int, timeout_s: float,
                   stop: threading.Event | None = None) -> None:
        """Return once the slot carries ``tag``; TransportError after ``timeout_s`` or when ``stop`` is set."""
        mm = self._live()
        offset = self._tag_offsets[bucket][index]
        unpack = _TAG.unpack_from
        for _ in range(200):  # a short spin catches a publish that is already under way
            if unpack(mm, offset)[0] == tag:
                _fence()
                return
        deadline = time.monotonic() + timeout_s
        pause = 5e-5
        while True:
            if unpack(mm, offset)[0] == tag:
                _fence()
                return
            if time.monotonic() >= deadline:
                raise TransportError(
                    f"slot {bucket}/{index} of shm ring {self.name} did not get tag {tag} within {timeout_s:.0f}s "
                    f"(it holds {unpack(mm, offset)[0]}); raise transport.timeout_s if the target is just slow"
                )
            if stop is not None and stop.is_set():
                raise TransportError(f"stopped while waiting for slot {bucket}/{index} of shm ring {self.name}")
            time.sleep(pause)
            pause = min(pause * 2, 5e-4)

    # ---------------------------------------------------------------- lifetime
    def hold_liveness(self, reader_id: str, epoch: int) -> None:
        """Lock this reader registration's liveness file until :meth:`close` (call before reading any slot):
        while it is locked the owner does not reuse slots this side may be reading."""
        if self._liveness is not None:
            raise TransportError(f"shm ring {self.name} already holds liveness lock {self._liveness.name}")
        self._liveness = LivenessLock.acquire(liveness_name(self.name, reader_id, epoch))

    def close(self) -> None:
        """Drop this side's references, its liveness lock (and the owner's lock). Payload views still held keep
        the mapping alive."""
        self._mm = None
        self._payloads = []
        if self._liveness is not None:
            self._liveness.release()
            self._liveness = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def unlink(self) -> None:
        """Remove the segment's name (owner only; idempotent). Existing mappings stay valid."""
        if not self.owner:
            raise TransportError(f"only the creator of shm ring {self.name} unlinks it")
        unlink_segment(self.name)

    def __repr__(self) -> str:
        return f"ShmRing({self.name!r}, buckets={len(self.slot_bytes)}, slots={self.slots_per_bucket}, owner={self.owner})"
