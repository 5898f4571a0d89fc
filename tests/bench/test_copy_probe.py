"""bench/copy_probe.py: the decoding walks that compare prompt lookup with the drafter."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import copy_probe  # noqa: E402
import recipe_sweep  # noqa: E402


def test_a_lookup_step_replaces_the_drafters_only_where_the_lookup_drafts():
    # Answer from 10. The lookup drafts at 12 (2 right) and 13 (none right), nowhere else.
    steps = {10: (1, -1), 12: (0, 2), 13: (3, 0), 15: (0, -1), 17: (1, -1)}
    tables = copy_probe.walk_tables(steps, 10)
    assert recipe_sweep.decoding_walk([tables["drafter"]]) == (2 + 1 + 4 + 2) / 4  # 10, 12, 13, 17
    assert recipe_sweep.decoding_walk([tables["lookup, else drafter"]]) == (2 + 3 + 1) / 3  # 10, 12, 15
    assert recipe_sweep.decoding_walk([tables["better of the two (oracle)"]]) == (2 + 3 + 1) / 3
    # Where the lookup drafts wrong and the drafter right, the lookup's step loses and the oracle's does not.
    tables = copy_probe.walk_tables({10: (2, 0)}, 10)
    assert [recipe_sweep.decoding_walk([t]) for t in tables.values()] == [3.0, 1.0, 3.0]


def test_greedy_verification_accepts_the_leading_right_drafts():
    assert copy_probe.accepted_run([1, 2, 3], [1, 2, 4, 5]) == 2
    assert copy_probe.accepted_run([1, 2, 3], [1, 2]) == 2  # the answer ends
    assert copy_probe.accepted_run([], [1]) == 0
    assert copy_probe.confidence_bin(0.95) == "0.9-1.0" and copy_probe.confidence_bin(1.0) == "0.9-1.0"
    assert copy_probe.confidence_bin(0.3) == "0.3-0.5"
