"""Training data of the target server: conversations -> tokenized samples.

A conversation is a list of ``{"role": ..., "content": ...}`` messages. It is
rendered with the tokenizer's own chat template and tokenized once; the loss
mask marks the tokens the assistant produced (its content and the end-of-turn
token that closes it), never the system/user text or the template's headers.

The mask is computed from character spans: for each assistant message the
template is rendered on ``messages[:i]`` with the generation prompt (where the
assistant text starts) and on ``messages[:i + 1]`` (where it ends); tokens of the
full rendering whose offsets start inside that span are assistant tokens. This
works for templates without ``{% generation %}`` markers (SmolLM2, Qwen3,
Llama 3), and does not depend on the prefix tokenizing like the full text.

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
from pathlib import Path
from typing import Any, Sequence

import torch

logger = logging.getLogger(__name__)

Messages = list[dict[str, str]]

ROLES = ("system", "user", "assistant", "tool")

# End-of-turn markers of common chat templates; the tokenizer's eos token is
# always one too. Used to stop the assistant mask before the template's
# trailing newline.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


class DataError(ValueError):
    """A data source the user pointed at cannot be used (missing, malformed)."""


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

    def train_lengths(self) -> list[int]:
        return [len(s) for s in self.train]


# --------------------------------------------------------------------------
# Sources


def load_conversations(source: str, *, seed: int) -> list[Messages]:
    """Load chat conversations from ``source``.

    ``"pydoc"``: conversations built from Python's own reference text
    (``pydoc_data.topics``), one per chunk of a topic, in an order shuffled by
    ``seed`` (so "the first N samples" is a spread of topics, not the
    alphabetically first ones). Anything else is a path to a JSONL file with
    one ``{"messages": [{"role": ..., "content": ...}, ...]}`` per line, kept in
    file order (blank lines are skipped).
    """
    if source == "pydoc":
        conversations = _pydoc_conversations()
        random.Random(seed).shuffle(conversations)
        return conversations
    return _jsonl_conversations(Path(source))


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


def _jsonl_conversations(path: Path) -> list[Messages]:
    if not path.is_file():
        raise DataError(f"data source {str(path)!r} is not 'pydoc' and no such file exists; "
                        "set data.source to 'pydoc' or to a JSONL file of {\"messages\": [...]} lines")
    conversations: list[Messages] = []
    try:
        handle = path.open("r", encoding="utf-8")
    except OSError as exc:
        raise DataError(f"cannot read data file {str(path)!r}: {exc}") from exc
    with handle:
        try:
            for lineno, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                conversations.append(_parse_line(path, lineno, line))
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: not UTF-8 text ({exc})") from exc
    if not conversations:
        raise DataError(f"{path}: no conversations (the file is empty)")
    return conversations


def _parse_line(path: Path, lineno: int, line: str) -> Messages:
    where = f"{path}:{lineno}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(record, dict) or "messages" not in record:
        raise DataError(f"{where}: expected an object with a \"messages\" list, got {_short(record)}")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: \"messages\" must be a non-empty list, got {_short(messages)}")
    out: Messages = []
    for j, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{where}: messages[{j}] must be an object, got {_short(message)}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or role not in ROLES:
            raise DataError(f"{where}: messages[{j}].role must be one of {', '.join(ROLES)}, got {_short(role)}")
        if not isinstance(content, str):
            raise DataError(f"{where}: messages[{j}].content must be a string, got {_short(content)}")
        out.append({"role": role, "content": content})
    return out


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------
# Tokenization


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict[str, str]], max_seq_len: int) -> tuple[list[int], list[int]]:
    """Render ``messages`` with the chat template and tokenize them.

    Returns ``(input_ids, loss_mask)`` truncated to ``max_seq_len``; the mask is
    1 on the tokens of each assistant message's content and on the end-of-turn
    token closing it, 0 elsewhere. The mask may be all zero (no assistant
    message, or all of it truncated away): callers drop such samples.
    """
    messages = [dict(m) for m in messages]
    full = _render(tokenizer, messages, add_generation_prompt=False)
    spans = _assistant_spans(tokenizer, messages, full)
    if getattr(tokenizer, "is_fast", False):
        encoding = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        input_ids = list(encoding["input_ids"])
        offsets = encoding["offset_mapping"]
        mask = [0] * len(input_ids)
        k = 0
        for t, (start, _end) in enumerate(offsets):
            while k < len(spans) and start >= spans[k][1]:
                k += 1
            if k < len(spans) and spans[k][0] <= start < spans[k][1]:
                mask[t] = 1
    else:
        input_ids, mask = _tokenize_by_prefixes(tokenizer, full, spans)
    _trim_after_end_of_turn(tokenizer, input_ids, mask)
    return input_ids[:max_seq_len], mask[:max_seq_len]


def _render(tokenizer: Any, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)


def _assistant_spans(tokenizer: Any, messages: Messages, full: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the assistant turns in ``full``."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = _render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        upto = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if i and upto.startswith(head) and full.startswith(upto) and len(head) >= cursor:
            start, end = len(head), len(upto)
        else:
            # The template renders earlier turns differently once later turns
            # exist (e.g. it strips reasoning from past assistant turns): find
            # the content itself and the end-of-turn marker right after it.
            found = full.find(message["content"], cursor)
            if found < 0 or not message["content"]:
                logger.debug("assistant message %d not found in the rendered conversation; left unmasked", i)
                continue
            start, end = found, found + len(message["content"])
            for marker in _end_of_turn_strings(tokenizer):
                if full.startswith(marker, end):
                    end += len(marker)
                    break
        spans.append((start, end))
        cursor = end
    return spans


def _tokenize_by_prefixes(tokenizer: Any, full: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Fallback for tokenizers without offsets: tokenize rendered prefixes."""
    input_ids = list(tokenizer(full, add_special_tokens=False)["input_ids"])
    mask = [0] * len(input_ids)
    for start, end in spans:
        a = len(tokenizer(full[:start], add_special_tokens=False)["input_ids"])
        b = len(tokenizer(full[:end], add_special_tokens=False)["input_ids"])
        for t in range(a, min(b, len(mask))):
            mask[t] = 1
    return input_ids, mask


