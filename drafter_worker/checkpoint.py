"""Checkpoints, the data cursor they carry, and the ledger of trained samples.

A checkpoint is a directory ``checkpoints/<drafter>/step-N/`` holding the
drafter in the published layout (``config.json`` + ``model.safetensors``),
``trainer.pt`` (optimizer state and RNG states: tensors only, loaded with
``weights_only=True``) and ``trainer_state.json`` (step, data cursor, data
identity). It is written under ``.tmp-step-N-<pid>``, every file and the
directory are fsynced, then it is renamed into place and ``latest`` is flipped
atomically (temporary file, fsync, rename, fsync of the directory), so a kill
or a power cut leaves either the old or the new checkpoint. A ``latest`` that
cannot be used falls back to the newest readable ``step-N``; the writer removes
temporaries a killed save left behind.

A drafter trained by several ranks (torchrun) has one checkpoint, written by
rank 0 after every rank made its ledger lines durable; it carries the
drafter's coverage of every target replica and each rank's RNG states.

The ledger (``ledger/<drafter>.jsonl``, one per rank ``ledger/<drafter>.rank<k>.jsonl``
when there are several) records, for every durable step, which
batch and sample ids it trained (or that the rank took a zero-gradient step). Every process start appends a ``resume`` line
naming the checkpoint step it resumed from, which discards later steps of the
dead lineage, so the lineage of the final checkpoint can be read from the file.
Lines are appended with one ``write`` each on an ``O_APPEND`` descriptor and
fsynced before the checkpoint that covers them is renamed into place; a line a
kill cut short is truncated before the next append.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError

from common.durable_io import cut_torn_tail, fsync_path, replace_durably, write_all, write_durably
from common.plan_shard import Shard
from drafter_worker.model.dflash_model import DFlashDrafter, load_drafter, save_drafter

logger = logging.getLogger(__name__)

CHECKPOINT_FILES = ("config.json", "model.safetensors", "trainer.pt", "trainer_state.json")
_STEP_NAME = re.compile(r"step-(\d+)")
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


class _RecordingFile:
    """A file for torch.save that keeps the OSError of a failed write, which torch reports as a bare RuntimeError."""

    def __init__(self, f):
        self._f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._f.flush()


def _torch_save(obj, path: Path) -> None:
    """torch.save that fails with the OSError of a failed write (a full disk), naming ``path``."""
    try:
        with open(path, "wb") as f:
            out = _RecordingFile(f)
            try:
                torch.save(obj, out)
            except RuntimeError:
                if out.error is None:
                    raise
                raise out.error from None
    except OSError as exc:  # from a write, or from flushing the rest at close
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from None


def _save_weights(directory: Path, model: DFlashDrafter) -> None:
    try:
        save_drafter(directory, model)
    except SafetensorError as exc:  # how safetensors reports a failed write ("... (os error 28)")
        found = _OS_ERROR.search(str(exc))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(directory / "model.safetensors")) from None


def _discard(path: Path) -> None:
    """Remove a temporary directory; one that cannot be removed now is removed at the writer's next start."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return  # never created (the save failed before its mkdir)
    except OSError as exc:
        logger.warning("[checkpoint] could not remove %s (%s); the next start removes it", path, exc)


@dataclass
class Coverage:
    """Plan indices trained so far: everything below ``watermark`` plus ``extra``."""

    watermark: int = 0
    extra: set[int] = field(default_factory=set)

    def __contains__(self, index: int) -> bool:
        return index < self.watermark or index in self.extra

    def add(self, index: int) -> None:
        if index < self.watermark or index in self.extra:
            raise ValueError(f"batch {index} trained twice")
        self.extra.add(index)
        while self.watermark in self.extra:
            self.extra.remove(self.watermark)
            self.watermark += 1

    def to_json(self) -> dict:
        return {"watermark": self.watermark, "extra": sorted(self.extra)}

    @classmethod
    def from_json(cls, data: dict) -> "Coverage":
        return cls(int(data["watermark"]), {int(i) for i in data["extra"]})


