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


def test_the_chain_walk_over_slot_ranks_is_the_decoding_walk_of_heldout_acceptance():
    # Two views of the same drafts: per-slot ranks walked with the chain, and the acceptance walk.
    # A vocabulary of 5 (the mask token is the last) makes a random drafter right often enough to walk.
    import torch

    from target_server.data import Sample
    from tests.fixtures import TINY_CAPTURED, TINY_HIDDEN, tiny_drafter

    model = tiny_drafter(vocab_size=5)
    g = torch.Generator().manual_seed(0)
    samples, feats = [], []
    for j in range(6):
        n = 40
        samples.append(Sample(j, torch.randint(0, 4, (n,), generator=g, dtype=torch.int32),
                              torch.tensor([0] * 6 + [1] * (n - 6), dtype=torch.uint8)))
        feats.append(torch.randn(n, TINY_CAPTURED * TINY_HIDDEN, generator=g))
    embed, head = torch.randn(5, TINY_HIDDEN, generator=g), torch.randn(5, TINY_HIDDEN, generator=g)
    _, rates, walk_tau = recipe_sweep.heldout_acceptance(model, samples, feats, embed, head, range(6))
    answers = recipe_sweep.slot_ranks(model, samples, feats, embed, head, range(6), top=5)
    assert rates[0] > 0.1 and walk_tau > 1.1  # the walk moves past accepted drafts, not one token a step
    assert recipe_sweep.tree_walk_tau(CHAIN, answers) == walk_tau
