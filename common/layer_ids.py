"""Which target layers feed a DFlash drafter: the one rule both sides of a job share.

The target captures these layers' outputs; the drafter's ``fc`` reads their
concatenation. Here, not in the drafter's model package, so the target server
needs no drafter code to know what to capture.
"""

from __future__ import annotations

from typing import Any


def _is_int(value: Any) -> bool:
    # bool is an int subclass; a True/False layer count is always a caller bug.
    return isinstance(value, int) and not isinstance(value, bool)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose outputs feed the drafter (the DFlash rule).

    One draft layer reads the middle target layer; otherwise the layers are
    spread evenly (rounded) from layer 1 to layer ``num_target_layers - 3``
    inclusive.  The feature for layer ``i`` is ``hidden_states[i + 1]`` in
    transformers' indexing (index 0 is the embedding output).
    """
    if not _is_int(num_target_layers) or num_target_layers < 1:
        raise ValueError(f"num_target_layers must be a positive int, got {num_target_layers!r}")
    if not _is_int(num_draft_layers) or num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be a positive int, got {num_draft_layers!r}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    # Distinct layers need at least num_draft_layers candidates in [start, end].
    if end - start + 1 < num_draft_layers:
        raise ValueError(
            f"cannot spread {num_draft_layers} draft layers over target layers "
            f"{start}..{end} of a {num_target_layers}-layer target; need "
            f"num_target_layers >= num_draft_layers + 3"
        )
    span = end - start
    # Python's round() (half to even) is what the published rule uses, so the
    # chosen layers match published checkpoints exactly.
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]
