"""Faster linear layers for CPU decoding, where a step multiplies 1 to 4 rows.

PyTorch's CPU BLAS can take a slow path in ``F.linear`` for few rows, and
whether it does depends on the machine. Measured per product with SmolLM2's
shapes (median of hundreds, microseconds, 2 threads; ``W @ x^T`` computed as
``torch.mm(W, x.t()).t()``, one row padded to two) on two of the machines this
project runs on:

=================  ======================  ======================
weight             machine A (session 10)  machine B (session 17)
                   1 row / 4 rows:         1 row / 4 rows:
                   F.linear vs W @ x^T     F.linear vs W @ x^T
=================  ======================  ======================
576 x 576          38 vs 65 / 82 vs 70     13 vs 49 / 42 vs 48
1536 x 576         97 vs 144 / 211 vs 179  35 vs 123 / 54 vs 123
49152 x 576 (head) 10,853 vs 4,655 /       3,068 vs 12,419 /
                   18,728 vs 5,422         7,626 vs 12,297
=================  ======================  ======================

On A the LM head is 2-3x faster through ``W @ x^T``; on B it is 2-4x slower.
So :func:`small_row_linear` times both once per shape (rows, weight shape,
dtype) on first use, in the process that decodes, and keeps the faster. A
speculative step verifies a few tokens while plain decoding feeds one, so
this matters most to verification, but both decoders get it:
:func:`small_row_linears` patches the modules of a model, and evaluation
applies it to the target and drafter for the speculative and the plain run
alike. Results equal ``F.linear`` up to floating-point summation order. CUDA
modules are left alone.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 4  # above this F.linear was as fast or faster on every machine measured
CALIBRATION_ROUNDS = 7  # interleaved timings of each path per shape, the median decides

# (rows, out features, in features, dtype) -> whether W @ x^T beat F.linear on this machine.
_prefer_mm: dict[tuple, bool] = {}


def _mm(flat: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    rows = flat.shape[0]
    if rows == 1:  # one row alone takes the slow GEMV path; padded to two it does not
        flat = torch.cat([flat, flat])
    return torch.mm(weight, flat.t()).t()[:rows]


def _faster_is_mm(flat: torch.Tensor, weight: torch.Tensor) -> bool:
    key = (flat.shape[0], *weight.shape, weight.dtype)
    if key not in _prefer_mm:
        times: dict[str, list[float]] = {"linear": [], "mm": []}
        paths = {"linear": lambda: F.linear(flat, weight), "mm": lambda: _mm(flat, weight)}
        for round_ in range(CALIBRATION_ROUNDS + 1):  # the first round warms up
            for name, path in paths.items():
                began = time.perf_counter()
                path()
                if round_:
                    times[name].append(time.perf_counter() - began)
        _prefer_mm[key] = statistics.median(times["mm"]) < statistics.median(times["linear"])
    return _prefer_mm[key]


def small_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``weight @ x^T`` when ``x`` has 1-4 rows and that is faster here."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if x.device.type != "cpu" or x.requires_grad or not 1 <= rows <= MAX_ROWS:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if not _faster_is_mm(flat, weight):
        return F.linear(x, weight, bias)
    out = _mm(flat, weight)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return small_row_linear(x, module.weight, module.bias)


@contextlib.contextmanager
def small_row_linears(*models: Any) -> Iterator[int]:
    """Route every CPU ``nn.Linear`` of ``models`` through :func:`small_row_linear` inside the block.

    Yields how many layers were patched; each module's own ``forward`` comes back on exit.
    """
    patched: list[nn.Linear] = []
    try:
        for model in models:
            for module in model.modules():
                if type(module) is nn.Linear and module.weight.device.type == "cpu" and "forward" not in vars(module):
                    module.forward = _forward.__get__(module)
                    patched.append(module)
        yield len(patched)
    finally:
        for module in patched:
            del module.forward
