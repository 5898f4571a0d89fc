"""What the quality recipe needed from every config: the non-finite guard, the schedule over the
plan, the logit-scale initialisation, the draft vocabulary, and a drafter that learns from features."""

from __future__ import annotations

import math

import pytest
import torch

from common.config import DrafterConfig
from drafter_worker.model.dflash_model import DFlashDrafter, dflash_block_loss, init_logit_scale
from common.sync_guard import sync_guard
from drafter_worker.trainer import DrafterTrainer, learning_rate, make_optimizer, summarize
from tests.fixtures import TINY_BLOCK as BLOCK, TINY_CAPTURED as K, TINY_HIDDEN as HIDDEN, tiny_drafter


def drafter(vocab: int, seed: int = 0, layers: int = 1, draft_vocab_size: int = 0) -> DFlashDrafter:
    return tiny_drafter(seed, vocab_size=vocab, max_position_embeddings=256, num_hidden_layers=layers,
                        draft_vocab_size=draft_vocab_size)


def trainer_for(model: DFlashDrafter, **overrides) -> DrafterTrainer:
    cfg = DrafterConfig(**{"block_size": BLOCK, "anchors_per_sequence": 4, "warmup_steps": 0, "max_steps": 0,
                           "learning_rate": 3e-3, **overrides})
    return DrafterTrainer(cfg, model, make_optimizer(cfg, model), torch.Generator().manual_seed(0), step=0)


def batch(vocab: int, b: int = 2, t: int = 20, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(b, t, K * HIDDEN, generator=gen)
    ids = torch.randint(0, vocab - 1, (b, t), generator=gen, dtype=torch.int32)
    mask = torch.zeros(b, t, dtype=torch.uint8)
    mask[:, 2:] = 1
    lengths = torch.full((b,), t, dtype=torch.int32)
    embed = torch.randn(vocab, HIDDEN, generator=gen)
    return features, ids, mask, lengths, embed, embed


# ---------------------------------------------------------------------------
# Non-finite guard
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("autocast", ["", "bfloat16"], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("distill_weight", [0.0, 1.0], ids=["hard-labels", "distilled"])
def test_nonfinite_step_changes_nothing_and_is_counted_without_a_host_read(distill_weight, autocast):
    vocab = 64
    model = drafter(vocab)
    trainer = trainer_for(model, distill_weight=distill_weight, autocast=autocast)
    trainer.teacher_norm = (torch.ones(HIDDEN), 1e-6)  # the last HIDDEN feature columns play the target's last layer
    good = batch(vocab)
    trainer.train_step(*good)  # optimizer state exists from here on
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    state = {id(p): {k: v.clone() for k, v in s.items()} for p, s in trainer.optimizer.state.items()}
    bad = list(good)
    bad[0] = good[0].clone()
    bad[0][0, 3, 5] = float("inf")  # one inf feature poisons the loss and every gradient
    with sync_guard("cpu", mode="record") as report:
        trainer.train_step(*bad)
        trainer.train_step(*bad)
        assert trainer.metrics.snapshot()
    assert report.violations == []
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    for p, s in trainer.optimizer.state.items():
        for k, v in s.items():
            assert torch.equal(v, state[id(p)][k]), k
    values = trainer.metrics.poll()
    summary = summarize(values)
    assert summary["nonfinite_steps"] == 2
    assert summary["nonfinite_streak"] == 2
    assert math.isfinite(summary["loss"])  # the good step's loss only
    # A finite step afterwards trains again and ends the streak.
    trainer.train_step(*good)
    assert not torch.equal(model.fc.weight, weights["fc.weight"])
    assert float(trainer.nonfinite_streak) == 0


# ---------------------------------------------------------------------------
# Schedule
# ---------------------------------------------------------------------------


def test_schedule_with_max_steps_0_decays_over_the_announced_plan():
    cfg = DrafterConfig(learning_rate=1e-3, warmup_steps=10, max_steps=0, min_lr_ratio=0.1)
    plan = 200  # what WELCOME.plan_batches says for this group
    lrs = [learning_rate(cfg, s, plan) for s in range(0, 220)]
    assert lrs[10] == pytest.approx(1e-3)
    assert lrs[105] == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))  # the cosine's mid point
    assert lrs[200] == pytest.approx(1e-4) and lrs[219] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(lrs[10:201], lrs[11:201]))
    # Unknown plan length (unlimited epochs): constant after warm-up, as before.
    assert learning_rate(cfg, 150, 0) == pytest.approx(1e-3)
    # The trainer uses the plan it was told.
    model = drafter(64)
    trainer = trainer_for(model, warmup_steps=0, learning_rate=1e-3)
    trainer.plan_steps = 4
    lrs = [trainer.train_step(*batch(64)) for _ in range(5)]
    assert lrs[0] == pytest.approx(1e-3) and lrs[4] == pytest.approx(1e-4)


