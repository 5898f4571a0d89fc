"""The soft-target loss: the target's distribution as the label, exact gradients, wired into the block loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from drafter_worker.model.distill_loss import distill_lm_head_loss, teacher_hidden


def _reference(hidden, teacher, head, labels, hard, soft):
    log_p = F.log_softmax(hidden @ head.T, -1)
    q = F.softmax(teacher @ head.T, -1)
    hard_ce = -log_p.gather(-1, labels[..., None]).squeeze(-1)
    return (hard * hard_ce + soft * -(q * log_p).sum(-1)).sum(), ((hidden @ head.T).argmax(-1) == labels).float()


@pytest.mark.parametrize("keep_bytes", [1 << 30, 0], ids=["kept-coefficients", "recomputed"])
def test_distill_loss_matches_autograd_reference(keep_bytes):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 5, 16, generator=gen, dtype=torch.float64)
    teacher = torch.randn(3, 5, 16, generator=gen, dtype=torch.float64)
    head = torch.randn(40, 16, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 40, (3, 5), generator=gen)
    hard, soft = torch.rand(3, 5, generator=gen, dtype=torch.float64), torch.rand(3, 5, generator=gen, dtype=torch.float64)
    hard[0, 0] = 0.0
    x = hidden.clone().requires_grad_(True)
    loss, hits = distill_lm_head_loss(x, teacher, head, labels, hard, soft, chunk_rows=4, keep_bytes=keep_bytes)
    loss.backward()
    y = hidden.clone().requires_grad_(True)
    ref, ref_hits = _reference(y, teacher, head, labels, hard.float().double(), soft.float().double())
    ref.backward()
    assert torch.allclose(loss.double(), ref, rtol=1e-6)
    assert torch.equal(hits, ref_hits) and hits.sum() > 0
    assert torch.allclose(x.grad, y.grad, rtol=1e-4, atol=1e-5)  # the logits are read as fp32


def test_a_head_of_its_own_gets_the_reference_gradient_and_the_teacher_keeps_the_targets_rows():
    """drafter.train_draft_head: the drafter scores with its own head, the teacher with the target's rows."""
    gen = torch.Generator().manual_seed(2)
    hidden, teacher = torch.randn(7, 16, generator=gen), torch.randn(7, 16, generator=gen)
    target_rows = torch.randn(40, 16, generator=gen)
    own = target_rows + 0.3 * torch.randn(40, 16, generator=gen)
    labels = torch.randint(0, 40, (7,), generator=gen)
    hard, soft = torch.rand(7, generator=gen), torch.rand(7, generator=gen)
    for keep_bytes in (1 << 30, 0):
        x, head = hidden.clone().requires_grad_(True), own.clone().requires_grad_(True)
        rows = target_rows.clone().requires_grad_(True)
        loss, _ = distill_lm_head_loss(x, teacher, head, labels, hard, soft, teacher_head=rows, chunk_rows=3,
                                       keep_bytes=keep_bytes)
        loss.backward()
        y, ref_head = hidden.clone().requires_grad_(True), own.clone().requires_grad_(True)
        log_p = F.log_softmax(y @ ref_head.T, -1)
        q = F.softmax(teacher @ target_rows.T, -1)
        ref = (hard * -log_p.gather(-1, labels[:, None]).squeeze(-1) + soft * -(q * log_p).sum(-1)).sum()
        ref.backward()
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(x.grad, y.grad)
        torch.testing.assert_close(head.grad, ref_head.grad)
        assert rows.grad is None  # the target's rows are the teacher's, never trained
    with pytest.raises(ValueError, match="teacher_head"):
        distill_lm_head_loss(hidden, teacher, own, labels, hard, soft, teacher_head=target_rows[:30])


