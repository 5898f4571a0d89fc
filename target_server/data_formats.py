"""Data sources and record formats: what users already have -> chat conversations.

A *source* is ``"pydoc"`` (Python's reference text as chats), a JSONL/JSON,
parquet or arrow file, a directory (saved with ``datasets``' ``save_to_disk``,
or holding data files), or the name of a Hugging Face dataset already in the
local cache (never downloaded). A *record* is one row of it; its *format* says
where the turns are:

- ``messages``: ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI);
- ``conversations``: the same turns under ``"conversations"``;
- ``sharegpt``: ``{"conversations": [{"from": "human", "value": ...}, ...]}``.

``auto`` tells them apart from the first records that look like one of them.
Every record becomes a list of messages with a standard role (system, user,
assistant, tool), a string ``content`` (``""`` where the data had none), and
for assistant turns the ``reasoning_content`` and ``tool_calls`` the chat
template reads. A record that cannot be used is reported with its file and
line (or row) and skipped; only when every record fails does loading stop.

Nothing here imports torch: the tokenizing processes import this module.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

logger = logging.getLogger(__name__)

Messages = list[dict[str, Any]]

FORMATS = ("auto", "messages", "conversations", "sharegpt")
ROLES = ("system", "user", "assistant", "tool")

# ShareGPT speakers -> standard roles ("function_call" is the assistant calling a tool).
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "tool": "tool", "function": "tool", "observation": "tool", "function_response": "tool", "ipython": "tool",
    "function_call": "assistant",
}

# Suffixes of the data files a directory source reads.
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
# A directory whose data files are named after splits is read through its train files only.
_SPLIT_NAME = re.compile(r"(?:^|[-_./])(train|training|test|testing|eval|evaluation|valid|validation|val|dev)(?:$|[-_./\d])")
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")

# Records looked at by format auto-detection.
DETECT_RECORDS = 16
# Skipped records logged one line each; the rest only count in the summary.
BAD_RECORDS_LOGGED = 20


class DataError(ValueError):
    """A data source the user pointed at cannot be used (missing, malformed)."""


class BadRecord(ValueError):
    """One record cannot be used; ``kind`` groups it in the summary."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


# --------------------------------------------------------------------------
# Reporting


@dataclass
class RecordReport:
    """Counts the records of a source and the ones skipped, with where and why.

    ``strict`` turns the first skipped record into a :class:`DataError`
    (readers of small hand-written files, such as prompt lists, want that).
    """

    strict: bool = False
    total: int = 0
    skipped: list[tuple[str, str, str]] = field(default_factory=list)  # (where, kind, reason)

    def skip(self, where: str, kind: str, reason: str) -> None:
        if self.strict:
            raise DataError(f"{where}: {reason}")
        self.skipped.append((where, kind, reason))
        if len(self.skipped) <= BAD_RECORDS_LOGGED:
            logger.warning("[data] skipped %s: %s", where, reason)
        elif len(self.skipped) == BAD_RECORDS_LOGGED + 1:
            logger.warning("[data] more records skipped; only the summary counts them")

    def summary(self) -> str:
        """``"N of M records skipped: 2 invalid JSON, 1 bad message"`` (empty when none was)."""
        if not self.skipped:
            return ""
        kinds: dict[str, int] = {}
        for _where, kind, _reason in self.skipped:
            kinds[kind] = kinds.get(kind, 0) + 1
        parts = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items(), key=lambda kv: (-kv[1], kv[0])))
        return f"{len(self.skipped)} of {self.total} records skipped: {parts}"

    def first_reasons(self, limit: int = 3) -> str:
        return "; ".join(f"{where}: {reason}" for where, _kind, reason in self.skipped[:limit])

    def raise_if_all_bad(self, source: str) -> None:
        if self.total and len(self.skipped) >= self.total:
            raise DataError(f"data source {source!r}: every one of its {self.total} records was skipped; "
                            f"the first: {self.first_reasons()}")


# --------------------------------------------------------------------------
# Sources


@dataclass
class Source:
    """An opened data source: what it is and a fingerprint of its content.

    ``kind`` is ``pydoc``, ``files`` (read here, record by record) or
    ``datasets`` (a ``datasets.Dataset`` in ``dataset``). ``fingerprint``
    changes whenever the content does (file bytes, or the datasets fingerprint).
    """

    name: str
    kind: str
    fingerprint: str
    files: list[Path] = field(default_factory=list)
    dataset: Any = None
    label: str = ""

    def describe(self) -> str:
        if self.kind == "files" and len(self.files) > 1:
            return f"{self.name} ({len(self.files)} files)"
        return self.name


