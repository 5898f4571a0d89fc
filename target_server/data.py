"""Training data of the target server: a data source -> tokenized samples.

``build_dataset`` reads a source in any supported format
(:mod:`target_server.data_formats`: pydoc, JSONL/JSON, parquet, arrow,
``datasets`` directories, cached hub datasets; ``messages``,
``conversations`` and ShareGPT records), splits it, tokenizes it with the
chat template in parallel (:mod:`target_server.chat_tokens`: the loss mask
covers only what the assistant produced) and caches the result on disk
(:mod:`target_server.token_cache`): the second start on the same data,
tokenizer and settings reads the samples back instead of tokenizing.

The held-out split hashes each conversation's content (with the seed), so a
conversation lands on the same side in every run and every process, and two
identical conversations never end up on both sides.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from common.progress import Progress
from target_server import token_cache
from target_server.chat_tokens import TokenizerPool, Tokenized, resolve_num_proc, tokenize_conversation
from target_server.data_formats import (
    FORMATS,
    ROLES,
    DataError,
    Messages,
    RecordReport,
    open_source,
    read_conversations,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DataError", "Dataset", "FORMATS", "Messages", "ROLES", "Sample", "build_dataset", "chunk_text",
    "conversation_hash", "fingerprint", "load_conversations", "token_ranking", "tokenize_conversation",
]


@dataclass
class Sample:
    """One tokenized conversation.

    ``input_ids`` is int32 ``[L]`` and ``loss_mask`` uint8 ``[L]`` (1 on
    assistant tokens); ``sample_id`` is the index in its split's list.
    """

    sample_id: int
    input_ids: torch.Tensor
    loss_mask: torch.Tensor

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def length(self) -> int:
        return len(self)


@dataclass
class Dataset:
    """Tokenized training and held-out samples of one data source."""

    train: list[Sample]
    heldout: list[Sample]
    source: str = ""
    num_conversations: int = 0
    num_dropped: int = 0
    num_truncated: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    num_records: int = 0  # records in the source, usable or not
    num_skipped: int = 0  # records that could not be used (reported with file and line)
    cache_path: str = ""  # the tokenized-cache file read or written; empty when the cache is off
    cache_hit: bool = False

    def train_lengths(self) -> list[int]:
        return [len(s) for s in self.train]


# --------------------------------------------------------------------------
# Sources


def load_conversations(source: str, *, seed: int, data_format: str = "auto", strict: bool = True) -> list[Messages]:
    """Load chat conversations from ``source``.

    ``"pydoc"``: conversations built from Python's own reference text
    (``pydoc_data.topics``), one per chunk of a topic, in an order shuffled by
    ``seed`` (so "the first N samples" is a spread of topics, not the
    alphabetically first ones). Anything else is a file, a directory or a
    cached hub dataset in ``data_format`` (see :mod:`target_server.data_formats`),
    kept in source order. ``strict``: the first record that cannot be used
    raises :class:`DataError` naming its file and line; otherwise such records
    are skipped and reported (``build_dataset`` does that).
    """
    if source == "pydoc":
        conversations = _pydoc_conversations()
        random.Random(seed).shuffle(conversations)
        return conversations
    return read_conversations(open_source(source), data_format=data_format,
                              report=RecordReport(strict=strict)).conversations


def _pydoc_conversations(max_chunk_chars: int = 800, min_chunk_chars: int = 200) -> list[Messages]:
    from pydoc_data.topics import topics

    conversations: list[Messages] = []
    for name in sorted(topics):
        chunks = chunk_text(topics[name], max_chunk_chars=max_chunk_chars, min_chunk_chars=min_chunk_chars)
        for k, chunk in enumerate(chunks):
            part = f" (part {k + 1} of {len(chunks)})" if len(chunks) > 1 else ""
            conversations.append([
                {"role": "user", "content": f"Explain the Python topic '{name}'{part}."},
                {"role": "assistant", "content": chunk},
            ])
    return conversations


def chunk_text(text: str, *, max_chunk_chars: int, min_chunk_chars: int = 0) -> list[str]:
    """Split ``text`` into chunks of at most ``max_chunk_chars`` characters.

    Cuts at paragraph breaks, then at line breaks, then anywhere; consecutive
    pieces are merged while they fit, and a last chunk shorter than
    ``min_chunk_chars`` is merged into the previous one when the sum fits 1.5x
    the limit.
    """
    text = text.strip()
    if not text:
        return []
    pieces: list[str] = []
    for paragraph in text.split("\n\n"):
        if len(paragraph) <= max_chunk_chars:
            pieces.append(paragraph)
            continue
        for line in paragraph.split("\n"):
            while len(line) > max_chunk_chars:
                pieces.append(line[:max_chunk_chars])
                line = line[max_chunk_chars:]
            pieces.append(line)
    chunks: list[str] = []
    current = ""
    for piece in pieces:
        if not current:
            current = piece
        elif len(current) + 2 + len(piece) <= max_chunk_chars:
            current = current + "\n\n" + piece
        else:
            chunks.append(current)
            current = piece
    if current:
        if chunks and len(current) < min_chunk_chars and len(chunks[-1]) + 2 + len(current) <= max_chunk_chars * 3 // 2:
            chunks[-1] = chunks[-1] + "\n\n" + current
        else:
            chunks.append(current)
    return [c.strip() for c in chunks if c.strip()]


# --------------------------------------------------------------------------
# Dataset


def conversation_hash(messages: Sequence[dict[str, Any]], seed: int) -> float:
    """A number in [0, 1) fixed by the conversation's content and the seed.

    Role and content make the hash; a message's other keys (reasoning, tool
    calls) join it only where present, so plain conversations keep the split
    they always had.
    """
    rows = []
    for m in messages:
        extras = {k: v for k, v in m.items() if k not in ("role", "content")}
        rows.append([m["role"], m["content"], extras] if extras else [m["role"], m["content"]])
    payload = json.dumps(rows, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    digest = hashlib.sha256(f"{seed}\n{payload}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def token_ranking(samples: Sequence[Sample], vocab_size: int, limit: int) -> list[int]:
    """Token ids of the samples' loss tokens, most frequent first (ties: lower id first), at most ``limit``."""
    if not samples:
        return []
    ids = torch.cat([s.input_ids[s.loss_mask.bool()].long() for s in samples])
    counts = torch.bincount(ids.clamp(0, vocab_size - 1), minlength=vocab_size)
    order = torch.argsort(counts, descending=True, stable=True)  # stable: ties keep the lower id first
    present = int((counts > 0).sum())
    return order[: min(present, limit)].tolist()


