"""Scale-out rules without processes: plan shards, per-replica coverage, generations of a drafter's ranks.

The random interleaving test models 2 target replicas (each a real BatchScheduler
with its Shard) and 2 drafters of 2 ranks each, doing what the processes do:
take, train-and-ACK (a batch the drafter has is skipped, as a round does),
drop-and-rejoin of one rank, checkpoints, a restart of the drafter (a new
generation from its checkpoint), and a restart of a replica. However these
interleave, every drafter's durable ledger ends with every plan index exactly once.
"""

from __future__ import annotations

import copy
import random
from collections import Counter

import pytest

from common import protocol as P
from common.auth import status_proof
from common.plan_shard import Shard, topology_id
from drafter_worker.checkpoint import Coverage
from tests.target_server.test_coordinator import KEY, Job, hello_msg
from tests.target_server.test_scheduler import Capturer, make_scheduler

TOTAL = 23  # plan indices; replica 0 owns 12 of them, replica 1 owns 11
REPLICAS = 2
RANKS = 2


def test_a_shard_owns_every_nth_index_and_maps_local_indices_both_ways():
    shards = [Shard(r, 3) for r in range(3)]
    assert [[i for i in range(10) if s.owns(i)] for s in shards] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert [s.size(10) for s in shards] == [4, 3, 3] and sum(s.size(10) for s in shards) == 10
    assert all(s.plan_index(s.local(i)) == i for s in shards for i in range(30) if s.owns(i))
    with pytest.raises(ValueError, match="belongs to replica 1"):
        shards[0].local(4)
    assert topology_id("plan", 2) != topology_id("plan", 3) and topology_id("plan", 2) == topology_id("plan", 2)


def test_per_replica_coverage_round_trips_through_hello_into_plan_indices():
    """Replica 1 of 3: a drafter covering its local indices < 2 and 4 is served 7, 10, then 16, 19... (locals 2, 3, 5, 6)."""
    sched = make_scheduler(slots=4, total=40)
    sched.shard = Shard(1, 3)
    cap = Capturer(sched)
    assert sched.join("d0", 1, 2, [4]) is True
    assert sched.groups["d0"].redo == [7, 10] and sched.groups["d0"].next_index == 16
    got = []
    for _ in range(20):
        cap.drain()
        while (ready := sched.take_for("d0")) is not None:
            sched.release(ready)
            got.append(ready.plan_index)
    assert got == [7, 10, *range(16, 40, 3)]
    assert sched.finished("d0") and sched.local_total == 13


def test_a_newer_generation_resets_the_cursor_and_the_same_generation_only_adds_coverage():
    sched = make_scheduler(slots=4, total=10)
    cap = Capturer(sched)
    sched.join("d0", 1, 0, [])
    cap.drain()
    taken = [sched.take_for("d0").plan_index for _ in range(4)]
    assert taken == [0, 1, 2, 3]
    # Rank 1 of the same generation joins with the drafter's coverage (0 and 1 trained): nothing rewinds.
    assert sched.join("d0", 1, 2, []) is False
    assert sched.groups["d0"].next_index == 4 and sched.groups["d0"].redo == []
    # A rank reconnecting knows more than the target (2 and 5 trained, 5 from a replica before its restart).
    sched.join("d0", 1, 3, [5])
    assert sched.groups["d0"].next_index == 6 and sched.groups["d0"].redo == [4]
    # The drafter restarts from a checkpoint covering < 1: generation 2 resets to exactly that.
    assert sched.join("d0", 2, 1, []) is True
    assert sched.groups["d0"].next_index == 1 and sched.groups["d0"].redo == []
    assert sched.generation("d0") == 2 and sched.generation("other") == -1


def test_the_coordinator_refuses_an_older_generation_and_a_disagreeing_rank_count():
    job = Job()
    assert isinstance(job.hello(b"a0", "d0", rank=0, world_size=2, generation=3), P.Welcome)
    assert isinstance(job.hello(b"a1", "d0", rank=1, world_size=2, generation=3), P.Welcome)
    job.now += 2
    stale = job.hello(b"old", "d0", rank=1, world_size=2, generation=2)
    assert isinstance(stale, P.Error) and stale.code == P.E_STALE and "restarted" in stale.message
    odd = job.hello(b"odd", "d0", rank=0, world_size=3, generation=3)
    assert isinstance(odd, P.Error) and odd.code == P.E_CONFIG and "has 2 ranks" in odd.message
    assert set(job.coord.regs) == {b"a0", b"a1"}
    # Generation 4 (torchrun restarted the group): both ranks of generation 3 are dropped at its first HELLO.
    job.now += 2
    assert isinstance(job.hello(b"b0", "d0", rank=0, world_size=2, generation=4), P.Welcome)
    assert set(job.coord.regs) == {b"b0"}
    rows = job.send(b"s", P.StatusRequest(auth=status_proof(KEY)))
    assert [(d.rank, d.generation) for d in rows[0][1].drafters] == [(0, 4)]