def open_source(source: str) -> Source:
    """Resolve ``source`` (see the module doc); raises :class:`DataError` naming what to set."""
    if source == "pydoc":
        import pydoc_data.topics

        return Source(source, "pydoc", "pydoc:" + _hash_files([Path(pydoc_data.topics.__file__)]))
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix.lower() not in DATA_SUFFIXES:
            logger.info("[data] %s: unknown suffix %r; reading it as JSON lines", path, path.suffix)
        return Source(source, "files", _hash_files([path]), files=[path])
    if path.is_dir():
        return _open_directory(source, path)
    if _HUB_NAME.fullmatch(source) and not source.lower().endswith(DATA_SUFFIXES):
        return _open_hub(source)
    raise DataError(f"data source {source!r} is not 'pydoc' and no such file exists; set data.source to 'pydoc', "
                    "a JSONL/JSON/parquet/arrow file, a directory of them (or one saved by datasets' save_to_disk), "
                    "or the name of a dataset in the local Hugging Face cache")


def _open_directory(source: str, path: Path) -> Source:
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        datasets = _import_datasets(source)
        try:
            loaded = datasets.load_from_disk(str(path))
        except (OSError, ValueError) as exc:
            raise DataError(f"cannot load the datasets directory {source!r}: {exc}") from exc
        dataset = _pick_split(loaded, source)
        return Source(source, "datasets", _dataset_fingerprint(dataset), dataset=dataset, label=str(path))
    files = data_files_in(path)
    if not files:
        raise DataError(f"data source {source!r} is a directory without data files "
                        f"({', '.join(DATA_SUFFIXES)}) and was not saved by datasets' save_to_disk")
    return Source(source, "files", _hash_files(files, root=path), files=files)


def data_files_in(directory: Path) -> list[Path]:
    """The data files under ``directory`` in name order; only the train ones when files are named after splits."""
    files = sorted(p for p in directory.rglob("*")
                   if p.is_file() and p.suffix.lower() in DATA_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(directory).parts))
    named = {p: _SPLIT_NAME.search(str(p.relative_to(directory)).lower()) for p in files}
    if any(named.values()):
        train = [p for p, m in named.items() if m and m.group(1) in ("train", "training")]
        if not train:
            raise DataError(f"data source {str(directory)!r}: its data files are named after splits but none "
                            "after the train split; point data.source to the file to train on")
        return train
    return files


def _open_hub(name: str) -> Source:
    """A hub dataset already on this machine: prepared by ``datasets``, or its files in the hub cache."""
    datasets = _import_datasets(name)
    with _offline():
        try:
            loaded = datasets.load_dataset(name)
        except Exception as exc:  # noqa: BLE001  datasets raises many kinds (ConnectionError, FileNotFoundError, ...)
            reason = f"{type(exc).__name__}: {exc}"
        else:
            dataset = _pick_split(loaded, name)
            return Source(name, "datasets", _dataset_fingerprint(dataset), dataset=dataset, label=name)
        snapshot = _hub_snapshot(name)
    if snapshot is not None:
        files = data_files_in(snapshot)
        if files:
            return Source(name, "files", _hash_files(files, root=snapshot), files=files)
    cache = datasets.config.HF_DATASETS_CACHE
    raise DataError(f"data source {name!r} is neither a file nor a dataset in the local Hugging Face cache ({cache}); "
                    "nothing is downloaded: fetch it first where there is network "
                    f"(python -c \"import datasets; datasets.load_dataset('{name}')\"), or point data.source to "
                    f"a file. ({reason[:300]})")


