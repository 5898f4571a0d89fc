"""The ranks that train one drafter together (torchrun), and their lockstep rounds.

Every rank receives its own batches (the target hands each batch of the
drafter's stream to one rank), trains on it, and DDP averages the gradients.
Before each batch the ranks hold a *round*: each says what it brings (a batch
``(replica, plan index)``, nothing because its stream is exhausted, or that it
is stopping) in one all-gather over a gloo group of host tensors, so:

- every rank knows which batches the drafter trains in this step, so every
  rank holds the same coverage of the whole drafter (what a HELLO and a
  checkpoint carry) without another message;
- a batch that two ranks bring, or that the drafter has trained already (a
  replica that restarted between a HELLO and an ACK can serve one again), is
  trained by one rank only: the others take a zero-gradient step;
- a rank whose stream has ended takes zero-gradient steps while the others
  still train, so the all-reduces of the step stay matched (uneven inputs);
- all ranks stop at the same round.

Waiting for a round, or for rank 0's checkpoint save, never blocks the control
sockets: the collectives are issued asynchronously and polled while the
caller's ``pump`` keeps heartbeats and receives going.

:class:`SoloGroup` is the same interface for a drafter of one process.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

logger = logging.getLogger(__name__)

# How long a round may wait for the other ranks: as long as a rank waits for batches (a replica
# restarting, a model loading), so no bound; a rank that dies closes its connections, which
# fails the round at once (and torchrun restarts the group).
ROUND_TIMEOUT = datetime.timedelta(days=7)

# What a rank brings to a round.
BATCH, EXHAUSTED, STOPPING = 0, 1, 2
_ROUND_WIDTH = 5  # kind, replica, plan index, tokens, training clock


@dataclass(frozen=True)
class Entry:
    kind: int
    replica: int = -1
    batch_id: int = -1
    tokens: int = 0  # real tokens of the batch (the drafter's tokens-trained count)
    clock_ms: int = 0  # the rank's training clock; rank 0's sets every rank's learning rate (drafter.decay_minutes)


@dataclass(frozen=True)
class RunIdentity:
    """Where this process sits in its torchrun job (all zeros/ones without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    run_id: str = ""
    restart_count: int = 0

    @classmethod
    def from_env(cls, env: dict | None = None) -> "RunIdentity":
        env = os.environ if env is None else env
        if "WORLD_SIZE" not in env:
            return cls()
        return cls(rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]), local_rank=int(env.get("LOCAL_RANK", 0)),
                   run_id=env.get("TORCHELASTIC_RUN_ID", ""),
                   restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))


def trained_in_round(entries: list[Entry], already_trained: Callable[[int, int], bool]) -> list[int | None]:
    """For each rank, the batch it trains this round as ``entries`` index, or None for a zero-gradient step.

    A batch is trained once: by the lowest rank that brings it, and not at all if the drafter has it already.
    """
    seen: set[tuple[int, int]] = set()
    out: list[int | None] = []
    for rank, e in enumerate(entries):
        key = (e.replica, e.batch_id)
        if e.kind == BATCH and key not in seen and not already_trained(*key):
            seen.add(key)
            out.append(rank)
        else:
            out.append(None)
    return out


class SoloGroup:
    """A drafter of one process: rounds are immediate, nothing is all-reduced."""

    rank = 0
    world_size = 1
    is_leader = True

    def round(self, mine: Entry, pump: Callable[[], None]) -> list[Entry]:
        return [mine]

    def gather_bytes(self, data: torch.Tensor, pump: Callable[[], None]) -> list[torch.Tensor]:
        return [data]

    def broadcast_int(self, value: int, pump: Callable[[], None]) -> int:
        return value

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        pass

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        return model

    def close(self) -> None:
        pass


