"""Time-window aggregation of metric records: the W&B row and the human line.

Pure bookkeeping, no sockets and no W&B, so it is tested on its own.

Per window the sidecar logs:
- for every source that reported in the window: its latest value of each key it
  reported, plus "step" (its latest training step) and, when an evaluation
  record (only eval/* keys, dflash-eval --watch) arrived, "eval/step" (the
  evaluated checkpoint's step): `Window.sources[source]`;
- `pipeline/*`: aggregates over the live drafters' latest state (loss mean, min,
  max; step skew; slowest step; summed tokens/s; number of drafters), over the
  live targets' (`target`, or `target/<r>` per replica: summed tokens/s,
  batches/s, queue depth, send rate; number of targets), the supply ratio
  (target tokens/s over drafter tokens/s, when both reported in the window),
  and per drafter trained by several ranks its rank skew;
- `sidecar/*`: the sidecar's own counters (filled in by the caller), and
  `sidecar/window`, the step axis of `pipeline/*` and `sidecar/*`: `Window.job`.

A drafter trained by several ranks reports as `rank/<id>.<k>`; the sidecar logs
each rank's series and composes the drafter's own `drafter/<id>` records from
them (ranks.py), for every step all its live ranks reported: those records are
in the window as if the drafter had pushed them (`Window.composed` lists them,
for metrics.jsonl), so a multi-rank drafter counts as one drafter everywhere.

`Window.row` is all of it as one flat row, each source's keys under
f"{source}/" (the names metrics.jsonl and docs/metrics.md use); the W&B
uploader splits it into one row per W&B run (wandb_layout.py).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Callable

from common.metric_names import (
    DRAFTER_SOURCE, EVAL_PREFIX, STEP, TARGET_SOURCE, Drafter, Eval, Pipeline, Ranks, Sidecar, Target,
)
from common.metrics_client import MetricsRecord, Number
from metrics_sidecar.ranks import RankComposer, is_drafter_side, is_target, rank_of


@dataclass
class SourceState:
    """What the sidecar knows about one producer, latest value per key."""

    step: int
    values: dict[str, Number] = field(default_factory=dict)
    last_seen: float = 0.0  # monotonic clock
    eval_step: int | None = None  # step of the latest eval-only record


@dataclass(frozen=True)
class Window:
    """One closed window, ready to log."""

    index: int
    sources: dict[str, dict[str, Number]]  # per source reporting in the window: latest values, "step", "eval/step"
    job: dict[str, Number]  # pipeline/*, sidecar/* and sidecar/window
    line: str  # the human log line
    composed: tuple[MetricsRecord, ...] = ()  # drafter records composed from their ranks' in this window

    @property
    def row(self) -> dict[str, Number]:
        """The whole window as one flat row: each source's keys under f"{source}/"."""
        row = {f"{source}/{key}": value for source, values in self.sources.items() for key, value in values.items()}
        row.update(self.job)
        return row


@dataclass(frozen=True)
class PipelineView:
    """Cross-drafter aggregates over the live drafters (and the live targets)."""

    values: dict[str, Number]
    slowest: str | None  # drafter id (without the "drafter/" prefix)
    stale: tuple[str, ...]  # drafter ids silent for longer than stale_after_s
    stale_targets: tuple[str, ...] = ()  # target sources silent for longer than stale_after_s
    ranks: dict[str, int] = field(default_factory=dict)  # drafter id -> its live ranks (multi-rank drafters)


def drafter_id(source: str) -> str:
    return source[len(DRAFTER_SOURCE.prefix):]


def _natural_key(text: str) -> list[object]:
    # d2 before d10
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def live_ranks(states: dict[str, SourceState], now: float, stale_after_s: float) -> dict[str, dict[int, int]]:
    """drafter id -> {rank: latest step} over the rank sources heard from within `stale_after_s`."""
    out: dict[str, dict[int, int]] = {}
    for source, state in states.items():
        parsed = rank_of(source)
        if parsed is not None and now - state.last_seen <= stale_after_s:
            out.setdefault(parsed[0], {})[parsed[1]] = state.step
    return out