def _hub_snapshot(name: str) -> Path | None:
    if "/" not in name:
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name, repo_type="dataset", local_files_only=True))
    except Exception:  # noqa: BLE001  not cached (LocalEntryNotFoundError) or not a valid repo id
        return None


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Offline mode for one ``datasets`` call: read the local cache, never the network."""
    import datasets.config
    import huggingface_hub.constants as hub_constants

    saved = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE"))
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved[0], saved[1]
        if saved[2] is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved[2]


def _import_datasets(source: str) -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise DataError(f"data source {source!r} needs the 'datasets' package (pip install datasets)") from exc
    return datasets


def _pick_split(loaded: Any, source: str) -> Any:
    """The ``train`` split of a DatasetDict (or its only split); a Dataset as it is."""
    if not hasattr(loaded, "keys"):
        return loaded
    splits = list(loaded.keys())
    if "train" in splits:
        return loaded["train"]
    if len(splits) == 1:
        return loaded[splits[0]]
    raise DataError(f"data source {source!r} has splits {splits} and none is called 'train'; "
                    "save the split to train on by itself and point data.source to it")


def _dataset_fingerprint(dataset: Any) -> str:
    """The ``datasets`` fingerprint (it changes with the content), else a hash of its arrow files."""
    fingerprint = getattr(dataset, "_fingerprint", None)
    if isinstance(fingerprint, str) and fingerprint:
        return "datasets:" + fingerprint
    files = [Path(f["filename"]) for f in getattr(dataset, "cache_files", [])]
    if not files:
        raise DataError("a datasets source without a fingerprint or cache files cannot be cached; "
                        "save it with save_to_disk and point data.source to that directory")
    return "datasets-files:" + _hash_files(files)


def _hash_files(files: list[Path], root: Path | None = None) -> str:
    """Content hash of ``files`` (with their names under ``root``; a lone file's name does not count)."""
    digest = hashlib.sha256()
    for path in files:
        name = str(path.relative_to(root)) if root is not None else ""
        digest.update(f"{name}\0{path.stat().st_size}\0".encode())
        try:
            with path.open("rb") as handle:
                for block in iter(lambda: handle.read(1 << 20), b""):
                    digest.update(block)
        except OSError as exc:
            raise DataError(f"cannot read data file {str(path)!r}: {exc}") from exc
    return digest.hexdigest()


# --------------------------------------------------------------------------
# Records


def iter_records(source: Source, report: RecordReport) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` for every record; unreadable ones are reported and left out.

    ``where`` is ``file:line`` for JSON lines (1-based), ``file:record N`` for a
    JSON array and ``file:row N`` (0-based, as in ``dataset[N]``) for tables.
    """
    if source.kind == "datasets":
        yield from _iter_table_rows(source.label, _dataset_batches(source.dataset), report)
        return
    for path in source.files:
        suffix = path.suffix.lower()
        if suffix == ".parquet":
            yield from _iter_table_rows(str(path), _parquet_batches(path), report)
        elif suffix == ".arrow":
            yield from _iter_table_rows(str(path), _arrow_batches(path), report)
        elif suffix == ".json" and _starts_with(path, b"["):
            yield from _iter_json_array(path, report)
        else:
            yield from _iter_json_lines(path, report)


def _starts_with(path: Path, prefix: bytes) -> bool:
    with path.open("rb") as handle:
        head = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(prefix)


def _iter_json_lines(path: Path, report: RecordReport) -> Iterator[tuple[str, Any]]:
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise DataError(f"cannot read data file {str(path)!r}: {exc}") from exc
    with handle:
        for lineno, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            report.total += 1
            where = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                report.skip(where, "not UTF-8", f"not UTF-8 text ({exc.reason} at byte {exc.start})")
                continue
            try:
                yield where, json.loads(text)
            except json.JSONDecodeError as exc:
                report.skip(where, "invalid JSON", f"invalid JSON ({exc.msg} at column {exc.colno})")


def _iter_json_array(path: Path, report: RecordReport) -> Iterator[tuple[str, Any]]:
    try:
        records = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise DataError(f"cannot read data file {str(path)!r}: {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        report.total += 1
        report.skip(str(path), "invalid JSON", f"not a JSON array of records ({exc})")
        return
    for i, record in enumerate(records):
        report.total += 1
        yield f"{path}:record {i}", record


def _iter_table_rows(label: str, batches: Iterator[list[dict]], report: RecordReport) -> Iterator[tuple[str, Any]]:
    row = 0
    for batch in batches:
        for record in batch:
            report.total += 1
            yield f"{label}:row {row}", record
            row += 1


def _parquet_batches(path: Path) -> Iterator[list[dict]]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(str(path))
    except (OSError, pyarrow.ArrowException) as exc:
        raise DataError(f"cannot read parquet file {str(path)!r}: {exc}") from exc
    for batch in handle.iter_batches(batch_size=1024):
        yield batch.to_pylist()


def _arrow_batches(path: Path) -> Iterator[list[dict]]:
    """Arrow IPC, file or stream format (``datasets`` caches use the stream format)."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path), "r") as source:
            reader = pa.ipc.open_file(source) if _starts_with(path, b"ARROW1") else pa.ipc.open_stream(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches)) if isinstance(
                reader, pa.ipc.RecordBatchFileReader) else iter(reader)
            for batch in batches:
                yield batch.to_pylist()
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"cannot read arrow file {str(path)!r}: {exc}") from exc


def _dataset_batches(dataset: Any) -> Iterator[list[dict]]:
    for columns in dataset.iter(batch_size=1024):
        names = list(columns)
        yield [dict(zip(names, values)) for values in zip(*(columns[n] for n in names))]


# --------------------------------------------------------------------------
# Formats


def detect_format(record: Any) -> str | None:
    """The one format ``record`` has the shape of, or None (unknown, or more than one)."""
    if not isinstance(record, dict):
        return None
    found = []
    if isinstance(record.get("messages"), list):
        found.append("messages")
    turns = record.get("conversations")
    if isinstance(turns, list) and turns and isinstance(turns[0], dict):
        if "from" in turns[0] or "value" in turns[0]:
            found.append("sharegpt")
        elif "role" in turns[0] or "content" in turns[0]:
            found.append("conversations")
    return found[0] if len(found) == 1 else None


def resolve_format(records: list[tuple[str, Any]], data_format: str, source: str) -> str:
    """``data_format``, or for ``auto`` the format the first recognisable records agree on."""
    if data_format != "auto":
        return data_format
    seen: dict[str, str] = {}  # format -> where it was first seen
    recognised = 0
    for where, record in records:
        found = detect_format(record)
        if found is None:
            continue
        seen.setdefault(found, where)
        recognised += 1
        if recognised >= DETECT_RECORDS:
            break
    if len(seen) > 1:
        first = ", ".join(f"{fmt} at {where}" for fmt, where in seen.items())
        raise DataError(f"cannot tell the format of {source}: its records look like {first}; "
                        f"set data.format to one of {', '.join(FORMATS[1:])}")
    if not seen:
        keys = next((sorted(map(str, r))[:8] for _w, r in records if isinstance(r, dict)), None)
        raise DataError(f"cannot tell the format of {source}: no record has a \"messages\" list or a "
                        f"\"conversations\" list of turns (first record's keys: {keys}); "
                        f"set data.format to one of {', '.join(FORMATS[1:])}")
    return next(iter(seen))


def to_messages(record: Any, data_format: str) -> Messages:
    """Normalise one record of ``data_format`` into standard messages; raises :class:`BadRecord`."""
    key = "messages" if data_format == "messages" else "conversations"
    if not isinstance(record, dict) or key not in record:
        raise BadRecord("not a conversation", f"expected an object with a \"{key}\" list, got {_short(record)}")
    turns = record[key]
    if not isinstance(turns, list) or not turns:
        raise BadRecord("not a conversation", f"\"{key}\" must be a non-empty list, got {_short(turns)}")
    if data_format == "sharegpt":
        messages = [_sharegpt_turn(turn, j) for j, turn in enumerate(turns)]
        system = record.get("system")
        if isinstance(system, str) and system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": system})
        return messages
    return [_chat_turn(turn, f"{key}[{j}]") for j, turn in enumerate(turns)]


def _chat_turn(turn: Any, at: str) -> dict[str, Any]:
    if not isinstance(turn, dict):
        raise BadRecord("bad message", f"{at} must be an object, got {_short(turn)}")
    role = turn.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise BadRecord("bad message", f"{at}.role must be one of {', '.join(ROLES)}, got {_short(role)}")
    message: dict[str, Any] = {"role": role}
    if role == "assistant":
        reasoning = turn.get("reasoning_content", turn.get("reasoning"))
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise BadRecord("bad message", f"{at}.reasoning_content must be a string, got {_short(reasoning)}")
            message["reasoning_content"] = reasoning
        if turn.get("tool_calls") is not None:
            message["tool_calls"] = _tool_calls(turn["tool_calls"], f"{at}.tool_calls")
    for extra in ("name", "tool_call_id"):
        if isinstance(turn.get(extra), str):
            message[extra] = turn[extra]
    # A tool result, or an assistant turn that only calls tools or only reasons, may have no content.
    may_be_empty = role == "tool" or "tool_calls" in message or "reasoning_content" in message
    message["content"] = _content(turn.get("content"), f"{at}.content", may_be_empty)
    return _ordered(message)


def _sharegpt_turn(turn: Any, j: int) -> dict[str, Any]:
    at = f"conversations[{j}]"
    if not isinstance(turn, dict):
        raise BadRecord("bad message", f"{at} must be an object, got {_short(turn)}")
    speaker = turn.get("from")
    role = SHAREGPT_ROLES.get(speaker.lower()) if isinstance(speaker, str) else None
    if role is None:
        raise BadRecord("bad message", f"{at}.from must be one of {', '.join(SHAREGPT_ROLES)}, got {_short(speaker)}")
    value = turn.get("value")
    if speaker.lower() == "function_call":
        calls = _parse_json_value(value, f"{at}.value")
        return {"role": "assistant", "content": "",
                "tool_calls": _tool_calls(calls if isinstance(calls, list) else [calls], f"{at}.value")}
    message = {"role": role, "content": _content(value, f"{at}.value", role == "tool")}
    if role == "tool" and isinstance(turn.get("name"), str):
        message["name"] = turn["name"]
    return _ordered(message)


def _content(content: Any, at: str, may_be_empty: bool) -> str:
    if isinstance(content, str):
        return content
    if content is None and may_be_empty:
        return ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        # OpenAI content parts: only text parts can be trained on.
        if all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
        kinds = sorted({str(p.get("type")) for p in content} - {"text"})
        raise BadRecord("non-text content", f"{at} has non-text parts ({', '.join(kinds)})")
    raise BadRecord("bad message", f"{at} must be a string, got {_short(content)}")


def _tool_calls(calls: Any, at: str) -> list[dict[str, Any]]:
    """Tool calls in the shape chat templates read: ``{"type": "function", "function": {"name", "arguments"}}``.

    String arguments holding a JSON object become that object (templates
    render ``arguments | tojson``); other strings are kept as they are.
    """
    if not isinstance(calls, list):
        raise BadRecord("bad tool call", f"{at} must be a list, got {_short(calls)}")
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        function = function if isinstance(function, dict) else call
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise BadRecord("bad tool call", f"{at}[{k}] must name a function, got {_short(call)}")
        arguments = function.get("arguments", function.get("parameters"))
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):
                parsed = json.loads(arguments)
                if isinstance(parsed, dict):
                    arguments = parsed
        arguments = {} if arguments is None else arguments
        entry: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if isinstance(call, dict) and isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


def _parse_json_value(value: Any, at: str) -> Any:
    if isinstance(value, (dict, list)):
        return value
    try:
        return json.loads(value)
    except (TypeError, json.JSONDecodeError):
        raise BadRecord("bad tool call", f"{at} of a function_call turn must be JSON, got {_short(value)}") from None


_KEY_ORDER = ("role", "content", "reasoning_content", "tool_calls", "name", "tool_call_id")


def _ordered(message: dict[str, Any]) -> dict[str, Any]:
    """Keys in one order, so equal messages from any format serialise (and hash) alike."""
    return {k: message[k] for k in _KEY_ORDER if k in message}


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------
# Conversations


@dataclass
class Conversations:
    """The usable conversations of a source, where each came from, and the report."""

    conversations: list[Messages]
    where: list[str]
    report: RecordReport
    data_format: str


def read_conversations(source: Source, *, data_format: str, report: RecordReport) -> Conversations:
    """Every usable record of ``source`` as messages (pydoc excluded: see ``data.load_conversations``)."""
    if data_format not in FORMATS:
        raise DataError(f"data.format must be one of {', '.join(FORMATS)}, got {data_format!r}")
    records = list(iter_records(source, report))
    if not report.total:
        raise DataError(f"{source.describe()}: no conversations (the source is empty)")
    report.raise_if_all_bad(source.name)
    resolved = resolve_format(records, data_format, source.describe())
    conversations: list[Messages] = []
    where: list[str] = []
    for at, record in records:
        try:
            conversations.append(to_messages(record, resolved))
        except BadRecord as bad:
            report.skip(at, bad.kind, bad.reason)
            continue
        where.append(at)
    report.raise_if_all_bad(source.name)
    return Conversations(conversations, where, report, resolved)
