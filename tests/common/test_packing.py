"""Tests for common/packing.py: the packed batch and weights buffers of the data plane."""

from __future__ import annotations

import pytest
import torch

from common.packing import DTYPES, BatchLayout, WeightsLayout, dtype_from_name, dtype_name

ALIGN = 64


def _span(view: torch.Tensor, buf: torch.Tensor) -> tuple[int, int]:
    start = view.data_ptr() - buf.data_ptr()
    return start, start + view.numel() * view.element_size()


@pytest.mark.parametrize(
    "b, t, f, dtype",
    [
        (1, 1, 1, torch.float32),
        (3, 7, 5, torch.bfloat16),  # odd sizes force padding between sections
        (4, 64, 96, torch.float32),
        (2, 13, 11, torch.float16),
    ],
)
def test_views_shapes_dtypes_alignment_and_disjointness(b, t, f, dtype):
    layout = BatchLayout(b, t, f, dtype)
    buf = layout.allocate()
    assert buf.dtype == torch.uint8 and buf.numel() == layout.nbytes
    assert layout.nbytes % ALIGN == 0
    features, input_ids, loss_mask, lengths = layout.views(buf)

    assert (features.shape, features.dtype) == ((b, t, f), dtype)
    assert (input_ids.shape, input_ids.dtype) == ((b, t), torch.int32)
    assert (loss_mask.shape, loss_mask.dtype) == ((b, t), torch.uint8)
    assert (lengths.shape, lengths.dtype) == ((b,), torch.int32)

    spans = [_span(v, buf) for v in (features, input_ids, loss_mask, lengths)]
    for v in (features, input_ids, loss_mask, lengths):
        assert v.is_contiguous()
        assert v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()  # a view, not a copy
    for start, end in spans:
        assert start % ALIGN == 0
        assert 0 <= start <= end <= layout.nbytes
    ordered = sorted(spans)
    for (_, end), (next_start, _) in zip(ordered, ordered[1:]):
        assert end <= next_start  # no overlap
    # Sections add up exactly (with padding) to nbytes.
    sizes = [b * t * f * dtype.itemsize, b * t * 4, b * t, b * 4]
    assert layout.nbytes == sum((s + ALIGN - 1) // ALIGN * ALIGN for s in sizes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_through_views_read_back_from_copy(dtype):
    b, t, f = 3, 9, 10
    layout = BatchLayout(b, t, f, dtype)
    buf = layout.allocate()
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(b, t, f, generator=gen).to(dtype)
    ids = torch.randint(0, 50_000, (b, t), generator=gen, dtype=torch.int32)
    mask = torch.randint(0, 2, (b, t), generator=gen, dtype=torch.uint8)
    lens = torch.tensor([9, 4, 1], dtype=torch.int32)

    fv, iv, mv, lv = layout.views(buf)
    fv.copy_(feats)
    iv.copy_(ids)
    mv.copy_(mask)
    lv.copy_(lens)

    # What the receiver sees: a different buffer holding the same bytes.
    received = buf.clone()
    buf.fill_(0xAB)  # the sender's buffer is reused: the copy must not depend on it
    f2, i2, m2, l2 = layout.views(received)
    assert torch.equal(f2, feats)
    assert torch.equal(i2, ids)
    assert torch.equal(m2, mask)
    assert torch.equal(l2, lens)


def test_writes_do_not_bleed_between_sections():
    layout = BatchLayout(2, 5, 3, torch.bfloat16)
    buf = layout.allocate()
    features, input_ids, loss_mask, lengths = layout.views(buf)
    features.fill_(-1.0)
    assert int(buf.sum()) != 0
    assert input_ids.abs().sum() == 0 and loss_mask.sum() == 0 and lengths.abs().sum() == 0
    lengths.fill_(-1)
    assert (features == -1.0).all() and input_ids.abs().sum() == 0 and loss_mask.sum() == 0


def test_views_accept_a_larger_buffer_and_refuse_small_or_wrong_dtype():
    layout = BatchLayout(2, 4, 8, torch.float32)
    big = torch.zeros(layout.nbytes + 128, dtype=torch.uint8)
    features, *_ = layout.views(big)
    assert features.shape == (2, 4, 8)
    with pytest.raises(ValueError, match="too small"):
        layout.views(torch.zeros(layout.nbytes - 1, dtype=torch.uint8))
    with pytest.raises(ValueError):
        layout.views(torch.zeros(layout.nbytes, dtype=torch.float32))


def test_layout_is_a_value():
    # Both sides derive the layout from the BATCH message; equal shapes mean equal layouts.
    a = BatchLayout(2, 4, 8, torch.float32)
    assert a == BatchLayout(2, 4, 8, torch.float32)
    assert a != BatchLayout(2, 4, 8, torch.bfloat16)
    assert hash(a) == hash(BatchLayout(2, 4, 8, torch.float32))
    with pytest.raises(Exception):
        a.batch_size = 3  # frozen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_layout_tied(dtype):
    layout = WeightsLayout(vocab_size=37, hidden_size=6, tied=True, dtype=dtype)
    matrix = 37 * 6 * dtype.itemsize
    assert layout.nbytes == (matrix + ALIGN - 1) // ALIGN * ALIGN
    buf = layout.allocate()
    assert buf.dtype == torch.uint8 and buf.numel() == layout.nbytes
    embed, head = layout.views(buf)
    assert embed.shape == head.shape == (37, 6)
    assert embed.dtype == head.dtype == dtype
    assert embed.data_ptr() == head.data_ptr()
    w = torch.randn(37, 6).to(dtype)
    embed.copy_(w)
    assert torch.equal(layout.views(buf.clone())[1], w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_layout_untied(dtype):
    layout = WeightsLayout(vocab_size=37, hidden_size=6, tied=False, dtype=dtype)
    matrix = 37 * 6 * dtype.itemsize
    padded = (matrix + ALIGN - 1) // ALIGN * ALIGN
    assert layout.nbytes == 2 * padded
    assert layout.nbytes == 2 * WeightsLayout(37, 6, True, dtype).nbytes
    buf = layout.allocate()
    embed, head = layout.views(buf)
    assert embed.shape == head.shape == (37, 6)
    assert embed.dtype == head.dtype == dtype
    e_span, h_span = _span(embed, buf), _span(head, buf)
    assert e_span == (0, matrix)
    assert h_span == (padded, padded + matrix)
    assert h_span[0] % ALIGN == 0
    gen = torch.Generator().manual_seed(3)
    we, wh = torch.randn(37, 6, generator=gen).to(dtype), torch.randn(37, 6, generator=gen).to(dtype)
    embed.copy_(we)
    head.copy_(wh)
    e2, h2 = layout.views(buf.clone())
    assert torch.equal(e2, we) and torch.equal(h2, wh)


def test_dtype_names_round_trip():
    for name, dtype in DTYPES.items():
        assert dtype_from_name(name) is dtype
        assert dtype_name(dtype) == name
    with pytest.raises(ValueError, match="int8"):
        dtype_from_name("int8")
    with pytest.raises(ValueError):
        dtype_name(torch.int64)
