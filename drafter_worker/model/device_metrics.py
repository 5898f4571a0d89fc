"""Device-side metric accumulators read back without ever waiting on the device.

Counters live in one flat float32 tensor on the process's device; the hot step
only adds into it (``add``/``maximum``: in-place device ops). Every
``log_every_steps`` the owner calls :meth:`snapshot`: the window is copied to a
staging tensor and zeroed on the compute stream, then copied to pinned host
memory on a side stream and an event is recorded. :meth:`poll` returns the
values once that event has completed and ``None`` before, so reading is never
a wait. On CPU the same API works with a plain copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.sync_guard import mark_host


@dataclass(frozen=True)
class _Slot:
    offset: int
    size: int
    reduce: str  # "sum" or "max"


class DeviceAccumulators:
    def __init__(self, device: torch.device | str, spec: dict[str, tuple[int, str]]):
        """``spec`` maps name -> (number of elements, "sum" | "max")."""
        self.device = torch.device(device)
        self._slots: dict[str, _Slot] = {}
        offset = 0
        for name, (size, reduce) in spec.items():
            if reduce not in ("sum", "max"):
                raise ValueError(f"metric {name}: reduce must be sum or max, got {reduce!r}")
            self._slots[name] = _Slot(offset, size, reduce)
            offset += size
        self._values = torch.zeros(offset, dtype=torch.float32, device=self.device)
        self._staging = torch.zeros_like(self._values)
        self.device = self._values.device  # with its index: a bare "cuda" is whichever GPU was current here
        cuda = self.device.type == "cuda"
        # Host memory filled by an event-tracked copy: reading it in poll() is not a device read.
        self._host = mark_host(torch.zeros(offset, dtype=torch.float32, pin_memory=cuda))
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._event: torch.cuda.Event | None = None
        self._pending = False

    def view(self, name: str) -> torch.Tensor:
        slot = self._slots[name]
        return self._values[slot.offset : slot.offset + slot.size]

    def add(self, name: str, value: torch.Tensor | float) -> None:
        self.view(name).add_(value)

    def maximum(self, name: str, value: torch.Tensor) -> None:
        view = self.view(name)
        torch.maximum(view, value.detach().to(view.dtype), out=view)

    @property
    def pending(self) -> bool:
        return self._pending

    def snapshot(self) -> bool:
        """Start reading the current window back and reset it. False if one is still in flight."""
        if self._pending:
            return False
        self._staging.copy_(self._values)
        self._values.zero_()
        if self._copy_stream is not None:
            # On this device's current stream: a bare record() would use the calling
            # thread's current device, which need not be this one.
            compute_done = torch.cuda.Event()
            compute_done.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(compute_done)
                self._host.copy_(self._staging, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(self._copy_stream)
        else:
            self._host.copy_(self._staging)
        self._pending = True
        return True

    def poll(self) -> dict[str, list[float]] | None:
        """The last snapshot's values once they are on the host; None while in flight or if none."""
        if not self._pending:
            return None
        if self._event is not None and not self._event.query():
            return None
        self._pending = False
        self._event = None
        flat = self._host.numpy()  # host memory: no device involved
        return {
            name: [float(v) for v in flat[slot.offset : slot.offset + slot.size]]
            for name, slot in self._slots.items()
        }