def test_the_soft_part_is_lowest_at_the_teacher():
    """Scored on the teacher's own hidden state, the soft loss is the teacher's entropy: nothing beats it."""
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(8, 16, generator=gen)
    head = torch.randn(32, 16, generator=gen)
    labels, hard, soft = torch.zeros(8, dtype=torch.long), torch.zeros(8), torch.ones(8)
    at_teacher, _ = distill_lm_head_loss(teacher, teacher, head, labels, hard, soft)
    for _ in range(5):
        other, _ = distill_lm_head_loss(teacher + 0.3 * torch.randn(8, 16, generator=gen), teacher, head, labels,
                                        hard, soft)
        assert other > at_teacher


def test_teacher_hidden_is_the_models_final_norm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16) + 0.5)
    x = torch.randn(2, 3, 16) * 50
    assert torch.allclose(teacher_hidden(x, norm.weight, 1e-5), norm(x), rtol=1e-5, atol=1e-5)


def test_block_loss_mixes_hard_and_soft_targets():
    """distill_weight 0 is the hard loss; 1 is the soft loss alone, whose gradient reaches the drafter."""
    from drafter_worker.model.dflash_model import DFlashDrafter, dflash_block_loss
    from tests.fixtures import tiny_drafter_config

    torch.manual_seed(0)
    config = tiny_drafter_config()
    drafter = DFlashDrafter(config)
    hidden = config.hidden_size
    k = len(drafter.target_layer_ids)
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(2, 24, k * hidden, generator=gen)
    ids = torch.randint(0, config.vocab_size - 1, (2, 24), generator=gen)
    mask = torch.ones(2, 24, dtype=torch.uint8)
    lengths = torch.tensor([24, 20], dtype=torch.int32)
    embed = torch.randn(config.vocab_size, hidden, generator=gen)
    norm = (torch.rand(hidden, generator=gen) + 0.5, 1e-6)
    anchors = torch.tensor([[3, 9], [2, 12]])

    def loss(weight):
        return dflash_block_loss(drafter, features=features, input_ids=ids, loss_mask=mask, lengths=lengths,
                                 embed_weight=embed, lm_head_weight=embed, anchors=anchors, loss_gamma=3.0,
                                 loss_impl="torch", distill_weight=weight, teacher_norm=norm).loss

    hard, soft, half = loss(0.0), loss(1.0), loss(0.5)
    assert torch.allclose(half, 0.5 * hard + 0.5 * soft, rtol=1e-5)
    assert not torch.allclose(hard, soft)
    # With no soft part the distilled path is the plain hard loss.
    assert torch.allclose(loss(1e-9), hard, rtol=1e-5)
    drafter.zero_grad()
    soft.backward()
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="teacher_norm"):
        dflash_block_loss(drafter, features=features, input_ids=ids, loss_mask=mask, lengths=lengths,
                          embed_weight=embed, lm_head_weight=embed, anchors=anchors, loss_gamma=3.0,
                          distill_weight=0.5)


def test_drafter_takes_the_teacher_from_the_welcome_or_refuses_with_the_layer_to_capture():
    from common.config import DrafterConfig
    from drafter_worker.connection import FatalError
    from drafter_worker.model_setup import teacher_norm
    from tests.messages import welcome

    norm = [0.5 + i / 64 for i in range(32)]
    distill = DrafterConfig(distill_weight=0.5)
    assert teacher_norm(DrafterConfig(), welcome(final_norm_weight=norm), torch.device("cpu")) is None
    weight, eps = teacher_norm(distill, welcome(target_layer_ids=[1, 5], final_norm_weight=norm), torch.device("cpu"))
    assert weight.tolist() == norm and eps == 1e-6
    with pytest.raises(FatalError, match=r"capture its last layer \(5\).*\[1, 4\]"):
        teacher_norm(distill, welcome(target_layer_ids=[1, 4], final_norm_weight=norm), torch.device("cpu"))
    with pytest.raises(FatalError, match="final RMSNorm"):
        teacher_norm(distill, welcome(target_layer_ids=[1, 5]), torch.device("cpu"))