def pipeline_aggregates(
    states: dict[str, SourceState],
    now: float,
    stale_after_s: float,
    reported: dict[str, dict[str, Number]] | None = None,
) -> PipelineView:
    """Aggregate the latest state of the drafters and targets heard from within `stale_after_s`.

    `reported`: the window's rows (source -> values); the supply ratio is emitted
    only when a target and a drafter (or a rank of one) reported tokens/s in it
    (None: whenever both sides are live).
    """
    live, stale, targets, stale_targets = _partition(states, now, stale_after_s)
    values: dict[str, Number] = {Pipeline.NUM_DRAFTERS: len(live)}
    slowest = _drafter_values(live, values)
    values[Pipeline.NUM_TARGETS] = len(targets)
    _target_values(targets, values)
    supply, demand = values.get(Pipeline.TARGET_TOKENS_PER_S), values.get(Pipeline.DRAFTER_TOKENS_PER_S)
    if supply is not None and demand is not None and demand > 0:
        both = reported is None or (
            any(is_target(s) and Target.TOKENS_PER_S in v for s, v in reported.items())
            and any(is_drafter_side(s) and Drafter.TOKENS_PER_S in v for s, v in reported.items())
        )
        if both:
            values[Pipeline.SUPPLY_RATIO] = supply / demand
    ranks = live_ranks(states, now, stale_after_s)
    for drafter in sorted(ranks, key=_natural_key):
        values[Ranks.SKEW(drafter)] = max(ranks[drafter].values()) - min(ranks[drafter].values())
    return PipelineView(
        values=values, slowest=slowest, stale=tuple(sorted(stale, key=_natural_key)),
        stale_targets=tuple(sorted(stale_targets, key=_natural_key)),
        ranks={drafter: len(r) for drafter, r in ranks.items()},
    )


def _partition(
    states: dict[str, SourceState], now: float, stale_after_s: float
) -> tuple[dict[str, SourceState], list[str], dict[str, SourceState], list[str]]:
    """(live drafters, stale drafter ids, live targets, stale target sources); other sources are left out."""
    live: dict[str, SourceState] = {}
    stale: list[str] = []
    targets: dict[str, SourceState] = {}
    stale_targets: list[str] = []
    for source, state in states.items():
        fresh = now - state.last_seen <= stale_after_s
        if is_target(source):
            if fresh:
                targets[source] = state
            else:
                stale_targets.append(source)
        elif source.startswith(DRAFTER_SOURCE.prefix):
            if fresh:
                live[source] = state
            else:
                stale.append(drafter_id(source))
    return live, stale, targets, stale_targets


def _drafter_values(live: dict[str, SourceState], values: dict[str, Number]) -> str | None:
    """Step skew, loss spread and total tokens/s of the live drafters into ``values``; returns the slowest's id."""
    if not live:
        return None
    steps = {source: state.step for source, state in live.items()}
    slowest_source = min(sorted(steps, key=_natural_key), key=lambda s: steps[s])
    values[Pipeline.STEP_SKEW] = max(steps.values()) - min(steps.values())
    values[Pipeline.SLOWEST_DRAFTER_STEP] = steps[slowest_source]
    losses = [s.values[Drafter.LOSS] for s in live.values() if Drafter.LOSS in s.values]
    if losses:
        values[Pipeline.LOSS_MEAN] = sum(losses) / len(losses)
        values[Pipeline.LOSS_MIN] = min(losses)
        values[Pipeline.LOSS_MAX] = max(losses)
    rates = [s.values[Drafter.TOKENS_PER_S] for s in live.values() if Drafter.TOKENS_PER_S in s.values]
    if rates:
        values[Pipeline.DRAFTER_TOKENS_PER_S] = sum(rates)
    return drafter_id(slowest_source)


def _target_values(targets: dict[str, SourceState], values: dict[str, Number]) -> None:
    """The live targets' rates and queue depths, summed over replicas, into ``values``."""
    for key, name in ((Target.TOKENS_PER_S, Pipeline.TARGET_TOKENS_PER_S),
                      (Target.BATCHES_PER_S, Pipeline.TARGET_BATCHES_PER_S),
                      (Target.QUEUE_DEPTH, Pipeline.TARGET_QUEUE_DEPTH),
                      (Target.SEND_GBPS, Pipeline.TARGET_SEND_GBPS)):
        have = [s.values[key] for s in targets.values() if key in s.values]
        if have:
            values[name] = sum(have)


