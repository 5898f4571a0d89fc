"""Conversations -> token ids and loss masks, with the tokenizer's chat template, in parallel.

A conversation is rendered with the tokenizer's own chat template (with
``chat_template_kwargs``, e.g. ``enable_thinking``) and tokenized once; the
loss mask marks the tokens the assistant produced (its reasoning, tool calls,
content and the end-of-turn token that closes it), never the system, user or
tool text or the template's headers.

The mask is computed from character spans: for each assistant message the
template is rendered on ``messages[:i]`` with the generation prompt (where the
assistant text starts) and on ``messages[:i + 1]`` (where it ends); tokens of the
full rendering whose offsets start inside that span are assistant tokens. This
works for templates without ``{% generation %}`` markers (SmolLM2, Qwen3,
Llama 3), and does not depend on the prefix tokenizing like the full text.

:class:`TokenizerPool` runs :func:`tokenize_conversation` over many
conversations in worker processes (or in this one), results in input order.
Nothing here imports torch.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Sequence

import numpy as np

from target_server.data_formats import DataError

logger = logging.getLogger(__name__)

# End-of-turn markers of common chat templates; the tokenizer's eos token is
# always one too. Used to stop the assistant mask before the template's
# trailing newline.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")

# A worker process pays off only for this many conversations or more.
MIN_CONVERSATIONS_PER_PROCESS = 256
# Conversations per task sent to a worker.
CHUNK_CONVERSATIONS = 64
# Bound on the wait for one chunk (a few hundred conversations take seconds).
CHUNK_TIMEOUT_S = 600.0


# --------------------------------------------------------------------------
# One conversation


def tokenize_conversation(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    max_seq_len: int,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], list[int]]:
    """Render ``messages`` with the chat template and tokenize them.

    Returns ``(input_ids, loss_mask)`` truncated to ``max_seq_len``; the mask is
    1 on the tokens of each assistant message (what the template renders of
    it) and on the end-of-turn token closing it, 0 elsewhere. The mask may be
    all zero (no assistant message, or all of it truncated away): callers drop
    such samples. ``chat_template_kwargs`` reach every template rendering.
    """
    kwargs = dict(chat_template_kwargs or {})
    messages = [dict(m) for m in messages]
    full = _render(tokenizer, messages, False, kwargs)
    spans = _assistant_spans(tokenizer, messages, full, kwargs)
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


def _render(tokenizer: Any, messages: Sequence[dict[str, Any]], add_generation_prompt: bool,
            kwargs: dict[str, Any]) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kwargs)


def _assistant_spans(tokenizer: Any, messages: list[dict[str, Any]], full: str,
                     kwargs: dict[str, Any]) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the assistant turns in ``full``."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        head = _render(tokenizer, messages[:i], True, kwargs) if i else ""
        upto = _render(tokenizer, messages[: i + 1], False, kwargs)
        if i and upto.startswith(head) and full.startswith(upto) and len(head) >= cursor:
            start, end = len(head), len(upto)
        else:
            # The template renders earlier turns differently once later turns
            # exist (e.g. it strips reasoning from past assistant turns): find
            # the content itself and the end-of-turn marker right after it.
            content = message.get("content") or ""
            found = full.find(content, cursor) if content else -1
            if found < 0:
                logger.debug("assistant message %d not found in the rendered conversation; left unmasked", i)
                continue
            start, end = found, found + len(content)
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
# Many conversations

# One tokenized conversation: (ids int32, mask uint8), or the reason it could not be rendered.
Tokenized = tuple[np.ndarray, np.ndarray] | str

# What a template may raise on a conversation it cannot render (jinja's
# TemplateError, also what templates' raise_exception raises, derives from
# Exception; the others come from the template's own expressions).
try:
    from jinja2 import TemplateError as _TemplateError
except ImportError:  # transformers requires jinja2 for chat templates; keep this importable without it
    _TemplateError = RuntimeError  # type: ignore[misc,assignment]
_RENDER_ERRORS = (_TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


def tokenize_many(tokenizer: Any, conversations: Sequence[Sequence[dict[str, Any]]], max_seq_len: int,
                  chat_template_kwargs: dict[str, Any] | None) -> list[Tokenized]:
    """:func:`tokenize_conversation` on each; a conversation the template refuses gives its reason instead."""
    out: list[Tokenized] = []
    for messages in conversations:
        try:
            ids, mask = tokenize_conversation(tokenizer, messages, max_seq_len, chat_template_kwargs)
        except _RENDER_ERRORS as exc:
            out.append(f"the chat template cannot render it ({type(exc).__name__}: {str(exc)[:200]})")
            continue
        out.append((np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8)))
    return out


_worker_state: dict[str, Any] = {}


def _init_worker(tokenizer: Any, max_seq_len: int, chat_template_kwargs: dict[str, Any] | None) -> None:
    # The parent decides what Ctrl-C means (it shuts the pool down).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_state.update(tokenizer=tokenizer, max_seq_len=max_seq_len, kwargs=chat_template_kwargs)


def _worker_chunk(conversations: list[list[dict[str, Any]]]) -> list[Tokenized]:
    state = _worker_state
    return tokenize_many(state["tokenizer"], conversations, state["max_seq_len"], state["kwargs"])


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def resolve_num_proc(num_proc: int) -> int:
    """``data.num_proc``: 0 means min(available cores, 8)."""
    return num_proc if num_proc > 0 else max(1, min(available_cores(), 8))


class TokenizerPool:
    """Tokenizes lists of conversations, in worker processes when there are enough of them.

    Results come back in input order and do not depend on the number of
    processes: each conversation is tokenized on its own, by the same function.
    Use as a context manager; the workers start on the first large enough call.

    Workers are forked on Linux: they inherit the tokenizer without pickling
    and start in milliseconds (spawning one costs seconds of imports). They run
    only the tokenizer and the template: no socket, thread, CUDA or torch
    state of this process is touched, and they leave without running its exit
    handlers. Elsewhere they are spawned.
    """

    def __init__(self, tokenizer: Any, max_seq_len: int, chat_template_kwargs: dict[str, Any] | None,
                 num_proc: int) -> None:
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.kwargs = dict(chat_template_kwargs or {})
        self.num_proc = max(1, num_proc)
        self.processes_used = 1
        self._executor: ProcessPoolExecutor | None = None

    def run(self, conversations: Sequence[Sequence[dict[str, Any]]],
            progress: Callable[[int], None] | None = None) -> list[Tokenized]:
        chunks = [list(conversations[i:i + CHUNK_CONVERSATIONS])
                  for i in range(0, len(conversations), CHUNK_CONVERSATIONS)]
        processes = min(self.num_proc, len(conversations) // MIN_CONVERSATIONS_PER_PROCESS)
        if processes < 2 and self._executor is None:
            out: list[Tokenized] = []
            for chunk in chunks:
                out += tokenize_many(self.tokenizer, chunk, self.max_seq_len, self.kwargs)
                if progress is not None:
                    progress(len(chunk))
            return out
        executor = self._start(processes)
        futures: list[Future] = [executor.submit(_worker_chunk, chunk) for chunk in chunks]
        out = []
        try:
            for chunk, future in zip(chunks, futures):
                out += future.result(timeout=CHUNK_TIMEOUT_S)
                if progress is not None:
                    progress(len(chunk))
        except BrokenProcessPool as exc:
            raise DataError(f"a tokenizing process died ({exc}); set data.num_proc = 1 to tokenize in this "
                            "process, or give the machine more memory") from None
        except TimeoutError:
            raise DataError(f"tokenizing {CHUNK_CONVERSATIONS} conversations took over {CHUNK_TIMEOUT_S:.0f}s; "
                            "set data.num_proc = 1 to tokenize in this process") from None
        finally:
            for future in futures:
                future.cancel()
        return out

    def _start(self, processes: int) -> ProcessPoolExecutor:
        if self._executor is None:
            method = "fork" if sys.platform.startswith("linux") else "spawn"
            self._executor = ProcessPoolExecutor(
                max_workers=processes, mp_context=multiprocessing.get_context(method),
                initializer=_init_worker, initargs=(self.tokenizer, self.max_seq_len, self.kwargs),
            )
            self.processes_used = processes
            logger.info("[data] tokenizing in %d processes (data.num_proc=%d)", processes, self.num_proc)
        return self._executor

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def __enter__(self) -> "TokenizerPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
