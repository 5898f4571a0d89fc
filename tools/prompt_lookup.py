"""Prompt lookup in front of a drafter: copies what the context already holds.

A DFlash drafter reads each context position only through the target's
features there, which hold the position's own token clearly and the token
before it less so. The recipe's drafter seldom drafts a stretch the answer
copies from its prompt (docs/recipe.md, "Copying from the prompt"). Prompt lookup drafts exactly
those: where the sequence's last n tokens occurred before, the drafts are the
tokens that followed their latest occurrence. :class:`PromptLookupProposer`
tries the lookup first and asks the drafter only where it finds nothing; the
target verifies either draft the same way, so greedy decoding stays exact.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

MAX_NGRAM = 4
MIN_NGRAM = 2


def lookup_draft(sequence: Sequence[int], num_draft: int, max_ngram: int = MAX_NGRAM,
                 min_ngram: int = MIN_NGRAM) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the sequence's last n tokens, for the
    longest n from ``max_ngram`` down to ``min_ngram`` that occurs; ``[]`` where none does."""
    seq = list(sequence)
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        key = seq[-n:]
        for j in range(len(seq) - n - 1, -1, -1):
            if seq[j:j + n] == key:
                return seq[j + n:j + n + num_draft]
    return []


class PromptLookupProposer:
    """Drafts by prompt lookup where it finds a match, by ``inner`` (a :class:`tools.speculative.Proposer`)
    elsewhere.

    The target features that arrive on lookup steps are held back and handed to ``inner`` on its next
    call, so its context stays in step with the target's. Lookup drafts come as logits that are 0 at the
    drafted token and -inf elsewhere: a sampled verification then draws that token with probability 1,
    and stays exact.
    """

    def __init__(self, inner: Any, vocab_size: int, device: torch.device | str = "cpu",
                 max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.inner = inner
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.block_size = inner.block_size
        self.layer_ids = inner.layer_ids
        self.lookup_steps = 0  # steps drafted by the lookup (all sequences)
        self._held: torch.Tensor | None = None

    # What an evaluation report reads of its proposer: the drafter's own settings and cost.
    @property
    def denoise_passes(self) -> int:
        return self.inner.denoise_passes

    @property
    def draft_confidence(self) -> float:
        return self.inner.draft_confidence

    @property
    def passes_taken(self) -> int:
        return self.inner.passes_taken

    def reset(self) -> None:
        self.inner.reset()
        self._held = None

    def propose(self, features: torch.Tensor | None, anchor: int, start: int, num_draft: int,
                tokens: Sequence[int] = ()) -> torch.Tensor:
        if features is not None:
            self._held = features if self._held is None else torch.cat([self._held, features], dim=1)
        draft = lookup_draft(tokens, num_draft, self.max_ngram, self.min_ngram)
        if draft:
            self.lookup_steps += 1
            logits = torch.full((len(draft), self.vocab_size), float("-inf"), device=self.device)
            logits[torch.arange(len(draft)), torch.tensor(draft)] = 0.0
            return logits
        held, self._held = self._held, None
        return self.inner.propose(held, anchor, start, num_draft, tokens)