class RankGroup:
    """``world_size`` ranks of one drafter under torchrun: DDP on ``backend``, rounds on a gloo group."""

    is_leader: bool

    def __init__(self, identity: RunIdentity, backend: str, device: torch.device, timeout_s: float):
        import torch.distributed as dist

        self._dist = dist
        self.rank = identity.rank
        self.world_size = identity.world_size
        self.is_leader = identity.rank == 0
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend=backend, store=_attempt_store(identity, timeout), rank=self.rank,
                                world_size=self.world_size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
        # Host tensors only: reading a round never waits on the device. Its own group, for its own timeout.
        self._control = dist.new_group(backend="gloo", timeout=ROUND_TIMEOUT)
        logger.info("[group] rank %d of %d joined (%s for gradients, gloo for rounds)", self.rank, self.world_size,
                    backend)

    def _wait(self, work, pump: Callable[[], None]) -> None:
        while not work.is_completed():
            pump()
            time.sleep(0.002)
        work.wait()

    def round(self, mine: Entry, pump: Callable[[], None]) -> list[Entry]:
        """Every rank's entry of this round, in rank order (waits for all of them, pumping meanwhile)."""
        out = [torch.empty(_ROUND_WIDTH, dtype=torch.int64) for _ in range(self.world_size)]
        mine_t = torch.tensor([mine.kind, mine.replica, mine.batch_id, mine.tokens, mine.clock_ms], dtype=torch.int64)
        self._wait(self._dist.all_gather(out, mine_t, group=self._control, async_op=True), pump)
        return [Entry(*(int(v) for v in t.tolist())) for t in out]

    def gather_bytes(self, data: torch.Tensor, pump: Callable[[], None]) -> list[torch.Tensor]:
        """Every rank's uint8 tensor of the same length (RNG states for rank 0's checkpoint)."""
        out = [torch.empty_like(data) for _ in range(self.world_size)]
        self._wait(self._dist.all_gather(out, data.contiguous(), group=self._control, async_op=True), pump)
        return out

    def broadcast_int(self, value: int, pump: Callable[[], None]) -> int:
        """Rank 0's ``value`` on every rank."""
        t = torch.tensor([value], dtype=torch.int64)
        self._wait(self._dist.broadcast(t, src=0, group=self._control, async_op=True), pump)
        return int(t.tolist()[0])  # a host tensor of the gloo group: no device sync

    def broadcast_parameters(self, model: torch.nn.Module) -> None:
        """Rank 0's weights everywhere (after a rank-local initialisation such as the feature scale)."""
        with torch.no_grad():
            for p in model.parameters():
                self._dist.broadcast(p.data, src=0)

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """The model for forward/backward: DDP over the group (the weights stay ``model``'s)."""
        from torch.nn.parallel import DistributedDataParallel

        class DrafterDDP(DistributedDataParallel):
            # dflash_block_loss reads the drafter's attributes (block size, heads) as well as calling it.
            def __getattr__(self, name):
                try:
                    return super().__getattr__(name)
                except AttributeError:
                    return getattr(self.module, name)

        return DrafterDDP(model, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)

    def close(self) -> None:
        try:
            self._dist.destroy_process_group()
        except Exception as exc:  # leaving anyway
            logger.debug("destroy_process_group: %s", exc)


def _attempt_store(identity: RunIdentity, timeout: datetime.timedelta):
    """torchrun's store (MASTER_ADDR:MASTER_PORT), under a prefix of this restart attempt.

    Without it a restarted group can read the addresses the previous attempt's ranks published
    and fail to connect to them (gloo "connectFullMesh failed ... Connection refused").
    """
    from torch.distributed import PrefixStore, TCPStore

    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), identity.world_size,
                     is_master=not agent_hosts_it and identity.rank == 0, timeout=timeout)
    return PrefixStore(f"dflash/{identity.run_id}/attempt-{identity.restart_count}", store)


def make_group(identity: RunIdentity, device: torch.device, timeout_s: float) -> SoloGroup | RankGroup:
    if identity.world_size == 1:
        return SoloGroup()
    return RankGroup(identity, "nccl" if device.type == "cuda" else "gloo", device, timeout_s)
