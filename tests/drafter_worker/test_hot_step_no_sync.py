"""The drafter's hot step, its metric snapshot and the deferred read run without one host read of a device value."""

from __future__ import annotations

import math

import pytest
import torch

from common.config import DrafterConfig, MetricsConfig
from common.packing import BatchLayout
from common.sync_guard import HostSyncError, sync_guard
from drafter_worker.trainer import DrafterTrainer, make_optimizer, summarize
from tests.fixtures import (
    TINY_BLOCK as BLOCK, TINY_CAPTURED as K, TINY_HIDDEN as HIDDEN, TINY_VOCAB as VOCAB, tiny_drafter,
)

B, T = 2, 20
STEPS = 12


def make_trainer(**overrides) -> DrafterTrainer:
    causal = overrides.get("causal_passes", False)
    model = tiny_drafter(0, denoise_passes=BLOCK - 1, causal_passes=True) if causal else tiny_drafter(0)
    cfg = DrafterConfig(block_size=BLOCK, anchors_per_sequence=3, warmup_steps=3, max_steps=STEPS, grad_clip=0.5,
                        **overrides)
    return DrafterTrainer(cfg, model, make_optimizer(cfg, model), torch.Generator().manual_seed(0), step=0)


def received_batch():
    """A batch as the worker gets it: views into one packed buffer, wire dtypes, plus the frozen target weights."""
    gen = torch.Generator().manual_seed(1)
    layout = BatchLayout(batch_size=B, seq_len=T, feature_dim=K * HIDDEN, dtype=torch.float32)
    features, input_ids, loss_mask, lengths = layout.views(layout.allocate())
    features.copy_(torch.randn(B, T, K * HIDDEN, generator=gen))
    input_ids.copy_(torch.randint(0, VOCAB - 1, (B, T), generator=gen, dtype=torch.int32))
    lengths.copy_(torch.tensor([T, T - 6], dtype=torch.int32))
    loss_mask[0, 2:T] = 1
    loss_mask[1, 2 : T - 6] = 1
    embed = torch.randn(VOCAB, HIDDEN, generator=gen)
    head = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.5
    return features, input_ids, loss_mask, lengths, embed, head


@pytest.mark.parametrize("overrides", [{}, {"reveal_fraction": 0.5}, {"causal_passes": True, "denoise_passes": BLOCK - 1}],
                         ids=["masked-blocks", "revealed-prefixes", "causal-passes"])
def test_hot_step_snapshot_and_deferred_read_make_no_host_reads(overrides):
    trainer = make_trainer(**overrides)
    batch = received_batch()
    log_every = MetricsConfig(log_every_steps=5).log_every_steps
    records, lrs = [], []
    with sync_guard("cpu", mode="record") as report:
        for _ in range(STEPS):
            lrs.append(trainer.train_step(*batch))
            # What the worker does after every step: snapshot on schedule, then a non-waiting poll.
            if trainer.step % log_every == 0:
                assert trainer.metrics.snapshot()
            values = trainer.metrics.poll()
            if values is not None:
                records.append((values, summarize(values)))
    assert report.violations == [], "\n".join(v.message for v in report.violations)

    assert trainer.step == STEPS
    assert all(isinstance(lr, float) for lr in lrs)  # host values, returned as they are
    assert [values["steps"] for values, _ in records] == [[5.0], [5.0]]  # steps 1-5 and 6-10
    for _, out in records:
        assert all(math.isfinite(v) for v in out.values()), out
        assert out["loss"] > 0 and out["label_tokens"] > 0 and 0 <= out["clip_rate"] <= 1


def test_item_in_the_logging_path_is_caught(monkeypatch):
    # Regression: guards against a grad_norm.item() in the logging path stalling the device every step.
    trainer = make_trainer()
    batch = received_batch()
    logged: list[float] = []
    add = trainer.metrics.add

    def add_and_log(name, value):
        add(name, value)
        if name == "grad_norm_sum":
            logged.append(value.item())  # the planted sync

    monkeypatch.setattr(trainer.metrics, "add", add_and_log)
    with pytest.raises(HostSyncError, match=r"Tensor\.item.*test_hot_step_no_sync\.py:\d+"):
        with sync_guard("cpu"):
            trainer.train_step(*batch)
    assert logged == []

    trainer.train_step(*batch)  # outside the guard the same code runs
    assert len(logged) == 1 and logged[0] > 0
