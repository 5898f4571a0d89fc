"""The sidecar's bounded per-source state, its torn-tail repair, and the W&B step it logs.

Pure pieces with a fake clock or a fake W&B run; the process-level versions
are in tests/hostile/test_sidecar_durability.py.
"""

from __future__ import annotations

import json

import pytest

from common.metrics_client import MetricsRecord
from metrics_sidecar.aggregate import WindowAggregator
from metrics_sidecar.jsonl_log import JsonlLog, repair_torn_tail
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

    def define_metric(self, name, step_metric=None):
        pass

    def log(self, row, step=None, commit=None):
        self.calls.append((step, commit))

    def finish(self):
        pass


def test_uploader_logs_window_n_as_wandb_step_n(tmp_path):
    # Regression: a restarted sidecar's rows restarted at _step 0 in W&B.
    run = RecordingRun()
    up = WandbUploader(run_dir=tmp_path, run_name="r", init_fn=lambda **kw: run)
    agg = WindowAggregator(first_window=41)
    up.start()
    for _ in range(2):
        agg.add(rec("drafter/d0"))
        up.submit(agg.close_window({}))
    up.close(timeout_s=10)
    assert run.calls == [(41, True), (42, True)]