def _token_id(tokenizer: Any, token: str) -> int | None:
    """Id of ``token`` if it is a single token of the vocabulary, else None."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == token:
        return token_id
    return None


def _end_of_turn_strings(tokenizer: Any) -> list[str]:
    out = [tokenizer.eos_token] if getattr(tokenizer, "eos_token", None) else []
    out += [t for t in _END_OF_TURN_TOKENS if t not in out and _token_id(tokenizer, t) is not None]
    return out


def _end_of_turn_ids(tokenizer: Any) -> set[int]:
    ids = {_token_id(tokenizer, t) for t in _end_of_turn_strings(tokenizer)}
    return {i for i in ids if i is not None}


def _trim_after_end_of_turn(tokenizer: Any, input_ids: list[int], mask: list[int]) -> None:
    """Unmask template tokens after each turn's end-of-turn token (a newline)."""
    ends = _end_of_turn_ids(tokenizer)
    in_turn_closed = False
    for t in range(len(mask)):
        if not mask[t]:
            in_turn_closed = False
            continue
        if in_turn_closed:
            mask[t] = 0
        elif input_ids[t] in ends:
            in_turn_closed = True


# --------------------------------------------------------------------------
# Dataset


def conversation_hash(messages: Sequence[dict[str, str]], seed: int) -> float:
    """A number in [0, 1) fixed by the conversation's content and the seed."""
    payload = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False, separators=(",", ":"))
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
) -> Dataset:
    """Load, split and tokenize ``source``.

    A conversation is held out when its content hash is below
    ``heldout_fraction``; training never sees a held-out conversation. Samples
    without an assistant token after truncation are dropped. ``sample_id`` is
    the index in ``train`` (resp. ``heldout``), stable for the same inputs.
    ``max_samples`` > 0 keeps only the first N training samples.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    started = time.monotonic()
    conversations = load_conversations(source, seed=seed)
    logger.info("[data] %d conversations from %s (%.1fs)", len(conversations), source, time.monotonic() - started)

    train: list[Sample] = []
    heldout: list[Sample] = []
    dropped = truncated = 0
    total = len(conversations)
    log_every = max(1, total // 10)
    started = time.monotonic()
    for n, messages in enumerate(conversations, start=1):
        if n % log_every == 0 or n == total:
            logger.info("[data] tokenizing %d/%d conversations (%.0f%%, %.1fs)", n, total, 100.0 * n / total, time.monotonic() - started)
        is_heldout = conversation_hash(messages, seed) < heldout_fraction
        if not is_heldout and max_samples and len(train) >= max_samples:
            continue
        ids, mask = tokenize_conversation(tokenizer, messages, max_seq_len + 1)
        if len(ids) > max_seq_len:
            truncated += 1
            ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        if not any(mask):
            dropped += 1
            continue
        target = heldout if is_heldout else train
        target.append(Sample(
            sample_id=len(target),
            input_ids=torch.tensor(ids, dtype=torch.int32),
            loss_mask=torch.tensor(mask, dtype=torch.uint8),
        ))
    if not train:
        raise DataError(f"data source {source!r} gave no training sample with assistant tokens "
                        f"(conversations={total}, dropped={dropped}, held out={len(heldout)})")
    lengths = [len(s) for s in train]
    stats = {
        "train_tokens": sum(lengths),
        "train_loss_tokens": int(sum(int(s.loss_mask.sum()) for s in train)),
        "mean_length": sum(lengths) / len(lengths),
        "max_length": max(lengths),
    }
    logger.info("[data] %d train / %d held-out samples, %d dropped (no assistant token), %d truncated to %d tokens; "
                "%d train tokens (%d in the loss), mean length %.1f",
                len(train), len(heldout), dropped, truncated, max_seq_len,
                stats["train_tokens"], stats["train_loss_tokens"], stats["mean_length"])
    return Dataset(train=train, heldout=heldout, source=source, num_conversations=total,
                   num_dropped=dropped, num_truncated=truncated, stats=stats)
