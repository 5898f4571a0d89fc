"""Faster linear layers for CPU decoding, where a step multiplies 1 to 16 rows.

PyTorch's CPU BLAS can take a slow path in ``F.linear`` for few rows, and
whether it does depends on the machine and the row count. ``W @ x^T``
(``torch.mm(W, x.t())``, one row padded to two) often avoids it. Measured per
product with SmolLM2's shapes, each timed over all 30 (60) layers' weights of
that shape so they stream from memory as in a forward pass (microseconds a
product, 2 threads, session 21's machine):

=================  ==================  ==================  ==================
weight             1 row:              2 rows:             5 rows:
                   F.linear vs W@x^T   F.linear vs W@x^T   F.linear vs W@x^T
=================  ==================  ==================  ==================
576 x 576          108 vs 46           163 vs 53           117 vs 70
1536 x 576         293 vs 115          450 vs 114          341 vs 170
576 x 1536         204 vs 119          325 vs 114          274 vs 295
49152 x 576 (head) 9,538 vs 2,792      21,855 vs 3,092     17,049 vs 5,192
=================  ==================  ==================  ==================

Timed one matrix alone, from the cache, the picture changes (576 x 576, 1 row:
28 vs 50), and on another machine (session 17) the head was 2-4x slower
through ``W @ x^T``. So :func:`small_row_linear` times both once per shape
(rows, weight shape, dtype) on first use, in the process that decodes, over
the weights of that shape in the models :func:`small_row_linears` patched (as
many as make 64 MB, twice these machines' L3 cache, so they stream from
memory), and keeps the faster. Where the two paths are within a few percent
the choice flips between runs whatever the number of rounds; three rounds
decide the clear cases, and the calibration of a SmolLM2 evaluation takes a
third of what seven rounds over every weight took (session 29). Plain and
speculative decoding both get it: evaluation patches the target and the
drafter for both runs alike. Results equal
``F.linear`` up to floating-point summation order. CUDA modules are left alone.

bf16 weights take neither path: :func:`small_row_linears` prepacks them once
into oneDNN's blocked layout (``torch.ops.mkldnn``, what inductor's CPU
freezing uses), so no call re-lays out the weight: SmolLM2's 211 products of
a step take 23 ms there against 34 ms through ``F.linear`` (one row, 2
threads, session 35).

That path also rounds a row alike at every row count, which speculative
decoding needs: a plain step multiplies one row, a verification the anchor
and its drafts, and the output equals greedy decoding only where a row's
product does not depend on how many rows share the call. With a single row
padded to two, the packed kernel gives a row the same bits at 1 to 16 rows.
``F.linear`` does not: its single row takes a GEMV that sums in another order,
and in bf16, where a rounding step is 0.4 %, that flipped greedy tokens on 10
of 12 SmolLM2 prompts (6 of 633 products of its weights differed in the last
bit, all at the 1536-wide down projection). float32 GEMMs differ between 2
and 5 rows too, at 1e-7, where no evaluation has seen a token flip (each
counts them).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 16  # a CPU verifies blocks of up to 16 tokens; the calibration picks the path for each row count
CALIBRATION_ROUNDS = 3  # interleaved timings of each path per shape, the median decides
CALIBRATION_BYTES = 64 << 20  # weights timed per shape: past the last-level cache, as a forward pass reads them

# (rows, out features, in features, dtype) -> whether W @ x^T beat F.linear on this machine.
_prefer_mm: dict[tuple, bool] = {}
# (out features, in features, dtype) -> the weights of that shape in the models patched now:
# the calibration runs over all of them, so they stream from memory as in a forward pass.
_weights_by_shape: dict[tuple, list[torch.Tensor]] = {}


def _two_rows(flat: torch.Tensor) -> torch.Tensor:
    """A single row padded to two: alone it takes a GEMV kernel, slower and rounding otherwise than a GEMM."""
    return torch.cat([flat, flat]) if flat.shape[0] == 1 else flat


def _mm(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # Contiguous rows, as F.linear gives: the next layer would read a transposed view slowly.
    return torch.mm(weight, _two_rows(flat).t()).t()[: flat.shape[0]].contiguous()


def _streamed(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The first of ``weights`` that together exceed CALIBRATION_BYTES (all of them when they do not)."""
    size = weights[0].numel() * weights[0].element_size()
    return weights[: CALIBRATION_BYTES // size + 1]


def _faster_is_mm(flat: torch.Tensor, weight: torch.Tensor) -> bool:
    key = (flat.shape[0], *weight.shape, weight.dtype)
    if key not in _prefer_mm:
        # Over the patched weights of the shape: one matrix alone sits in the cache (see above).
        weights = _streamed(_weights_by_shape.get(key[1:]) or [weight])
        times: dict[str, list[float]] = {"linear": [], "mm": []}
        paths = {"linear": lambda w: F.linear(flat, w), "mm": lambda w: _mm(flat, w)}
        for round_ in range(CALIBRATION_ROUNDS + 1):  # the first round warms up
            for name, path in paths.items():
                began = time.perf_counter()
                for w in weights:
                    path(w)
                if round_:
                    times[name].append(time.perf_counter() - began)
        _prefer_mm[key] = statistics.median(times["mm"]) < statistics.median(times["linear"])
    return _prefer_mm[key]


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` in oneDNN's blocked layout for :func:`small_row_linear`, where that pays: a bf16 weight on a
    CPU with oneDNN. ``None`` elsewhere, and where this build of torch has not the op."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (AttributeError, RuntimeError):
        return None


def small_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 1 to MAX_ROWS rows: through ``packed`` (:func:`prepack`'s) when given,
    else through ``weight @ x^T`` where that is faster here for this many rows."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if x.device.type != "cpu" or x.requires_grad or not 1 <= rows <= MAX_ROWS:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if packed is not None:
        out = torch.ops.mkldnn._linear_pointwise(_two_rows(flat), packed, bias, "none", [], "")[:rows]
    elif _faster_is_mm(flat, weight):
        out = _mm(flat, weight)
        if bias is not None:
            out = out + bias
    else:
        return F.linear(x, weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _forward(module: nn.Linear, packed: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return small_row_linear(x, module.weight, module.bias, packed)


@contextlib.contextmanager
def small_row_linears(*models: Any) -> Iterator[int]:
    """Route every CPU ``nn.Linear`` of ``models`` through :func:`small_row_linear` inside the block.

    Yields how many layers were patched; each module's own ``forward`` comes back on exit.
    """
    patched: list[nn.Linear] = []
    outer_weights = dict(_weights_by_shape)
    try:
        for model in models:
            for module in model.modules():
                if type(module) is nn.Linear and module.weight.device.type == "cpu" and "forward" not in vars(module):
                    packed = prepack(module.weight)
                    module.forward = functools.partial(_forward, module, packed)
                    patched.append(module)
                    if packed is None:  # timed against the other path on first use
                        weight = module.weight.detach()
                        _weights_by_shape.setdefault((*weight.shape, weight.dtype), []).append(weight)
        yield len(patched)
    finally:
        for module in patched:
            del module.forward
        _weights_by_shape.clear()
        _weights_by_shape.update(outer_weights)