# ---------------------------------------------------------------------------
# Logit-scale initialisation
# ---------------------------------------------------------------------------


def anisotropic_embedding(vocab: int, seed: int = 0) -> torch.Tensor:
    """Like SmolLM2's tied embedding: a large shared direction plus large per-token parts."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randn(HIDDEN, generator=gen) * 1.5
    return common + torch.randn(vocab, HIDDEN, generator=gen) * 1.2


def initial_loss(model: DFlashDrafter, embed: torch.Tensor, vocab: int) -> float:
    features, ids, mask, lengths, _, _ = batch(vocab, b=4, t=40)
    with torch.no_grad():
        out = dflash_block_loss(model, features=features, input_ids=ids.long(), loss_mask=mask, lengths=lengths,
                                embed_weight=embed, lm_head_weight=embed, num_anchors=8, loss_gamma=7.0,
                                generator=torch.Generator().manual_seed(0))
    return float(out.loss)


def test_logit_scale_init_starts_the_loss_near_ln_v():
    vocab = 2048
    embed = anisotropic_embedding(vocab)
    untouched = initial_loss(drafter(vocab), embed, vocab)
    assert untouched > 1.5 * math.log(vocab)  # the problem: far above chance
    model = drafter(vocab)
    factor = init_logit_scale(model, embed, embed, 1.0)
    assert factor < 0.5
    assert initial_loss(model, embed, vocab) == pytest.approx(math.log(vocab), rel=0.2)


# ---------------------------------------------------------------------------
# Draft vocabulary
# ---------------------------------------------------------------------------


def test_draft_vocabulary_scores_only_its_tokens_and_never_credits_others():
    vocab = 64
    model = drafter(vocab, draft_vocab_size=16)
    kept = list(range(10, 26))
    model.set_draft_vocab(kept)
    features, ids, mask, lengths, embed, head = batch(vocab)
    ids.clamp_(10, 40)  # some labels outside the vocabulary
    out = dflash_block_loss(model, features=features, input_ids=ids.long(), loss_mask=mask, lengths=lengths,
                            embed_weight=embed, lm_head_weight=head, num_anchors=4, loss_gamma=7.0,
                            generator=torch.Generator().manual_seed(0))
    out.loss.backward()
    assert torch.isfinite(out.loss)
    logits = model.draft_logits(torch.randn(3, HIDDEN), head)
    assert logits.shape == (3, vocab)
    outside = [t for t in range(vocab) if t not in kept]
    assert torch.isinf(logits[:, outside]).all() and torch.isfinite(logits[:, kept]).all()
    with pytest.raises(ValueError):
        model.set_draft_vocab([1] * 16)


# ---------------------------------------------------------------------------
# It learns from the features
# ---------------------------------------------------------------------------


def feature_coded_batch(vocab: int, gen: torch.Generator, b: int = 8, t: int = 24, classes: int = 8):
    """Token j+2 is a class coded in the features of position j (a spike on one of their first
    ``classes`` dims); the first two tokens are random. Slot 1 of the block anchored at a predicts
    token a+1, coded only at position a-1: the last context position it may read."""
    features = torch.randn(b, t, K * HIDDEN, generator=gen)
    code = torch.randint(0, classes, (b, t), generator=gen)
    features.scatter_add_(2, code[:, :, None], torch.full((b, t, 1), 4.0))
    ids = torch.randint(classes, vocab - 1, (b, t), generator=gen, dtype=torch.int32)
    ids[:, 2:] = code[:, :-2].to(torch.int32)
    mask = torch.ones(b, t, dtype=torch.uint8)
    return features, ids, mask, torch.full((b,), t, dtype=torch.int32)


def slot1_accuracy_after(steps: int, blind: bool, autocast: str = "") -> float:
    vocab = 64
    model = drafter(vocab, layers=1)
    gen = torch.Generator().manual_seed(5)
    embed = torch.randn(vocab, HIDDEN, generator=gen)
    init_logit_scale(model, embed, embed, 1.0)
    trainer = trainer_for(model, anchors_per_sequence=8, learning_rate=3e-3, warmup_steps=5, autocast=autocast)
    for _ in range(steps):
        features, ids, mask, lengths = feature_coded_batch(vocab, gen)
        if blind:
            features = torch.zeros_like(features)
        trainer.train_step(features, ids, mask, lengths, embed, embed)
    trainer.metrics.snapshot()
    trainer.metrics.poll()  # drop the training window
    with torch.no_grad():
        correct = count = 0.0
        for _ in range(4):
            features, ids, mask, lengths = feature_coded_batch(vocab, gen)
            if blind:
                features = torch.zeros_like(features)
            out = dflash_block_loss(model, features=features, input_ids=ids.long(), loss_mask=mask, lengths=lengths,
                                    embed_weight=embed, lm_head_weight=embed, num_anchors=8, loss_gamma=7.0,
                                    generator=gen)
            correct += float(out.correct_per_pos[1])
            count += float(out.count_per_pos[1])
    return correct / count


@pytest.mark.parametrize("autocast", ["", "bfloat16"], ids=["fp32", "bf16-autocast"])
def test_slot1_learns_a_token_coded_in_the_features(autocast):
    assert slot1_accuracy_after(300, blind=False, autocast=autocast) > 0.5


def test_slot1_cannot_learn_it_without_the_features():
    # The control: the same task with the features zeroed stays near chance (1/8).
    assert slot1_accuracy_after(300, blind=True) < 0.3


# ---------------------------------------------------------------------------
# bf16 autocast (drafter.autocast)
# ---------------------------------------------------------------------------


def test_bf16_autocast_computes_in_bf16_and_keeps_float32_weights_and_optimizer_state():
    vocab = 64
    seen: list[torch.dtype] = []
    losses = {}
    for autocast in ("", "bfloat16"):
        model = drafter(vocab)
        trainer = trainer_for(model, autocast=autocast, distill_weight=1.0)
        trainer.teacher_norm = (torch.ones(HIDDEN), 1e-6)
        hook = model.fc.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
        for seed in range(3):
            trainer.train_step(*batch(vocab, seed=seed))
        hook.remove()
        assert trainer.metrics.snapshot()
        losses[autocast] = trainer.metrics.poll()["loss_sum"][0] / 3
        assert all(p.dtype == torch.float32 for p in model.parameters())
        for state in trainer.optimizer.state.values():
            assert all(v.dtype == torch.float32 for v in state.values())
    # The projection that reads the captured features ran in bf16 only under autocast ...
    assert seen == [torch.float32] * 3 + [torch.bfloat16] * 3
    # ... and the loss it trains on is the float32 one up to bf16 rounding.
    assert losses["bfloat16"] == pytest.approx(losses[""], rel=0.02)