def fingerprint(dataset: Dataset, tokenizer: Any) -> str:
    """Content hash of the training split (token ids, loss masks, order), the tokenizer and its chat template.

    Batch indices in ledgers and checkpoints mean something only for the same
    tokenized data: editing the JSONL, the tokenizer or the template changes it.
    """
    digest = hashlib.sha256()
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    digest.update(json.dumps(sorted(vocab.items()), separators=(",", ":")).encode())
    digest.update(str(getattr(tokenizer, "chat_template", "") or "").encode())
    for sample in dataset.train:
        digest.update(len(sample).to_bytes(4, "little"))
        digest.update(sample.input_ids.numpy().tobytes())
        digest.update(sample.loss_mask.numpy().tobytes())
    return digest.hexdigest()[:32]


def build_dataset(
    tokenizer: Any,
    source: str,
    *,
    max_seq_len: int,
    seed: int,
    heldout_fraction: float = 0.02,
    max_samples: int = 0,
    data_format: str = "auto",
    chat_template_kwargs: dict[str, Any] | None = None,
    num_proc: int = 0,
    cache_dir: str | None = None,
) -> Dataset:
    """Load, split and tokenize ``source``, or read it back from the tokenized cache.

    A conversation is held out when its content hash is below
    ``heldout_fraction``; training never sees a held-out conversation. Samples
    without an assistant token after truncation are dropped. ``sample_id`` is
    the index in ``train`` (resp. ``heldout``), stable for the same inputs.
    ``max_samples`` > 0 keeps only the first N training samples.

    ``data_format``, ``chat_template_kwargs``, ``num_proc`` (0 = min(cores, 8))
    and ``cache_dir`` are the ``data.*`` keys of the same names; ``cache_dir``
    None (the default here) caches nothing, ``""`` uses the default directory
    (see :func:`token_cache.resolve_cache_dir`). The samples do not depend on
    ``num_proc`` or on whether they came from the cache. Records that cannot be
    used are skipped and reported; :class:`DataError` only when none can be.
    """
    _check_settings(heldout_fraction, data_format)
    kwargs = dict(chat_template_kwargs or {})
    started = time.monotonic()
    src = open_source(source)
    path, key = _cache_entry(tokenizer, src, source, cache_dir, data_format=data_format, chat_template_kwargs=kwargs,
                             max_seq_len=max_seq_len, seed=seed, heldout_fraction=heldout_fraction,
                             max_samples=max_samples)
    cached = _lookup_cache(path, key, source, max_seq_len, started)
    if cached is not None:
        return cached
    report = RecordReport()
    conversations, where, resolved = _load_records(src, source, seed=seed, data_format=data_format, report=report,
                                                   started=started)
    held = [conversation_hash(messages, seed) < heldout_fraction for messages in conversations]
    results = _tokenize_needed(tokenizer, conversations, held, max_seq_len=max_seq_len, max_samples=max_samples,
                               chat_template_kwargs=kwargs, num_proc=num_proc)
    dataset = _assemble(results, held, where, report, source, num_conversations=len(conversations),
                        max_seq_len=max_seq_len, max_samples=max_samples)
    _write_cache(dataset, path, key, resolved, report)
    _log_dataset(dataset, max_seq_len)
    return dataset


