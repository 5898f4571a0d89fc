"""Which target replica serves which batch of the plan, and the job's topology id.

With ``target.replicas = N``, replica ``r`` owns the plan indices ``i`` with
``i mod N == r``: which target serves a batch is a function of the batch, so
replicas never coordinate with each other. A drafter keeps its coverage per
replica in the replica's *local* indices (``i // N``), which keeps one
watermark per replica dense while the replicas progress at different rates:
HELLO stays small whatever the skew between replicas.

The topology id names (plan, replica count): a checkpoint made under one
topology cannot resume under another, because its per-replica coverage would
name other batches.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    replica: int = 0
    replicas: int = 1

    def __post_init__(self) -> None:
        if not (self.replicas >= 1 and 0 <= self.replica < self.replicas):
            raise ValueError(f"replica {self.replica} of {self.replicas}: need 0 <= replica < replicas")

    def owns(self, index: int) -> bool:
        return index >= 0 and index % self.replicas == self.replica

    def local(self, index: int) -> int:
        """The replica's local index of plan index ``index`` (which it must own)."""
        if not self.owns(index):
            raise ValueError(f"plan index {index} belongs to replica {index % self.replicas}, not {self.replica}")
        return index // self.replicas

    def plan_index(self, local: int) -> int:
        return local * self.replicas + self.replica

    def size(self, total: int) -> int:
        """How many of the plan indices below ``total`` this replica owns."""
        return max(0, (total - self.replica + self.replicas - 1) // self.replicas)


def topology_id(plan_fingerprint: str, replicas: int) -> str:
    """Names the split of one plan over ``replicas`` targets (what per-replica coverage refers to)."""
    return hashlib.sha256(f"{plan_fingerprint}/{replicas}".encode()).hexdigest()[:16]


def plan_fingerprint(data_fingerprint: str, batches_per_epoch: int, total_batches: int | None,
                     buckets: list[list[int]], seed: int) -> str:
    """Names the sequence of batches: the data and everything that cuts it into plan indices."""
    text = f"{data_fingerprint}/{batches_per_epoch}/{total_batches}/{buckets}/{seed}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
