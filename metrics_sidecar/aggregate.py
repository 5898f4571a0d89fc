"""Time-window aggregation of metric records: the W&B row and the human line.

Pure bookkeeping, no sockets and no W&B, so it is tested on its own.

Per window the sidecar logs ONE row:
- for every source that reported in the window: its latest value of each key it
  reported, as f"{source}/{key}", plus f"{source}/step" (its latest step);
- `pipeline/*`: aggregates over the live drafters' latest state (loss mean, min,
  max; step skew; slowest step; summed tokens/s; number of drafters);
- `sidecar/*`: the sidecar's own counters (filled in by the caller), and
  `sidecar/window`, the step axis of `pipeline/*` and `sidecar/*`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Callable

from common.metrics_client import MetricsRecord, Number

DRAFTER_PREFIX = "drafter/"
TARGET_SOURCE = "target"
WINDOW_KEY = "sidecar/window"


@dataclass
class SourceState:
    """What the sidecar knows about one producer, latest value per key."""

    step: int
    values: dict[str, Number] = field(default_factory=dict)
    last_seen: float = 0.0  # monotonic clock


@dataclass(frozen=True)
class Window:
    """One closed window, ready to log."""

    index: int
    row: dict[str, Number]
    sources: tuple[str, ...]  # sources with series in `row`
    line: str  # the human log line


@dataclass(frozen=True)
class PipelineView:
    """Cross-drafter aggregates over the live drafters."""

    values: dict[str, Number]
    slowest: str | None  # drafter id (without the "drafter/" prefix)
    stale: tuple[str, ...]  # drafter ids silent for longer than stale_after_s


def drafter_id(source: str) -> str:
    return source[len(DRAFTER_PREFIX):]


def _natural_key(text: str) -> list[object]:
    # d2 before d10
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def pipeline_aggregates(states: dict[str, SourceState], now: float, stale_after_s: float) -> PipelineView:
    """Aggregate the latest state of the drafters heard from within `stale_after_s`."""
    live: dict[str, SourceState] = {}
    stale: list[str] = []
    for source, state in states.items():
        if not source.startswith(DRAFTER_PREFIX):
            continue
        if now - state.last_seen > stale_after_s:
            stale.append(drafter_id(source))
        else:
            live[source] = state
    values: dict[str, Number] = {"pipeline/num_drafters": len(live)}
    slowest = None
    if live:
        steps = {source: state.step for source, state in live.items()}
        slowest_source = min(sorted(steps, key=_natural_key), key=lambda s: steps[s])
        slowest = drafter_id(slowest_source)
        values["pipeline/step_skew"] = max(steps.values()) - min(steps.values())
        values["pipeline/slowest_drafter_step"] = steps[slowest_source]
        losses = [s.values["loss"] for s in live.values() if "loss" in s.values]
        if losses:
            values["pipeline/loss_mean"] = sum(losses) / len(losses)
            values["pipeline/loss_min"] = min(losses)
            values["pipeline/loss_max"] = max(losses)
        rates = [s.values["tokens_per_s"] for s in live.values() if "tokens_per_s" in s.values]
        if rates:
            values["pipeline/drafter_tokens_per_s"] = sum(rates)
    return PipelineView(values=values, slowest=slowest, stale=tuple(sorted(stale, key=_natural_key)))


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
    """
    stale = set(pipeline.stale)
    parts = []
    drafters = sorted((s for s in states if s.startswith(DRAFTER_PREFIX)), key=_natural_key)
    for source in drafters:
        if drafter_id(source) in stale:
            continue
        st = states[source]
        v = st.values
        parts.append(
            f"{drafter_id(source)} step={st.step:>6d} loss={_cell(v.get('loss'), '.3f', 6)}"
            f" eal={_cell(v.get('eal'), '.2f', 5)} lr={_cell(v.get('lr'), '.1e', 7)}"
            f" tok/s={_cell(v.get('tokens_per_s'), '.0f', 6)}"
        )
    target = states.get(TARGET_SOURCE)
    if target is None:
        parts.append("target -")
    else:
        parts.append(
            f"target step={target.step:>6d} tok/s={_cell(target.values.get('tokens_per_s'), '.0f', 6)}"
            f" queue={_cell(target.values.get('queue_depth'), 'g', 3)}"
        )
    tail = (
        f"skew={_cell(pipeline.values.get('pipeline/step_skew'), 'd', 3)}"
        f" slowest={pipeline.slowest or '-'}"
    )
    if stale:
        tail += f" stale={','.join(pipeline.stale)}"
    tail += (
        f" | recv={sidecar_values.get('sidecar/records_received', 0)}"
        f" bad={sidecar_values.get('sidecar/records_malformed', 0)}"
        f" dropped={sidecar_values.get('sidecar/records_dropped_by_producers', 0)}"
        f" backlog={sidecar_values.get('sidecar/upload_backlog', 0)}"
    )
    parts.append(tail)
    return f"[window {index:>5d}] " + " | ".join(parts)


class WindowAggregator:
    """Collects records into windows; `close_window` builds the row and the line.

    Per-source state is bounded: at most `max_sources` sources are tracked
    (`admits` says whether a record's source may be added), and a source
    silent for `forget_after_s` (default 10 x stale_after_s) is dropped by
    `forget_silent`, so a stream of fresh source names cannot grow memory.
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
        return gone

    def add(self, record: MetricsRecord) -> bool:
        """Fold one record in (its source must be admitted); return True the first time its source is seen."""
        now = self._clock()
        state = self.states.get(record.source)
        is_new = state is None
        # Eval records (dflash-eval --watch) carry a checkpoint's step, which lags
        # training: they must not rewind the source's progress, skew or step axis.
        eval_only = bool(record.values) and all(k.startswith("eval/") for k in record.values)
        if state is None:
            state = self.states[record.source] = SourceState(step=record.step)
        if not eval_only:
            state.step = record.step
        state.values.update(record.values)
        state.last_seen = now
        upd = self._window.get(record.source)
        if upd is None:
            upd = self._window[record.source] = SourceState(step=record.step)
        elif not eval_only:
            upd.step = record.step
        upd.values.update(record.values)
        upd.last_seen = now
        self.pending += 1
        return is_new

    def close_window(self, sidecar_values: dict[str, Number]) -> Window:
        """Close the open window; `sidecar_values` are the sidecar/* counters to log."""
        index = self.next_index
        self.next_index += 1
        row: dict[str, Number] = {}
        for source, upd in self._window.items():
            for key, value in upd.values.items():
                row[f"{source}/{key}"] = value
            row[f"{source}/step"] = upd.step
        pipeline = pipeline_aggregates(self.states, self._clock(), self.stale_after_s)
        row.update(pipeline.values)
        row.update(sidecar_values)
        row[WINDOW_KEY] = index
        sources = tuple(self._window)
        line = format_window_line(index, self.states, pipeline, sidecar_values)
        self._window = {}
        self.pending = 0
        return Window(index=index, row=row, sources=sources, line=line)
