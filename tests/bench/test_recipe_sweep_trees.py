"""bench/recipe_sweep.py's verification-tree walk: what a step accepts and how trees are chosen."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import recipe_sweep  # noqa: E402

CHAIN = [(0,), (0, 0), (0, 0, 0)]


def test_a_step_accepts_the_deepest_path_whose_ranks_are_all_right():
    tree = [(0,), (1,), (0, 0), (1, 0)]
    assert recipe_sweep.tree_accepts(tree, (1, 0, 5)) == 2  # second choice at slot 1, then the first
    assert recipe_sweep.tree_accepts(tree, (1, 2, 0)) == 1
    assert recipe_sweep.tree_accepts(tree, (2, 0, 0)) == 0
    assert recipe_sweep.tree_accepts(CHAIN, (1, 0, 0)) == 0  # a chain verifies only the first choices


def test_the_walk_moves_past_accepted_drafts_and_the_targets_token():
    # Answer from position 10: at 10 two drafts are right (next anchor 13), at 13 none (14), at 14 all three (18).
    answers = [(10, {10: (0, 0, 3), 13: (1, 0, 0), 14: (0, 0, 0)})]
    assert recipe_sweep.tree_walk_tau(CHAIN, answers) == (3 + 1 + 4) / 3
    # Verifying the second choice at slot 1 as well rescues the step at 13: 10 -> 13 -> 15, then 15 is unknown.
    assert recipe_sweep.tree_walk_tau(CHAIN + [(1,)], answers) == (3 + 2) / 2


def test_greedy_tree_adds_the_most_often_right_paths_with_their_parents():
    seen = [(0, 0, 0)] * 5 + [(1, 0, 8)] * 4 + [(0, 1, 8)] * 2 + [(2, 8, 8)]
    answers = [(0, dict(enumerate(seen)))]
    tree = recipe_sweep.greedy_tree(answers, nodes=4, top=8, depth=3)
    assert tree == [(0,), (0, 0), (0, 0, 0), (1,)]
    assert all(path[:-1] in tree for path in tree if len(path) > 1)  # prefix-closed: verifiable
    assert len(recipe_sweep.greedy_tree(answers, nodes=100, top=2, depth=1)) == 2  # bounded by top ** depth