@dataclass
class TrainerState:
    step: int
    coverage: list[Coverage]  # one per target replica, in its local indices (common.plan_shard)
    drafter_id: str
    model_id: str
    tokens_trained: int = 0
    # The data the checkpoint was trained on (WELCOME): size of the training split, its
    # content hash and the plan's batches per epoch. Empty/0 in checkpoints that predate them.
    train_samples: int = 0
    data_fingerprint: str = ""
    batches_per_epoch: int = 0
    # The drafter directory training started from (drafter.init_from); empty for a random start.
    init_from: str = ""
    # The plan x replica split the coverage refers to (WELCOME.topology_id; empty before the first batch).
    topology_id: str = ""
    world_size: int = 1  # ranks that trained the drafter (the RNG states in trainer.pt are per rank)
    # The drafter's training clock: wall-clock seconds since its first step, over all its runs
    # (drafter.decay_minutes schedules by it). 0 in checkpoints that predate it.
    train_seconds: float = 0.0

    def to_json(self) -> dict:
        data = {
            "step": self.step, "coverage": [c.to_json() for c in self.coverage], "drafter_id": self.drafter_id,
            "model_id": self.model_id, "tokens_trained": self.tokens_trained,
            "train_samples": self.train_samples, "data_fingerprint": self.data_fingerprint,
            "batches_per_epoch": self.batches_per_epoch, "topology_id": self.topology_id,
            "world_size": self.world_size, "train_seconds": self.train_seconds,
        }
        if self.init_from:
            data["init_from"] = self.init_from
        return data

    @classmethod
    def from_json(cls, data: dict) -> "TrainerState":
        coverage = data["coverage"]
        # A checkpoint from before target replicas holds one coverage map.
        coverage = [Coverage.from_json(c) for c in coverage] if isinstance(coverage, list) else [Coverage.from_json(coverage)]
        return cls(
            step=int(data["step"]), coverage=coverage, drafter_id=data["drafter_id"],
            model_id=data["model_id"], tokens_trained=int(data.get("tokens_trained", 0)),
            train_samples=int(data.get("train_samples", 0)), data_fingerprint=data.get("data_fingerprint", ""),
            batches_per_epoch=int(data.get("batches_per_epoch", 0)), init_from=data.get("init_from", ""),
            topology_id=data.get("topology_id", ""), world_size=int(data.get("world_size", 1)),
            train_seconds=_seconds(data.get("train_seconds", 0.0)),
        )

    def trained(self, replica: int, batch_id: int) -> bool:
        """Whether the drafter has trained plan index ``batch_id`` of ``replica``."""
        return batch_id // len(self.coverage) in self.coverage[replica]

    def claimed(self) -> dict[int, set[int]]:
        """replica -> the plan indices the coverage counts as trained."""
        replicas = len(self.coverage)
        return {r: {Shard(r, replicas).plan_index(j) for j in (*range(c.watermark), *c.extra)}
                for r, c in enumerate(self.coverage)}


def _seconds(value) -> float:
    if type(value) not in (int, float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"train_seconds must be a finite number >= 0, got {value!r}")
    return float(value)