def test_the_coordinator_refuses_the_wrong_replica_and_another_topology():
    job = Job()
    job.coord.admission = job.coord.admission.__class__(**{**job.coord.admission.__dict__, "replica": 1,
                                                           "replicas": 2, "topology_id": "t" * 16})
    wrong = job.send(b"a", hello_msg("d0", replica=0))
    assert wrong[0][1].code == P.E_CONFIG and "this target is replica 1 of 2" in wrong[0][1].message
    job.now += 2
    other = job.send(b"a", hello_msg("d0", replica=1, topology_id="u" * 16))
    assert other[0][1].code == P.E_CONFIG and "topology" in other[0][1].message and "new run" in other[0][1].message
    job.now += 2
    assert isinstance(job.send(b"a", hello_msg("d0", replica=1, topology_id="t" * 16))[0][1], P.Welcome)


class _Drafter:
    """A drafter's ranks as the target sees them: what each rank holds, trained, and made durable."""

    def __init__(self, name: str):
        self.name = name
        self.generation = 1
        self.coverage = [Coverage() for _ in range(REPLICAS)]  # live, identical on every rank (rounds)
        self.ledger: list[int] = []
        self.checkpoint = (copy.deepcopy(self.coverage), [])
        self.inflight = [[[] for _ in range(REPLICAS)] for _ in range(RANKS)]  # rank -> replica -> plan indices

    def hello(self, sched, replica: int) -> None:
        c = self.coverage[replica]
        sched.join(self.name, self.generation, c.watermark, sorted(c.extra))


def _random_run(seed: int) -> tuple[dict[str, Counter], int]:
    rng = random.Random(seed)
    replicas = []
    for r in range(REPLICAS):
        sched = make_scheduler(slots=3, total=TOTAL)
        sched.shard = Shard(r, REPLICAS)
        replicas.append((sched, Capturer(sched)))
    drafters = [_Drafter("g0"), _Drafter("g1")]
    served_again = 0  # batches a rank was served that its drafter had trained already
    for d in drafters:
        for sched, _ in replicas:
            for _rank in range(RANKS):
                d.hello(sched, replicas.index((sched, _)))

    def done() -> bool:
        return all(s.finished(d.name) for s, _ in replicas for d in drafters) and not any(
            i for d in drafters for per_rank in d.inflight for i in per_rank)

    for _ in range(5000):
        if done():
            break
        r = rng.randrange(REPLICAS)
        sched, cap = replicas[r]
        d = rng.choice(drafters)
        rank = rng.randrange(RANKS)
        op = rng.random()
        if op < 0.25:
            cap.once(timeout_s=0.0)
        elif op < 0.55:  # a take (a BATCH to this rank)
            ready = sched.take_for(d.name)
            if ready is not None:
                sched.release(ready)  # pair transport: free once sent
                d.inflight[rank][r].append(ready.plan_index)
        elif op < 0.85:  # the rank trains its oldest batch from this replica in a round, then ACKs
            if d.inflight[rank][r]:
                index = d.inflight[rank][r].pop(0)
                if index // REPLICAS not in d.coverage[r]:  # a batch the drafter has is not trained again
                    d.coverage[r].add(index // REPLICAS)
                    d.ledger.append(index)
                else:
                    served_again += 1
        elif op < 0.90:  # the rank's link to this replica drops and re-registers (same generation)
            sched.leave(d.name, d.inflight[rank][r])
            d.inflight[rank][r] = []
            d.hello(sched, r)
        elif op < 0.95:  # a checkpoint (all ranks, after a round)
            d.checkpoint = (copy.deepcopy(d.coverage), list(d.ledger))
        elif op < 0.975:  # torchrun restarts the drafter: a new generation from its checkpoint
            d.generation += 1
            d.coverage, d.ledger = copy.deepcopy(d.checkpoint[0]), list(d.checkpoint[1])
            for rr, (s, _) in enumerate(replicas):
                for k in range(RANKS):  # the target drops the old generation's registrations first
                    s.leave(d.name, d.inflight[k][rr])
                    d.inflight[k][rr] = []
                for _k in range(RANKS):
                    d.hello(s, rr)
        else:  # replica r restarts: fresh state, every rank registers again with the drafter's coverage
            fresh = make_scheduler(slots=3, total=TOTAL)
            fresh.shard = Shard(r, REPLICAS)
            replicas[r] = (fresh, Capturer(fresh))
            for dd in drafters:
                for k in range(RANKS):
                    dd.inflight[k][r] = []
                    dd.hello(fresh, r)
    assert done(), "the interleaving did not finish"
    return {d.name: Counter(d.ledger) for d in drafters}, served_again


@pytest.mark.parametrize("seed", range(40))
def test_random_interleavings_train_every_index_exactly_once_per_drafter(seed):
    ledgers, served_again = _random_run(seed)
    for name, ledger in ledgers.items():
        assert ledger == Counter(range(TOTAL)), (name, sorted(ledger.items()))
    # The target alone keeps it exactly once here (a joining rank never rewinds its peers' cursor):
    # the drafter's own check (rank_group.trained_in_round) is a second line, not the mechanism.
    assert served_again == 0
