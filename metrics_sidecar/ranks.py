"""Drafters trained by several ranks, and target replicas: which source is which, and the
drafter's own series composed from its ranks' records.

Pure bookkeeping (no sockets, no W&B), used by the aggregator (aggregate.py) and by
tools/report.py.

A drafter trained by W > 1 torchrun ranks pushes one record per rank, source
``rank/<id>.<k>``, with the keys a one-process drafter pushes as ``drafter/<id>``,
each computed over that rank's own batches; the ranks step in lockstep, so their
step numbers agree. For every step at which all of the drafter's live ranks
reported, `RankComposer` makes one ``drafter/<id>`` record by the rules of
`compose_values`, so whatever reads ``drafter/<id>`` (charts, W&B, dflash-eval,
dflash-status, dflash-report) sees one drafter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from common.metric_names import (
    DRAFTER_SOURCE, RANK_SOURCE, TARGET_REPLICA_SOURCE, TARGET_SOURCE, Drafter,
)
from common.metrics_client import MetricsRecord, Number

# Steps waiting for a rank's record, per drafter; older ones go first (a rank that stopped
# reporting stops composition until it goes stale; then the others compose on their own).
MAX_PENDING_STEPS = 64

# How a drafter's value is made from its ranks' values. Every other key (loss, acc/pos_<k>,
# data_wait_frac, compute_ms, grad_norm, clip_rate, ...): the mean over the ranks.
_SUM = frozenset({Drafter.TOKENS_PER_S, Drafter.SAMPLES_PER_S, Drafter.LABEL_TOKENS})
_MAX = frozenset({Drafter.GRAD_NORM_MAX, Drafter.NONFINITE_STEPS, Drafter.MEM_ALLOCATED_GB, Drafter.MEM_PEAK_GB})
# Rank 0's (the lowest rank that has the key): values of the whole drafter, the same on every rank.
_FIRST_RANK = frozenset({Drafter.LR, Drafter.CHECKPOINT_STEP, Drafter.TOKENS_TRAINED})


def rank_of(source: str) -> tuple[str, int] | None:
    """(drafter id, rank) of a ``rank/<id>.<k>`` source, else None."""
    param = RANK_SOURCE.parse(source)
    if param is None:
        return None
    drafter, _, rank = param.rpartition(".")
    return drafter, int(rank)


def is_target(source: str) -> bool:
    """Whether ``source`` is the target (``target``) or one of its replicas (``target/<r>``)."""
    return source == TARGET_SOURCE or TARGET_REPLICA_SOURCE.parse(source) is not None


def is_drafter_side(source: str) -> bool:
    """Whether ``source`` is a drafter (``drafter/<id>``) or a rank of one (``rank/<id>.<k>``)."""
    return DRAFTER_SOURCE.parse(source) is not None or rank_of(source) is not None


def _eal(acc: Mapping[int, float]) -> float | None:
    """Expected acceptance length from the per-position accuracies 1..K (as the trainer computes it)."""
    if not acc or sorted(acc) != list(range(1, len(acc) + 1)):
        return None
    eal, run = 0.0, 1.0
    for k in range(1, len(acc) + 1):
        run *= acc[k]
        eal += run
    return eal


def compose_values(ranks: Mapping[int, Mapping[str, Number]]) -> dict[str, Number]:
    """One drafter's values from its ranks' values at one step (rank -> values).

    tokens/s, samples/s, label tokens and tokens trained: the sum over the ranks;
    lr and checkpoint step: rank 0's; grad_norm_max, nonfinite steps and CUDA
    memory: the max; eal: from the mean accuracies (as a one-process drafter
    computes it from its own), else the mean eal; everything else (loss,
    accuracies, data wait, compute time, grad norm, clip rate): the mean over
    the ranks that have the key.
    """
    keys: list[str] = []
    for values in ranks.values():
        keys.extend(k for k in values if k not in keys)
    out: dict[str, Number] = {}
    for key in keys:
        have = [(rank, values[key]) for rank, values in sorted(ranks.items()) if key in values]
        numbers = [v for _, v in have]
        if key in _SUM:
            out[key] = sum(numbers)
        elif key in _MAX:
            out[key] = max(numbers)
        elif key in _FIRST_RANK:
            out[key] = numbers[0]
        else:
            out[key] = sum(numbers) / len(numbers)
    if Drafter.EAL in out:
        acc = {int(k): v for key, v in out.items() if (k := Drafter.ACC_POS.parse(key)) is not None}
        eal = _eal(acc)
        if eal is not None:
            out[Drafter.EAL] = eal
    return out


@dataclass
class _Step:
    ranks: dict[int, dict[str, Number]] = field(default_factory=dict)
    time: float = 0.0  # the newest of its records' times


class RankComposer:
    """Holds the ranks' records per drafter and step until every live rank has reported that step."""

    def __init__(self, max_pending_steps: int = MAX_PENDING_STEPS) -> None:
        self.max_pending_steps = max_pending_steps
        # drafter id -> step -> what its ranks reported at that step, in order of first arrival
        self._pending: dict[str, dict[int, _Step]] = {}

    def add(self, drafter: str, rank: int, record: MetricsRecord) -> None:
        """Keep one (training) record of rank ``rank`` of ``drafter``."""
        steps = self._pending.setdefault(drafter, {})
        entry = steps.get(record.step)
        if entry is None:
            entry = steps[record.step] = _Step()
            while len(steps) > self.max_pending_steps:
                del steps[next(iter(steps))]
        entry.ranks.setdefault(rank, {}).update(record.values)
        entry.time = max(entry.time, record.time)

    def compose(self, live: Mapping[str, Iterable[int]]) -> list[MetricsRecord]:
        """The ``drafter/<id>`` records of every step that all of its live ranks (``live[id]``) reported.

        A rank's records arrive in order (one connection each), so once a step is
        complete, an incomplete step that arrived before it will never complete:
        it is dropped.
        """
        out: list[MetricsRecord] = []
        for drafter, steps in self._pending.items():
            ranks = set(live.get(drafter, ()))
            if not ranks:
                continue
            complete = [step for step, entry in steps.items() if ranks <= entry.ranks.keys()]
            if not complete:
                continue
            order = list(steps)
            last = order.index(complete[-1])
            for step in complete:
                entry = steps[step]
                out.append(MetricsRecord(source=DRAFTER_SOURCE(drafter), step=step, time=entry.time,
                                         values=compose_values(entry.ranks), dropped=0))
            for step in order[: last + 1]:
                del steps[step]
        return out

    def forget(self, keep: Iterable[str]) -> None:
        """Drop what is held for drafters not in ``keep`` (those with no rank tracked any more)."""
        keep = set(keep)
        for drafter in [d for d in self._pending if d not in keep]:
            del self._pending[drafter]

    def pending_steps(self, drafter: str) -> list[int]:
        return list(self._pending.get(drafter, {}))
