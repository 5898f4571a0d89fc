"""STATUS's tokens/s: the target's capture rate over the last minute, not over one metrics window."""

from __future__ import annotations

import pytest

from target_server.server import STATUS_RATE_SPAN_S, rate_over


def test_status_rate_is_steady_where_windows_alternate_and_falls_to_zero_when_capture_stops():
    # 10-s windows holding two and one 1,280-token batches in turn: their own rates swing between 256
    # and 128 tokens/s; a minute of them reads 192.
    history, total = [(0.0, 0)], 0
    for i in range(1, 13):
        total += 1280 * (1 + i % 2)
        history.append((10.0 * i, total))
    assert STATUS_RATE_SPAN_S == 60.0
    assert [rate_over(history[:k + 1], 60.0) for k in range(6, 13)] == [pytest.approx(192.0)] * 7
    assert rate_over(history[:3], 60.0) == pytest.approx(3840 / 20)  # under a minute in: what there is
    # A target that stopped capturing reads 0 a minute later, not its last busy rate.
    stalled = history + [(130.0 + 10.0 * i, total) for i in range(6)]
    assert rate_over(stalled, 60.0) == 0.0
    assert rate_over([(5.0, 0)], 60.0) == 0.0  # no window yet
