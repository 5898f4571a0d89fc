"""Checkpoints, the data cursor they carry, and the ledger of trained samples.

A checkpoint is a directory ``checkpoints/<drafter>/step-N/`` holding the
drafter in the published layout (``config.json`` + ``model.safetensors``),
``trainer.pt`` (optimizer state and RNG states: tensors only, loaded with
``weights_only=True``) and ``trainer_state.json`` (step, data cursor). It is
written under a temporary name and renamed, so a kill never leaves a
half-written checkpoint behind; ``latest`` names the newest one.

The ledger (``ledger/<drafter>.jsonl``) records, for every durable step, which
batch and sample ids it trained. Every process start appends a ``resume`` line
naming the checkpoint step it resumed from, which discards later steps of the
dead lineage, so the lineage of the final checkpoint can be read from the file.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.dflash_model import DFlashDrafter, load_drafter, save_drafter

logger = logging.getLogger(__name__)


@dataclass
class Coverage:
    """Plan indices trained so far: everything below ``watermark`` plus ``extra``."""

    watermark: int = 0
    extra: set[int] = field(default_factory=set)

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
    coverage: Coverage
    drafter_id: str
    group: str
    model_id: str
    tokens_trained: int = 0


class CheckpointStore:
    def __init__(self, run_dir: Path, drafter_id: str, keep: int):
        self.root = run_dir / "checkpoints" / drafter_id
        self.keep = keep

    def latest(self) -> Path | None:
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / "trainer_state.json").exists() else None

    def read_state(self, path: Path) -> TrainerState:
        data = json.loads((path / "trainer_state.json").read_text())
        return TrainerState(
            step=int(data["step"]), coverage=Coverage.from_json(data["coverage"]), drafter_id=data["drafter_id"],
            group=data["group"], model_id=data["model_id"], tokens_trained=int(data.get("tokens_trained", 0)),
        )

    def save(
        self,
        state: TrainerState,
        model: DFlashDrafter,
        optimizer: torch.optim.Optimizer,
        generator: torch.Generator,
    ) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        name = f"step-{state.step}"
        final = self.root / name
        tmp = self.root / f".tmp-{name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        save_drafter(tmp, model)
        torch.save(
            {"optimizer": optimizer.state_dict(), "generator": generator.get_state(), "torch_rng": torch.get_rng_state()},
            tmp / "trainer.pt",
        )
        (tmp / "trainer_state.json").write_text(json.dumps({
            "step": state.step, "coverage": state.coverage.to_json(), "drafter_id": state.drafter_id,
            "group": state.group, "model_id": state.model_id, "tokens_trained": state.tokens_trained,
            "saved_at": time.time(),
        }, indent=1))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = self.root / ".latest.tmp"
        pointer_tmp.write_text(name)
        os.replace(pointer_tmp, self.root / "latest")
        self._prune(keep_name=name)
        return final

    def _prune(self, keep_name: str) -> None:
        steps = sorted(
            (p for p in self.root.glob("step-*") if p.is_dir()),
            key=lambda p: int(p.name.split("-", 1)[1]),
        )
        for old in steps[: -self.keep]:
            if old.name != keep_name:
                shutil.rmtree(old, ignore_errors=True)

    def load(
        self, path: Path, device: torch.device, optimizer_factory
    ) -> tuple[DFlashDrafter, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
        model = load_drafter(path, device=device)
        model.float()
        optimizer = optimizer_factory(model)
        blob = torch.load(path / "trainer.pt", map_location=device, weights_only=True)
        optimizer.load_state_dict(blob["optimizer"])
        return model, optimizer, blob["generator"], blob["torch_rng"]


class Ledger:
    """Append-only record of which samples each durable step trained."""

    def __init__(self, run_dir: Path, drafter_id: str):
        self.path = run_dir / "ledger" / f"{drafter_id}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._pending: list[dict] = []

    def _append(self, lines: list[dict]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            for line in lines:
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def resumed(self, from_step: int) -> None:
        self._append([{"kind": "resume", "from_step": from_step, "time": time.time()}])

    def trained(self, step: int, batch_id: int, epoch: int, sample_ids: list[int], first_step: int | None = None) -> None:
        """Batch ``batch_id`` was trained by steps ``first_step..step`` (one step unless drafter.steps_per_batch > 1)."""
        entry = {"kind": "step", "step": step, "batch_id": batch_id, "epoch": epoch, "sample_ids": sample_ids}
        if first_step is not None and first_step != step:
            entry["first_step"] = first_step
        self._pending.append(entry)

    def make_durable(self) -> None:
        """Write the pending steps; call right before the checkpoint that covers them is renamed into place."""
        if self._pending:
            self._append(self._pending)
            self._pending = []


def read_lineage(ledger_path: Path, final_step: int) -> dict[int, dict]:
    """step -> entry for the lineage that ends at checkpoint ``final_step``."""
    steps: dict[int, dict] = {}
    with open(ledger_path, encoding="utf-8") as f:
        for line in f:
            entry = json.loads(line)
            if entry["kind"] == "resume":
                for s in [s for s in steps if s > entry["from_step"]]:
                    del steps[s]
            else:
                steps[entry["step"]] = entry
    return {s: e for s, e in steps.items() if s <= final_step}


@dataclass
class LineageReport:
    drafter_id: str
    final_step: int
    batches: int
    samples_per_epoch: dict[int, int]
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_lineage(run_dir: Path, drafter_id: str) -> LineageReport:
    """Check from files that the final checkpoint's lineage trained every step once and no sample twice per epoch."""
    store = CheckpointStore(run_dir, drafter_id, keep=1)
    latest = store.latest()
    if latest is None:
        return LineageReport(drafter_id, 0, 0, {}, ["no checkpoint"])
    final_step = store.read_state(latest).step
    lineage = read_lineage(run_dir / "ledger" / f"{drafter_id}.jsonl", final_step)
    problems = []
    covered = {s for last, e in lineage.items() for s in range(e.get("first_step", last), last + 1)}
    missing = sorted(set(range(1, final_step + 1)) - covered)
    if missing:
        problems.append(f"durable steps missing from the ledger: {missing[:10]}")
    batch_ids = [e["batch_id"] for e in lineage.values()]
    if len(batch_ids) != len(set(batch_ids)):
        problems.append("a batch was trained twice")
    per_epoch: dict[int, list[int]] = {}
    for entry in lineage.values():
        per_epoch.setdefault(entry["epoch"], []).extend(entry["sample_ids"])
    for epoch, samples in per_epoch.items():
        if len(samples) != len(set(samples)):
            problems.append(f"a sample was trained twice in epoch {epoch}")
    return LineageReport(
        drafter_id, final_step, len(batch_ids), {e: len(s) for e, s in sorted(per_epoch.items())}, problems
    )
