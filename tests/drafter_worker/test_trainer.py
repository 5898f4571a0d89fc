"""Tests for drafter_worker/trainer.py: the LR schedule, one training step, its device metrics."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from common.config import ConfigError, DrafterConfig, load_config
from drafter_worker.trainer import DrafterTrainer, learning_rate, make_optimizer, summarize
from tests.fixtures import (
    TINY_BLOCK as BLOCK, TINY_CAPTURED as K, TINY_HIDDEN as HIDDEN, TINY_VOCAB as VOCAB, tiny_drafter,
)

B, T = 3, 24
REPO = Path(__file__).resolve().parents[2]


def random_batch(seed: int = 0):
    """What a drafter gets off the data plane: packed dtypes (int32 ids, uint8 mask, int32 lengths)."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(B, T, K * HIDDEN, generator=gen)
    input_ids = torch.randint(0, VOCAB - 1, (B, T), generator=gen, dtype=torch.int32)
    lengths = torch.tensor([T, T - 5, 11], dtype=torch.int32)
    loss_mask = torch.zeros(B, T, dtype=torch.uint8)
    for row, n in enumerate(lengths.tolist()):
        loss_mask[row, 3:n] = 1  # a "prompt" of 3 tokens is not trained; padding is not either
        input_ids[row, n:] = 0
    gen_w = torch.Generator().manual_seed(100)
    embed = torch.randn(VOCAB, HIDDEN, generator=gen_w)
    head = torch.randn(VOCAB, HIDDEN, generator=gen_w) * 0.5
    return features, input_ids, loss_mask, lengths, embed, head


def make_trainer(seed: int = 0, **overrides) -> DrafterTrainer:
    cfg = DrafterConfig(**{"anchors_per_sequence": 3, "warmup_steps": 0, "max_steps": 0, "learning_rate": 3e-3,
                           **overrides})
    model = tiny_drafter(seed)
    return DrafterTrainer(cfg, model, make_optimizer(cfg, model), torch.Generator().manual_seed(seed), step=0)


# ---------------------------------------------------------------------------
# learning_rate
# ---------------------------------------------------------------------------


def test_lr_warmup_then_cosine():
    cfg = DrafterConfig(learning_rate=1e-3, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    lrs = [learning_rate(cfg, s) for s in range(0, 131)]
    warm = lrs[:10]
    assert all(a < b for a, b in zip(warm, warm[1:]))  # strictly up during warm-up
    assert 0 < lrs[0] <= 1e-3 / 10 + 1e-12
    assert lrs[9] == pytest.approx(1e-3)
    assert lrs[10] == pytest.approx(1e-3)  # the peak at the end of warm-up
    assert max(lrs) == pytest.approx(1e-3)
    decay = lrs[10:111]
    assert all(a >= b for a, b in zip(decay, decay[1:]))  # monotone down
    assert lrs[60] == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))  # half-way: the cosine mid point
    assert lrs[110] == pytest.approx(1e-4)  # min_lr_ratio * peak at the end of decay
    assert all(lr == pytest.approx(1e-4) for lr in lrs[110:])  # and it stays there
    assert min(lrs) >= 1e-4 - 1e-12


def test_lr_decay_steps_overrides_max_steps():
    cfg = DrafterConfig(learning_rate=2e-3, warmup_steps=0, max_steps=1000, decay_steps=50, min_lr_ratio=0.25)
    assert learning_rate(cfg, 0) == pytest.approx(2e-3)
    assert learning_rate(cfg, 50) == pytest.approx(5e-4)
    assert learning_rate(cfg, 500) == pytest.approx(5e-4)


def test_lr_constant_without_a_horizon():
    cfg = DrafterConfig(learning_rate=6e-4, warmup_steps=4, max_steps=0, decay_steps=0)
    assert [learning_rate(cfg, s) for s in range(4)] == pytest.approx([1.5e-4, 3e-4, 4.5e-4, 6e-4])
    assert all(learning_rate(cfg, s) == 6e-4 for s in range(4, 5000, 97))


