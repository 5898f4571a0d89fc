"""LM head + cross-entropy + argmax accuracy: the plain reference and versions without ``[N, V]`` logits.

Drop-in replacements for :func:`lm_head_loss` (the plain reference): same arguments, same ``(loss_sum, weight_sum, hits)`` result, same
gradients.  With ``N`` scored positions (~2000 per step: 16 blocks x 15 slots x
8 rows) and the target vocabulary ``V`` (49152 for SmolLM2, 150k+ for Qwen),
the reference holds the fp32 logits, their softmax and its gradient, each
``N * V * 4`` bytes (0.4 GB apiece at N=2000, V=49152).  The fused versions
walk the vocabulary in chunks with an online log-sum-exp and a running argmax,
so the largest temporary is ``N * chunk``.

Implementations (all without device-to-host syncs):

* :func:`chunked_lm_head_loss` - torch only, any device.  When only
  ``hidden`` needs a gradient (the frozen-head case) the forward also
  accumulates ``softmax @ W`` chunk by chunk, flash-attention style (the
  accumulator is rescaled whenever the running max moves), so the backward is
  one elementwise expression and the op costs two ``N x V x H`` matmuls, the
  same as the reference's forward plus grad-of-hidden.  When the head itself
  requires grad, the forward only keeps ``lse`` and the backward recomputes the
  chunk logits: four matmuls against the reference's three (the logits twice,
  then grad_hidden and grad_weight).
  Extra memory: ``O(N * chunk)`` temporaries plus ``O(N * H)`` saved for
  backward (and the ``[V, H]`` grad_weight when the head is trained).
* :func:`triton_lm_head_loss` - the forward (per-row lse, target logit and
  argmax) is one Triton kernel over vocabulary tiles with ``tl.dot``; no logits
  reach global memory at all.  Rows and vocabulary are both split across
  programs and the per-split partials are merged in torch.  The backward reuses
  the torch chunked recompute (cuBLAS matmuls per vocabulary chunk), so this
  path costs three matmuls even with a frozen head: it trades one matmul for
  not writing/reading the chunk logits in the forward.  Runs on CUDA, or on CPU
  when ``TRITON_INTERPRET=1`` was set before triton was first imported (slow;
  for tests).
* :func:`fused_lm_head_loss` - dispatch by ``drafter.loss_impl``: ``triton``,
  ``chunked``, ``torch`` (the plain reference) or ``auto`` (default: Triton for
  CUDA tensors of at most ``TRITON_MAX_ROWS`` rows when Triton imports, else
  chunked; the row limit is where the two crossed on an H200).

Semantics shared with the reference: logits are computed in the LM head's dtype
(``hidden`` is cast to it) and then read as fp32, so a bf16 head is never
copied to fp32; ``weights`` are cast to fp32; ``hits`` is float, 1.0 where the
argmax equals the label, ties resolved to the lowest vocabulary index like
``torch.argmax``, and carries no grad.  Labels must lie in ``[0, V)`` at every
position, including weight-0 ones (the reference requires that too; there is
no ``ignore_index``).  NaN logits are not handled specially (the reference's
argmax would pick the NaN; here a NaN never wins the argmax).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch
import torch.nn.functional as F

try:  # Triton is a declared dependency, but the torch path must not need it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only without triton installed
    triton = None
    tl = None

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "MODES",
    "TRITON_MAX_ROWS",
    "chunked_lm_head_loss",
    "fused_lm_head_loss",
    "lm_head_loss",
    "resolve_mode",
    "triton_lm_head_loss",
]

MODES = ("auto", "triton", "chunked", "torch")  # drafter.loss_impl
DEFAULT_CHUNK_SIZE = 4096

LossResult = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


# ---------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------


def _flatten(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, H]`` hidden in the head's dtype, ``[N]`` labels, ``[N]`` fp32 weights."""
    if weight.dim() != 2:
        raise ValueError(f"lm_head_weight must be [V, H], got shape {tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden last dim {hidden.shape[-1]} != lm_head_weight H = {weight.shape[1]}")
    if tuple(hidden.shape[:-1]) != tuple(labels.shape) or tuple(weights.shape) != tuple(labels.shape):
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, labels {tuple(labels.shape)} and weights "
            f"{tuple(weights.shape)} must agree on the leading dims"
        )
    if labels.dtype.is_floating_point:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    x = hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype)
    return x, labels.reshape(-1), weights.reshape(-1).float()


