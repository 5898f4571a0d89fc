"""``dflash-regen --base-url``: the target's answers from an OpenAI-compatible server.

    dflash-regen --prompts prompts.jsonl --out data/regen.jsonl --base-url http://gpu-host:8000/v1
    dflash-regen --prompts prompts.jsonl --out data/regen.jsonl --base-url http://gpu-host:8000/v1 \\
        --model Qwen/Qwen3-8B --concurrency 64 --max-new-tokens 2048

Regenerating millions of answers is a serving engine's job (vLLM, SGLang,
``transformers serve``, ...): this client sends one chat-completions request
per prompt, ``--concurrency`` at a time, and lets the engine batch them.

- Same records as the in-process mode: ``{"messages": [..., {"role":
  "assistant", "content": ANSWER}], "prompt_line": N, "finish_reason": "stop" |
  "length"}``, the answer stripped of surrounding whitespace, greedy
  (``temperature`` 0) unless ``--temperature`` > 0 (then ``top_p`` 1 and a
  per-prompt ``seed``). The *server* applies the chat template: the model's own
  template unless the engine was started with another one (vLLM
  ``--chat-template``), the same template the in-process mode applies. Start
  the engine without a reasoning parser, or the thinking part of the answers is
  split off into a field this client does not read.
- Retries: a connection error, a timeout, HTTP 408, 429 and 5xx are retried
  with exponential backoff and jitter (``Retry-After`` honoured), at most
  ``--max-attempts`` tries per prompt. Another 4xx (a prompt longer than the
  context, say) skips that prompt at once. Skipped prompts are listed at the
  end and retried by the next run. When ``--concurrency`` prompts in a row have
  run out of attempts the server is taken as down and the run stops (exit 1).
- Resume: records are appended to ``--out`` one ``write`` each (``O_APPEND``,
  fsynced at least every second and at the end); a torn last line (a kill in
  mid-write) is cut on restart. Prompts are matched to records by the content
  of their messages, not by position, since answers arrive out of order: a
  rerun answers only what is missing and never writes a prompt twice (a prompt
  that occurs k times in the prompts file is answered k times). One process at
  a time may write ``--out`` (an advisory lock).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import random
import signal
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import httpx

from common.durable_io import cut_torn_tail, write_all
from common.progress import Progress
from tools.regen_prompts import Prompt, RegenError

logger = logging.getLogger("tools.regen")

_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_FSYNC_EVERY_S = 1.0


class ServerUnavailable(RegenError):
    """The server does not answer (at start, or ``concurrency`` prompts in a row ran out of tries)."""


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 6  # tries per request, the first included
    base_s: float = 1.0  # the delay before the second try is drawn from [base_s / 2, base_s]
    max_s: float = 30.0  # no single delay is longer (a server's Retry-After included)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 < self.base_s <= self.max_s:
            raise ValueError(f"need 0 < base_s <= max_s, got base_s={self.base_s} max_s={self.max_s}")

    def delay_s(self, failures: int, rng: random.Random, retry_after_s: float | None = None) -> float:
        """Wait after the ``failures``-th failed try: doubling, with "equal jitter" (half fixed, half random)."""
        if retry_after_s is not None:
            return min(self.max_s, max(0.0, retry_after_s))
        cap = min(self.max_s, self.base_s * 2.0 ** (failures - 1))
        return cap / 2 + rng.uniform(0, cap / 2)


@dataclass(frozen=True)
class ServerSettings:
    base_url: str  # OpenAI API root, e.g. http://host:8000/v1
    model: str | None = None  # the served model's name; None: the only one /models lists
    api_key: str | None = None  # sent as "Authorization: Bearer KEY"
    concurrency: int = 8  # requests in flight
    request_timeout_s: float = 600.0  # one request, the whole answer included
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")


@dataclass(frozen=True)
class Answer:
    content: str
    finish_reason: str  # "stop" or "length"
    new_tokens: int


class _Retryable(Exception):
    def __init__(self, what: str, retry_after_s: float | None = None) -> None:
        super().__init__(what)
        self.retry_after_s = retry_after_s


class _Rejected(Exception):
    """The server refused this request for good (a 4xx other than 408 and 429, or an answer without text)."""

    def __init__(self, what: str, status: int = 0) -> None:
        super().__init__(what)
        self.status = status


# ---------------------------------------------------------------------------
# Output file: content keys, resume, appends
# ---------------------------------------------------------------------------


def prompt_key(messages: Sequence[dict[str, str]]) -> bytes:
    """Content hash of a conversation (roles and contents, in order); 128 bits."""
    payload = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(payload.encode("utf-8")).digest()[:16]


def pending_prompts(out_fd: int, out: Path, prompts: Sequence[Prompt]) -> tuple[list[Prompt], int]:
    """Prompts not yet answered in the open ``out``, and how many are; cuts a torn last line first.

    A record counts for a prompt with the same messages; among equal prompts
    its ``prompt_line`` is preferred. A record that answers no prompt of the
    file (another prompts file, or a larger ``--limit``) is refused, as in the
    in-process mode.
    """
    cut = cut_torn_tail(out_fd)
    if cut:
        logger.warning("[regen] %s ended with a partial line (%d bytes, interrupted write): cut it", out, cut)
    lines_by_key: dict[bytes, list[int]] = defaultdict(list)
    for p in prompts:
        lines_by_key[prompt_key(p.messages)].append(p.line)
    answered: set[int] = set()
    with open(out, "rb") as f:  # streamed: the file can hold millions of answers
        for lineno, text in enumerate(f, start=1):
            if text.strip():
                answered.add(_answered_line(out, lineno, text, lines_by_key, answered))
    return [p for p in prompts if p.line not in answered], len(answered)


def _answered_line(out: Path, lineno: int, text: bytes, lines_by_key: dict[bytes, list[int]],
                   answered: set[int]) -> int:
    """The prompt line that record ``text`` answers."""
    try:
        record = json.loads(text)
        messages, line = record["messages"][:-1], record.get("prompt_line")
        key = prompt_key(messages)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError, IndexError):
        raise RegenError(f"{out}:{lineno} is not a dflash-regen record; pass another --out") from None
    free = [n for n in lines_by_key.get(key, ()) if n not in answered]
    if not free:
        if key in lines_by_key:
            raise RegenError(f"{out}:{lineno} answers a prompt more often than the prompts file asks it")
        raise RegenError(f"{out}:{lineno} answers a prompt that is not in the prompts file: {out} was made "
                         "from other prompts (or a larger --limit); pass another --out or delete it")
    return line if line in free else free[0]


def open_output(out: Path) -> int:
    """``out`` opened for appending (created if missing) and locked against a second writer."""
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(out, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        raise RegenError(f"cannot open {out}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RegenError(f"another process is writing {out} (it holds its lock); wait for it or pass another "
                         "--out") from None
    return fd


class _Appender:
    """One ``write`` per record on an ``O_APPEND`` fd; fsync at most every second, and at close."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._last_sync = time.monotonic()
        self._dirty = False

    def append(self, record: dict[str, Any]) -> None:
        write_all(self.fd, (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
        self._dirty = True
        if time.monotonic() - self._last_sync >= _FSYNC_EVERY_S:
            self.sync()

    def sync(self) -> None:
        if self._dirty:
            os.fsync(self.fd)
            self._dirty = False
        self._last_sync = time.monotonic()


# ---------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------


def _client(settings: ServerSettings) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    n = settings.concurrency
    return httpx.AsyncClient(
        base_url=settings.base_url.rstrip("/") + "/", headers=headers,
        timeout=httpx.Timeout(settings.request_timeout_s, connect=min(10.0, settings.request_timeout_s)),
        limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
    )


def _retry_after_s(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def _detail(response: httpx.Response, limit: int = 200) -> str:
    text = response.text.strip().replace("\n", " ")
    return f"HTTP {response.status_code}" + (f": {text[:limit]}" if text else "")


async def _send(client: httpx.AsyncClient, method: str, path: str, **kwargs: Any) -> Any:
    """One try: the decoded JSON body, or ``_Retryable`` / ``_Rejected``."""
    try:
        response = await client.request(method, path, **kwargs)
    except httpx.TransportError as exc:  # refused, reset, timed out, DNS, ...
        raise _Retryable(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__) from None
    if response.status_code in _RETRY_STATUS:
        raise _Retryable(_detail(response), _retry_after_s(response))
    if response.status_code >= 400:
        raise _Rejected(_detail(response), response.status_code)
    try:
        return response.json()
    except ValueError:
        raise _Retryable(f"HTTP {response.status_code} with a body that is not JSON") from None


async def _with_retries(what: str, policy: RetryPolicy, rng: random.Random, attempt: Any) -> Any:
    """``await attempt()`` until it succeeds, is rejected or has failed ``policy.max_attempts`` times."""
    for failures in range(1, policy.max_attempts + 1):
        try:
            return await attempt()
        except _Retryable as exc:
            if failures == policy.max_attempts:
                raise
            delay = policy.delay_s(failures, rng, exc.retry_after_s)
            logger.warning("[regen] %s: %s; retrying in %.1fs (try %d of %d)", what, exc, delay, failures + 1,
                           policy.max_attempts)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")


async def resolve_model(client: httpx.AsyncClient, settings: ServerSettings, rng: random.Random) -> str:
    """The model name to request: ``settings.model``, else the only model ``/models`` lists."""
    try:
        body = await _with_retries(f"GET {settings.base_url}/models", settings.retry, rng,
                                   lambda: _send(client, "GET", "models"))
    except _Retryable as exc:
        raise ServerUnavailable(f"no answer from {settings.base_url} ({exc}); is the server up?") from None
    except _Rejected as exc:
        if exc.status in (401, 403):
            raise RegenError(f"{settings.base_url} refused the API key ({exc}); pass --api-key "
                             "or set OPENAI_API_KEY") from None
        if settings.model:
            logger.warning("[regen] GET %s/models: %s; requesting model %r anyway", settings.base_url, exc,
                           settings.model)
            return settings.model
        raise RegenError(f"GET {settings.base_url}/models: {exc}; the base URL of an OpenAI API usually "
                         "ends in /v1 (or pass --model)") from None
    try:
        served = [str(m["id"]) for m in body["data"]]
    except (KeyError, TypeError):
        served = []
    if settings.model:
        if served and settings.model not in served:
            logger.warning("[regen] %s lists models %s, not %r; requesting it anyway", settings.base_url, served,
                           settings.model)
        return settings.model
    if len(served) != 1:
        raise RegenError(f"{settings.base_url} serves {len(served)} models ({', '.join(served) or 'none listed'}); "
                         "pass --model NAME")
    return served[0]


def _parse_completion(body: Any) -> Answer:
    try:
        choice = body["choices"][0]
        content, finish = choice["message"]["content"], choice.get("finish_reason")
    except (KeyError, IndexError, TypeError):
        raise _Retryable("a response without choices[0].message.content") from None
    if not isinstance(content, str):
        raise _Rejected(f"the answer has no text content (finish_reason {finish!r}); tool calls or a reasoning "
                        "parser on the server?")
    if finish not in ("stop", "length"):
        raise _Retryable(f"finish_reason {finish!r}")
    usage = body.get("usage") or {}
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return Answer(content.strip(), finish, int(tokens) if isinstance(tokens, int) else 0)


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


@dataclass
class _Tally:
    written: int = 0
    new_tokens: int = 0
    failed: list[tuple[int, str]] = field(default_factory=list)  # (prompt line, why), not answered this run
    in_a_row: int = 0  # prompts that ran out of tries since the last answer
    server_down: str = ""  # why the run stopped early, if it did


async def _regenerate(
    prompts: Sequence[Prompt],
    out_fd: int,
    settings: ServerSettings,
    tally: _Tally,
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
) -> None:
    rng = random.Random(seed)
    appender = _Appender(out_fd)
    async with _client(settings) as client:
        model = await resolve_model(client, settings, rng)
        logger.info("[regen] answering %d prompts with %r at %s, %d requests in flight", len(prompts), model,
                    settings.base_url, settings.concurrency)

        async def answer(p: Prompt) -> Answer:
            request: dict[str, Any] = {"model": model, "messages": p.messages, "max_tokens": max_new_tokens,
                                       "temperature": temperature, "stream": False}
            if temperature > 0:
                request.update(top_p=1.0, seed=seed + p.line)
            return _parse_completion(await _send(client, "POST", "chat/completions", json=request))

        todo = iter(prompts)  # shared by the workers: each prompt is taken once
        progress = Progress("[regen] answers", total=len(prompts), unit="prompts", every_s=10.0, logger=logger)

        async def worker() -> None:
            for p in todo:
                if tally.server_down:
                    return
                try:
                    a = await _with_retries(f"prompt line {p.line}", settings.retry, rng, lambda: answer(p))
                except _Rejected as exc:
                    logger.warning("[regen] prompt line %d skipped: the server rejected it (%s)", p.line, exc)
                    tally.failed.append((p.line, str(exc)))
                    continue
                except _Retryable as exc:
                    logger.warning("[regen] prompt line %d skipped after %d tries: %s", p.line,
                                   settings.retry.max_attempts, exc)
                    tally.failed.append((p.line, str(exc)))
                    tally.in_a_row += 1
                    if tally.in_a_row >= settings.concurrency and not tally.server_down:
                        tally.server_down = (f"{settings.base_url} stopped answering: {tally.in_a_row} prompts in "
                                             f"a row failed {settings.retry.max_attempts} tries (last: {exc})")
                    continue
                appender.append({"messages": [*p.messages, {"role": "assistant", "content": a.content}],
                                 "prompt_line": p.line, "finish_reason": a.finish_reason})
                tally.written += 1
                tally.new_tokens += a.new_tokens
                tally.in_a_row = 0
                progress.update()

        workers = [asyncio.create_task(worker()) for _ in range(min(settings.concurrency, len(prompts)))]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            appender.sync()
            progress.close()


async def _run_until_signal(coro: Any) -> Any:
    """Run ``coro``; SIGINT or SIGTERM cancels it (answers written so far stay) and raises KeyboardInterrupt."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(coro)
    stopped: list[int] = []

    def stop(signum: int) -> None:  # only flags and cancels; the task's finally blocks do the work
        stopped.append(signum)
        task.cancel()

    installed = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
            loop.add_signal_handler(signum, stop, signum)
            installed.append(signum)
    try:
        return await task
    except asyncio.CancelledError:
        if stopped:
            raise KeyboardInterrupt from None
        raise
    finally:
        for signum in installed:
            loop.remove_signal_handler(signum)


def regenerate_from_server(
    prompts: Sequence[Prompt],
    out: Path,
    settings: ServerSettings,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
) -> dict[str, Any]:
    """Answer every prompt not yet in ``out`` through the server and append the records; returns counts.

    ``failed`` lists ``(prompt line, why)`` of the prompts skipped this run
    (a rerun tries them again). Raises ``ServerUnavailable`` when the server
    does not answer at all or stops answering (what was answered is kept),
    ``RegenError`` for a foreign ``out`` or a server that refuses the run,
    ``KeyboardInterrupt`` on SIGINT or SIGTERM.
    """
    fd = open_output(out)
    tally = _Tally()
    started = time.monotonic()
    try:
        todo, done = pending_prompts(fd, out, prompts)
        if done:
            logger.info("[regen] resuming: %d of %d prompts already answered in %s", done, len(prompts), out)
        if todo:
            asyncio.run(_run_until_signal(_regenerate(todo, fd, settings, tally, max_new_tokens=max_new_tokens,
                                                      temperature=temperature, seed=seed)))
    finally:
        os.close(fd)  # also releases the lock
        elapsed = time.monotonic() - started
        if tally.written:
            logger.info("[regen] %d answers, %d new tokens in %.1fs (%.1f new tokens/s)", tally.written,
                        tally.new_tokens, elapsed, tally.new_tokens / max(elapsed, 1e-9))
    if tally.server_down:
        raise ServerUnavailable(f"{tally.server_down}; {tally.written} answers written this run, "
                                f"{done + tally.written} of {len(prompts)} in {out}")
    return {"prompts": len(prompts), "skipped": done, "written": tally.written, "new_tokens": tally.new_tokens,
            "failed": sorted(tally.failed), "elapsed_s": elapsed}
