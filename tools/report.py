"""``dflash-report runs/<name>``: PNG figures from the run's ``metrics.jsonl``, no upload needed.

Writes into ``runs/<name>/plots/`` (or ``--out``) and prints one path per line:

- ``drafter-<id>.png`` per drafter: loss, expected acceptance length (EAL) and
  learning rate against the drafter's step, and accuracy per block position in
  its last record;
- ``drafters.png``: every drafter's loss and EAL on shared axes (experiments side by side);
- ``target.png``: the target's tokens/s and queue depth against wall time;
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
from common.metric_names import DRAFTER_SOURCE, TARGET_SOURCE, Drafter, Eval, Target

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
    prefix = DRAFTER_SOURCE.prefix
    drafters = {name[len(prefix):]: s for name, s in sorted(sources.items()) if name.startswith(prefix)}
    written: list[Path] = []

    def save(fig, name: str) -> None:
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    for drafter_id, series in drafters.items():
        fig, axes = plt.subplots(2, 2, figsize=(11, 7))
        fig.suptitle(f"drafter {drafter_id} ({run_dir.name})")
        for ax, key, label in ((axes[0, 0], Drafter.LOSS, "loss (nats)"),
                               (axes[0, 1], Drafter.EAL, "expected acceptance length"),
                               (axes[1, 1], Drafter.LR, "learning rate")):
            steps, values = series.by_step(key)
            _line(ax, steps, values, label, "step")
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
        for drafter_id, series in evaluated.items():
            for ax, key, label in ((axes[0], Eval.TAU, drafter_id), (axes[1], Eval.ACCEPT_POS(1), f"{drafter_id} pos 1"),
                                   (axes[1], Eval.ACCEPT_POS(2), f"{drafter_id} pos 2")):
                times, values = series.by_time(key, t0)
                if times:
                    ax.plot([t / 60.0 for t in times], values, marker=".", label=label)
        _axes(axes[0], "tau (tokens per draft-and-verify step)", "minutes since the first record", legend=True)
        _axes(axes[1], "acceptance rate by block position", "minutes since the first record", legend=True)
        save(fig, "eval.png")

    if TARGET_SOURCE in sources:
        target = sources[TARGET_SOURCE]
        fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
        fig.suptitle(f"target ({run_dir.name})")
        _line(axes[0], *target.by_time(Target.TOKENS_PER_S, t0), "tokens/s", None)
        _line(axes[1], *target.by_time(Target.QUEUE_DEPTH, t0), "queue depth (ready batches)",
              "seconds since the first record")
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
