"""Soft-target loss: cross-entropy of the drafter against the target's own next-token distribution.

The recipe's labels are the target's greedy tokens, so a hard label says only
which token won. The target's distribution at the same position also says how
close the runners-up were; training on it (knowledge distillation, as
DistillSpec does for drafters) generalises better from little data: a probe
reading the target's features scored 0.51 held-out accuracy for the first
draft slot trained on the distribution against 0.48 on the hard labels
(docs/recipe.md).

The teacher's logits come from the target's last layer: the drafter applies
the target's final norm to that captured layer and multiplies by the same
frozen LM head rows it scores its own hidden states with, so the loss needs
no extra transfer. Rows are processed in chunks; a chunk's ``[rows, V]``
gradient coefficients are kept for the backward when they fit
``keep_bytes`` (one matmul in the backward), otherwise recomputed from the
saved inputs. No device-to-host sync.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["soft_target_loss", "teacher_hidden"]

DEFAULT_CHUNK_ROWS = 1024
DEFAULT_KEEP_BYTES = 256 << 20


def teacher_hidden(last_layer: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The target's final hidden state: its RMSNorm (weight ``norm_weight``) of its last layer's output."""
    x32 = last_layer.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return norm_weight.float() * x32


def _chunk(x: torch.Tensor, teacher: torch.Tensor, head: torch.Tensor, w: torch.Tensor):
    """``(loss_sum, coef)`` of one row chunk; ``coef = w * (softmax(student) - softmax(teacher))``."""
    student = F.linear(x.to(head.dtype), head).float()
    target = F.linear(teacher.to(head.dtype), head).float()
    log_p = F.log_softmax(student, dim=-1)
    q = F.softmax(target, dim=-1)
    loss_sum = (w * -(q * log_p).sum(-1)).sum()
    return loss_sum, w[:, None] * (log_p.exp() - q)


class _SoftTargetLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, teacher, head, w, chunk_rows: int, keep_bytes: int):
        keep = x.shape[0] * head.shape[0] * 4 <= keep_bytes
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        coefs = []
        for i in range(0, x.shape[0], chunk_rows):
            loss_sum, coef = _chunk(x[i:i + chunk_rows], teacher[i:i + chunk_rows], head, w[i:i + chunk_rows])
            total = total + loss_sum
            if keep:
                coefs.append(coef)
        ctx.chunk_rows = chunk_rows
        ctx.coefs = coefs if keep else None
        ctx.save_for_backward(x, teacher, head, w)
        return total

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor):
        x, teacher, head, w = ctx.saved_tensors
        rows = ctx.chunk_rows
        grads = []
        for n, i in enumerate(range(0, x.shape[0], rows)):
            coef = ctx.coefs[n] if ctx.coefs is not None else _chunk(x[i:i + rows], teacher[i:i + rows], head,
                                                                      w[i:i + rows])[1]
            grads.append((coef.to(head.dtype) @ head).float())
        ctx.coefs = None
        grad_x = (torch.cat(grads) * grad_loss).to(x.dtype) if grads else torch.zeros_like(x)
        return grad_x, None, None, None, None, None


def soft_target_loss(
    hidden: torch.Tensor,
    teacher: torch.Tensor,
    head: torch.Tensor,
    weights: torch.Tensor,
    *,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    keep_bytes: int = DEFAULT_KEEP_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_sum, weight_sum)``: ``sum(weights * CE(softmax(teacher @ head.T), hidden @ head.T))``.

    ``hidden`` and ``teacher`` are ``[..., H]`` (the drafter's outputs and the
    target's final hidden states of the same positions), ``head`` the frozen
    ``[V, H]`` rows both are scored on (the draft vocabulary's, when it has
    one: the teacher is then renormalised over it), ``weights`` ``[...]``.
    Only ``hidden`` gets a gradient.
    """
    if hidden.shape != teacher.shape or hidden.shape[:-1] != weights.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)}, teacher {tuple(teacher.shape)} and weights "
                         f"{tuple(weights.shape)} must agree")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    h = hidden.shape[-1]
    w = weights.reshape(-1).float()
    loss_sum = _SoftTargetLoss.apply(hidden.reshape(-1, h), teacher.reshape(-1, h).detach(), head.detach(), w,
                                     chunk_rows, keep_bytes)
    return loss_sum, w.sum()