def _check_settings(heldout_fraction: float, data_format: str) -> None:
    """Refuse bad ``data.*`` settings before any file is opened or cache consulted."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    if data_format not in FORMATS:
        raise DataError(f"data.format must be one of {', '.join(FORMATS)}, got {data_format!r}")


def _cache_entry(tokenizer: Any, src: Any, source: str, cache_dir: str | None, *, data_format: str,
                 chat_template_kwargs: dict[str, Any], max_seq_len: int, seed: int, heldout_fraction: float,
                 max_samples: int) -> tuple[Any, str | None]:
    """``(path, key)`` of this data set's tokenized-cache entry, ``(None, None)`` with the cache off
    (``cache_dir`` None, or resolving to no directory: ``"off"``).

    The key covers everything the samples depend on (data, format, tokenizer,
    template arguments, split and selection settings), so a change in any of
    them misses the cache instead of reading stale samples.
    """
    directory = token_cache.resolve_cache_dir(cache_dir) if cache_dir is not None else None
    if directory is None:
        return None, None
    key = token_cache.cache_key({
        "data": src.fingerprint, "format": data_format, "tokenizer": token_cache.tokenizer_digest(tokenizer),
        "chat_template_kwargs": chat_template_kwargs, "max_seq_len": max_seq_len, "seed": seed,
        "heldout_fraction": heldout_fraction, "max_samples": max_samples,
    })
    return token_cache.cache_path(directory, source, key), key


def _lookup_cache(path: Any, key: str | None, source: str, max_seq_len: int, started: float) -> Dataset | None:
    """The data set cached at ``path`` (a hit, logged with its summary), or None after logging a miss
    (or that the cache is off: ``path`` None).

    Kept apart from the tokenizing path so a second start on the same inputs
    returns here without reading the source's records at all.
    """
    if path is None:
        logger.info("[data] tokenized cache off")
        return None
    dataset = _read_cache(path, key, source)
    if dataset is None:
        logger.info("[data] tokenized cache miss: %s", path)
        return None
    logger.info("[data] tokenized cache hit: %s (%d train / %d held-out samples); tokenization skipped (%.1fs)",
                path, len(dataset.train), len(dataset.heldout), time.monotonic() - started)
    _log_dataset(dataset, max_seq_len)
    return dataset


def _load_records(src: Any, source: str, *, seed: int, data_format: str, report: RecordReport,
                  started: float) -> tuple[list[Messages], list[str], str]:
    """``(conversations, where each came from, resolved format)`` of the source; unusable records go to ``report``.

    ``pydoc`` is built here rather than read, so it gets its own record
    locations and counts the same way a file's records do.
    """
    if src.kind == "pydoc":
        conversations = load_conversations(source, seed=seed)
        where = [f"pydoc:{i}" for i in range(len(conversations))]
        report.total = len(conversations)
        resolved = "messages"
    else:
        read = read_conversations(src, data_format=data_format, report=report)
        conversations, where, resolved = read.conversations, read.where, read.data_format
    logger.info("[data] %d conversations from %s (format %s, %.1fs)",
                len(conversations), src.describe(), resolved, time.monotonic() - started)
    return conversations, where, resolved


def _select_samples(results: dict[int, Tokenized], held: list[bool], where: list[str], report: RecordReport, *,
                    max_seq_len: int, max_samples: int) -> tuple[list[Sample], list[Sample], int, int]:
    """``(train, heldout, dropped, truncated)`` from the tokenized conversations, in source order.

    Truncates to ``max_seq_len``, drops samples left without an assistant
    token, reports template errors to ``report``, and stops taking training
    samples at ``max_samples`` (the same walk ``_tokenize_needed`` planned for).
    """
    train: list[Sample] = []
    heldout: list[Sample] = []
    dropped = truncated = 0
    for i, is_heldout in enumerate(held):
        if not is_heldout and max_samples and len(train) >= max_samples:
            continue
        result = results[i]
        if isinstance(result, str):
            report.skip(where[i], "template error", result)
            continue
        ids, mask = result
        if len(ids) > max_seq_len:
            truncated += 1
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        if not mask.any():
            dropped += 1
            continue
        target = heldout if is_heldout else train
        target.append(Sample(sample_id=len(target), input_ids=torch.from_numpy(ids), loss_mask=torch.from_numpy(mask)))
    return train, heldout, dropped, truncated


def _assemble(results: dict[int, Tokenized], held: list[bool], where: list[str], report: RecordReport,
              source: str, *, num_conversations: int, max_seq_len: int, max_samples: int) -> Dataset:
    """The :class:`Dataset` of the tokenized conversations; :class:`DataError` when nothing usable is left.

    Skipped records only warn; a source whose every record is bad, or that
    yields no training sample, is a configuration error worth stopping on.
    """
    train, heldout, dropped, truncated = _select_samples(results, held, where, report, max_seq_len=max_seq_len,
                                                         max_samples=max_samples)
    report.raise_if_all_bad(source)
    if report.skipped:
        logger.warning("[data] %s (first: %s)", report.summary(), report.first_reasons())
    if not train:
        raise DataError(f"data source {source!r} gave no training sample with assistant tokens "
                        f"(conversations={num_conversations}, dropped={dropped}, held out={len(heldout)})")
    return Dataset(train=train, heldout=heldout, source=source, num_conversations=num_conversations,
                   num_dropped=dropped, num_truncated=truncated, stats=_stats(train),
                   num_records=report.total, num_skipped=len(report.skipped))


def _write_cache(dataset: Dataset, path: Any, key: str | None, data_format: str, report: RecordReport) -> None:
    """Store ``dataset`` as the cache entry ``path`` (None: cache off) so the next start skips tokenizing.

    A failed write costs only the next start's time, so it never fails this one.
    """
    if path is None or key is None:
        return
    if token_cache.write(path, _cache_header(dataset, key, data_format, report), _cache_arrays(dataset)):
        dataset.cache_path = str(path)
        logger.info("[data] tokenized cache written: %s (%.1f MiB)", path, path.stat().st_size / 2**20)


def _tokenize_needed(tokenizer: Any, conversations: list[Messages], held: list[bool], *, max_seq_len: int,
                     max_samples: int, chat_template_kwargs: dict[str, Any], num_proc: int) -> dict[int, Tokenized]:
    """Tokenize every held-out conversation and the training ones the selection will reach.

    Without ``max_samples`` that is all of them. With it, training
    conversations go in source order, each round as many as samples are still
    missing, so exactly those the selection loop looks at are tokenized
    (some are dropped: no assistant token, or the template refuses them).
    Each result is tokenized to ``max_seq_len + 1`` tokens, so the caller can
    count truncations.
    """
    train_order = [i for i, h in enumerate(held) if not h]
    pending = [i for i, h in enumerate(held) if h]
    results: dict[int, Tokenized] = {}
    started = time.monotonic()
    kept = position = 0
    total = len(conversations) if not max_samples else None
    with TokenizerPool(tokenizer, max_seq_len + 1, chat_template_kwargs, resolve_num_proc(num_proc)) as pool, \
            Progress("[data] tokenizing", total=total, unit="conversations", logger=logger) as progress:
        while True:
            wanted = max_samples - kept if max_samples else len(train_order)
            batch = train_order[position: position + max(0, wanted)]
            todo = sorted(pending + batch)
            pending = []
            if not todo:
                break
            for i, result in zip(todo, pool.run([conversations[i] for i in todo], progress.update)):
                results[i] = result
            kept += sum(1 for i in batch if not isinstance(results[i], str) and results[i][1][:max_seq_len].any())
            position += len(batch)
            if not max_samples or kept >= max_samples or position >= len(train_order):
                break
        logger.info("[data] tokenized %d conversations in %.1fs (%d process%s)", len(results),
                    time.monotonic() - started, pool.processes_used, "es" if pool.processes_used > 1 else "")
    return results


def _stats(train: list[Sample]) -> dict[str, Any]:
    lengths = [len(s) for s in train]
    return {
        "train_tokens": sum(lengths),
        "train_loss_tokens": int(sum(int(s.loss_mask.sum()) for s in train)),
        "mean_length": sum(lengths) / len(lengths),
        "max_length": max(lengths),
    }


def _log_dataset(dataset: Dataset, max_seq_len: int) -> None:
    stats = dataset.stats
    logger.info("[data] %d train / %d held-out samples, %d dropped (no assistant token), %d truncated to %d tokens; "
                "%d train tokens (%d in the loss), mean length %.1f",
                len(dataset.train), len(dataset.heldout), dataset.num_dropped, dataset.num_truncated, max_seq_len,
                stats["train_tokens"], stats["train_loss_tokens"], stats["mean_length"])


# --------------------------------------------------------------------------
# Tokenized cache


def _cache_arrays(dataset: Dataset) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for split, samples in (("train", dataset.train), ("heldout", dataset.heldout)):
        arrays[f"{split}_lengths"] = np.asarray([len(s) for s in samples], dtype=np.int64)
        arrays[f"{split}_ids"] = (torch.cat([s.input_ids for s in samples]).numpy() if samples
                                  else np.zeros(0, np.int32))
        arrays[f"{split}_mask"] = (torch.cat([s.loss_mask for s in samples]).numpy() if samples
                                   else np.zeros(0, np.uint8))
    return arrays


def _cache_header(dataset: Dataset, key: str, data_format: str, report: RecordReport) -> dict[str, Any]:
    return {
        "key": key, "version": token_cache.TOKENIZED_VERSION, "source": dataset.source, "format": data_format,
        "num_conversations": dataset.num_conversations, "num_dropped": dataset.num_dropped,
        "num_truncated": dataset.num_truncated, "num_records": dataset.num_records,
        "num_skipped": dataset.num_skipped, "skipped_summary": report.summary(),
        "skipped_first": report.first_reasons(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def _read_cache(path: Any, key: str, source: str) -> Dataset | None:
    cached = token_cache.read(path, key)
    if cached is None:
        return None
    header, arrays = cached
    try:
        dataset = _from_cache(source, header, arrays)
    except token_cache.CacheCorrupt as exc:
        logger.warning("[data] tokenized cache %s does not hold a data set (%s); tokenizing again", path, exc)
        return None
    dataset.cache_path = str(path)
    if header.get("skipped_summary"):
        logger.warning("[data] when this cache entry was built, %s (first: %s)",
                       header["skipped_summary"], header.get("skipped_first", ""))
    return dataset


def _from_cache(source: str, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> Dataset:
    """The data set a cache file holds; :class:`token_cache.CacheCorrupt` when it does not add up."""
    splits: dict[str, list[Sample]] = {}
    try:
        for split in ("train", "heldout"):
            lengths = arrays[f"{split}_lengths"]
            ids, mask = arrays[f"{split}_ids"], arrays[f"{split}_mask"]
            if (int(lengths.sum()) != len(ids) or len(ids) != len(mask) or (lengths <= 0).any()
                    or ids.dtype != np.int32 or mask.dtype != np.uint8):
                raise token_cache.CacheCorrupt(f"inconsistent {split} arrays")
            cuts = np.cumsum(lengths)[:-1]
            splits[split] = [Sample(sample_id=k, input_ids=torch.from_numpy(a), loss_mask=torch.from_numpy(m))
                             for k, (a, m) in enumerate(zip(np.split(ids, cuts), np.split(mask, cuts)))
                             ] if len(lengths) else []
        counts = {name: int(header[name]) for name in
                  ("num_conversations", "num_dropped", "num_truncated", "num_records", "num_skipped")}
    except (KeyError, TypeError, ValueError) as exc:
        raise token_cache.CacheCorrupt(f"missing or bad entry {exc}") from None
    if not splits["train"]:
        raise token_cache.CacheCorrupt("no training sample")
    return Dataset(train=splits["train"], heldout=splits["heldout"], source=source, stats=_stats(splits["train"]),
                   cache_hit=True, **counts)
