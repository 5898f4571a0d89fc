"""The sidecar's bounded per-source state, its torn-tail repair, the W&B steps it logs and its run ids.

Pure pieces with a fake clock or a fake W&B run; the process-level versions
are in tests/hostile/test_sidecar_durability.py.
"""

from __future__ import annotations

import json

import pytest

from common.metrics_client import MetricsRecord
from metrics_sidecar.aggregate import WindowAggregator
from metrics_sidecar.jsonl_log import JsonlLog, repair_torn_tail
from metrics_sidecar.wandb_layout import LEGACY_RUN_ID_FILE, RUNS_FILE, TARGET_RUN, RunRegistry, resolve_wandb_settings
from metrics_sidecar.wandb_uploader import WandbUploader


def rec(source: str, step: int = 0, **values) -> MetricsRecord:
    return MetricsRecord(source=source, step=step, time=0.0, values=values or {"x": 1.0}, dropped=0)


def test_aggregator_refuses_sources_beyond_the_limit_and_forgets_silent_ones():
    # Regression: every fresh source name stayed in the sidecar's state for good.
    clock = [0.0]
    agg = WindowAggregator(stale_after_s=1.0, max_sources=3, clock=lambda: clock[0])
    assert agg.forget_after_s == 10.0
    for name in ("drafter/d0", "a", "b"):
        assert agg.admits(name)
        agg.add(rec(name))
    assert not agg.admits("c") and agg.admits("a")
    agg.close_window({})
    clock[0] = 5.0
    agg.add(rec("drafter/d0", 1))
    clock[0] = 10.5  # a and b silent for 10.5 s, d0 for 5.5 s
    assert agg.forget_silent() == ["a", "b"]
    assert set(agg.states) == {"drafter/d0"} and agg.admits("c")


def test_sources_in_the_open_window_are_never_forgotten():
    clock = [0.0]
    agg = WindowAggregator(stale_after_s=1.0, forget_after_s=0.0, clock=lambda: clock[0])
    agg.add(rec("a"))
    clock[0] = 1.0
    assert agg.forget_silent() == []  # its series are still to be logged
    window = agg.close_window({})
    assert window.row["a/x"] == 1.0 and agg.forget_silent() == ["a"]


@pytest.mark.parametrize(
    "content, kept",
    [
        (b"", b""),
        (b'{"a":1}\n', b'{"a":1}\n'),
        (b'{"a":1}\n{"b":', b'{"a":1}\n'),
        (b'{"b":', b""),
        (b"x" * 200_000 + b"\n" + b"y" * 100_000, b"x" * 200_000 + b"\n"),  # newline beyond one read chunk
    ],
)
def test_repair_torn_tail(tmp_path, content, kept):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(content)
    assert repair_torn_tail(path) == len(content) - len(kept)
    assert path.read_bytes() == kept
    assert repair_torn_tail(tmp_path / "missing.jsonl") == 0


def test_jsonl_log_writes_a_window_at_flush_and_continues_after_a_torn_line(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"source":"a","step":0}\n{"sou')
    log = JsonlLog(path)
    assert "dropped its last 5 byte(s)" in caplog.text
    log.write(rec("a", 1), received_at=1.0)
    log.write(rec("a", 2), received_at=2.0)
    assert path.read_bytes() == b'{"source":"a","step":0}\n'  # nothing before the window closes
    log.flush()
    log.close()
    log.close()  # idempotent
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]


class RecordingRun:
    def __init__(self):
        self.calls: list[tuple[int | None, bool | None]] = []
        self.summary: dict = {}

    def define_metric(self, name, step_metric=None):
        pass

    def log(self, row, step=None, commit=None):
        self.calls.append((step, commit))

    def finish(self):
        pass


def test_uploader_logs_window_n_as_wandb_step_n_in_every_run(tmp_path):
    # Regression: a restarted sidecar's rows restarted at _step 0 in W&B.
    runs: dict[str, RecordingRun] = {}

    def init(**kwargs):
        return runs.setdefault(kwargs["name"], RecordingRun())

    up = WandbUploader(run_dir=tmp_path, run_name="r", init_fn=init)
    agg = WindowAggregator(first_window=41)
    up.start()
    agg.add(rec("drafter/d0"))
    up.submit(agg.close_window({}))
    agg.add(rec("drafter/d1"))  # a drafter's first window is the job's 42nd
    up.submit(agg.close_window({}))
    up.close(timeout_s=10)
    assert runs["r/target"].calls == [(41, True), (42, True)]
    assert runs["r/d0"].calls == [(41, True)] and runs["r/d1"].calls == [(42, True)]


def test_run_registry_persists_ids_caps_drafter_runs_and_continues_a_legacy_run(tmp_path, caplog):
    settings = resolve_wandb_settings(run_dir=tmp_path, job_name="job", env={})
    (tmp_path / LEGACY_RUN_ID_FILE).write_text("job-1234abcd\n")  # an earlier sidecar's single run
    registry = RunRegistry(tmp_path, "job", settings, max_drafter_runs=1)
    target = registry.spec(TARGET_RUN)
    assert (target.run_id, target.name, target.job_type) == ("job-1234abcd", "job/target", "target")
    d0 = registry.spec("drafter/d0")
    assert d0.name == "job/d0" and d0.drafter_id == "d0" and d0.run_id.startswith("job-d0-")
    assert registry.spec("drafter/d1") is None and registry.spec("eval") is None and registry.spec("drafter/a/b") is None
    registry.remember_summary("drafter/d0", {"eval/tau": 1.5, "eval/step": 40})
    again = RunRegistry(tmp_path, "job", settings, max_drafter_runs=1)
    assert again.ids == {"target": "job-1234abcd", "drafter/d0": d0.run_id}
    assert again.spec("drafter/d0").summary == {"eval/tau": 1.5, "eval/step": 40}
    # A fresh run directory never resumes another job's runs of the same name.
    assert RunRegistry(tmp_path / "fresh", "job", settings).spec(TARGET_RUN).run_id != target.run_id
    (tmp_path / RUNS_FILE).write_text("{not json")
    assert RunRegistry(tmp_path, "job", settings).ids == {} and "ignoring unreadable" in caplog.text
