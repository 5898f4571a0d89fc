"""Tests for target_server/scheduler.py (BatchScheduler), with the capture thread simulated inline."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest
import torch

from common.packing import BatchLayout
from target_server.scheduler import BatchScheduler, ReadyBatch

QUICK_S = 0.01  # next_to_capture timeout when the caller expects an answer or nothing at all


def make_scheduler(*, slots: int = 2, total: int | None = None, buckets: int = 1) -> BatchScheduler:
    layouts = [BatchLayout(2, 4 * (b + 1), 3, torch.float32) for b in range(buckets)]
    return BatchScheduler(
        bucket_of=lambda i: i % buckets,
        layouts=layouts,
        slots_per_bucket=slots,
        total_batches=total,
        device=torch.device("cpu"),
    )


class Capturer:
    """Stands in for the capture thread: asks what to compute, stamps the buffer, publishes."""

    def __init__(self, sched: BatchScheduler):
        self.sched = sched
        self.captured: Counter[int] = Counter()
        self.buffers: dict[int, int] = {}  # plan index -> data_ptr of the buffer it went into

    def once(self, timeout_s: float = QUICK_S) -> int | None:
        got = self.sched.next_to_capture(timeout_s=timeout_s)
        if got is None:
            return None
        index, buf = got
        bucket = index % len(self.sched.layouts)
        layout = self.sched.layouts[bucket]
        assert buf.numel() == layout.nbytes
        _, input_ids, _, lengths = layout.views(buf)
        input_ids.fill_(index)  # the "forward pass": a recognisable stamp
        lengths.fill_(index)
        self.captured[index] += 1
        self.buffers[index] = buf.data_ptr()
        self.sched.publish(ReadyBatch(index, 0, bucket, [index * 10], 8, buf, layout))
        return index

    def drain(self, limit: int = 100) -> list[int]:
        """Capture until nothing more can be captured right now."""
        out = []
        for _ in range(limit):
            index = self.once()
            if index is None:
                break
            out.append(index)
        return out


def take(sched: BatchScheduler, group: str, release: bool = True) -> int | None:
    ready = sched.take_for(group)
    if ready is None:
        return None
    _, input_ids, _, _ = ready.layout.views(ready.buffer)
    assert int(input_ids[0, 0]) == ready.plan_index  # the buffer still holds what was captured for it
    assert ready.sample_ids == [ready.plan_index * 10]
    if release:
        sched.release(ready)
    return ready.plan_index


def run_until_done(sched: BatchScheduler, cap: Capturer, groups: list[str], rng: random.Random | None = None,
                   max_rounds: int = 500) -> dict[str, list[int]]:
    """Interleave captures and takes until every group is finished; fail on a stall."""
    got: dict[str, list[int]] = {g: [] for g in groups}
    idle = 0
    for _ in range(max_rounds):
        if all(sched.finished(g) for g in groups):
            return got
        progressed = cap.once() is not None
        order = list(groups)
        if rng is not None:
            rng.shuffle(order)
        for g in order:
            for _ in range(rng.randint(0, 3) if rng else 1):
                index = take(sched, g)
                if index is not None:
                    got[g].append(index)
                    progressed = True
        idle = 0 if progressed else idle + 1
        assert idle < 5, f"stalled: {got}, ready={sorted(sched._ready)}"
    pytest.fail(f"did not finish in {max_rounds} rounds: {got}")


# ---------------------------------------------------------------------------


def test_two_groups_get_every_index_once_in_order_and_share_captures():
    sched = make_scheduler(slots=2, total=12)
    cap = Capturer(sched)
    sched.join("a", 1, 0, [])
    sched.join("b", 1, 0, [])
    got = run_until_done(sched, cap, ["a", "b"])
    assert got["a"] == list(range(12))
    assert got["b"] == list(range(12))
    assert all(cap.captured[i] == 1 for i in range(12)), cap.captured  # computed once for both
    assert set(cap.captured) == set(range(12))


@pytest.mark.parametrize("seed", range(5))
def test_random_interleavings_two_buckets(seed):
    rng = random.Random(seed)
    sched = make_scheduler(slots=2, total=20, buckets=2)
    cap = Capturer(sched)
    for g in ("a", "b", "c"):
        sched.join(g, 1, 0, [])
    got = run_until_done(sched, cap, ["a", "b", "c"], rng=rng)
    for g in ("a", "b", "c"):
        assert got[g] == list(range(20))
    # Groups that start together never make the scheduler compute a batch twice.
    assert all(cap.captured[i] == 1 for i in range(20)), cap.captured
    assert sched.take_for("a") is None


def test_join_with_covered_set_gets_exactly_the_missing_indices():
    sched = make_scheduler(slots=2, total=11)
    cap = Capturer(sched)
    # The checkpoint covers everything below 3, plus 5 and 7.
    sched.join("g", 1, 3, [5, 7])
    assert not sched.finished("g")
    got = run_until_done(sched, cap, ["g"])
    assert got["g"] == [3, 4, 6, 8, 9, 10]  # redo first, in order, then new ones
    assert set(cap.captured) == {3, 4, 6, 8, 9, 10}  # nothing covered is computed


def test_join_with_everything_covered():
    sched = make_scheduler(slots=2, total=4)
    sched.join("g", 1, 4, [])
    assert sched.finished("g")
    assert sched.take_for("g") is None
    assert sched.next_to_capture(timeout_s=QUICK_S) is None


def test_leave_then_rejoin_gets_unacknowledged_batches():
    sched = make_scheduler(slots=4, total=8)
    cap = Capturer(sched)
    sched.join("g", 1, 0, [])
    assert cap.drain() == [0, 1, 2, 3]
    assert [take(sched, "g") for _ in range(4)] == [0, 1, 2, 3]
    # The registration dies: it trained 0 and 2, never acknowledged 1 and 3.
    sched.leave("g", [1, 3])
    assert sched.groups["g"].redo == [1, 3]
    assert sched.groups["g"].active == 0
    # The restarted drafter (a new generation) has a checkpoint covering < 1 plus 2.
    sched.join("g", 2, 1, [2])
    got = run_until_done(sched, cap, ["g"])
    assert got["g"] == [1, 3, 4, 5, 6, 7]


def test_leave_hands_unacked_to_the_rest_of_the_group():
    sched = make_scheduler(slots=4, total=6)
    cap = Capturer(sched)
    sched.join("g", 1, 0, [])  # registration 1
    sched.join("g", 1, 0, [])  # registration 2 of the same group (shares the stream)
    cap.drain()
    assert take(sched, "g") == 0  # registration 1
    assert take(sched, "g") == 1  # registration 1
    assert take(sched, "g") == 2  # registration 2
    sched.leave("g", [1])  # registration 1 dies after acknowledging 0 only
    assert sched.groups["g"].active == 1
    got = run_until_done(sched, cap, ["g"])
    assert got["g"] == [1, 3, 4, 5]  # the lost batch first


def test_leave_ignores_indices_never_dispatched_and_unknown_groups():
    sched = make_scheduler(slots=2, total=6)
    sched.leave("nobody", [1, 2])  # no error
    sched.join("g", 1, 0, [])
    sched.leave("g", [4, 5])  # not dispatched yet: they come anyway, not as redo
    assert sched.groups["g"].redo == []
    sched.join("g", 1, 0, [])
    got = run_until_done(sched, Capturer(sched), ["g"])
    assert got["g"] == list(range(6))


def test_lagging_group_does_not_deadlock_evicts_highest_index():
    sched = make_scheduler(slots=2)
    cap = Capturer(sched)
    sched.join("fast", 1, 2, [])  # fast is already at index 2
    assert cap.drain() == [2, 3]  # both slots hold batches fast still needs
    ptr_of_3 = cap.buffers[3]
    # A new group starts from 0: neither slot is free and both batches are needed.
    sched.join("slow", 1, 0, [])
    got = sched.next_to_capture(timeout_s=1.0)
    assert got is not None, "lagging group deadlocked"
    index, buf = got
    assert index == 0
    assert buf.data_ptr() == ptr_of_3  # the batch furthest ahead was evicted, not 2
    sched.abandon(index, buf)
    assert take(sched, "fast") == 2  # what fast needs next survived


def test_lagging_group_runs_to_completion_with_full_slots():
    sched = make_scheduler(slots=2, total=10)
    cap = Capturer(sched)
    sched.join("fast", 1, 0, [])
    for _ in range(4):
        cap.once()
        take(sched, "fast")
    cap.drain()  # slots full of what fast needs next
    sched.join("slow", 1, 0, [])
    got = run_until_done(sched, cap, ["fast", "slow"])
    assert got["fast"] == list(range(4, 10))
    assert got["slow"] == list(range(10))


def test_total_batches_finishes_and_take_returns_none():
    sched = make_scheduler(slots=2, total=3)
    cap = Capturer(sched)
    sched.join("g", 1, 0, [])
    assert not sched.finished("g")
    got = run_until_done(sched, cap, ["g"])
    assert got["g"] == [0, 1, 2]
    assert sched.finished("g")
    assert sched.take_for("g") is None
    assert sched.take_for("g") is None
    # Nothing past the end is ever captured.
    assert cap.once() is None
    assert max(cap.captured) == 2


def test_finished_is_false_for_unknown_group_and_unlimited_plans():
    sched = make_scheduler(slots=2, total=None)
    assert not sched.finished("nobody")
    sched.join("g", 1, 10**6, [])
    assert not sched.finished("g")


def test_finished_waits_for_redo():
    sched = make_scheduler(slots=2, total=2)
    cap = Capturer(sched)
    sched.join("g", 1, 0, [])
    cap.drain()
    assert take(sched, "g") == 0 and take(sched, "g") == 1
    assert sched.finished("g")
    sched.leave("g", [1])
    assert not sched.finished("g")
    assert take(sched, "g") == 1  # still captured: handed out again
    assert sched.finished("g")


def test_pinned_buffers_are_never_handed_out_for_capture():
    sched = make_scheduler(slots=1)
    cap = Capturer(sched)
    sched.join("g", 1, 0, [])
    assert cap.once() == 0
    ready = sched.take_for("g")  # pinned: a send is reading it
    assert ready is not None and ready.plan_index == 0
    # Index 0 is no longer needed, but its buffer is pinned.
    assert sched.next_to_capture(timeout_s=QUICK_S) is None
    sched.release(ready)
    index, buf = sched.next_to_capture(timeout_s=QUICK_S)
    assert index == 1 and buf.data_ptr() == ready.buffer.data_ptr()


def test_pinned_batch_ahead_is_not_evicted_for_a_lagging_group():
    sched = make_scheduler(slots=2)
    cap = Capturer(sched)
    sched.join("fast", 1, 3, [])
    assert cap.drain() == [3, 4]
    r3 = sched.take_for("fast")
    r4 = sched.take_for("fast")
    assert (r3.plan_index, r4.plan_index) == (3, 4)
    sched.join("slow", 1, 0, [])  # wants 0; 3 and 4 are higher but pinned
    assert sched.next_to_capture(timeout_s=QUICK_S) is None
    sched.release(r4)
    index, buf = sched.next_to_capture(timeout_s=QUICK_S)
    assert index == 0
    assert buf.data_ptr() == r4.buffer.data_ptr() != r3.buffer.data_ptr()


def test_release_wakes_a_waiting_capture_thread():
    sched = make_scheduler(slots=1)
    cap = Capturer(sched)
    sched.join("g", 1, 0, [])
    cap.once()
    ready = sched.take_for("g")
    result: list = []
    t = threading.Thread(target=lambda: result.append(sched.next_to_capture(timeout_s=5.0)))
    start = time.monotonic()
    t.start()
    time.sleep(0.05)
    sched.release(ready)
    t.join(timeout=5.0)
    assert not t.is_alive()
    assert time.monotonic() - start < 4.0  # woken by the release, not by the 5 s timeout
    assert result and result[0] is not None and result[0][0] == 1


def test_abandon_returns_the_buffer_and_the_index_is_wanted_again():
    sched = make_scheduler(slots=1)
    sched.join("g", 1, 0, [])
    index, buf = sched.next_to_capture(timeout_s=QUICK_S)
    assert index == 0
    sched.abandon(index, buf)
    index2, buf2 = sched.next_to_capture(timeout_s=QUICK_S)
    assert index2 == 0 and buf2.data_ptr() == buf.data_ptr()


def test_next_to_capture_times_out_when_nothing_is_wanted():
    sched = make_scheduler(slots=2)
    start = time.monotonic()
    assert sched.next_to_capture(timeout_s=0.1) is None  # no group at all
    elapsed = time.monotonic() - start
    assert 0.09 <= elapsed < 10.0
    sched.join("g", 1, 0, [])
    sched.leave("g", [])  # an inactive group wants nothing either
    assert sched.next_to_capture(timeout_s=QUICK_S) is None


def test_next_to_capture_after_close_returns_none():
    sched = make_scheduler(slots=2)
    sched.join("g", 1, 0, [])
    sched.close()
    start = time.monotonic()
    assert sched.next_to_capture(timeout_s=5.0) is None  # even though a batch is wanted
    assert time.monotonic() - start < 4.0  # not the 5 s timeout


def test_close_wakes_a_waiting_capture_thread():
    sched = make_scheduler(slots=2)
    result: list = []
    t = threading.Thread(target=lambda: result.append(sched.next_to_capture(timeout_s=10.0)))
    t.start()
    time.sleep(0.05)
    start = time.monotonic()
    sched.close()
    t.join(timeout=5.0)
    assert not t.is_alive()
    assert time.monotonic() - start < 8.0  # woken by close, not by the 10 s timeout
    assert result == [None]


def test_depths_counts_ready_batches_per_bucket():
    sched = make_scheduler(slots=2, buckets=2)
    cap = Capturer(sched)
    assert sched.depths() == (0, [0, 0])
    sched.join("g", 1, 0, [])
    cap.drain()
    depth, per_bucket = sched.depths()
    assert depth == sum(per_bucket) == 2  # lookahead = slots_per_bucket = 2: indices 0 and 1
    assert per_bucket == [1, 1]


def test_a_reused_buffer_comes_with_the_events_of_the_sends_that_read_it():
    # On CUDA a send's completion is an event; the capture into the same buffer waits on it.
    sched = make_scheduler(slots=1)
    cap = Capturer(sched)
    sched.join("g", 1, 0, [])
    cap.once()
    ready = sched.take_for("g")
    ready.reader_events += ["send-1", "send-2"]  # stand-ins: the scheduler only hands them on
    sched.release(ready)
    index, buf = sched.next_to_capture(timeout_s=QUICK_S)
    assert index == 1 and buf.data_ptr() == cap.buffers[0]
    assert sched.reader_events(buf) == ["send-1", "send-2"]
    assert sched.reader_events(buf) == []  # handed over once
