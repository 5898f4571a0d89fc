"""A CUDA stream of one thread's own, ordered against the others by events only.

The pipeline's stages run on different threads: the target's capture and its
per-registration sends, the drafter's receive and its training step. On a GPU
each of those threads issues its work on a :class:`SideStream` of its own, so
a send or a receive never queues behind unrelated compute on the default
stream (NCCL orders its own stream after the *current* stream at the time of
the call). Cross-stage order is expressed with events: the producer records
one after the work that fills a buffer, the consumer's stream waits on it.
Nothing here blocks the host (no ``synchronize``, no ``Event.wait()`` on the
host side).

On the CPU every method is a no-op: there ops run synchronously on the thread
that issues them and the threads themselves give the overlap.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class SideStream:
    """One thread's stream on ``device`` (None on the CPU)."""

    def __init__(self, device: torch.device):
        # Created on ``device`` itself (not the calling thread's current device);
        # a bare "cuda" takes the current device's index here, once, so the stream
        # and the default stream it waits on are the same GPU's on every thread.
        self.stream: torch.cuda.Stream | None = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.device = self.stream.device if self.stream is not None else device

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make this the current stream of the calling thread (a no-op on the CPU)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def wait(self, event: "torch.cuda.Event | None") -> None:
        """Order this stream's later work after ``event`` (device-side; None: nothing to wait for)."""
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def wait_default(self) -> None:
        """Order this stream's later work after everything issued so far on the device's default stream."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.default_stream(self.device))

    def record(self) -> "torch.cuda.Event | None":
        """An event that completes when the work issued so far on this stream has (None on the CPU)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


def record_current(device: torch.device) -> "torch.cuda.Event | None":
    """An event after the work issued so far on the calling thread's current stream (None on the CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def wait_current(device: torch.device, event: "torch.cuda.Event | None") -> None:
    """Order the current stream's later work after ``event`` (device-side; None: nothing to wait for)."""
    if device.type == "cuda" and event is not None:
        torch.cuda.current_stream(device).wait_event(event)