def _check_chunk_size(chunk_size: int) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _onehot_in_chunk(labels: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(column, in_chunk)``: the label's column inside ``[start, start+width)`` (clamped) and whether it is there."""
    local = labels - start
    in_chunk = (local >= 0) & (local < width)
    return local.clamp(0, width - 1).unsqueeze(1), in_chunk


def _chunked_stats(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    accumulate_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One pass over vocabulary chunks.

    Returns ``(lse, target_logit, argmax, softmax_at_w)``, the last being
    ``softmax(x W^T) @ W`` in fp32 ``[N, H]`` when ``accumulate_grad`` (else
    ``None``).  Peak temporaries: the ``[N, chunk]`` logits (fp32, reused in
    place for the exponentials) plus their cast to the head's dtype.
    """
    n = x.shape[0]
    vocab = weight.shape[0]
    m = torch.full((n,), float("-inf"), dtype=torch.float32, device=x.device)
    s = torch.zeros(n, dtype=torch.float32, device=x.device)
    arg = torch.zeros(n, dtype=torch.long, device=x.device)
    tgt = torch.zeros(n, dtype=torch.float32, device=x.device)
    acc = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device) if accumulate_grad else None
    for start in range(0, vocab, chunk_size):
        w_chunk = weight[start : start + chunk_size]
        width = w_chunk.shape[0]
        logits = F.linear(x, w_chunk).float()  # [N, chunk]: the head's dtype, read as fp32
        col, in_chunk = _onehot_in_chunk(labels, start, width)
        tgt += torch.where(in_chunk, logits.gather(1, col).squeeze(1), 0.0)
        chunk_max, chunk_arg = logits.max(dim=1)  # first maximum on ties
        # Strict '>' keeps the earlier chunk on ties: lowest index overall, like torch.argmax.
        arg = torch.where(chunk_max > m, chunk_arg + start, arg)
        new_m = torch.maximum(m, chunk_max)
        scale = torch.exp(m - new_m)  # 0 on the first chunk (m = -inf)
        p = logits.sub_(new_m.unsqueeze(1)).exp_()  # in place: no second [N, chunk] fp32 buffer
        s = s * scale + p.sum(dim=1)
        if acc is not None:
            acc.mul_(scale.unsqueeze(1)).add_(torch.mm(p.to(weight.dtype), w_chunk))
        m = new_m
    lse = m + torch.log(s)
    if acc is not None:
        acc.div_(s.unsqueeze(1))
    return lse, tgt, arg, acc


def _chunked_backward(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    coef: torch.Tensor,
    lse: torch.Tensor,
    need_x: bool,
    need_w: bool,
    chunk_size: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``sum(coef * CE)`` by recomputing the chunk logits.

    ``d/dlogits = coef * (softmax - onehot)``, cast to the head's dtype before
    the matmuls as autograd does for the reference.
    """
    grad_x = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if need_x else None
    grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if need_w else None
    for start in range(0, weight.shape[0], chunk_size):
        w_chunk = weight[start : start + chunk_size]
        width = w_chunk.shape[0]
        g = F.linear(x, w_chunk).float().sub_(lse.unsqueeze(1)).exp_()  # softmax chunk
        col, in_chunk = _onehot_in_chunk(labels, start, width)
        g.scatter_add_(1, col, -in_chunk.to(g.dtype).unsqueeze(1))
        g.mul_(coef.unsqueeze(1))
        g = g.to(weight.dtype)
        if grad_x is not None:
            grad_x.add_(torch.mm(g, w_chunk))
        if grad_w is not None:
            torch.mm(g.t(), x, out=grad_w[start : start + width])
    return (grad_x.to(x.dtype) if grad_x is not None else None), grad_w


def _finish(
    lse: torch.Tensor, tgt: torch.Tensor, arg: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    loss_sum = (weights * (lse - tgt)).sum()
    hits = (arg == labels).float()
    return loss_sum, hits


def _needs_grad(x: torch.Tensor, weight: torch.Tensor) -> tuple[bool, bool]:
    enabled = torch.is_grad_enabled()
    return enabled and x.requires_grad, enabled and weight.requires_grad


# ---------------------------------------------------------------------------
# Chunked torch implementation
# ---------------------------------------------------------------------------
# Plain reference (drafter.loss_impl = "torch")
# ---------------------------------------------------------------------------


def lm_head_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted cross-entropy through the frozen LM head (plain reference).

    Materialises the ``[..., V]`` logits.  ``drafter.loss_impl = "torch"``
    trains with it; the other implementations have the same semantics without
    the logits and are tested against it.

    Args:
        hidden: ``[..., H]`` drafter outputs.
        lm_head_weight: ``[V, H]`` frozen target LM head.
        labels: ``[...]`` target token ids (any value in range where weight is 0).
        weights: ``[...]`` float per-token weights (0 = ignored).

    Returns:
        ``(loss_sum, weight_sum, hits)``: scalar ``sum(weights * CE)`` (with
        grad), scalar ``sum(weights)``, and float ``[...]`` 1.0 where the argmax
        equals the label (unmasked, no grad).
    """
    # Compute in the head's dtype so a bf16 head is never copied to fp32.
    logits = F.linear(hidden.to(lm_head_weight.dtype), lm_head_weight).float()
    flat_logits = logits.reshape(-1, logits.shape[-1])
    ce = F.cross_entropy(flat_logits, labels.reshape(-1), reduction="none").view(labels.shape)
    weights = weights.float()
    loss_sum = (ce * weights).sum()
    with torch.no_grad():
        hits = (logits.argmax(dim=-1) == labels).float()
    return loss_sum, weights.sum(), hits


# ---------------------------------------------------------------------------


class _ChunkedLMHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, weight, labels, weights, chunk_size: int, need_x: bool, need_w: bool):
        # Frozen head: fold grad_hidden into the forward pass (no recompute).
        fold = need_x and not need_w
        lse, tgt, arg, softmax_at_w = _chunked_stats(x, weight, labels, chunk_size, accumulate_grad=fold)
        loss_sum, hits = _finish(lse, tgt, arg, labels, weights)
        ctx.mark_non_differentiable(hits)
        ctx.chunk_size = chunk_size
        ctx.fold = fold
        ctx.need = (need_x, need_w)
        if fold:
            ctx.save_for_backward(softmax_at_w, weight, labels, weights)
        elif need_x or need_w:
            ctx.save_for_backward(x, weight, labels, weights, lse)
        return loss_sum, hits

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor, grad_hits: torch.Tensor | None):
        coef_scale = grad_loss.float()
        if ctx.fold:
            softmax_at_w, weight, labels, weights = ctx.saved_tensors
            coef = (coef_scale * weights).unsqueeze(1)
            grad_x = coef * (softmax_at_w - weight.index_select(0, labels).float())
            return grad_x.to(weight.dtype), None, None, None, None, None, None
        x, weight, labels, weights, lse = ctx.saved_tensors
        need_x, need_w = ctx.need
        grad_x, grad_w = _chunked_backward(
            x, weight, labels, coef_scale * weights, lse, need_x, need_w, ctx.chunk_size
        )
        return grad_x, grad_w, None, None, None, None, None


def chunked_lm_head_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> LossResult:
    """:func:`lm_head_loss` over vocabulary chunks (torch only, any device).

    ``grad_weight`` is computed only when ``lm_head_weight.requires_grad``.
    """
    _check_chunk_size(chunk_size)
    x, flat_labels, flat_weights = _flatten(hidden, lm_head_weight, labels, weights)
    need_x, need_w = _needs_grad(x, lm_head_weight)
    if need_x or need_w:
        loss_sum, hits = _ChunkedLMHeadLoss.apply(
            x, lm_head_weight, flat_labels, flat_weights, chunk_size, need_x, need_w
        )
    else:
        lse, tgt, arg, _ = _chunked_stats(x, lm_head_weight, flat_labels, chunk_size, accumulate_grad=False)
        loss_sum, hits = _finish(lse, tgt, arg, flat_labels, flat_weights)
    return loss_sum, flat_weights.sum(), hits.view(labels.shape)


# ---------------------------------------------------------------------------
# Triton implementation (forward kernel; backward by torch chunks)
# ---------------------------------------------------------------------------


def _lm_head_stats_kernel(
    x_ptr,
    w_ptr,
    labels_ptr,
    m_ptr,
    s_ptr,
    arg_ptr,
    tgt_ptr,
    n_rows,
    vocab,
    hidden,
    stride_x,
    stride_w,
    v_per_split,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """Per-row partial (max, sum exp, argmax, target logit) over one vocabulary split.

    Program ``(i, j)`` owns rows ``i*BLOCK_N ..`` and vocabulary
    ``j*v_per_split .. (j+1)*v_per_split``; partials go to row ``j`` of the
    ``[splits, N]`` outputs.
    """
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    labels = tl.load(labels_ptr + rows64, mask=row_ok, other=-1)
    v_begin = pid_s * v_per_split
    v_end = tl.minimum(v_begin + v_per_split, vocab)
    offs_v = tl.arange(0, BLOCK_V)
    offs_h = tl.arange(0, BLOCK_H)

    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    arg = tl.zeros((BLOCK_N,), tl.int32)
    tgt = tl.zeros((BLOCK_N,), tl.float32)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + offs_v
        col_ok = cols < v_end
        logits = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        for h0 in range(0, hidden, BLOCK_H):
            hs = h0 + offs_h
            h_ok = hs < hidden
            x = tl.load(
                x_ptr + rows64[:, None] * stride_x + hs[None, :],
                mask=row_ok[:, None] & h_ok[None, :],
                other=0.0,
            )
            w = tl.load(
                w_ptr + cols.to(tl.int64)[None, :] * stride_w + hs[:, None],
                mask=col_ok[None, :] & h_ok[:, None],
                other=0.0,
            )
            if UPCAST_DOT:  # the interpreter's dot multiplies bf16 as raw integers; fp32 is exact here
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            logits = tl.dot(x, w, logits, input_precision=INPUT_PRECISION)
        # Round to the head's dtype like the reference (F.linear in that dtype, then .float()).
        logits = logits.to(w_ptr.dtype.element_ty).to(tl.float32)
        logits = tl.where(col_ok[None, :], logits, float("-inf"))
        tile_max, tile_arg = tl.max(logits, axis=1, return_indices=True, return_indices_tie_break_left=True)
        # Strict '>' keeps the earlier tile on ties: lowest index wins, like torch.argmax.
        arg = tl.where(tile_max > m, v0 + tile_arg, arg)
        new_m = tl.maximum(m, tile_max)
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(logits - new_m[:, None]), axis=1)
        m = new_m
        tgt += tl.sum(tl.where(cols[None, :] == labels[:, None], logits, 0.0), axis=1)
    out = pid_s.to(tl.int64) * n_rows + rows64
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    tl.store(arg_ptr + out, arg, mask=row_ok)
    tl.store(tgt_ptr + out, tgt, mask=row_ok)


def _triton_interpret() -> bool:
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older triton without knobs
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


if triton is not None:
    # triton.jit picks compiled vs interpreted when it decorates, and
    # triton.language's own helpers (tl.max with indices, tl.sum) are decorated
    # when triton is imported: TRITON_INTERPRET=1 must be set before the first
    # ``import triton`` in the process, not just before this call.
    _lm_head_stats_kernel = triton.jit(_lm_head_stats_kernel)
    _INTERPRETED = _triton_interpret()
else:  # pragma: no cover
    _INTERPRETED = False


def _triton_available_for(device: torch.device) -> bool:
    return triton is not None and (device.type == "cuda" or _INTERPRETED)


def _default_num_splits(device: torch.device, row_blocks: int, vocab_tiles: int) -> int:
    if device.type == "cuda":
        # Aim for ~4 programs per SM (a cached host query, not a sync).
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 1
    return max(1, min(vocab_tiles, -(-target // row_blocks)))


def _triton_stats(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    block_n: int,
    block_v: int,
    block_h: int,
    num_splits: int | None,
    num_warps: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, h = x.shape
    vocab = weight.shape[0]
    if n == 0:  # nothing to score: no kernel launch over an empty grid
        empty = torch.zeros(0, dtype=torch.float32, device=x.device)
        return empty, empty.clone(), torch.zeros(0, dtype=torch.long, device=x.device)
    x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    labels = labels.contiguous()
    row_blocks = -(-n // block_n)
    vocab_tiles = -(-vocab // block_v)
    splits = num_splits if num_splits is not None else _default_num_splits(x.device, row_blocks, vocab_tiles)
    splits = max(1, min(splits, vocab_tiles))
    v_per_split = -(-vocab_tiles // splits) * block_v
    splits = -(-vocab // v_per_split)  # no empty split

    m_part = torch.empty(splits, n, dtype=torch.float32, device=x.device)
    s_part = torch.empty_like(m_part)
    tgt_part = torch.empty_like(m_part)
    arg_part = torch.empty(splits, n, dtype=torch.int32, device=x.device)
    if weight.dtype == torch.float32 and not (x.is_cuda and torch.backends.cuda.matmul.allow_tf32):
        precision = "ieee"  # match torch's fp32 matmul
    else:
        precision = "tf32"  # TF32 allowed, or 16-bit inputs (where it is ignored)
    # Triton launches on the *current* device and its current stream, not the
    # tensors' device: on a thread whose current device is another GPU the kernel
    # would run there with this GPU's pointers.
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _lm_head_stats_kernel[(row_blocks, splits)](
            x, weight, labels, m_part, s_part, arg_part, tgt_part,
            n, vocab, h, x.stride(0), weight.stride(0), v_per_split,
            BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_H=block_h, INPUT_PRECISION=precision,
            UPCAST_DOT=_INTERPRETED and weight.dtype == torch.bfloat16, num_warps=num_warps,
        )  # fmt: skip
    # Merge the vocabulary splits.
    m = m_part.max(dim=0).values
    lse = m + torch.log((s_part * torch.exp(m_part - m)).sum(dim=0))
    tgt = tgt_part.sum(dim=0)
    # Lowest index among the splits holding the maximum (torch.argmax's tie rule).
    arg = torch.where(m_part == m, arg_part, vocab).min(dim=0).values.long()
    return lse, tgt, arg


class _TritonLMHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, weight, labels, weights, chunk_size: int, need_x: bool, need_w: bool, kernel_kw: dict):
        lse, tgt, arg = _triton_stats(x, weight, labels, **kernel_kw)
        loss_sum, hits = _finish(lse, tgt, arg, labels, weights)
        ctx.mark_non_differentiable(hits)
        ctx.chunk_size = chunk_size
        ctx.need = (need_x, need_w)
        ctx.save_for_backward(x, weight, labels, weights, lse)
        return loss_sum, hits

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor, grad_hits: torch.Tensor | None):
        x, weight, labels, weights, lse = ctx.saved_tensors
        need_x, need_w = ctx.need
        grad_x, grad_w = _chunked_backward(
            x, weight, labels, grad_loss.float() * weights, lse, need_x, need_w, ctx.chunk_size
        )
        return grad_x, grad_w, None, None, None, None, None, None


def triton_lm_head_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    block_n: int = 64,
    block_v: int = 128,
    block_h: int = 64,
    num_splits: int | None = None,
    num_warps: int = 8,
) -> LossResult:
    """:func:`lm_head_loss` with a Triton forward kernel.

    The backward recomputes logits per ``chunk_size`` vocabulary chunk with
    torch matmuls.  Block sizes (powers of two, >= 16) and ``num_splits`` (how
    many programs share one row block's vocabulary; default ~4 programs per
    SM) are tuning knobs that do not change the result beyond float rounding.
    Needs CUDA tensors, or for CPU tensors ``TRITON_INTERPRET=1`` in the
    environment before triton is first imported.
    """
    _check_chunk_size(chunk_size)
    for name, value in (("block_n", block_n), ("block_v", block_v), ("block_h", block_h)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {value}")
    if triton is None:
        raise RuntimeError("triton_lm_head_loss needs the 'triton' package; install it or use chunked_lm_head_loss")
    if not _triton_available_for(hidden.device):
        raise RuntimeError(
            f"triton_lm_head_loss needs CUDA tensors (got {hidden.device}); set TRITON_INTERPRET=1 to run "
            "the kernel on CPU (slow; set it before triton is first imported), or set drafter.loss_impl = \"chunked\""
        )
    x, flat_labels, flat_weights = _flatten(hidden, lm_head_weight, labels, weights)
    need_x, need_w = _needs_grad(x, lm_head_weight)
    kernel_kw = dict(block_n=block_n, block_v=block_v, block_h=block_h, num_splits=num_splits, num_warps=num_warps)
    if need_x or need_w:
        loss_sum, hits = _TritonLMHeadLoss.apply(
            x, lm_head_weight, flat_labels, flat_weights, chunk_size, need_x, need_w, kernel_kw
        )
    else:
        lse, tgt, arg = _triton_stats(x, lm_head_weight, flat_labels, **kernel_kw)
        loss_sum, hits = _finish(lse, tgt, arg, flat_labels, flat_weights)
    return loss_sum, flat_weights.sum(), hits.view(labels.shape)


# ---------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------


# ``auto`` takes the Triton kernel only up to this many scored rows. Measured on an H200 in bf16
# (bench/fused_loss_bench.py, fwd+bwd, frozen head; docs/benchmarks.md): the kernel wins where the
# chunked path is launch-bound (N=960, H=4096, V=128256: 10.0 vs 16.6 ms; N=1920, H=576, V=49152:
# 3.5 vs 6.2 ms) and loses once cuBLAS has rows to fill (N=3840, H=4096, V=128256: 36.4 vs 22.9 ms;
# N=3840, H=4096, V=32000: 9.3 vs 6.3 ms; N=7680, H=576, V=49152: 9.0 vs 7.5 ms).
TRITON_MAX_ROWS = 2048


def resolve_mode(device: torch.device, mode: str = "auto", rows: int | None = None) -> str:
    """``triton``, ``chunked`` or ``torch`` for ``rows`` scored positions on ``device``.

    ``auto``: Triton on CUDA when it imports and ``rows`` (unknown: assumed few) is at most
    :data:`TRITON_MAX_ROWS`, else chunked. ``rows`` is a host-side shape, never a tensor value.
    """
    if mode not in MODES:
        raise ValueError(f"drafter.loss_impl must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "auto":
        few_rows = rows is None or rows <= TRITON_MAX_ROWS
        return "triton" if triton is not None and device.type == "cuda" and few_rows else "chunked"
    return mode


def fused_lm_head_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    mode: str = "auto",
) -> LossResult:
    """Weighted CE through the LM head by the implementation ``mode`` names (``drafter.loss_impl``).

    Same arguments and result as :func:`lm_head_loss`; all but ``torch`` never build ``[N, V]`` logits.
    """
    chosen = resolve_mode(hidden.device, mode, rows=hidden.numel() // hidden.shape[-1])
    if chosen == "triton":
        return triton_lm_head_loss(hidden, lm_head_weight, labels, weights, chunk_size=chunk_size)
    if chosen == "chunked":
        return chunked_lm_head_loss(hidden, lm_head_weight, labels, weights, chunk_size=chunk_size)
    return lm_head_loss(hidden, lm_head_weight, labels, weights)