def _ranks_cell(drafter: str, pipeline: PipelineView) -> str:
    n = pipeline.ranks.get(drafter)
    if not n:
        return ""
    skew = pipeline.values.get(Ranks.SKEW(drafter), 0)
    return f" ranks={n}" + (f" rank_skew={skew}" if skew else "")


def _cell(value: Number | None, spec: str, width: int) -> str:
    text = "-" if value is None else format(value, spec)
    return text.rjust(width)


def format_window_line(
    index: int,
    states: dict[str, SourceState],
    pipeline: PipelineView,
    sidecar_values: dict[str, Number],
) -> str:
    """One aligned human line, e.g.

    [window 12] d0 step=40 loss=5.123 eal=1.21 lr=2.0e-04 tok/s=512 | ... | target ... | skew=2 slowest=d1

    A drafter trained by several ranks adds ``ranks=<n>`` (and ``rank_skew=<steps>`` when
    its ranks' latest steps differ); with target replicas each has its part
    (``target/0 ...``); ``supply=`` is the supply ratio when the window has one.
    """
    stale = set(pipeline.stale)
    parts = []
    drafters = sorted((s for s in states if s.startswith(DRAFTER_SOURCE.prefix)), key=_natural_key)
    for source in drafters:
        if drafter_id(source) in stale:
            continue
        st = states[source]
        v = st.values
        parts.append(
            f"{drafter_id(source)} step={st.step:>6d} loss={_cell(v.get(Drafter.LOSS), '.3f', 6)}"
            f" eal={_cell(v.get(Drafter.EAL), '.2f', 5)} lr={_cell(v.get(Drafter.LR), '.1e', 7)}"
            f" tok/s={_cell(v.get(Drafter.TOKENS_PER_S), '.0f', 6)}"
            + _ranks_cell(drafter_id(source), pipeline)
        )
    targets = sorted((s for s in states if is_target(s)), key=_natural_key)
    if not targets:
        parts.append(f"{TARGET_SOURCE} -")
    for source in targets:
        target = states[source]
        if source in pipeline.stale_targets:
            parts.append(f"{source} stale")
            continue
        parts.append(
            f"{source} step={target.step:>6d} tok/s={_cell(target.values.get(Target.TOKENS_PER_S), '.0f', 6)}"
            f" queue={_cell(target.values.get(Target.QUEUE_DEPTH), 'g', 3)}"
        )
    tail = (
        f"skew={_cell(pipeline.values.get(Pipeline.STEP_SKEW), 'd', 3)}"
        f" slowest={pipeline.slowest or '-'}"
    )
    if stale:
        tail += f" stale={','.join(pipeline.stale)}"
    if Pipeline.SUPPLY_RATIO in pipeline.values:
        tail += f" supply={pipeline.values[Pipeline.SUPPLY_RATIO]:.2f}"
    tail += (
        f" | recv={sidecar_values.get(Sidecar.RECORDS_RECEIVED, 0)}"
        f" bad={sidecar_values.get(Sidecar.RECORDS_MALFORMED, 0)}"
        f" dropped={sidecar_values.get(Sidecar.RECORDS_DROPPED_BY_PRODUCERS, 0)}"
        f" backlog={sidecar_values.get(Sidecar.UPLOAD_BACKLOG, 0)}"
    )
    parts.append(tail)
    return f"[window {index:>5d}] " + " | ".join(parts)


