"""A guard that fails when guarded code reads a device value on the host (docs/architecture.md, "The metrics path").

``with sync_guard(device) as report:`` wraps a hot step in tests, so that a
``.item()`` slipped into the step fails CI instead of stalling the device in
production. ``mode="record"`` lists the violations in the report instead of
raising at the first one.

CUDA
    The framework is the authority: ``torch.cuda.set_sync_debug_mode("error")``
    inside the guard (``"warn"`` in record mode), the previous mode restored on
    exit. A sync surfaces as :class:`HostSyncError` (chained to torch's error);
    record mode collects torch's warnings (``warnings.catch_warnings``, which is
    process-wide: record from one thread at a time).

CPU (and any other device type)
    There is no device to wait on, so the guard emulates the CUDA contract: while
    it is active, the methods that read a tensor's values on the host raise
    :class:`HostSyncError` naming the method and the call site (``file:line``):
    ``Tensor.item``, ``tolist``, ``__bool__`` (``if t:``), ``__float__``,
    ``__int__``, ``__index__``, ``cpu``, ``numpy``, ``__array__``, ``nonzero``
    and ``torch.nonzero`` (always: the output shape depends on the values; the
    sync-free form is ``torch.nonzero_static(t, size=N)``), and ``Tensor.to`` with
    a CPU target when the source is on an accelerator (with
    ``strict_cpu_copies=True`` also when the source is already on the CPU, so
    CPU-only tests catch a ``.to("cpu")`` that would be a device-to-host copy on
    an accelerator). The methods are patched on ``torch.Tensor`` (and
    ``torch.nonzero``) on entry and restored exactly on exit, also on an
    exception; they only check calls made on the thread that entered the guard.

    Not caught on CPU (the CUDA mode catches them): syncs inside C++ ops, such as
    boolean-mask indexing, ``torch.unique``, ``masked_select`` and
    ``repeat_interleave`` without ``output_size``; ``f"{t}"`` and ``repr(t)``.

The torch-internal rule
    A call whose immediate caller is in torch's own package directory is
    allowed (and counted in :attr:`SyncGuardReport.torch_internal`). Torch reads
    host values as part of ordinary ops that stay asynchronous on an
    accelerator: the non-fused AdamW reads its ``step`` counter, which lives on
    the CPU even when the parameters are on the GPU, with ``.item()``. On CUDA the
    real sync debug mode judges those calls; here only project code (and tests)
    is held to the contract.

Host buffers
    A tensor that *is* host memory, filled by an event-tracked copy (the pinned
    snapshot of :class:`drafter_worker.model.device_metrics.DeviceAccumulators`), is not a device
    read. Its owner registers it once with :func:`mark_host`; reads of it and of
    its direct views pass the guard. This ties the exemption to the buffer rather
    than to a block of code, so a device tensor read in the same place still
    fails. :func:`allow` exists for deliberate reads of anything else.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import warnings
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

__all__ = ["HostSyncError", "HostSyncViolation", "SyncGuardReport", "allow", "mark_host", "sync_guard"]


class HostSyncError(RuntimeError):
    """Guarded code read a device value on the host (a device-to-host sync on an accelerator)."""


@dataclass(frozen=True)
class HostSyncViolation:
    method: str  # e.g. "Tensor.item"; "cuda" for a sync reported by the CUDA debug mode
    site: str  # "file:line" of the call
    function: str  # name of the calling function ("" when unknown)
    message: str


@dataclass
class SyncGuardReport:
    device: torch.device
    mode: str  # "raise" or "record"
    violations: list[HostSyncViolation] = field(default_factory=list)
    # "Tensor.item at <file>:<line>" -> count: host reads made by torch itself, allowed.
    torch_internal: Counter = field(default_factory=Counter)


# ---------------------------------------------------------------------------
# Host buffers
# ---------------------------------------------------------------------------

_host_buffers: dict[int, weakref.ref] = {}


def mark_host(tensor: torch.Tensor) -> torch.Tensor:
    """Declare ``tensor`` a host buffer: reading it (or a direct view) is not a device read.

    Returns ``tensor``. Costs one dict entry, dropped when the tensor is freed.
    """
    if tensor.device.type != "cpu":
        raise ValueError(f"mark_host: only CPU tensors are host buffers, got one on {tensor.device}")
    key = id(tensor)
    _host_buffers[key] = weakref.ref(tensor, lambda _ref, key=key: _host_buffers.pop(key, None))
    return tensor


def _is_host_buffer(obj: Any) -> bool:
    if not isinstance(obj, torch.Tensor):
        return False
    for candidate in (obj, obj._base):
        if candidate is not None:
            ref = _host_buffers.get(id(candidate))
            if ref is not None and ref() is candidate:
                return True
    return False


# ---------------------------------------------------------------------------
# Call sites
# ---------------------------------------------------------------------------

_THIS_FILE = os.path.realpath(__file__)
_TORCH_DIR = os.path.realpath(os.path.dirname(torch.__file__)) + os.sep


@functools.lru_cache(maxsize=4096)
def _classify(filename: str) -> str:
    """"guard", "torch" or "other" for a code object's file name."""
    path = os.path.realpath(filename)
    if path == _THIS_FILE:
        return "guard"
    return "torch" if path.startswith(_TORCH_DIR) else "other"


