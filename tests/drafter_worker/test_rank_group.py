"""Tests for drafter_worker/rank_group.py: who trains what in a round, and torchrun's environment."""

from __future__ import annotations

from drafter_worker.checkpoint import Coverage, TrainerState
from drafter_worker.rank_group import BATCH, EXHAUSTED, STOPPING, Entry, RunIdentity, SoloGroup, trained_in_round


def _state(replicas: int = 2) -> TrainerState:
    return TrainerState(0, [Coverage() for _ in range(replicas)], "d0", "tiny")


def test_each_batch_of_a_round_is_trained_once_by_the_lowest_rank_that_brings_it():
    state = _state()
    state.coverage[1].add(0)  # plan index 1 (replica 1's local 0) is trained already
    entries = [Entry(BATCH, 0, 4), Entry(BATCH, 0, 4), Entry(EXHAUSTED), Entry(BATCH, 1, 1), Entry(BATCH, 1, 3)]
    assert trained_in_round(entries, state.trained) == [0, None, None, None, 4]


def test_a_round_of_nothing_new_trains_nothing():
    state = _state(replicas=1)
    state.coverage[0].add(0)
    assert trained_in_round([Entry(BATCH, 0, 0), Entry(EXHAUSTED), Entry(STOPPING)], state.trained) == [None] * 3


def test_run_identity_reads_torchrun_and_defaults_to_one_process():
    assert RunIdentity.from_env({}) == RunIdentity(0, 1, 0, "", 0)
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "job7",
           "TORCHELASTIC_RESTART_COUNT": "2"}
    assert RunIdentity.from_env(env) == RunIdentity(3, 4, 1, "job7", 2)


def test_a_one_process_drafter_has_rounds_of_one_and_no_wrapper():
    group = SoloGroup()
    mine = Entry(BATCH, 0, 7, 100)
    assert group.round(mine, pump=lambda: None) == [mine]
    assert group.broadcast_int(5, pump=lambda: None) == 5
    model = object()
    assert group.wrap(model, None) is model
