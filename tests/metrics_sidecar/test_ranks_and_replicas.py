"""Target replicas (`target/<r>`) and drafters trained by several ranks (`rank/<id>.<k>`) in the sidecar.

Real wire records (made, encoded and parsed as producers and the sidecar do)
through the aggregator with a fake clock; the W&B layout with a fake W&B; and
`python -m metrics_sidecar` as a real process with real offline W&B runs.
The job: two target replicas, drafter d0 trained by two ranks, one-process drafter d1.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from common.metric_names import drafter_source, target_source
from common.metrics_client import (
    MetricsPusher, MetricsRecord, encode_metrics_record, make_metrics_record, parse_metrics_record,
)
from metrics_sidecar.aggregate import WindowAggregator
from metrics_sidecar.ranks import RankComposer, compose_values
from metrics_sidecar.wandb_layout import drafter_step_metric, split_window
from metrics_sidecar.wandb_reader import read_wandb_offline_history, read_wandb_offline_runs
from metrics_sidecar.wandb_uploader import WandbUploader

REPO_ROOT = Path(__file__).resolve().parents[2]

# The job's sources, as the producers name them.
T0, T1 = target_source(0, 2), target_source(1, 2)  # target/0, target/1
R0, R1 = drafter_source("d0", 0, 2), drafter_source("d0", 1, 2)  # rank/d0.0, rank/d0.1
D1 = drafter_source("d1", 0, 1)  # drafter/d1

# Hand-computed: targets offer 1200 + 1000 = 2200 tokens/s; drafters take (300 + 500) + 400 = 1200.
TARGET = {T0: {"tokens_per_s": 1200.0, "batches_per_s": 3.0, "queue_depth": 2, "send_gbps": 0.5},
          T1: {"tokens_per_s": 1000.0, "batches_per_s": 2.5, "queue_depth": 1, "send_gbps": 0.25}}
SUPPLY_RATIO = 2200.0 / 1200.0


def rank_values(rank: int, step: int) -> dict[str, float]:
    return {
        "loss": 5.0 - 0.25 * step + rank,  # mean over the ranks: 5.5 - 0.25 step
        "lr": 1e-3 * (rank + 1),  # the drafter's: rank 0's
        "tokens_per_s": 300.0 + 200.0 * rank,  # sum: 800
        "samples_per_s": 2.0 + rank,  # sum: 5
        "data_wait_frac": 0.1 + 0.2 * rank,  # mean: 0.2
        "acc/pos_1": 0.5 + 0.2 * rank,  # mean: 0.6
        "acc/pos_2": 0.4 - 0.2 * rank,  # mean: 0.3
        "eal": 9.9,  # recomputed from the mean accuracies: 0.6 + 0.6 * 0.3
        "grad_norm_max": 1.0 + rank,  # max: 2
    }


def d1_values(step: int) -> dict[str, float]:
    return {"loss": 4.0 - 0.25 * step, "tokens_per_s": 400.0, "lr": 5e-4}


def wire(source: str, step: int, values: dict, now: float = 1.7e9) -> MetricsRecord:
    """A record as the sidecar receives it: made and encoded by the producer side, parsed back."""
    return parse_metrics_record(encode_metrics_record(make_metrics_record(source, step, values, now=now)))


# --- the composition rules --------------------------------------------------------


def test_compose_values_follows_the_rules_per_key():
    out = compose_values({1: rank_values(1, 4), 0: rank_values(0, 4)})
    assert out["loss"] == pytest.approx(5.5 - 0.25 * 4)
    assert out["lr"] == 1e-3 and out["tokens_per_s"] == 800.0 and out["samples_per_s"] == 5.0
    assert out["data_wait_frac"] == pytest.approx(0.2) and out["grad_norm_max"] == 2.0
    assert out["acc/pos_1"] == pytest.approx(0.6) and out["acc/pos_2"] == pytest.approx(0.3)
    assert out["eal"] == pytest.approx(0.6 + 0.6 * 0.3)
    # A key only some ranks have (a rank with no finite step sends no loss): the mean over those that do.
    assert compose_values({0: {"loss": 2.0, "lr": 1.0}, 1: {"lr": 2.0}}) == {"loss": 2.0, "lr": 1.0}
    # eal without a complete set of accuracies: the mean eal.
    assert compose_values({0: {"eal": 1.0}, 1: {"eal": 2.0}}) == {"eal": 1.5}


def test_composer_waits_for_every_live_rank_and_drops_steps_a_rank_missed():
    composer = RankComposer()
    composer.add("d0", 0, wire(R0, 10, {"loss": 1.0}))
    assert composer.compose({"d0": [0, 1]}) == []  # rank 1 has not reported step 10 yet
    composer.add("d0", 0, wire(R0, 20, {"loss": 2.0}))
    composer.add("d0", 1, wire(R1, 20, {"loss": 4.0}))  # rank 1's step-10 record was lost
    composer.add("d0", 0, wire(R0, 30, {"loss": 5.0}))
    (record,) = composer.compose({"d0": [0, 1]})
    assert (record.source, record.step, record.values) == ("drafter/d0", 20, {"loss": 3.0})
    assert composer.pending_steps("d0") == [30]  # step 10 can never complete; 30 still can
    # Rank 1 went silent (stale): rank 0 alone makes the drafter's steps.
    assert [(r.step, r.values) for r in composer.compose({"d0": [0]})] == [(30, {"loss": 5.0})]
    composer.forget([])
    assert composer.pending_steps("d0") == []


# --- through the aggregator ---------------------------------------------------------


def test_two_replicas_a_two_rank_drafter_and_a_one_process_drafter():
    clock = [100.0]
    agg = WindowAggregator(stale_after_s=60.0, clock=lambda: clock[0])
    for step in (0, 10):
        for source, values in TARGET.items():
            agg.add(wire(source, step, values))
        agg.add(wire(R0, step, rank_values(0, step)))
        agg.add(wire(R1, step, rank_values(1, step)))
        agg.add(wire(D1, step, d1_values(step)))
    w1 = agg.close_window({})
    row = w1.row

    # Per replica, under its own source; the sums across replicas in pipeline/*.
    assert row["target/0/tokens_per_s"] == 1200.0 and row["target/1/tokens_per_s"] == 1000.0
    assert row["target/0/step"] == row["target/1/step"] == 10 and "target/tokens_per_s" not in row
    assert row["pipeline/num_targets"] == 2
    assert row["pipeline/target_tokens_per_s"] == 2200.0 and row["pipeline/target_batches_per_s"] == 5.5
    assert row["pipeline/target_queue_depth"] == 3 and row["pipeline/target_send_gbps"] == 0.75
    # Each rank under its own source, and the drafter composed from them at each step.
    assert row["rank/d0.0/loss"] == 5.0 - 2.5 and row["rank/d0.1/loss"] == 6.0 - 2.5 and row["rank/d0.1/step"] == 10
    assert [(r.source, r.step) for r in w1.composed] == [("drafter/d0", 0), ("drafter/d0", 10)]
    assert row["drafter/d0/step"] == 10
    assert row["drafter/d0/loss"] == pytest.approx(5.5 - 2.5)
    assert row["drafter/d0/tokens_per_s"] == 800.0 and row["drafter/d0/samples_per_s"] == 5.0
    assert row["drafter/d0/lr"] == 1e-3 and row["drafter/d0/data_wait_frac"] == pytest.approx(0.2)
    assert row["drafter/d0/acc/pos_1"] == pytest.approx(0.6) and row["drafter/d0/eal"] == pytest.approx(0.78)
    # A two-rank drafter is one drafter to the pipeline aggregates.
    assert row["pipeline/num_drafters"] == 2 and row["pipeline/step_skew"] == 0
    assert row["pipeline/drafter_tokens_per_s"] == 1200.0
    assert row["pipeline/loss_mean"] == pytest.approx(((5.5 - 2.5) + (4.0 - 2.5)) / 2)
    assert row["pipeline/rank_skew/d0"] == 0 and not any(k.startswith("pipeline/rank_skew/d1") for k in row)
    assert row["pipeline/supply_ratio"] == pytest.approx(SUPPLY_RATIO)
    assert "d0 step=    10" in w1.line and "ranks=2" in w1.line and "rank_skew" not in w1.line
    assert "target/0 step=    10 tok/s=  1200 queue=  2 | target/1 step=    10 tok/s=  1000" in w1.line
    assert "supply=1.83" in w1.line

    # Rank 0 runs one record ahead: rank skew, and the drafter stays at its last complete step.
    clock[0] += 1.0
    agg.add(wire(R0, 20, rank_values(0, 20)))
    w2 = agg.close_window({})
    assert w2.composed == () and "drafter/d0/step" not in w2.row
    assert w2.row["rank/d0.0/step"] == 20 and w2.row["pipeline/rank_skew/d0"] == 10
    assert "pipeline/supply_ratio" not in w2.row  # no target reported in this window
    assert "rank_skew=10" in w2.line
    # Rank 1 catches up in the next window: step 20 is composed then.
    clock[0] += 1.0
    agg.add(wire(R1, 20, rank_values(1, 20)))
    for source, values in TARGET.items():
        agg.add(wire(source, 20, values))
    w3 = agg.close_window({})
    assert [r.step for r in w3.composed] == [20] and w3.row["drafter/d0/step"] == 20
    assert w3.row["drafter/d0/loss"] == pytest.approx(5.5 - 5.0) and w3.row["pipeline/rank_skew/d0"] == 0
    assert w3.row["pipeline/supply_ratio"] == pytest.approx(SUPPLY_RATIO)  # a rank and a target reported
    assert w3.row["pipeline/step_skew"] == 10  # d0 at 20, d1 at 10

    # Replica 1 and rank 1 go silent: no longer summed, no longer awaited.
    clock[0] += 61.0
    agg.add(wire(T0, 30, TARGET[T0]))
    agg.add(wire(R0, 30, rank_values(0, 30)))
    w4 = agg.close_window({})
    assert w4.row["pipeline/num_targets"] == 1 and w4.row["pipeline/target_tokens_per_s"] == 1200.0
    assert [r.step for r in w4.composed] == [30] and w4.row["drafter/d0/tokens_per_s"] == 300.0
    assert "target/1 stale" in w4.line and "ranks=1" in w4.line


def test_eval_records_of_a_multi_rank_drafter_keep_its_composed_step():
    agg = WindowAggregator()
    agg.add(wire(R0, 60, {"loss": 1.0}))
    agg.add(wire(R1, 60, {"loss": 2.0}))
    agg.add(wire("drafter/d0", 40, {"eval/tau": 1.3}))  # dflash-eval --watch pushes as the drafter
    window = agg.close_window({})
    assert window.row["drafter/d0/step"] == 60 and window.row["drafter/d0/eval/step"] == 40
    assert window.row["drafter/d0/loss"] == 1.5 and window.row["drafter/d0/eval/tau"] == 1.3


# --- W&B layout: ranks in their drafter's run, replicas in the target run --------------


class FakeRun:
    def __init__(self):
        self.logged: list[dict] = []
        self.defined: list[tuple] = []
        self.summary: dict = {}

    def define_metric(self, name, step_metric=None):
        self.defined.append((name, step_metric))

    def log(self, row, step=None, commit=None):
        self.logged.append(dict(row))

    def finish(self):
        pass


def _job_windows(n: int) -> list:
    agg = WindowAggregator()
    out = []
    for i in range(n):
        step = 10 * i
        for source, values in TARGET.items():
            agg.add(wire(source, step, values))
        agg.add(wire(R0, step, rank_values(0, step)))
        agg.add(wire(R1, step, rank_values(1, step)))
        agg.add(wire(D1, step, d1_values(step)))
        out.append(agg.close_window({}))
    return out


def test_split_window_puts_ranks_in_their_drafters_run_and_replicas_in_the_target_run():
    (window,) = _job_windows(1)
    split = split_window(window, has_own_run=lambda key: key in ("drafter/d0", "drafter/d1"))
    assert list(split.rows) == ["drafter/d0", "drafter/d1", "target"]
    d0 = split.rows["drafter/d0"]
    assert d0["loss"] == pytest.approx(5.5) and d0["step"] == 0
    assert d0["rank/0/loss"] == 5.0 and d0["rank/1/loss"] == 6.0 and d0["rank/1/step"] == 0
    assert set(split.folded) == {T0, T1}
    assert split.rows["target"]["target/1/tokens_per_s"] == 1000.0
    assert not any(k.startswith("rank/") for k in split.rows["target"])
    # Without a run of its own (over metrics.wandb_max_drafter_runs) a drafter and its ranks fold in.
    split = split_window(window, has_own_run=lambda key: False)
    assert split.rows["target"]["rank/d0.1/loss"] == 6.0 and split.rows["target"]["drafter/d0/lr"] == 1e-3
    assert drafter_step_metric("rank/1/loss") == "rank/1/step" and drafter_step_metric("rank/1/step") is None
    assert drafter_step_metric("rank/1/acc/pos_2") == "rank/1/step" and drafter_step_metric("loss") == "step"


@pytest.mark.timeout(30)
def test_uploader_opens_one_run_per_drafter_whatever_its_ranks(tmp_path):
    runs: dict[str, FakeRun] = {}

    def init(**kwargs):
        run = runs[kwargs["name"]] = FakeRun()
        return run

    up = WandbUploader(run_dir=tmp_path, run_name="job", backoff_s=0.01, init_fn=init)
    up.start()
    for window in _job_windows(2):
        up.submit(window)
    up.close(timeout_s=10)
    assert set(runs) == {"job/target", "job/d0", "job/d1"} and set(up.run_ids) == {"target", "drafter/d0", "drafter/d1"}
    d0 = runs["job/d0"]
    assert d0.logged[-1]["rank/1/tokens_per_s"] == 500.0 and d0.logged[-1]["tokens_per_s"] == 800.0
    assert ("rank/1/step", None) in d0.defined and ("rank/1/loss", "rank/1/step") in d0.defined
    assert ("loss", "step") in d0.defined
    target = runs["job/target"]
    assert ("target/1/*", "target/1/step") in target.defined
    assert target.logged[-1]["pipeline/supply_ratio"] == pytest.approx(SUPPLY_RATIO)
    assert target.logged[-1]["pipeline/rank_skew/d0"] == 0


# --- the real process ------------------------------------------------------------------


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def wandb_env(tmp_path):
    home = tmp_path / "wandb_home"
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_DATA_DIR": str(home / "data"),
        "WANDB_ARTIFACT_DIR": str(home / "artifacts"),
        "WANDB_DISABLE_GIT": "true",
    }


@pytest.mark.timeout(120)
def test_process_logs_replicas_ranks_the_composed_drafter_and_the_supply_ratio(tmp_path, wandb_env):
    run_dir = tmp_path / "multi"
    address = free_address()
    proc = subprocess.Popen(
        [sys.executable, "-m", "metrics_sidecar", "--address", address, "--run-dir", str(run_dir),
         "--run-name", "multi", "--window-s", "0.3"],
        cwd=REPO_ROOT, env={**os.environ, **wandb_env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    pushers = {s: MetricsPusher(address, s) for s in (T0, T1, R0, R1, D1)}
    try:
        wait_for(lambda: any("[startup]" in line for line in lines), 30, "sidecar start-up")
        for steps in (range(0, 5), range(5, 10)):  # the second phase starts once d0's first steps are composed
            for step in steps:
                for source, values in TARGET.items():
                    assert pushers[source].send(values, step)
                assert pushers[R0].send(rank_values(0, step), step)
                assert pushers[R1].send(rank_values(1, step), step)
                assert pushers[D1].send(d1_values(step), step)
            wait_for(lambda: any(r["source"] == "drafter/d0" and r["step"] == steps[-1]
                                 for r in read_jsonl(run_dir / "metrics.jsonl")), 20, f"d0's step {steps[-1]}")
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    finally:
        for pusher in pushers.values():
            pusher.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    reader.join(5)
    assert rc == 0, "".join(lines)

    # metrics.jsonl: every received record, plus the drafter records composed from d0's ranks.
    records = read_jsonl(run_dir / "metrics.jsonl")
    composed = [r for r in records if r["source"] == "drafter/d0"]
    assert [r["step"] for r in composed] == list(range(10)) and all(r["composed"] for r in composed)
    assert composed[-1]["values"]["loss"] == pytest.approx(5.5 - 0.25 * 9)
    assert composed[-1]["values"]["tokens_per_s"] == 800.0 and composed[-1]["values"]["lr"] == 1e-3
    assert sum(r["source"] == R1 for r in records) == 10 and not any("composed" in r for r in records if r["source"] != "drafter/d0")

    # W&B: one run per drafter (d0's holds its ranks too), replicas in the target run.
    runs = read_wandb_offline_runs(run_dir)
    assert set(runs) == {"multi/d0", "multi/d1", "multi/target"}
    d0, target = runs["multi/d0"], runs["multi/target"]
    last = [row for row in d0.history if "loss" in row][-1]
    assert last["step"] == 9 and last["loss"] == pytest.approx(5.5 - 0.25 * 9) and last["tokens_per_s"] == 800.0
    assert [row["rank/1/loss"] for row in d0.history if "rank/1/loss" in row][-1] == pytest.approx(6.0 - 0.25 * 9)
    assert d0.step_metrics["rank/1/loss"] == "rank/1/step" and d0.step_metrics["loss"] == "step"
    rows = target.history
    assert [r["target/1/tokens_per_s"] for r in rows if "target/1/tokens_per_s" in r][-1] == 1000.0
    assert target.step_metrics["target/0/*"] == "target/0/step"
    assert [r["pipeline/supply_ratio"] for r in rows if "pipeline/supply_ratio" in r][-1] == pytest.approx(SUPPLY_RATIO)
    assert rows[-1]["pipeline/rank_skew/d0"] == 0 and rows[-1]["pipeline/num_drafters"] == 2
    assert rows[-1]["pipeline/target_tokens_per_s"] == 2200.0 and rows[-1]["pipeline/num_targets"] == 2
    assert not any(k.startswith(("rank/", "drafter/")) for row in rows for k in row)
    keys = set().union(*read_wandb_offline_history(run_dir))
    assert {"drafter/d0/loss", "rank/d0.0/loss", "rank/d0.1/step", "drafter/d1/loss", "target/0/step"} <= keys
    windows = [line for line in lines if "[window" in line]
    assert any("ranks=2" in line and "target/1 step=" in line and "supply=1.83" in line for line in windows), windows
