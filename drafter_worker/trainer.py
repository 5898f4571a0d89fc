"""The drafter's optimisation step and its device-side metrics.

The step never reads a device value on the host: the loss, gradient norm,
clip decision, per-position hits and token counts are added into
:class:`DeviceAccumulators` and read back later, without waiting.

A step whose loss or gradient norm is not finite changes nothing: the fused
AdamW kernel is handed a device-side ``found_inf`` flag (the mechanism
``torch.amp.GradScaler`` uses) and skips the update, its step count and
moment estimates included, without the host ever reading the flag. The
number of such steps and the longest run of them are device counters too;
the worker stops the drafter when a snapshot shows ``MAX_NONFINITE_STREAK``
in a row.
"""

from __future__ import annotations

import logging
import math

import torch

from common.config import DrafterConfig
from common.devices import resolve_dtype
from common.metric_names import Drafter
from common.progress import Progress
from drafter_worker.model.device_metrics import DeviceAccumulators
from drafter_worker.model.dflash_model import DFlashDrafter, dflash_block_loss
from drafter_worker.model.lm_loss import TRITON_MAX_ROWS, resolve_mode

logger = logging.getLogger(__name__)


MAX_NONFINITE_STREAK = 10  # this many non-finite steps in a row stop the drafter (exit code 3)
NONFINITE_STREAK = "nonfinite_streak"  # in summarize()'s output for the worker's stop rule; not a series


def schedule_length(cfg: DrafterConfig, plan_steps: int = 0) -> int:
    """Steps the cosine covers: ``decay_steps``, else ``max_steps``, else the plan
    length the target announced (its batches for this group over all epochs);
    0 = no known end (the learning rate stays at its peak after warm-up)."""
    return cfg.decay_steps or cfg.max_steps or plan_steps


def learning_rate(cfg: DrafterConfig, step: int, plan_steps: int = 0, train_seconds: float = 0.0) -> float:
    """Linear warm-up, then cosine decay to ``learning_rate * min_lr_ratio``: over
    ``decay_minutes`` of the drafter's training clock (``train_seconds``) when set,
    else over :func:`schedule_length` steps."""
    peak = cfg.learning_rate
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.decay_minutes:
        progress = min(1.0, max(0.0, train_seconds) / (cfg.decay_minutes * 60.0))
    else:
        decay = schedule_length(cfg, plan_steps)
        if not decay:
            return peak
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, decay - cfg.warmup_steps))
    floor = peak * cfg.min_lr_ratio
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(cfg: DrafterConfig, model: DFlashDrafter) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if param.ndim < 2 else decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Fused (CPU and CUDA): the only AdamW that takes a device-side found_inf flag.
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.adam_beta1, cfg.adam_beta2), fused=True)


