"""dflash-report (tools/report.py): PNG curves from a run's metrics.jsonl."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT
from tools.report import Series, read_metrics, step_skew

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir: Path) -> None:
    """Two drafters (d1 restarted: steps 20..30 logged twice), the target, and a half-written last line."""
    t0 = 1.7e9
    lines = []
    for i, drafter in enumerate(("d0", "d1")):
        steps = list(range(2, 42, 2))
        if drafter == "d1":
            steps = steps[:15] + list(range(20, 42, 2))  # resumed from the step-20 checkpoint
        for n, step in enumerate(steps):
            acc = {f"acc/pos_{k}": 0.8 * math.exp(-k / 4) * (1 - math.exp(-step / 15)) for k in range(1, 8)}
            lines.append({
                "source": f"drafter/{drafter}", "step": step, "time": t0 + n * 0.5 + 0.1 * i, "received_at": 0,
                "values": {"loss": 10 * math.exp(-step / 20) + 1 + i, "eal": sum(acc.values()),
                           "lr": 1e-3 * min(1.0, step / 6), "tokens_per_s": 500.0, **acc},
            })
    for n in range(40):
        lines.append({"source": "target", "step": n, "time": t0 + n * 0.5, "received_at": 0,
                      "values": {"tokens_per_s": 1000 + 50 * (n % 7), "queue_depth": n % 4, "bucket_depth/0": 1}})
    run_dir.mkdir(parents=True)
    text = "\n".join(json.dumps(line) for line in lines) + '\n{"source": "drafter/d0", "st'
    (run_dir / "metrics.jsonl").write_text(text)


def assert_real_png(path: Path) -> None:
    """A valid PNG of a plot: decodes, has a sensible size, and is not blank."""
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert height >= 200 and width >= 300, (path, image.shape)
    rgb = image[..., :3]
    non_white = (rgb < 0.95).any(axis=-1).mean()
    colours = len(np.unique((rgb.reshape(-1, 3) * 255).astype(np.uint8), axis=0))
    assert non_white > 0.01, f"{path} is almost blank ({non_white:.3%} ink)"
    assert colours > 20, f"{path} has only {colours} colours"


def test_report_writes_valid_pngs_and_prints_their_paths(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    _write_run(run_dir)
    done = subprocess.run([sys.executable, "-m", "tools.report", str(run_dir)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    printed = [Path(p) for p in done.stdout.split()]
    names = sorted(p.name for p in printed)
    assert names == ["drafter-d0.png", "drafter-d1.png", "drafters.png", "pipeline.png", "target.png"]
    for path in printed:
        assert path.parent == run_dir / "plots"
        assert_real_png(path)
    assert "skipped 1 unreadable line" in done.stderr


def test_restarted_drafter_curve_follows_the_latest_records():
    # Guards against a zig-zag loss curve after a restart: a step logged twice keeps its newest value.
    series = Series([
        {"step": 10, "time": 1.0, "values": {"loss": 5.0}},
        {"step": 20, "time": 2.0, "values": {"loss": 4.0}},
        {"step": 10, "time": 3.0, "values": {"loss": 4.5}},
        {"step": 30, "time": 4.0, "values": {"loss": float("nan")}},
    ])
    assert series.by_step("loss") == ([10, 20], [4.5, 4.0])


def test_step_skew_is_interpolated_not_a_logging_phase_sawtooth():
    fast = Series([{"step": s, "time": s / 10, "values": {}} for s in range(0, 101, 5)])
    slow = Series([{"step": s, "time": s / 10 + 0.3, "values": {}} for s in range(0, 101, 5)])
    times, skews = step_skew({"fast": fast, "slow": slow}, t0=0.0)
    assert len(times) == len(skews) > 10
    # Slow trails fast by 0.3 s = 3 steps at every moment, though each logs every 5 steps;
    # after fast's last record its step holds, so the gap closes.
    assert all(abs(v - 3.0) < 1e-6 for t, v in zip(times, skews) if t <= 10.0)
    assert skews[-1] < 1e-6


def test_missing_or_empty_run_is_one_clear_line(tmp_path):
    for run_dir, expected in ((tmp_path / "nope", "does not exist"), (tmp_path / "empty", "metrics.jsonl does not exist")):
        if run_dir.name == "empty":
            run_dir.mkdir()
        done = subprocess.run([sys.executable, "-m", "tools.report", str(run_dir)],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert done.returncode == 2
        assert expected in done.stderr and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    (tmp_path / "empty" / "metrics.jsonl").write_text("\n")
    with pytest.raises(Exception, match="no metric records"):
        read_metrics(tmp_path / "empty")


def _write_multi_run(run_dir: Path, composed: bool) -> None:
    """Two target replicas, drafter d0 trained by two ranks (with or without the sidecar's composed
    records), one-process drafter d1."""
    t0 = 1.7e9
    lines = []
    for n, step in enumerate(range(2, 42, 2)):
        t = t0 + n * 0.5
        ranks = {k: {"loss": 8 * math.exp(-step / 20) + 1 + k, "lr": 1e-3 * (k + 1), "tokens_per_s": 300.0 + 200 * k,
                     "eal": 1.0, "acc/pos_1": 0.5 + 0.2 * k, "acc/pos_2": 0.4 - 0.2 * k} for k in (0, 1)}
        for k, values in ranks.items():
            if not (k == 1 and step == 10):  # rank 1's step-10 record was dropped: no drafter step 10
                lines.append({"source": f"rank/d0.{k}", "step": step, "time": t + 0.01 * k, "received_at": 0,
                              "values": values})
        if composed and step != 10:
            lines.append({"source": "drafter/d0", "step": step, "time": t + 0.01, "received_at": 0, "composed": True,
                          "values": {"loss": (ranks[0]["loss"] + ranks[1]["loss"]) / 2, "tokens_per_s": 800.0,
                                     "lr": 1e-3}})
        lines.append({"source": "drafter/d1", "step": step, "time": t, "received_at": 0,
                      "values": {"loss": 9 * math.exp(-step / 20) + 1, "tokens_per_s": 400.0}})
    lines.append({"source": "drafter/d0", "step": 20, "time": t0 + 30, "received_at": 0,
                  "values": {"eval/tau": 1.4, "eval/tau_stderr": 0.1}})
    for n in range(40):
        for r in (0, 1):
            lines.append({"source": f"target/{r}", "step": n, "time": t0 + n * 0.5 + 0.1 * r, "received_at": 0,
                          "values": {"tokens_per_s": 1000 + 200 * r + 50 * (n % 7), "queue_depth": (n + r) % 4}})
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")


@pytest.mark.parametrize("composed", [True, False], ids=["composed-by-sidecar", "composed-here"])
def test_report_shows_target_replicas_and_a_drafter_trained_by_two_ranks(tmp_path, composed):
    from tools.report import group_sources, write_report

    run_dir = tmp_path / "runs" / "multi"
    _write_multi_run(run_dir, composed)
    sources, skipped = read_metrics(run_dir)
    grouped = group_sources(sources)
    assert skipped == 0
    assert list(grouped.drafters) == ["d0", "d1"] and list(grouped.ranks) == ["d0"]
    assert list(grouped.ranks["d0"]) == [0, 1] and list(grouped.targets) == ["target/0", "target/1"]
    d0 = grouped.drafters["d0"]
    steps, losses = d0.by_step("loss")
    assert 10 not in steps and steps[:2] == [2, 4] and len(steps) == 19  # a step rank 1 missed is no drafter step
    rank_losses = [grouped.ranks["d0"][k].by_step("loss")[1][0] for k in (0, 1)]
    assert losses[0] == pytest.approx(sum(rank_losses) / 2)
    assert d0.by_step("tokens_per_s")[1][0] == 800.0 and d0.by_step("lr")[1][0] == 1e-3
    if not composed:  # composed here by the sidecar's rules: eal from the mean accuracies
        assert d0.by_step("acc/pos_1")[1][0] == pytest.approx(0.6)
        assert d0.by_step("eal")[1][0] == pytest.approx(0.6 + 0.6 * 0.3)
    assert d0.by_time("eval/tau", 0.0)[1] == [1.4]  # the eval records stay with the drafter

    paths = write_report(run_dir)
    assert sorted(p.name for p in paths) == ["drafter-d0.png", "drafter-d1.png", "drafters.png", "eval.png",
                                              "pipeline.png", "target.png"]
    for path in paths:
        assert_real_png(path)
