"""Soft-target loss: cross-entropy of the drafter against the target's own next-token distribution.

The recipe's labels are the target's greedy tokens, so a hard label says only
which token won. The target's distribution at the same position also says how
close the runners-up were; training on it (knowledge distillation, as
DistillSpec does for drafters) generalises better from little data: a probe
reading the target's features scored 0.51 held-out accuracy for the first
draft slot trained on the distribution against 0.48 on the hard labels
(docs/recipe.md).

The teacher's logits come from the target's last layer: the drafter applies
the target's final norm to that captured layer and multiplies by the target's
frozen LM head rows, the ones the drafter scores its own hidden states with
unless it trains a head of its own (``drafter.train_draft_head``), so the
loss needs no extra transfer. The hard and the soft part share one pass over the head.
Rows are processed in chunks; a chunk's ``[rows, V]`` gradient coefficients
are kept for the backward when they fit ``keep_bytes`` (one matmul in the
backward), otherwise recomputed from the saved inputs. No device-to-host
sync.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["distill_lm_head_loss", "teacher_hidden"]

DEFAULT_CHUNK_ROWS = 1024
DEFAULT_KEEP_BYTES = 256 << 20


def teacher_hidden(last_layer: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The target's final hidden state: its RMSNorm (weight ``norm_weight``) of its last layer's output."""
    x32 = last_layer.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return norm_weight.float() * x32


def _chunk(x, teacher, head, teacher_head, labels, hard, soft):
    """``(loss_sum, hits, coef)`` of one row chunk; ``coef`` is d(loss_sum)/d(student logits)."""
    student = F.linear(x.to(head.dtype), head).float()
    target = F.linear(teacher.to(teacher_head.dtype), teacher_head).float()
    log_p = F.log_softmax(student, dim=-1)
    q = F.softmax(target, dim=-1)
    hard_ce = -log_p.gather(1, labels[:, None]).squeeze(1)
    soft_ce = -(q * log_p).sum(-1)
    loss_sum = (hard * hard_ce + soft * soft_ce).sum()
    hits = (student.argmax(-1) == labels).float()
    coef = (hard + soft)[:, None] * log_p.exp() - soft[:, None] * q
    coef.scatter_add_(1, labels[:, None], -hard[:, None])
    return loss_sum, hits, coef


class _DistillLMHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, teacher, head, teacher_head, labels, hard, soft, chunk_rows: int, keep_bytes: int):
        keep = x.shape[0] * head.shape[0] * 4 <= keep_bytes
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        hits, coefs = [], []
        for i in range(0, x.shape[0], chunk_rows):
            rows = slice(i, i + chunk_rows)
            loss_sum, chunk_hits, coef = _chunk(x[rows], teacher[rows], head, teacher_head, labels[rows], hard[rows],
                                                soft[rows])
            total = total + loss_sum
            hits.append(chunk_hits)
            if keep:
                coefs.append(coef)
        ctx.chunk_rows = chunk_rows
        ctx.coefs = coefs if keep else None
        # Autocast (drafter.autocast) is off when autograd runs backward: keep the forward's for its matmuls.
        device_type = x.device.type
        ctx.autocast = (device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type))
        ctx.save_for_backward(x, teacher, head, teacher_head, labels, hard, soft)
        ctx.mark_non_differentiable(*hits)
        return (total, torch.cat(hits) if hits else x.new_zeros(0, dtype=torch.float32))

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, _grad_hits: Any):
        device_type, dtype, enabled = ctx.autocast
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            return _DistillLMHeadLoss._backward(ctx, grad_loss)

    @staticmethod
    def _backward(ctx: Any, grad_loss: torch.Tensor):
        x, teacher, head, teacher_head, labels, hard, soft = ctx.saved_tensors
        step = ctx.chunk_rows
        grads = []
        # A head the drafter trains (drafter.train_draft_head): its gradient is coef^T @ x, accumulated in fp32.
        grad_head = None
        if ctx.needs_input_grad[2]:
            grad_head = torch.zeros(head.shape, dtype=torch.float32, device=head.device)
        for n, i in enumerate(range(0, x.shape[0], step)):
            rows = slice(i, i + step)
            coef = (ctx.coefs[n] if ctx.coefs is not None
                    else _chunk(x[rows], teacher[rows], head, teacher_head, labels[rows], hard[rows], soft[rows])[2])
            grads.append((coef.to(head.dtype) @ head).float())
            if grad_head is not None:
                grad_head += (coef.to(head.dtype).T @ x[rows].to(head.dtype)).float()
        ctx.coefs = None
        grad_x = (torch.cat(grads) * grad_loss).to(x.dtype) if grads else torch.zeros_like(x)
        if grad_head is not None:
            grad_head = (grad_head * grad_loss).to(head.dtype)
        return grad_x, None, grad_head, None, None, None, None, None, None


def distill_lm_head_loss(
    hidden: torch.Tensor,
    teacher: torch.Tensor,
    head: torch.Tensor,
    labels: torch.Tensor,
    hard_weights: torch.Tensor,
    soft_weights: torch.Tensor,
    *,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    keep_bytes: int = DEFAULT_KEEP_BYTES,
    teacher_head: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, hits)``: ``sum(hard_weights * CE(label) + soft_weights * CE(softmax(teacher @ head.T)))``.

    One pass scores both labels: the drafter's logits ``hidden @ head.T`` are
    computed once for the hard and the soft part (three ``N x V x H`` matmuls
    in all with the teacher's, against two for the hard loss alone).
    ``hidden`` and ``teacher`` are ``[..., H]`` (the drafter's outputs and the
    target's final hidden states of the same positions), ``head`` the ``[V, H]``
    rows the drafter is scored on (the draft vocabulary's, when it has one: the
    teacher is then renormalised over it), ``teacher_head`` the target's own
    rows for the same V tokens (default ``head``), ``labels`` ``[...]`` row
    indices into ``head``, the weights ``[...]`` (normalised by the caller).
    ``hits`` is float ``[...]``, 1.0 where the argmax is the label (no grad).
    ``hidden`` gets a gradient, and ``head`` when it requires one (a drafter's
    own head); the teacher side never does.
    """
    if hidden.shape != teacher.shape or not (hidden.shape[:-1] == labels.shape == hard_weights.shape
                                             == soft_weights.shape):
        raise ValueError(f"hidden {tuple(hidden.shape)}, teacher {tuple(teacher.shape)}, labels "
                         f"{tuple(labels.shape)} and weights {tuple(hard_weights.shape)} / "
                         f"{tuple(soft_weights.shape)} must agree")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    h = hidden.shape[-1]
    teacher_head = head if teacher_head is None else teacher_head
    if teacher_head.shape != head.shape:
        raise ValueError(f"teacher_head {tuple(teacher_head.shape)} must match head {tuple(head.shape)}")
    loss, hits = _DistillLMHeadLoss.apply(
        hidden.reshape(-1, h), teacher.reshape(-1, h).detach(), head, teacher_head.detach(), labels.reshape(-1).long(),
        hard_weights.reshape(-1).float().detach(), soft_weights.reshape(-1).float().detach(), chunk_rows, keep_bytes)
    return loss, hits.view(labels.shape)
