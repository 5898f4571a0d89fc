"""On-disk cache of tokenized data sets: one checked file per (data, tokenizer, settings).

The key hashes everything the tokenized samples depend on: the data's content
(file bytes, or the ``datasets`` fingerprint), the tokenizer (its whole
definition: vocabulary, merges, normalizer, special tokens), its chat template,
``chat_template_kwargs``, ``max_seq_len``, ``seed``, ``heldout_fraction``,
``max_samples``, the format, and :data:`TOKENIZED_VERSION` (bump it when the
tokenization or the selection of samples changes).

A file is ``MAGIC | u64 header length | header JSON | arrays | sha256`` where
the trailing sha256 covers every byte before it. It is written to a temporary
file, fsynced and renamed into place, so a reader sees a whole file or none;
one that is torn or corrupt anyway (a full disk, a bad copy) fails the check,
is logged, deleted and rebuilt. The cache never stops a job: a directory that
cannot be written is logged and the job goes on without it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from common.cache_home import cache_dir_from_env

logger = logging.getLogger(__name__)

# Version of what is cached: bump when tokenize_conversation, the formats'
# normalisation or build_dataset's selection of samples changes its output.
TOKENIZED_VERSION = 1

ENV_CACHE_DIR = "DFLASH_DATA_CACHE_DIR"
SUFFIX = ".dftok"
_MAGIC = b"DFTOK\x00\x01\n"
_DIGEST_BYTES = 32
_ALIGN = 8


class CacheCorrupt(Exception):
    """A cache file fails its checks (it is rebuilt, never trusted)."""


def resolve_cache_dir(setting: str) -> Path | None:
    """``data.cache_dir``: a directory, ``"off"`` (None: no cache), or empty for the default.

    The default is ``$DFLASH_DATA_CACHE_DIR``, else ``$XDG_CACHE_HOME/dflash/tokenized``
    (``~/.cache/dflash/tokenized``).
    """
    if setting.strip().lower() == "off":
        return None
    if setting:
        return Path(setting).expanduser()
    return cache_dir_from_env(ENV_CACHE_DIR, "tokenized")


def tokenizer_digest(tokenizer: Any) -> str:
    """Hash of what tokenization depends on in ``tokenizer``: its full definition and chat template."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        digest.update(json.dumps(sorted(vocab.items()), separators=(",", ":")).encode())
    special = getattr(tokenizer, "special_tokens_map", {}) or {}
    digest.update(json.dumps(special, sort_keys=True, default=str).encode())
    template = getattr(tokenizer, "chat_template", None)
    digest.update(json.dumps(template, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def cache_key(parts: dict[str, Any]) -> str:
    payload = json.dumps({"version": TOKENIZED_VERSION, **parts}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def cache_path(directory: Path, source: str, key: str) -> Path:
    """``<directory>/<readable source name>-<key>.dftok`` (the name is for humans clearing the cache)."""
    stem = Path(source.rstrip("/")).name or source
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", stem)[:40].strip("._") or "data"
    return directory / f"{slug}-{key}{SUFFIX}"


def write(path: Path, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> bool:
    """Write ``arrays`` (1-D) and ``header`` atomically to ``path``; False (logged) when it cannot."""
    layout = []
    offset = 0
    for name, array in arrays.items():
        array = np.ascontiguousarray(array)
        layout.append({"name": name, "dtype": array.dtype.str, "count": int(array.size), "offset": offset})
        offset += _aligned(array.nbytes)
    meta = json.dumps({**header, "arrays": layout}, sort_keys=True).encode()
    meta += b" " * (_aligned(len(_MAGIC) + 8 + len(meta)) - (len(_MAGIC) + 8 + len(meta)))  # arrays start aligned
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as handle:
            def put(data: bytes | memoryview) -> None:
                digest.update(data)
                handle.write(data)

            put(_MAGIC)
            put(struct.pack("<Q", len(meta)))
            put(meta)
            for array in arrays.values():
                data = np.ascontiguousarray(array).tobytes()
                put(data + b"\0" * (_aligned(len(data)) - len(data)))
            handle.write(digest.digest())
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        tmp = None
        _fsync_dir(path.parent)
    except OSError as exc:
        logger.warning("[data] cannot write the tokenized cache %s (%s); going on without it", path, exc)
        return False
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
    return True


def read(path: Path, key: str) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
    """The header and arrays cached at ``path`` for ``key``; None when there is none.

    A file that fails any check (magic, length, checksum, key, layout) is
    logged, deleted and reported as missing, so the caller rebuilds it.
    """
    try:
        blob = bytearray(path.read_bytes())
    except FileNotFoundError:
        return None
    except OSError as exc:
        logger.warning("[data] cannot read the tokenized cache %s (%s); tokenizing again", path, exc)
        return None
    try:
        return _parse(blob, key)
    except CacheCorrupt as exc:
        logger.warning("[data] tokenized cache %s is corrupt (%s); deleting it and tokenizing again", path, exc)
        try:
            path.unlink()
        except OSError as unlink_error:
            logger.warning("[data] cannot delete %s: %s", path, unlink_error)
        return None


def _parse(blob: bytearray, key: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    head = len(_MAGIC) + 8
    if len(blob) < head + _DIGEST_BYTES or bytes(blob[: len(_MAGIC)]) != _MAGIC:
        raise CacheCorrupt("not a tokenized-cache file, or cut short")
    body = memoryview(blob)[: len(blob) - _DIGEST_BYTES]
    if hashlib.sha256(body).digest() != bytes(blob[-_DIGEST_BYTES:]):
        raise CacheCorrupt("checksum mismatch")
    (meta_len,) = struct.unpack_from("<Q", blob, len(_MAGIC))
    try:
        header = json.loads(bytes(blob[head: head + meta_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CacheCorrupt(f"unreadable header ({exc})") from None
    if not isinstance(header, dict) or header.get("key") != key:
        raise CacheCorrupt("written for another key")
    start = head + meta_len
    try:
        layout = [(str(e["name"]), np.dtype(e["dtype"]), start + int(e["offset"]), int(e["count"]))
                  for e in header["arrays"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise CacheCorrupt(f"bad array layout ({exc})") from None
    arrays = {}
    for name, dtype, offset, count in layout:
        if count < 0 or offset + count * dtype.itemsize > len(body):
            raise CacheCorrupt(f"array {name} runs past the end")
        arrays[name] = np.frombuffer(blob, dtype=dtype, count=count, offset=offset)
    return header, arrays


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories; the rename is done either way
    finally:
        os.close(fd)