def _caller(frame) -> tuple[str, str, str]:
    """(kind, "file:line", function name) of the first frame outside this module."""
    while frame is not None and _classify(frame.f_code.co_filename) == "guard":
        frame = frame.f_back
    if frame is None:
        return "other", "<unknown>", ""
    code = frame.f_code
    return _classify(code.co_filename), f"{code.co_filename}:{frame.f_lineno}", code.co_name


# ---------------------------------------------------------------------------
# Guard state
# ---------------------------------------------------------------------------

_local = threading.local()  # .guards: list[_Guard] (innermost last), .allow_depth: int
_patch_lock = threading.Lock()
_patch_depth = 0
_saved: list[tuple[Any, str, bool, Any]] = []  # (owner, name, owner had its own attribute, original)


class _Guard:
    def __init__(self, device: torch.device, mode: str, strict_cpu_copies: bool):
        self.cuda = device.type == "cuda"
        self.strict_cpu_copies = strict_cpu_copies
        self.report = SyncGuardReport(device=device, mode=mode)

    def violation(self, method: str, site: str, function: str) -> None:
        hint = (
            "use torch.nonzero_static(t, size=N) (fixed-size output) or a masked op instead"
            if method.endswith("nonzero")
            else "keep the value on the device (DeviceAccumulators) and read it after a snapshot, outside the step"
        )
        message = (
            f"{method} inside sync_guard at {site} (in {function}): it reads a tensor value on the host, "
            f"which waits for the device on an accelerator; {hint} (sync_guard.allow() for a deliberate read)"
        )
        if self.report.mode == "record":
            self.report.violations.append(HostSyncViolation(method, site, function, message))
        else:
            raise HostSyncError(message)


def _active() -> _Guard | None:
    """The innermost guard of this thread when it is an emulating one, unless inside allow()."""
    guards = getattr(_local, "guards", None)
    if not guards or getattr(_local, "allow_depth", 0) or guards[-1].cuda:
        return None  # none, deliberately allowed, or the CUDA debug mode is the authority
    return guards[-1]


def _cpu_target(args: tuple, kwargs: dict) -> bool:
    """Whether a ``Tensor.to(...)`` call names the CPU as its target device."""
    dev = kwargs.get("device", kwargs.get("other"))
    if dev is None and len(args) > 1:
        dev = args[1]
    if isinstance(dev, torch.Tensor):
        dev = dev.device
    if isinstance(dev, str):
        dev = torch.device(dev)
    return isinstance(dev, torch.device) and dev.type == "cpu"


def _to_reads_host(guard: _Guard, args: tuple, kwargs: dict) -> bool:
    if not _cpu_target(args, kwargs):
        return False
    source = args[0].device.type
    return source not in ("cpu", "meta") or guard.strict_cpu_copies


def _always(_guard: _Guard, _args: tuple, _kwargs: dict) -> bool:
    return True