class DrafterTrainer:
    def __init__(
        self,
        cfg: DrafterConfig,
        model: DFlashDrafter,
        optimizer: torch.optim.Optimizer,
        generator: torch.Generator,
        step: int,
        collect_metrics: bool = True,
    ):
        self.cfg = cfg
        self.model = model
        # What the step calls: the model itself, or its DDP wrapper when several ranks train it
        # (drafter_worker.rank_group); weights, optimizer and checkpoints stay ``model``'s.
        self.forward_model: torch.nn.Module = model
        self.optimizer = optimizer
        self.generator = generator
        self.step = step
        self.plan_steps = 0  # the target's plan length for this group (WELCOME); sets the schedule when max_steps is 0
        self.train_seconds = 0.0  # the drafter's training clock (host value, set by the caller); drafter.decay_minutes
        self.collect_metrics = collect_metrics  # off only to measure what metrics cost (bench/)
        # The target's final norm (weight, eps) from WELCOME: the soft-target loss needs it (drafter.distill_weight).
        self.teacher_norm: tuple[torch.Tensor, float] | None = None
        self.params = [p for p in model.parameters() if p.requires_grad]
        device = next(model.parameters()).device
        self.device_type = device.type
        self.autocast_dtype = resolve_dtype(cfg.autocast, device) if cfg.autocast else "float32"
        bs = model.block_size
        chosen = resolve_mode(device, cfg.loss_impl)
        if cfg.loss_impl == "auto" and chosen == "triton":
            chosen = f"triton up to {TRITON_MAX_ROWS} scored rows a call, chunked above"
        logger.info("[model] LM-head loss: %s (drafter.loss_impl = %s)", chosen, cfg.loss_impl)
        if cfg.autocast:
            logger.info("[model] training step computes in %s (drafter.autocast = %s; weights and optimizer float32)",
                        self.autocast_dtype, cfg.autocast)
        # Consecutive non-finite steps so far (device scalar; never read in the step).
        self.nonfinite_streak = torch.zeros((), device=device)
        self.metrics = DeviceAccumulators(device, {
            "loss_sum": (1, "sum"),
            "steps": (1, "sum"),
            "finite_steps": (1, "sum"),
            "nonfinite_streak_max": (1, "max"),
            "correct": (bs, "sum"),
            "count": (bs, "sum"),
            "grad_norm_sum": (1, "sum"),
            "grad_norm_peak": (1, "max"),
            "clipped": (1, "sum"),
            "labels": (1, "sum"),
        })

    def train_step(
        self,
        features: torch.Tensor,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        lengths: torch.Tensor,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        contribute: bool = True,
    ) -> float:
        """One optimizer step on one batch; returns the learning rate used (a host value).

        ``contribute=False``: a zero-gradient step (this rank has no batch of its own this round, see
        drafter_worker.rank_group); it runs the same forward and backward, so the gradient all-reduce of
        the other ranks is matched, and records no metrics."""
        lr = learning_rate(self.cfg, self.step, self.plan_steps, self.train_seconds)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.model.train()
        with self._autocast():
            out = dflash_block_loss(
                self.forward_model,
                features=features,
                input_ids=input_ids.long(),
                loss_mask=loss_mask,
                lengths=lengths,
                embed_weight=embed_weight,
                lm_head_weight=lm_head_weight,
                num_anchors=self.cfg.anchors_per_sequence,
                loss_gamma=self.cfg.loss_gamma,
                loss_impl=self.cfg.loss_impl,
                generator=self.generator,
                distill_weight=self.cfg.distill_weight,
                teacher_norm=self.teacher_norm,
                reveal_fraction=self.cfg.reveal_fraction,
            )
        (out.loss if contribute else out.loss * 0.0).backward()
        # Returns the pre-clip norm as a device tensor; clipping itself is a device op.
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=True)
        loss = out.loss.detach()
        finite = torch.isfinite(loss) & torch.isfinite(norm)
        # Read by the fused kernel on the device: 1 skips the whole update.
        self.optimizer.grad_scale = None
        self.optimizer.found_inf = (~finite).float()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite_streak = (self.nonfinite_streak + 1.0) * (~finite)
        self.step += 1
        if self.collect_metrics and contribute:
            self.record_step(loss, out.correct_per_pos, out.count_per_pos, out.num_tokens, norm, finite)
        return lr

    def _autocast(self) -> torch.autocast:
        """The step's autocast context: bf16 matmuls where drafter.autocast asks for them, else a no-op."""
        return torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.autocast_dtype == "bfloat16")

    def record_step(self, loss, correct_per_pos, count_per_pos, num_tokens, grad_norm, finite=None) -> None:
        """Add one step's device values to the accumulators (device ops only, no host read).

        A non-finite step counts in ``steps`` and the streak only: its loss and norm
        would poison the window's means."""
        m = self.metrics
        if finite is None:
            finite = torch.ones((), dtype=torch.bool, device=loss.device)
        ok = finite.float()
        m.add("loss_sum", torch.where(finite, loss, 0.0))
        m.add("steps", 1.0)
        m.add("finite_steps", ok)
        m.maximum("nonfinite_streak_max", self.nonfinite_streak)
        m.add("correct", correct_per_pos * ok)
        m.add("count", count_per_pos * ok)
        m.add("grad_norm_sum", torch.where(finite, grad_norm, 0.0))
        m.maximum("grad_norm_peak", torch.where(finite, grad_norm, 0.0))
        m.add("clipped", (finite & (grad_norm > self.cfg.grad_clip)).float())
        m.add("labels", num_tokens * ok)

    def warm_up(self, shapes: list[tuple[int, int]], feature_dim: int, embed_weight, lm_head_weight) -> None:
        """Run forward and backward once per batch shape so allocator and kernel set-up are
        not in the first measured step. Leaves weights, optimizer, RNG and metrics untouched."""
        device = next(self.model.parameters()).device
        generator = torch.Generator(device=device)
        generator.manual_seed(0)
        self.model.train()
        progress = Progress("drafter warm-up", total=len(shapes), unit="shapes", every_s=10.0, logger=logger)
        for batch_size, seq_len in shapes:
            with self._autocast():
                out = dflash_block_loss(
                    self.model,
                    features=torch.zeros(batch_size, seq_len, feature_dim, device=device),
                    input_ids=torch.zeros(batch_size, seq_len, dtype=torch.long, device=device),
                    loss_mask=torch.ones(batch_size, seq_len, dtype=torch.uint8, device=device),
                    lengths=torch.full((batch_size,), seq_len, dtype=torch.int32, device=device),
                    embed_weight=embed_weight,
                    lm_head_weight=lm_head_weight,
                    num_anchors=self.cfg.anchors_per_sequence,
                    loss_gamma=self.cfg.loss_gamma,
                    loss_impl=self.cfg.loss_impl,
                    generator=generator,
                    distill_weight=self.cfg.distill_weight,
                    teacher_norm=self.teacher_norm,
                )
            out.loss.backward()
            progress.update()
        progress.close()
        self.optimizer.zero_grad(set_to_none=True)


def summarize(values: dict[str, list[float]]) -> dict[str, float]:
    """Turn one window of accumulator values (host floats) into metric values.

    Plain Python on host floats: no tensors, so nothing here can touch a device
    (and the CPU sync guard has nothing to flag).
    """
    finite_steps = values["finite_steps"][0]
    steps = max(finite_steps, 1.0)
    acc = [c / max(n, 1.0) for c, n in zip(values["correct"], values["count"])]
    # EAL = sum_k prod_{i<=k} acc_i over the draft slots (as expected_acceptance_length).
    eal, run = 0.0, 1.0
    for a in acc[1:]:
        run *= a
        eal += run
    out = {
        Drafter.LOSS: values["loss_sum"][0] / steps,
        Drafter.GRAD_NORM: values["grad_norm_sum"][0] / steps,
        Drafter.GRAD_NORM_MAX: values["grad_norm_peak"][0],
        Drafter.CLIP_RATE: values["clipped"][0] / steps,
        Drafter.LABEL_TOKENS: values["labels"][0],
        Drafter.EAL: eal,
        Drafter.NONFINITE_STEPS: values["steps"][0] - values["finite_steps"][0],
        NONFINITE_STREAK: values["nonfinite_streak_max"][0],
    }
    if finite_steps == 0:  # no finite step in the window: no loss or norm to report (not a 0)
        for key in (Drafter.LOSS, Drafter.GRAD_NORM, Drafter.GRAD_NORM_MAX):
            del out[key]
    for k in range(1, len(acc)):
        out[Drafter.ACC_POS(k)] = acc[k]
    return out
