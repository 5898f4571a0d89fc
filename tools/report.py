"""``dflash-report runs/<name>``: PNG figures from the run's ``metrics.jsonl``, no upload needed.

Writes into ``runs/<name>/plots/`` (or ``--out``) and prints one path per line:

- ``drafter-<id>.png`` per drafter: loss, expected acceptance length (EAL) and
  learning rate against the drafter's step, and accuracy per block position in
  its last record; for a drafter trained by several ranks (sources
  ``rank/<id>.<k>``), the drafter's own curves (composed from its ranks' by the
  metrics sidecar, or here when metrics.jsonl has none) and each rank's loss;
- ``drafters.png``: every drafter's loss and EAL on shared axes (experiments side by side);
- ``target.png``: the target's tokens/s and queue depth against wall time, one
  line per replica (``target/<r>``) when there are several;
- ``pipeline.png``: each drafter's step against wall time, and the step skew
  (fastest minus slowest drafter) between them.

A drafter that was restarted resumes from its checkpoint and repeats some
steps; for a repeated step the newest record wins, so curves follow the lineage
of the latest checkpoint. Works on a live run too (a half-written last line is
skipped).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from common import cli
from common.metric_names import DRAFTER_SOURCE, EVAL_PREFIX, TARGET_REPLICA_SOURCE, TARGET_SOURCE, Drafter, Eval, Target
from metrics_sidecar.ranks import compose_values, rank_of

METRICS_FILE = "metrics.jsonl"

logger = logging.getLogger(__name__)


class ReportError(RuntimeError):
    """A user-fixable problem (no run directory, no metrics yet); the message says what to do."""


@dataclass
class Series:
    """Records of one source, as read."""

    records: list[dict] = field(default_factory=list)

    def by_step(self, key: str) -> tuple[list[int], list[float]]:
        """``key`` against step; for a step logged twice (after a restart) the newest record wins."""
        latest: dict[int, float] = {}
        for rec in self.records:
            value = rec["values"].get(key)
            if _finite(value):
                latest[int(rec["step"])] = float(value)
        steps = sorted(latest)
        return steps, [latest[s] for s in steps]

    def by_time(self, key: str, t0: float) -> tuple[list[float], list[float]]:
        pts = sorted((rec["time"] - t0, float(rec["values"][key])) for rec in self.records if _finite(rec["values"].get(key)))
        return [p[0] for p in pts], [p[1] for p in pts]


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_metrics(run_dir: Path) -> tuple[dict[str, Series], int]:
    """``{source: Series}`` and the number of unreadable lines skipped."""
    path = run_dir / METRICS_FILE
    if not run_dir.is_dir():
        raise ReportError(f"run directory {run_dir} does not exist (runs live under run.root_dir/run.name, e.g. runs/demo)")
    if not path.exists():
        raise ReportError(f"{path} does not exist: the metrics sidecar writes it once the run has logged something")
    sources: dict[str, Series] = {}
    skipped = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                source, values = rec["source"], rec["values"]
                int(rec["step"]), float(rec["time"])
                if not isinstance(source, str) or not isinstance(values, dict):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                skipped += 1
                continue
            sources.setdefault(source, Series()).records.append(rec)
    if not sources:
        raise ReportError(f"{path} holds no metric records yet; run the job for a few steps first")
    return sources, skipped


def _trains(rec: dict) -> bool:
    """Whether a record is a training one (not only the eval/* values of dflash-eval --watch)."""
    return any(not key.startswith(EVAL_PREFIX) for key in rec["values"])


def compose_ranks(ranks: dict[int, Series]) -> Series:
    """A drafter's records made from its ranks', at each step every rank reported (newest record
    per rank and step), by the metrics sidecar's rules (metrics_sidecar/ranks.py)."""
    latest: dict[int, dict[int, dict]] = {}
    for rank, series in ranks.items():
        for rec in series.records:
            if _trains(rec):
                latest.setdefault(int(rec["step"]), {})[rank] = rec
    records = []
    for step in sorted(latest):
        got = latest[step]
        if got.keys() == ranks.keys():
            records.append({"step": step, "time": max(float(r["time"]) for r in got.values()),
                            "values": compose_values({k: r["values"] for k, r in got.items()})})
    return Series(records)


@dataclass
class Sources:
    """The records of a run, by role."""

    drafters: dict[str, Series]  # drafter id -> its own records (composed from its ranks' where it has ranks)
    ranks: dict[str, dict[int, Series]]  # drafter id -> rank -> records, for drafters trained by several ranks
    targets: dict[str, Series]  # "target", or "target/<r>" per replica, in replica order


def group_sources(sources: dict[str, Series]) -> Sources:
    """Sort a run's sources into drafters (a multi-rank drafter once), their ranks, and targets."""
    drafters: dict[str, Series] = {}
    ranks: dict[str, dict[int, Series]] = {}
    targets: dict[str, Series] = {}
    for name, series in sources.items():
        drafter = DRAFTER_SOURCE.parse(name)
        parsed = rank_of(name)
        if drafter is not None:
            drafters[drafter] = series
        elif parsed is not None:
            ranks.setdefault(parsed[0], {})[parsed[1]] = series
        elif name == TARGET_SOURCE or TARGET_REPLICA_SOURCE.parse(name) is not None:
            targets[name] = series
    for drafter, by_rank in ranks.items():
        own = drafters.get(drafter, Series())
        if not any(_trains(rec) for rec in own.records):  # no composed records (an older sidecar): compose here
            drafters[drafter] = Series(compose_ranks(by_rank).records + own.records)
    order = sorted(drafters, key=_natural_key)
    return Sources(
        drafters={d: drafters[d] for d in order},
        ranks={d: dict(sorted(ranks[d].items())) for d in sorted(ranks, key=_natural_key)},
        targets={t: targets[t] for t in sorted(targets, key=_natural_key)},
    )


def _natural_key(text: str) -> list[object]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def step_skew(drafters: dict[str, Series], t0: float, points: int = 200) -> tuple[list[float], list[float]]:
    """Fastest minus slowest drafter step over wall time.

    Each drafter reports its step only every ``log_every_steps`` steps, at its
    own moments, so raw records would show a saw-tooth of logging phase; each
    drafter's step is interpolated linearly in time instead, on a common grid
    from the moment every drafter has reported to the last record.
    """
    import numpy as np

    curves = []
    for series in drafters.values():
        pts = sorted((float(rec["time"]) - t0, float(rec["step"])) for rec in series.records)
        curves.append((np.array([p[0] for p in pts]), np.array([p[1] for p in pts])))
    if not curves:
        return [], []
    start = max(float(x[0]) for x, _ in curves)
    end = max(float(x[-1]) for x, _ in curves)
    grid = np.linspace(start, end, points) if end > start else np.array([start])
    steps = np.stack([np.interp(grid, x, y) for x, y in curves])
    return grid.tolist(), (steps.max(axis=0) - steps.min(axis=0)).tolist()


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the figures; returns their paths. Raises :class:`ReportError` for a missing or empty run."""
    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    sources, skipped = read_metrics(run_dir)
    if skipped:
        logger.warning("skipped %d unreadable line(s) of %s", skipped, run_dir / METRICS_FILE)
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    t0 = min(rec["time"] for s in sources.values() for rec in s.records)
    grouped = group_sources(sources)
    drafters = grouped.drafters
    written: list[Path] = []

    def save(fig, name: str) -> None:
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    for drafter_id, series in drafters.items():
        ranks = grouped.ranks.get(drafter_id, {})
        fig, axes = plt.subplots(2, 2, figsize=(11, 7))
        fig.suptitle(f"drafter {drafter_id}{f' ({len(ranks)} ranks)' if ranks else ''} ({run_dir.name})")
        for ax, key, label in ((axes[0, 0], Drafter.LOSS, "loss (nats)"),
                               (axes[0, 1], Drafter.EAL, "expected acceptance length"),
                               (axes[1, 1], Drafter.LR, "learning rate")):
            steps, values = series.by_step(key)
            _line(ax, steps, values, label, "step")
        if ranks:  # each rank's own loss next to the drafter's (their mean)
            for line in axes[0, 0].lines:
                line.set_label("drafter (mean over ranks)")
            for rank, rank_series in ranks.items():
                steps, values = rank_series.by_step(Drafter.LOSS)
                if steps:
                    axes[0, 0].plot(steps, values, linewidth=0.8, alpha=0.6, label=f"rank {rank}")
            _axes(axes[0, 0], "loss (nats)", "step", legend=True)
        _position_accuracy(axes[1, 0], series)
        save(fig, f"drafter-{_safe(drafter_id)}.png")

    if drafters:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        fig.suptitle(f"drafters compared ({run_dir.name})")
        for ax, key, label in ((axes[0], Drafter.LOSS, "loss (nats)"),
                               (axes[1], Drafter.EAL, "expected acceptance length")):
            for drafter_id, series in drafters.items():
                steps, values = series.by_step(key)
                if steps:
                    ax.plot(steps, values, marker="." if len(steps) < 30 else None, label=drafter_id)
            _axes(ax, label, "step", legend=True)
        save(fig, "drafters.png")

    evaluated = {d: s for d, s in drafters.items() if s.by_time(Eval.TAU, t0)[0]}
    if evaluated:
        # tau is the product; plotted against wall-clock minutes, the budget a user pays.
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        fig.suptitle(f"measured speculative decoding ({run_dir.name})")
        banded = False
        for drafter_id, series in evaluated.items():
            for ax, key, label in ((axes[0], Eval.TAU, drafter_id), (axes[1], Eval.ACCEPT_POS(1), f"{drafter_id} pos 1"),
                                   (axes[1], Eval.ACCEPT_POS(2), f"{drafter_id} pos 2")):
                times, values = series.by_time(key, t0)
                if times:
                    line, = ax.plot([t / 60.0 for t in times], values, marker=".", label=label)
                    if key == Eval.TAU:
                        banded |= _stderr_band(ax, series, t0, line.get_color())
        _axes(axes[0], "tau (tokens per draft-and-verify step)" + (", shaded +- its standard error" if banded else ""),
              "minutes since the first record", legend=True)
        _axes(axes[1], "acceptance rate by block position", "minutes since the first record", legend=True)
        save(fig, "eval.png")

    if grouped.targets:
        fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
        replicas = len(grouped.targets) > 1 or TARGET_SOURCE not in grouped.targets
        if replicas:
            fig.suptitle(f"target, {len(grouped.targets)} replicas ({run_dir.name})")
        else:
            fig.suptitle(f"target ({run_dir.name})")
        for ax, key, label, xlabel in ((axes[0], Target.TOKENS_PER_S, "tokens/s", None),
                                       (axes[1], Target.QUEUE_DEPTH, "queue depth (ready batches)",
                                        "seconds since the first record")):
            if not replicas:
                _line(ax, *grouped.targets[TARGET_SOURCE].by_time(key, t0), label, xlabel)
                continue
            for name, target in grouped.targets.items():  # one line per replica
                times, values = target.by_time(key, t0)
                if times:
                    ax.plot(times, values, marker="." if len(times) < 30 else None,
                            label=name if name == TARGET_SOURCE else f"replica {TARGET_REPLICA_SOURCE.parse(name)}")
            _axes(ax, label, xlabel, legend=True)
        save(fig, "target.png")

    if drafters:
        fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
        fig.suptitle(f"pipeline ({run_dir.name})")
        for drafter_id, series in drafters.items():
            pts = sorted((rec["time"] - t0, int(rec["step"])) for rec in series.records)
            axes[0].plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=drafter_id)
        _axes(axes[0], "drafter step", None, legend=True)
        times, skews = step_skew(drafters, t0)
        _line(axes[1], times, skews, "step skew (fastest - slowest drafter, steps)", "seconds since the first record")
        axes[1].set_ylim(0, 1.1 * max(skews, default=0.0) + 1.0)
        save(fig, "pipeline.png")
    return written


def _line(ax, xs, ys, label: str, xlabel: str | None) -> None:
    if xs:
        ax.plot(xs, ys, marker="." if len(xs) < 30 else None)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
    _axes(ax, label, xlabel)


def _axes(ax, label: str, xlabel: str | None, legend: bool = False) -> None:
    ax.set_title(label, fontsize=10)
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.grid(True, alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _stderr_band(ax, series: Series, t0: float, color) -> bool:
    """Shade tau +- its standard error over the prompts, where an evaluation reported one; True if any did."""
    pts = sorted((rec["time"] - t0, float(rec["values"][Eval.TAU]), float(rec["values"][Eval.TAU_STDERR]))
                 for rec in series.records
                 if _finite(rec["values"].get(Eval.TAU)) and _finite(rec["values"].get(Eval.TAU_STDERR)))
    if pts:
        ax.fill_between([t / 60.0 for t, _, _ in pts], [v - e for _, v, e in pts], [v + e for _, v, e in pts],
                        color=color, alpha=0.2, linewidth=0)
    return bool(pts)


def _position_accuracy(ax, series: Series) -> None:
    last = next((r for r in reversed(series.records)
                 if any(Drafter.ACC_POS.parse(k) is not None for k in r["values"])), None)
    if last is None:
        _line(ax, [], [], "accuracy per block position", "block position")
        return
    acc = sorted((int(pos), float(v)) for k, v in last["values"].items()
                 if (pos := Drafter.ACC_POS.parse(k)) is not None and _finite(v))
    ax.bar([p for p, _ in acc], [a for _, a in acc], color="tab:green")
    ax.set_ylim(0, max(1e-3, max((a for _, a in acc), default=0.0)) * 1.15)
    _axes(ax, f"accuracy per block position at step {last['step']}", "block position")


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash-report", description=cli.help_text(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="the run directory, e.g. runs/demo")
    p.add_argument("--out", type=Path, help="where to write the PNGs (default: RUN_DIR/plots)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="dflash-report: %(message)s")
    try:
        paths = write_report(args.run_dir, args.out)
    except ReportError as exc:
        print(f"dflash-report: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"dflash-report: {exc.name or 'matplotlib'} is not installed; pip install matplotlib", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