def test_lr_without_warmup_starts_at_peak():
    cfg = DrafterConfig(learning_rate=1e-3, warmup_steps=0, max_steps=20, min_lr_ratio=0.0)
    assert learning_rate(cfg, 0) == pytest.approx(1e-3)
    assert learning_rate(cfg, 20) == pytest.approx(0.0, abs=1e-15)
    assert all(learning_rate(cfg, s) > 0 for s in range(20))


def test_lr_over_minutes_follows_the_training_clock_not_the_steps():
    cfg = DrafterConfig(learning_rate=1e-3, warmup_steps=10, max_steps=0, decay_minutes=2.0, min_lr_ratio=0.1)
    assert learning_rate(cfg, 4, 0, train_seconds=100.0) == pytest.approx(5e-4)  # warm-up is by steps
    mid = 1e-4 + 0.5 * (1e-3 - 1e-4)
    for step in (10, 500, 50_000):  # however many steps the minutes held
        assert learning_rate(cfg, step, 0, 0.0) == pytest.approx(1e-3)
        assert learning_rate(cfg, step, 0, 60.0) == pytest.approx(mid)
        assert learning_rate(cfg, step, 0, 120.0) == pytest.approx(1e-4)
        assert learning_rate(cfg, step, 0, 1e6) == pytest.approx(1e-4)
    clock = [learning_rate(cfg, 20, 0, t) for t in range(0, 121)]
    assert all(a > b for a, b in zip(clock, clock[1:]))
    trainer = make_trainer(warmup_steps=0, max_steps=0, decay_minutes=1.0, min_lr_ratio=0.0, learning_rate=1e-3)
    trainer.train_seconds = 30.0
    assert trainer.train_step(*random_batch()) == pytest.approx(5e-4)


@pytest.mark.parametrize("overrides, message", [
    (["drafter.decay_minutes=40", "drafter.decay_steps=2000"], "set one of them"),
    (["drafter.decay_minutes=-1"], "finite number >= 0"),
    (["drafter.decay_minutes=nan"], "finite number >= 0"),
    (["drafter.decay_steps=-5"], "must be >= 0"),
])
def test_schedule_lengths_that_cannot_work_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


# ---------------------------------------------------------------------------
# make_optimizer
# ---------------------------------------------------------------------------


def test_optimizer_groups_decay_only_matrices():
    cfg = DrafterConfig(weight_decay=0.05)
    model = tiny_drafter()
    opt = make_optimizer(cfg, model)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decay["params"])
    assert all(p.ndim < 2 for p in no_decay["params"]) and no_decay["params"]  # the norms
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


# ---------------------------------------------------------------------------
# train_step and its metrics
# ---------------------------------------------------------------------------


def test_train_step_runs_and_reports_metrics():
    trainer = make_trainer(warmup_steps=2, max_steps=10, learning_rate=1e-3)
    batch = random_batch()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    lrs = [trainer.train_step(*batch) for _ in range(3)]
    assert trainer.step == 3
    assert lrs == pytest.approx([learning_rate(trainer.cfg, s) for s in range(3)])
    assert trainer.optimizer.param_groups[0]["lr"] == lrs[-1]
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert "fc.weight" in changed and "layers.0.self_attn.q_proj.weight" in changed
    assert all(p.grad is None for p in trainer.model.parameters())  # zeroed after the step

    assert trainer.metrics.poll() is None  # nothing snapshotted yet
    assert trainer.metrics.snapshot()
    values = trainer.metrics.poll()
    assert values is not None
    assert values["steps"] == [3.0]
    out = summarize(values)
    for key in ("loss", "grad_norm", "grad_norm_max", "clip_rate", "label_tokens", "eal"):
        assert math.isfinite(out[key]), key
    assert out["loss"] > 0
    assert out["grad_norm"] > 0 and out["grad_norm_max"] >= out["grad_norm"] - 1e-6
    assert 0.0 <= out["clip_rate"] <= 1.0
    assert out["clip_rate"] * 3 == pytest.approx(round(out["clip_rate"] * 3))  # a count of steps
    assert out["label_tokens"] > 0
    assert sorted(k for k in out if k.startswith("acc/")) == [f"acc/pos_{k}" for k in range(1, BLOCK)]
    for k in range(1, BLOCK):
        assert 0.0 <= out[f"acc/pos_{k}"] <= 1.0
    assert 0.0 <= out["eal"] <= BLOCK - 1
    assert values["count"][0] == 0.0  # slot 0 holds the anchor: never a label

    # The window was reset: a second snapshot without steps is empty.
    assert trainer.metrics.snapshot()
    empty = trainer.metrics.poll()
    assert empty["steps"] == [0.0] and empty["loss_sum"] == [0.0]