def _why_unreadable(path: Path) -> str:
    """Why ``path`` is not a complete checkpoint; empty when it is one."""
    bad = [name for name in CHECKPOINT_FILES if not (path / name).is_file() or (path / name).stat().st_size == 0]
    if bad:
        return f"lacks {', '.join(bad)}"
    try:
        TrainerState.from_json(json.loads((path / "trainer_state.json").read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"has an unreadable trainer_state.json ({type(exc).__name__}: {exc})"
    return ""


class InitFromError(ValueError):
    """``drafter.init_from`` names no usable drafter, or one made for another target; the message says which."""


def load_init_from(
    directory: str | Path,
    device: torch.device,
    *,
    hidden_size: int,
    vocab_size: int,
    target_layer_ids: list[int],
    mask_token_id: int,
    block_size: int,
) -> DFlashDrafter:
    """The drafter of an exported or published DFlash directory (``drafter.init_from``), in fp32 on
    ``device``, after checking that it fits this target and block size; raises :class:`InitFromError`."""
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise InitFromError(f"drafter.init_from = {str(directory)!r}: no config.json there "
                            "(expected an exported or published DFlash drafter directory)")
    try:
        model = load_drafter(path, device=device)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        raise InitFromError(f"drafter.init_from = {str(directory)!r} cannot be loaded as a DFlash drafter: "
                            f"{type(exc).__name__}: {exc}") from None
    config = model.config
    wrong = []
    if config.hidden_size != hidden_size:
        wrong.append(f"hidden size {config.hidden_size}, the target's is {hidden_size}")
    if config.vocab_size != vocab_size:
        wrong.append(f"vocabulary size {config.vocab_size}, the target's is {vocab_size}")
    if list(model.target_layer_ids) != list(target_layer_ids):
        wrong.append(f"target layers {list(model.target_layer_ids)}, the target captures {list(target_layer_ids)} "
                     f"(set target.target_layer_ids = {list(model.target_layer_ids)})")
    if model.mask_token_id != mask_token_id:
        wrong.append(f"mask token {model.mask_token_id}, the target uses {mask_token_id} "
                     f"(set target.mask_token_id = {model.mask_token_id})")
    if model.block_size != block_size:
        wrong.append(f"block size {model.block_size}, drafter.block_size is {block_size} "
                     f"(set drafter.block_size = {model.block_size})")
    if wrong:
        raise InitFromError(f"drafter.init_from = {str(directory)!r} was made for another setup: " + "; ".join(wrong))
    return model.float()


class CheckpointStore:
    """The checkpoints of one drafter. Only the drafter itself passes ``writer=True``: it removes the
    temporaries of a save that was killed, which a reader could not tell from a save in progress."""

    def __init__(self, run_dir: Path, drafter_id: str, keep: int, writer: bool = False):
        self.root = run_dir / "checkpoints" / drafter_id
        self.keep = keep
        if writer:
            self._remove_stale()

    def _remove_stale(self) -> None:
        stale = [*self.root.glob(".tmp-step-*"), *self.root.glob(".latest.tmp")]
        for path in stale:
            if path.is_dir():
                _discard(path)
            else:
                path.unlink(missing_ok=True)
        if stale:
            logger.info("[checkpoint] removed %d temporaries of an interrupted save from %s", len(stale), self.root)

    def steps(self) -> list[Path]:
        """The ``step-N`` directories, oldest first (numeric order: step-100 after step-20)."""
        found = [p for p in self.root.glob("step-*") if _STEP_NAME.fullmatch(p.name) and p.is_dir()]
        return sorted(found, key=lambda p: int(p.name.split("-", 1)[1]))

    def _pointed(self) -> tuple[Path | None, str]:
        """The checkpoint ``latest`` names, or None and what is wrong with the pointer."""
        try:
            name = (self.root / "latest").read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None, "is missing"
        except (OSError, UnicodeDecodeError) as exc:
            return None, f"cannot be read ({exc})"
        if not _STEP_NAME.fullmatch(name):
            return None, f"holds {name[:40]!r}, not a step-N name"
        path = self.root / name
        why = _why_unreadable(path)
        return (None, f"names {name}, which {why}") if why else (path, "")

    def latest(self) -> Path | None:
        """The checkpoint to resume from: the one ``latest`` names, else the newest readable one (with a warning)."""
        path, why = self._pointed()
        if path is not None:
            return path
        fallback = next((p for p in reversed(self.steps()) if not _why_unreadable(p)), None)
        if fallback is not None or (self.root / "latest").exists():
            logger.warning("[checkpoint] %s/latest %s; falling back to %s", self.root, why,
                           fallback.name if fallback else "no checkpoint (nothing readable is left)")
        return fallback

    def read_state(self, path: Path) -> TrainerState:
        return TrainerState.from_json(json.loads((path / "trainer_state.json").read_text(encoding="utf-8")))

    def save(
        self,
        state: TrainerState,
        model: DFlashDrafter,
        optimizer: torch.optim.Optimizer,
        generator: torch.Generator,
        rank_rng: list[torch.Tensor] | None = None,
    ) -> Path:
        """Write step ``state.step`` durably and point ``latest`` at it.

        On OSError (a full disk...) the temporaries are removed and the error is
        raised again; ``latest`` still names the previous checkpoint unless only
        the fsync after its rename failed (then it names this one, maybe not durably).
        """
        name = f"step-{state.step}"
        tmp = self.root / f".tmp-{name}-{os.getpid()}"
        try:
            self._make_root()
            self._write_tmp(tmp, state, model, optimizer, generator, rank_rng)
            final = self._rename_into_place(tmp, name)
            self._point_latest(name)
        except OSError:
            _discard(tmp)
            (self.root / ".latest.tmp").unlink(missing_ok=True)
            raise
        self._prune(keep_name=name)
        return final

    def _make_root(self) -> None:
        if self.root.is_dir():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        fsync_path(self.root.parent)
        fsync_path(self.root.parent.parent)

    def _write_tmp(self, tmp: Path, state: TrainerState, model: DFlashDrafter, optimizer: torch.optim.Optimizer,
                   generator: torch.Generator, rank_rng: list[torch.Tensor] | None) -> None:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        _save_weights(tmp, model)
        blob = {"optimizer": optimizer.state_dict(), "generator": generator.get_state(), "torch_rng": torch.get_rng_state()}
        if rank_rng is not None:
            blob["rank_rng"] = list(rank_rng)  # rank k's pack_rng(), for a resume with the same world size
        _torch_save(blob, tmp / "trainer.pt")
        write_durably(tmp / "trainer_state.json",
                       json.dumps({**state.to_json(), "saved_at": time.time()}, indent=1).encode())
        for name in CHECKPOINT_FILES[:-1]:  # trainer_state.json is fsynced already
            fsync_path(tmp / name)
        fsync_path(tmp)

    def _rename_into_place(self, tmp: Path, name: str) -> Path:
        final = self.root / name
        if final.exists():
            # Out of the way atomically: a kill leaves a temporary the next start removes.
            old = self.root / f".tmp-{name}-{os.getpid()}-replaced"
            os.replace(final, old)
            _discard(old)
        os.replace(tmp, final)
        fsync_path(self.root)
        return final

    def _point_latest(self, name: str) -> None:
        replace_durably(self.root / "latest", name.encode(), tmp=self.root / ".latest.tmp")

    def _prune(self, keep_name: str) -> None:
        for old in self.steps()[: -self.keep]:
            if old.name == keep_name:
                continue
            # Renamed first, so a kill mid-delete never leaves a half step-N behind.
            doomed = self.root / f".tmp-{old.name}-{os.getpid()}-pruned"
            try:
                os.replace(old, doomed)
            except OSError as exc:  # the new checkpoint is in place: the save succeeded
                logger.warning("[checkpoint] could not prune %s (%s); the next save tries again", old, exc)
                continue
            _discard(doomed)

    def load(
        self, path: Path, device: torch.device, optimizer_factory, rank: int = 0, world_size: int = 1,
    ) -> tuple[DFlashDrafter, torch.optim.Optimizer, torch.Tensor | None, torch.Tensor | None]:
        """Model, optimizer and rank ``rank``'s (generator, torch) RNG states (None when the checkpoint was
        written by another number of ranks, which the worker refuses to resume)."""
        model = load_drafter(path, device=device)
        model.float()
        optimizer = optimizer_factory(model)
        blob = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
        optimizer.load_state_dict(blob["optimizer"])
        ranks = blob.get("rank_rng")
        if ranks is not None:
            if len(ranks) != world_size:
                return model, optimizer, None, None
            return (model, optimizer, *unpack_rng(ranks[rank], blob["generator"].numel()))
        if world_size != 1:
            return model, optimizer, None, None
        return model, optimizer, blob["generator"], blob["torch_rng"]


def pack_rng(generator: torch.Generator) -> torch.Tensor:
    """A rank's RNG states as one uint8 tensor (the anchor generator's, then torch's CPU one)."""
    return torch.cat([generator.get_state().cpu(), torch.get_rng_state()])


def unpack_rng(packed: torch.Tensor, generator_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    return packed[:generator_bytes].clone(), packed[generator_bytes:].clone()


def ledger_name(drafter_id: str, rank: int, world_size: int) -> str:
    return drafter_id if world_size == 1 else f"{drafter_id}.rank{rank}"


class Ledger:
    """Append-only record of which samples each durable step trained."""

    def __init__(self, run_dir: Path, name: str):
        self.path = run_dir / "ledger" / f"{name}.jsonl"  # ledger_name(): one file per rank
        self._pending: list[dict] = []
        if not self.path.parent.is_dir():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fsync_path(self.path.parent.parent)
        created = not self.path.exists()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._cut_torn_tail(fd)
        finally:
            os.close(fd)
        if created:
            fsync_path(self.path.parent)

    def _cut_torn_tail(self, fd: int) -> None:
        """A kill mid-append leaves a fragment the next line would be glued to: cut it."""
        dropped = cut_torn_tail(fd)
        if dropped:
            logger.warning("[ledger] %s ends in an unfinished line (a write was interrupted); dropped its %d bytes",
                           self.path, dropped)

    def _append(self, lines: list[dict]) -> None:
        """One write per line, then one fsync; each line leaves ``lines`` once written, so a failure keeps the rest."""
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            self._cut_torn_tail(fd)  # a failed earlier append may have left part of a line
            while lines:
                self._append_line(fd, (json.dumps(lines[0], separators=(",", ":")) + "\n").encode())
                lines.pop(0)
            os.fsync(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _append_line(fd: int, line: bytes) -> None:
        start = os.fstat(fd).st_size
        try:
            write_all(fd, line)
        except OSError:
            os.ftruncate(fd, start)  # no fragment for the next line to be glued to
            raise

    def resumed(self, from_step: int) -> None:
        self._append([{"kind": "resume", "from_step": from_step, "time": time.time()}])

    def trained(self, step: int, batch_id: int, epoch: int, sample_ids: list[int], first_step: int | None = None,
                rank: int | None = None) -> None:
        """Batch ``batch_id`` was trained by steps ``first_step..step`` (one step unless drafter.steps_per_batch > 1)."""
        entry = {"kind": "step", "step": step, "batch_id": batch_id, "epoch": epoch, "sample_ids": sample_ids}
        if first_step is not None and first_step != step:
            entry["first_step"] = first_step
        if rank is not None:
            entry["rank"] = rank
        self._pending.append(entry)

    def idle(self, step: int, first_step: int) -> None:
        """Steps ``first_step..step`` took a zero-gradient step on this rank (its stream ended first, or its
        batch was one the drafter had); the other ranks' ledgers hold what they trained."""
        self._pending.append({"kind": "idle", "step": step, "first_step": first_step})

    def make_durable(self) -> None:
        """Write and fsync the pending steps; call right before the checkpoint that covers them is renamed into place.

        On OSError the lines not yet written stay pending for the next call.
        """
        if self._pending:
            self._append(self._pending)


def read_lineage(ledger_path: Path, final_step: int) -> dict[int, dict]:
    """step -> entry for the lineage that ends at checkpoint ``final_step``.

    An unfinished last line (a kill mid-append) is skipped with a warning; any other
    line that does not parse raises ValueError naming it.
    """
    steps: dict[int, dict] = {}
    with open(ledger_path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                logger.warning("[ledger] %s: skipping the unfinished last line %d (%d bytes)",
                               ledger_path, number, len(line))
                break
            try:
                entry = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"ledger {ledger_path} line {number} is corrupt ({exc}); the lineage cannot be "
                                 "read past it") from None
            if entry["kind"] == "resume":
                for s in [s for s in steps if s > entry["from_step"]]:
                    del steps[s]
            else:
                steps[entry["step"]] = entry
    return {s: e for s, e in steps.items() if s <= final_step}


@dataclass
class LineageReport:
    """What the ledgers of a drafter's ranks say about its final checkpoint."""

    drafter_id: str
    final_step: int
    world_size: int
    batches: int
    samples_per_epoch: dict[int, int]
    problems: list[str]
    finished_epochs: list[int] = field(default_factory=list)  # epochs checked for completeness

    @property
    def ok(self) -> bool:
        return not self.problems


def _missing_steps(lineage: dict[int, dict], final_step: int) -> list[int]:
    covered = {s for last, e in lineage.items() for s in range(e.get("first_step", last), last + 1)}
    return sorted(set(range(1, final_step + 1)) - covered)


def _batch_problems(entries: list[dict], claimed: set[int]) -> list[str]:
    """Every batch the checkpoint counts as trained (and told the targets so) is in a ledger once, and no other."""
    counts = Counter(e["batch_id"] for e in entries)
    problems = []
    twice = sorted(b for b, n in counts.items() if n > 1)
    if twice:
        problems.append(f"batches trained twice: {twice[:10]}")
    lost = sorted(claimed - counts.keys())
    if lost:
        problems.append(f"{len(lost)} batches the checkpoint counts as trained are in no ledger (lost): {lost[:10]}")
    unclaimed = sorted(counts.keys() - claimed)
    if unclaimed:
        problems.append(f"{len(unclaimed)} ledger batches the checkpoint does not count as trained: {unclaimed[:10]}")
    return problems


def _finished_epochs(claimed_by_replica: dict[int, set[int]], entries: list[dict], batches_per_epoch: int) -> list[int]:
    """Epochs the drafter has trained past: every replica trained its last batch of the epoch, or a later one.

    A replica serves its batches in plan order (a batch to redo before any new one),
    so a finished epoch with a batch missing has lost it.
    """
    if not batches_per_epoch:
        # Checkpoints that predate batches_per_epoch: an epoch is finished once a later one began.
        return list(range(max((e["epoch"] for e in entries), default=0)))
    replicas = len(claimed_by_replica)
    tops = {r: max(c, default=-1) for r, c in claimed_by_replica.items()}
    finished = []
    epoch = 0
    while True:
        end = (epoch + 1) * batches_per_epoch  # first index of the next epoch
        lasts = {r: end - 1 - ((end - 1 - r) % replicas) for r in tops}  # each replica's last index below end
        if not all(top >= lasts[r] for r, top in tops.items() if lasts[r] >= epoch * batches_per_epoch):
            return finished
        finished.append(epoch)
        epoch += 1


def _sample_problems(per_epoch: dict[int, list[int]], finished: list[int], train_samples: int) -> list[str]:
    problems = [f"a sample was trained twice in epoch {e}" for e, s in per_epoch.items() if len(s) != len(set(s))]
    for epoch in finished:
        seen = set(per_epoch.get(epoch, []))
        missing = sorted(set(range(train_samples)) - seen)
        if missing:
            problems.append(f"epoch {epoch}: {len(missing)} of {train_samples} samples never trained: {missing[:10]}")
        outside = sorted(s for s in seen if not 0 <= s < train_samples)
        if outside:
            problems.append(f"epoch {epoch}: sample ids outside the {train_samples}-sample split: {outside[:10]}")
    return problems


def verify_lineage(run_dir: Path, drafter_id: str) -> LineageReport:
    """Check from files that the drafter's final checkpoint trained every durable step on every rank, every
    batch it counts exactly once (over all ranks), and every sample of every finished epoch exactly once."""
    latest = CheckpointStore(run_dir, drafter_id, keep=1).latest()
    if latest is None:
        return LineageReport(drafter_id, 0, 0, 0, {}, [f"{drafter_id}: no checkpoint"])
    state = CheckpointStore(run_dir, drafter_id, keep=1).read_state(latest)
    problems: list[str] = []
    entries: list[dict] = []
    for rank in range(state.world_size):
        name = ledger_name(drafter_id, rank, state.world_size)
        path = run_dir / "ledger" / f"{name}.jsonl"
        if not path.exists():
            problems.append(f"{name}: no ledger at {path}")
            continue
        lineage = read_lineage(path, state.step)
        missing = _missing_steps(lineage, state.step)
        if missing:
            problems.append(f"{name}: durable steps missing from the ledger: {missing[:10]}")
        entries += [e for e in lineage.values() if e["kind"] == "step"]
    claimed_by_replica = state.claimed()
    problems += _batch_problems(entries, set().union(*claimed_by_replica.values()))
    per_epoch: dict[int, list[int]] = {}
    for entry in entries:
        per_epoch.setdefault(entry["epoch"], []).extend(entry["sample_ids"])
    finished: list[int] = []
    if state.train_samples:  # checkpoints that predate it cannot be checked for completeness
        finished = _finished_epochs(claimed_by_replica, entries, state.batches_per_epoch)
    problems += _sample_problems(per_epoch, finished, state.train_samples)
    return LineageReport(drafter_id, state.step, state.world_size, len(entries),
                         {e: len(s) for e, s in sorted(per_epoch.items())}, problems, finished)