def _wrap(method: str, original: Callable, applies: Callable[[_Guard, tuple, dict], bool]) -> Callable:
    def guarded(*args, **kwargs):
        guard = _active()
        if (
            guard is not None
            and applies(guard, args, kwargs)
            and not _is_host_buffer(args[0] if args else kwargs.get("input"))
        ):
            kind, site, function = _caller(sys._getframe(1))
            if kind == "torch":
                guard.report.torch_internal[f"{method} at {site}"] += 1
            else:
                guard.violation(method, site, function)
        return original(*args, **kwargs)

    functools.update_wrapper(guarded, original)
    return guarded


_TENSOR_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy", "__array__", "nonzero")


def _patch() -> None:
    targets: list[tuple[Any, str, str, Callable]] = [
        (torch.Tensor, name, f"Tensor.{name}", _always) for name in _TENSOR_METHODS
    ]
    targets.append((torch.Tensor, "to", "Tensor.to(cpu)", _to_reads_host))
    targets.append((torch, "nonzero", "torch.nonzero", _always))
    for owner, name, method, applies in targets:
        had_own = name in vars(owner)
        original = vars(owner)[name] if had_own else getattr(owner, name)
        _saved.append((owner, name, had_own, original))
        setattr(owner, name, _wrap(method, original, applies))


def _unpatch() -> None:
    while _saved:
        owner, name, had_own, original = _saved.pop()
        if had_own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------

_CUDA_SYNC_TEXT = "called a synchronizing CUDA operation"


@contextlib.contextmanager
def sync_guard(
    device: torch.device | str,
    *,
    mode: str = "raise",
    strict_cpu_copies: bool = False,
) -> Iterator[SyncGuardReport]:
    """Fail (``mode="raise"``) or record (``mode="record"``) every host read of device values inside.

    Yields a :class:`SyncGuardReport` whose ``violations`` list fills in record mode.
    """
    global _patch_depth
    if mode not in ("raise", "record"):
        raise ValueError(f"sync_guard mode must be 'raise' or 'record', got {mode!r}")
    device = torch.device(device)
    guard = _Guard(device, mode, strict_cpu_copies)
    if not hasattr(_local, "guards"):
        _local.guards = []
        _local.allow_depth = 0

    if guard.cuda:
        previous = torch.cuda.get_sync_debug_mode()
        _local.guards.append(guard)
        caught: list[warnings.WarningMessage] = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("error" if mode == "raise" else "warn")
                try:
                    yield guard.report
                except RuntimeError as exc:
                    if _CUDA_SYNC_TEXT in str(exc) and not isinstance(exc, HostSyncError):
                        raise HostSyncError(f"a synchronizing CUDA operation inside sync_guard: {exc}") from exc
                    raise
                finally:
                    torch.cuda.set_sync_debug_mode(previous)
        finally:
            _local.guards.remove(guard)
            for w in caught:
                if _CUDA_SYNC_TEXT in str(w.message):
                    site = f"{w.filename}:{w.lineno}"
                    guard.report.violations.append(HostSyncViolation("cuda", site, "", f"{w.message} at {site}"))
                else:  # not ours: hand it back to the caller's warning filters
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
        return

    with _patch_lock:
        if _patch_depth == 0:
            try:
                _patch()
            except BaseException:
                _unpatch()
                raise
        _patch_depth += 1
    _local.guards.append(guard)
    try:
        yield guard.report
    finally:
        _local.guards.remove(guard)
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                _unpatch()


@contextlib.contextmanager
def allow() -> Iterator[None]:
    """Permit host reads inside an active guard for this block (this thread); a no-op outside one."""
    guards = getattr(_local, "guards", None) or []
    cuda = any(g.cuda for g in guards)
    previous = torch.cuda.get_sync_debug_mode() if cuda else None
    _local.allow_depth = getattr(_local, "allow_depth", 0) + 1
    if cuda:
        torch.cuda.set_sync_debug_mode("default")
    try:
        yield
    finally:
        _local.allow_depth -= 1
        if cuda:
            torch.cuda.set_sync_debug_mode(previous)
