"""tools/prompt_lookup.py: what prompt lookup drafts, and how it hands the other steps to the drafter."""

from __future__ import annotations

import torch

from tools.prompt_lookup import PromptLookupProposer, lookup_draft


def test_lookup_drafts_what_followed_the_latest_occurrence_of_the_longest_ngram():
    #            0  1  2  3  4  5  6  7  8  9  10
    sequence = [5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7]
    # The bigram (6, 7) occurs at 1 and 5: the latest, at 5, is followed by 1, 2, 6.
    assert lookup_draft(sequence, 3) == [1, 2, 6]
    # The longer match wins over a later, shorter one: (9, 6, 7) at 0, not (6, 7) at 5.
    assert lookup_draft([9, 6, 7, 4, 3, 6, 7, 0, 9, 6, 7], 2) == [4, 3]
    assert lookup_draft([1, 2, 3, 4], 3) == []  # no bigram repeats
    assert lookup_draft([1, 2, 3, 4], 3, min_ngram=1) == []  # nor does the last token
    assert lookup_draft([4, 1, 2, 3, 4], 3, min_ngram=1) == [1, 2, 3]
    assert lookup_draft([1, 2, 1, 2], 4) == [1, 2]  # what is there, up to the sequence's end


class RecordingProposer:
    block_size = 5
    layer_ids = [0]

    def __init__(self):
        self.calls = []

    def reset(self):
        self.calls.clear()

    def propose(self, features, anchor, start, num_draft, tokens=()):
        self.calls.append((features.shape[1], start))
        return torch.zeros(1, 10)


def test_the_drafter_gets_the_features_of_the_lookup_steps_on_its_next_call():
    inner = RecordingProposer()
    proposer = PromptLookupProposer(inner, vocab_size=10)
    features = lambda n: torch.zeros(1, n, 3)  # noqa: E731
    # Step 1: nothing repeats, the drafter drafts with the prompt's 3 positions.
    proposer.propose(features(3), 4, 3, 4, [1, 2, 3, 4])
    # Step 2: (3, 4) occurred at 2: the lookup drafts what followed, as logits whose argmax it is.
    logits = proposer.propose(features(2), 4, 5, 4, [1, 2, 3, 4, 3, 4])
    assert logits.argmax(-1).tolist() == [3, 4] and torch.isinf(logits).sum() == 2 * 9
    # Step 3: the drafter's context gets step 2's 2 positions and step 3's 1 at once.
    proposer.propose(features(1), 7, 6, 4, [1, 2, 3, 4, 3, 4, 7])
    assert inner.calls == [(3, 3), (3, 6)] and proposer.lookup_steps == 1
    proposer.reset()
    assert inner.calls == []