def test_label_tokens_respect_mask_and_lengths():
    trainer = make_trainer()
    features, input_ids, loss_mask, lengths, embed, head = random_batch()
    loss_mask.zero_()  # nothing trainable: no valid anchor, no label
    trainer.train_step(features, input_ids, loss_mask, lengths, embed, head)
    trainer.metrics.snapshot()
    out = summarize(trainer.metrics.poll())
    assert out["label_tokens"] == 0.0
    assert math.isfinite(out["loss"]) and out["loss"] == 0.0
    assert out["eal"] == 0.0


def test_clip_rate_counts_clipped_steps():
    trainer = make_trainer(grad_clip=1e-6)  # every real gradient is clipped
    batch = random_batch()
    for _ in range(2):
        trainer.train_step(*batch)
    trainer.metrics.snapshot()
    out = summarize(trainer.metrics.poll())
    assert out["clip_rate"] == 1.0
    trainer = make_trainer(grad_clip=1e6)
    trainer.train_step(*batch)
    trainer.metrics.snapshot()
    assert summarize(trainer.metrics.poll())["clip_rate"] == 0.0


def test_loss_decreases_on_a_repeated_batch():
    trainer = make_trainer(learning_rate=5e-3, anchors_per_sequence=4)
    batch = random_batch(seed=3)
    losses = []
    for _ in range(20):
        trainer.train_step(*batch)
        trainer.metrics.snapshot()
        losses.append(summarize(trainer.metrics.poll())["loss"])
    assert all(math.isfinite(x) for x in losses)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.8 * first, losses


def test_same_seed_same_training():
    batch = random_batch()
    a, b = make_trainer(seed=4), make_trainer(seed=4)
    for _ in range(3):
        a.train_step(*batch)
        b.train_step(*batch)
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name


def test_warm_up_changes_no_weight_optimizer_state_or_rng():
    # The worker runs it on a GPU only (on a CPU a shape's first step costs what the next does), so
    # what it promises is checked here: training after it is training without it.
    batch = random_batch()
    warmed, cold = make_trainer(seed=5), make_trainer(seed=5)
    warmed.train_step(*batch)
    cold.train_step(*batch)
    embed, head = batch[4], batch[5]
    warmed.warm_up([(2, 16), (1, T)], K * HIDDEN, embed, head)
    assert all(p.grad is None for p in warmed.model.parameters())
    for _ in range(2):
        warmed.train_step(*batch)
        cold.train_step(*batch)
    for (name, pa), pb in zip(warmed.model.named_parameters(), cold.model.parameters()):
        assert torch.equal(pa, pb), name


def test_train_step_never_reads_the_device_on_the_host(monkeypatch):
    # Guards the rule of docs/architecture.md ("The metrics path"): nothing in the step may call .item(),
    # .tolist(), .cpu(), bool(tensor)... from project code. Torch's own internals
    # (AdamW's CPU step counter) are allowed.
    trainer = make_trainer()
    batch = random_batch()
    offenders: list[str] = []

    def guard(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(str(REPO)) and "/.venv/" not in caller and "/tests/" not in caller:
                offenders.append(f"{name} from {caller}:{sys._getframe(1).f_lineno}")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapper)

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
        guard(name)
    trainer.train_step(*batch)
    monkeypatch.undo()
    assert offenders == []
    assert trainer.step == 1