class WindowAggregator:
    """Collects records into windows; `close_window` builds the row and the line.

    Per-source state is bounded: at most `max_sources` sources are tracked
    (`admits` says whether a record's source may be added), and a source
    silent for `forget_after_s` (default 10 x stale_after_s) is dropped by
    `forget_silent`, so a stream of fresh source names cannot grow memory.

    Records of a drafter's ranks (`rank/<id>.<k>`) are also held per step (at most
    ranks.MAX_PENDING_STEPS per drafter) until every live rank of the drafter has
    reported that step; `close_window` then composes the drafter's `drafter/<id>`
    records from them and folds them in like received ones.
    """

    def __init__(
        self,
        *,
        stale_after_s: float = 60.0,
        forget_after_s: float | None = None,
        max_sources: int = 1024,
        first_window: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_sources < 1:
            raise ValueError(f"max_sources must be >= 1, got {max_sources}")
        self.stale_after_s = stale_after_s
        self.forget_after_s = 10.0 * stale_after_s if forget_after_s is None else forget_after_s
        self.max_sources = max_sources
        self.states: dict[str, SourceState] = {}
        self.next_index = first_window
        self._clock = clock
        self._window: dict[str, SourceState] = {}
        self._ranks = RankComposer()
        self.pending = 0  # valid records in the open window

    def admits(self, source: str) -> bool:
        """Whether a record from `source` may be added (tracked already, or room for one more)."""
        return source in self.states or len(self.states) < self.max_sources

    def forget_silent(self) -> list[str]:
        """Drop the state of sources silent for longer than forget_after_s; return their names."""
        cutoff = self._clock() - self.forget_after_s
        gone = [s for s, st in self.states.items() if st.last_seen < cutoff and s not in self._window]
        for source in gone:
            del self.states[source]
        if gone:
            self._ranks.forget({parsed[0] for s in self.states if (parsed := rank_of(s)) is not None})
        return gone

    def add(self, record: MetricsRecord) -> bool:
        """Fold one record in (its source must be admitted); return True the first time its source is seen."""
        is_new = self._fold(record, self._clock())
        rank = rank_of(record.source)
        if rank is not None and not _eval_only(record):
            self._ranks.add(rank[0], rank[1], record)
        self.pending += 1
        return is_new

    def _fold(self, record: MetricsRecord, now: float) -> bool:
        """Update the source's state and its row in the open window; True if the source is new."""
        state = self.states.get(record.source)
        is_new = state is None
        # Eval records (dflash-eval --watch) carry a checkpoint's step, which lags
        # training: they must not rewind the source's progress, skew or step axis.
        # Their step goes to the window as "eval/step" instead.
        eval_only = _eval_only(record)
        if state is None:
            state = self.states[record.source] = SourceState(step=record.step)
        if not eval_only:
            state.step = record.step
        state.values.update(record.values)
        state.last_seen = now
        upd = self._window.get(record.source)
        if upd is None:
            upd = self._window[record.source] = SourceState(step=state.step)
        elif not eval_only:
            upd.step = record.step
        if eval_only:
            upd.eval_step = record.step
        upd.values.update(record.values)
        upd.last_seen = now
        return is_new

    def _compose_ranks(self, now: float) -> list[MetricsRecord]:
        """Fold in the drafter records composed from the ranks' (every step all live ranks reported)."""
        live = live_ranks(self.states, now, self.stale_after_s)
        composed = [r for r in self._ranks.compose(live) if self.admits(r.source)]
        for record in composed:
            self._fold(record, now)
        return composed

    def close_window(self, sidecar_values: dict[str, Number]) -> Window:
        """Close the open window; `sidecar_values` are the sidecar/* counters to log."""
        index = self.next_index
        self.next_index += 1
        now = self._clock()
        composed = self._compose_ranks(now)
        sources: dict[str, dict[str, Number]] = {}
        for source, upd in self._window.items():
            values = sources[source] = dict(upd.values)
            values[STEP] = upd.step
            if upd.eval_step is not None:
                values[Eval.STEP] = upd.eval_step
        pipeline = pipeline_aggregates(self.states, now, self.stale_after_s, reported=sources)
        job = {**pipeline.values, **sidecar_values, Sidecar.WINDOW: index}
        line = format_window_line(index, self.states, pipeline, sidecar_values)
        self._window = {}
        self.pending = 0
        return Window(index=index, sources=sources, job=job, line=line, composed=tuple(composed))


def _eval_only(record: MetricsRecord) -> bool:
    return bool(record.values) and all(k.startswith(EVAL_PREFIX) for k in record.values)
