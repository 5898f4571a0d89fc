"""tools.small_linears: the few-row linear path equals F.linear, and the patch comes off cleanly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tools import small_linears
from tools.small_linears import MAX_ROWS, WIDE_OUTPUT, small_row_linear, small_row_linears


@pytest.mark.parametrize("out_features", [48, WIDE_OUTPUT])
@pytest.mark.parametrize("shape", [(1, 32), (1, 1, 32), (2, 32), (1, 3, 32), (4, 32), (2, 3, 32), (0, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_small_row_linear_equals_f_linear(out_features, shape, bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, 32, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(*shape, generator=gen)
    got = small_row_linear(x, weight, b)
    assert got.shape == (*shape[:-1], out_features)
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_training_and_many_rows_keep_f_linear():
    weight = torch.randn(16, 8, requires_grad=True)
    x = torch.randn(2, 8, requires_grad=True)
    small_row_linear(x, weight, None).sum().backward()  # autograd path: F.linear, gradients flow
    assert x.grad is not None and weight.grad is not None
    many = torch.randn(MAX_ROWS + 1, 8)
    torch.testing.assert_close(small_row_linear(many, weight.detach(), None), F.linear(many, weight.detach()))


def test_patch_routes_every_linear_and_restores_it(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, WIDE_OUTPUT, bias=False))
    x = torch.randn(3, 8)
    with torch.inference_mode():
        before = model(x)
    calls = []

    def counting(x, weight, bias):
        calls.append(tuple(weight.shape))
        return small_row_linear(x, weight, bias)

    monkeypatch.setattr(small_linears, "small_row_linear", counting)
    with small_row_linears(model) as patched, torch.inference_mode():
        assert patched == 2
        inside = model(x)
    assert calls == [(16, 8), (WIDE_OUTPUT, 16)]
    torch.testing.assert_close(inside, before, rtol=1e-5, atol=1e-5)
    assert all("forward" not in vars(m) for m in model.modules())  # the class forward again
    with torch.inference_mode():
        model(x)
    assert len(calls) == 2
