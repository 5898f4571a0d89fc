"""Faster linear layers for CPU decoding, where a step multiplies 1 to 4 rows.

On this project's CPU (PyTorch's CPU BLAS, 2 threads) ``F.linear`` takes a slow
path for few rows. Measured per product with SmolLM2's shapes (median of
hundreds, microseconds; ``W @ x^T`` computed as ``torch.mm(W, x.t()).t()``):

=================  =========  ============  =========  ============
weight             1 row      1 row padded  4 rows     4 rows
                   F.linear   to 2, W@x^T   F.linear   W @ x^T
=================  =========  ============  =========  ============
576 x 576          38         65            82         70
1536 x 576         97         144           211        179
576 x 1536         95         144           171        109
49152 x 576 (head) 10,853     4,655         18,728     5,422
=================  =========  ============  =========  ============

So the wide LM head always goes through ``W @ x^T`` (one row padded to two),
and every layer does for 2-4 rows. A speculative step verifies a few tokens
while plain decoding feeds one, so this matters most to verification, but
both decoders get it: :func:`small_row_linears` patches the modules of a
model, and evaluation applies it to the target and drafter for the
speculative and the plain run alike. Results equal ``F.linear`` up to
floating-point summation order. CUDA modules are left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 4  # above this F.linear is as fast or faster (5 rows: 199 vs 244 us for 1536 x 576)
WIDE_OUTPUT = 8192  # from this many outputs a single row is faster padded to two (the LM head)


def small_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through ``weight @ x^T`` when ``x`` has 1-4 rows and that is faster."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    wide = weight.shape[0] >= WIDE_OUTPUT
    if x.device.type != "cpu" or x.requires_grad or not 1 <= rows <= MAX_ROWS or (rows == 1 and not wide):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        flat = torch.cat([flat, flat])
    out = torch.mm(weight, flat.t()).t()[:rows]
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
