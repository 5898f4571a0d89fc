"""Which batch to capture next, which group gets which batch, and buffer reuse.

The data set is a deterministic plan of batches; a plan index names one batch
for all time (``epoch = index // batches_per_epoch``). This target replica
serves the plan indices its :class:`~common.plan_shard.Shard` owns (every
index with ``replicas = 1``). Every drafter group (one drafter, trained by one
or more ranks) sees every owned batch once: a group's progress is
``next_index`` (lowest owned index never dispatched) plus ``redo`` (indices
below it that must be sent again because a registration died before
acknowledging them, or because a restarted drafter's checkpoint does not cover
them). A captured batch is computed once and sent to every group that needs
it, then its buffer is reused.

Coverage arrives in the replica's local indices (HELLO) and is kept here in
plan indices. A group's *generation* grows with every (re)start of the
drafter: a HELLO of a newer generation resets the group's cursor to its
checkpoint's coverage (what was trained since that checkpoint is lost with the
restart, so it is served again); a HELLO of the current generation (another
rank, or a rank reconnecting) only adds its coverage, so a joining rank never
rewinds what its peers were served.

Thread model: the capture thread calls :meth:`next_to_capture` /
:meth:`publish`; the control thread calls everything else. One condition
variable guards the state; no call holds it while doing real work.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from common.packing import BatchLayout
from common.plan_shard import Shard


@dataclass
class ReadyBatch:
    plan_index: int
    epoch: int
    bucket: int
    sample_ids: list[int]
    num_tokens: int
    buffer: torch.Tensor
    layout: BatchLayout
    from_cache: bool = False  # the features came from the feature cache, not a forward pass
    pins: int = 0  # drafters the batch went to that may still read this buffer (a send, or shm: until ACK)
    # CUDA: recorded on the capture stream after the batch was written; a link's
    # stream waits on it before reading the buffer (None on the CPU).
    ready_event: object = None
    # transport "shm": the pool slot that is this batch's buffer, and the tag it was published with.
    shm_slot: int = -1
    shm_tag: int = 0
    # CUDA: one event per finished send of this buffer; the next capture into it waits on them.
    reader_events: list = field(default_factory=list)


@dataclass
class GroupState:
    next_index: int = 0
    redo: list[int] = field(default_factory=list)  # kept sorted
    active: int = 0  # live registrations in this group
    generation: int = -1

    def wants(self, index: int) -> bool:
        return index >= self.next_index or index in self.redo


class BatchScheduler:
    def __init__(
        self,
        *,
        bucket_of: "callable",
        layouts: list[BatchLayout],
        slots_per_bucket: int,
        total_batches: int | None,
        device: torch.device,
        pin_memory: bool = False,
        buffers: list[list[torch.Tensor]] | None = None,
        shard: Shard = Shard(),
    ):
        """``slots_per_bucket`` batches per bucket are captured ahead of the groups; ``buffers``
        (transport shm: the shared pool's slots, more than that per bucket) replaces allocating them."""
        self._bucket_of = bucket_of  # plan index -> bucket
        self.layouts = layouts
        self.total_batches = total_batches  # of the whole plan (every replica's), None = unlimited
        self.shard = shard
        self.lookahead = slots_per_bucket
        self._cond = threading.Condition()
        if buffers is None:
            buffers = [[layout.allocate(device, pin_memory=pin_memory) for _ in range(slots_per_bucket)] for layout in layouts]
        self._free: list[list[torch.Tensor]] = [list(per_bucket) for per_bucket in buffers]
        self._ready: dict[int, ReadyBatch] = {}
        self._reader_events: dict[int, list] = {}  # buffer data_ptr -> events of its last batch's sends
        self._capturing: set[int] = set()
        self.groups: dict[str, GroupState] = {}
        self.blocked_s = 0.0  # capture thread time spent with nothing it may compute
        self._closed = False

    # ---- group lifecycle (control thread) ----
    @property
    def local_total(self) -> int | None:
        """Plan indices this replica serves (None = unlimited)."""
        return None if self.total_batches is None else self.shard.size(self.total_batches)

    def generation(self, group: str) -> int:
        """The group's current generation (-1 before any registration)."""
        with self._cond:
            state = self.groups.get(group)
            return -1 if state is None else state.generation

    def join(self, group: str, generation: int, covered_watermark: int, covered_extra: list[int]) -> bool:
        """A registration joins ``group``; its checkpoint covers local indices < watermark plus extra.

        Returns True when ``generation`` is newer than the group's: the cursor was reset to this
        coverage, and the caller drops the older generation's registrations. The caller refuses
        a generation older than the group's."""
        # Computed before taking the lock: its size is the peer's to choose (bounded by the protocol).
        shard = self.shard
        extra = set(covered_extra)
        top_local = max([covered_watermark, *(i + 1 for i in extra)])
        with self._cond:
            state = self.groups.setdefault(group, GroupState())
            newer = generation > state.generation
            if newer:
                state.generation = generation
                state.next_index = shard.plan_index(top_local)
                state.redo = [shard.plan_index(j) for j in range(covered_watermark, top_local) if j not in extra]
            else:
                self._merge(state, covered_watermark, extra, top_local)
            state.active += 1
            self._cond.notify_all()
            return newer

    def _merge(self, state: GroupState, watermark: int, extra: set[int], top_local: int) -> None:
        """Add a same-generation registration's coverage: what it covers is not served again."""
        shard = self.shard

        def covered(index: int) -> bool:
            j = shard.local(index)
            return j < watermark or j in extra

        state.redo = [i for i in state.redo if not covered(i)]
        top = shard.plan_index(top_local)
        if top > state.next_index:
            gap = range(state.next_index, top, shard.replicas)
            state.redo = sorted(state.redo + [i for i in gap if not covered(i)])
            state.next_index = top

    def leave(self, group: str, unacked: list[int]) -> None:
        """A registration left or died; its unacknowledged batches must be sent again."""
        with self._cond:
            state = self.groups.get(group)
            if state is None:
                return
            state.active = max(0, state.active - 1)
            state.redo = sorted(set(state.redo) | {i for i in unacked if i < state.next_index})
            self._cond.notify_all()

    def finished(self, group: str) -> bool:
        state = self.groups.get(group)
        return (
            state is not None
            and self.total_batches is not None
            and state.next_index >= self.total_batches
            and not state.redo
        )

    # ---- dispatch (control thread) ----
    def take_for(self, group: str) -> ReadyBatch | None:
        """The next batch for ``group`` if it is captured already; pins it until :meth:`release`."""
        with self._cond:
            state = self.groups[group]
            if state.redo:
                index = state.redo[0]
            elif self.total_batches is None or state.next_index < self.total_batches:
                index = state.next_index
            else:
                return None
            ready = self._ready.get(index)
            if ready is None:
                self._cond.notify_all()  # the capture thread may have been idle
                return None
            if state.redo and state.redo[0] == index:
                state.redo.pop(0)
            else:
                state.next_index += self.shard.replicas
            ready.pins += 1
            return ready

    def release(self, ready: ReadyBatch) -> None:
        with self._cond:
            ready.pins -= 1
            self._cond.notify_all()

    # ---- capture (capture thread) ----
    def _needed(self, index: int) -> bool:
        return any(s.active and s.wants(index) for s in self.groups.values())

    def _wanted(self) -> list[int]:
        wanted: set[int] = set()
        for state in self.groups.values():
            if not state.active:
                continue
            wanted.update(state.redo[: self.lookahead])
            end = state.next_index + self.lookahead * self.shard.replicas
            if self.total_batches is not None:
                end = min(end, self.total_batches)
            wanted.update(range(state.next_index, end, self.shard.replicas))
        return sorted(i for i in wanted if i not in self._ready and i not in self._capturing)

    def _take_slot(self, bucket: int, index: int) -> torch.Tensor | None:
        if self._free[bucket]:
            return self._free[bucket].pop()
        candidates = [r for r in self._ready.values() if r.bucket == bucket and r.pins == 0]
        unneeded = [r for r in candidates if not self._needed(r.plan_index)]
        # Evict what nobody needs; else a batch further ahead than the one wanted
        # now (it is captured again later), so a lagging group never deadlocks.
        victims = unneeded or sorted((r for r in candidates if r.plan_index > index), key=lambda r: -r.plan_index)
        if not victims:
            return None
        victim = victims[0]
        del self._ready[victim.plan_index]
        if victim.reader_events:
            self._reader_events[victim.buffer.data_ptr()] = victim.reader_events
        return victim.buffer

    def next_to_capture(self, timeout_s: float) -> tuple[int, torch.Tensor] | None:
        """Block (bounded) until some group needs a batch that is not captured; reserve a buffer for it."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self._closed:
                for index in self._wanted():
                    slot = self._take_slot(self._bucket_of(index), index)
                    if slot is not None:
                        self._capturing.add(index)
                        return index, slot
                    break  # lowest wanted index has no free buffer yet: wait for a release
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                start = time.monotonic()
                self._cond.wait(remaining)
                self.blocked_s += time.monotonic() - start
            return None

    def reader_events(self, buffer: torch.Tensor) -> list:
        """Events of the sends that read ``buffer`` before the capture thread got it (CUDA; else empty)."""
        with self._cond:
            return self._reader_events.pop(buffer.data_ptr(), [])

    def publish(self, ready: ReadyBatch) -> None:
        with self._cond:
            self._capturing.discard(ready.plan_index)
            self._ready[ready.plan_index] = ready
            self._cond.notify_all()

    def abandon(self, index: int, buffer: torch.Tensor) -> None:
        """The capture of ``index`` failed; return its buffer."""
        with self._cond:
            self._capturing.discard(index)
            self._free[self._bucket_of(index)].append(buffer)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- observability (any thread; host values only) ----
    def depths(self) -> tuple[int, list[int]]:
        with self._cond:
            per_bucket = [0] * len(self.layouts)
            for ready in self._ready.values():
                per_bucket[ready.bucket] += 1
            return len(self._ready), per_bucket
