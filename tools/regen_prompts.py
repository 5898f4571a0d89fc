"""The prompts file both regeneration modes read (in-process and from a serving engine)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

Messages = list[dict[str, str]]


class RegenError(RuntimeError):
    """A prompts or output file cannot be used; the message says why."""


@dataclass
class Prompt:
    line: int  # 1-based line number in the prompts file
    messages: Messages


# ---------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------


def read_prompts(path: Path) -> list[Prompt]:
    """Prompts of ``path`` (``{"messages": [...]}`` or ``{"prompt": "..."}`` per line)."""
    from target_server.data import ROLES

    try:
        handle = open(path, encoding="utf-8")
    except OSError as exc:
        raise RegenError(f"cannot read prompts file {path}: {exc.strerror}") from None
    prompts: list[Prompt] = []
    with handle:
        for lineno, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise RegenError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            if isinstance(record, dict) and isinstance(record.get("prompt"), str):
                messages = [{"role": "user", "content": record["prompt"]}]
            elif isinstance(record, dict) and isinstance(record.get("messages"), list):
                messages = record["messages"]
                for j, m in enumerate(messages):
                    if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
                        raise RegenError(f"{where}: messages[{j}] must be {{\"role\": one of {', '.join(ROLES)}, "
                                         f"\"content\": string}}")
                messages = [{"role": m["role"], "content": m["content"]} for m in messages]
                users = [j for j, m in enumerate(messages) if m["role"] == "user"]
                if not users:
                    raise RegenError(f"{where}: the conversation has no user turn to answer")
                messages = messages[: users[-1] + 1]
            else:
                raise RegenError(f"{where}: expected {{\"messages\": [...]}} or {{\"prompt\": \"...\"}}")
            prompts.append(Prompt(line=lineno, messages=messages))
    if not prompts:
        raise RegenError(f"{path}: no prompts (the file is empty)")
    return prompts
