"""Byte layout of the packed buffers that travel on the data plane.

A batch travels as ONE contiguous uint8 buffer (one send, one receive) holding
the captured features, token ids, loss mask and lengths. Both sides derive the
same layout from the shapes in the BATCH message, so no per-tensor headers
travel. Sections are 64-byte aligned so every view is well aligned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ALIGN = 64

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} (supported: {', '.join(DTYPES)})") from None


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


def _round_up(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class BatchLayout:
    """features [B, T, F] (dtype), input_ids int32 [B, T], loss_mask uint8 [B, T], lengths int32 [B]."""

    batch_size: int
    seq_len: int
    feature_dim: int
    dtype: torch.dtype

    @property
    def _sizes(self) -> list[int]:
        b, t, f = self.batch_size, self.seq_len, self.feature_dim
        return [b * t * f * self.dtype.itemsize, b * t * 4, b * t, b * 4]

    @property
    def nbytes(self) -> int:
        return sum(_round_up(s) for s in self._sizes)

    def allocate(self, device: torch.device | str = "cpu", pin_memory: bool = False) -> torch.Tensor:
        return torch.zeros(self.nbytes, dtype=torch.uint8, device=device, pin_memory=pin_memory)

    def views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(features, input_ids, loss_mask, lengths) views into ``buf``; no copies."""
        if buf.dtype != torch.uint8 or buf.numel() < self.nbytes:
            raise ValueError(f"buffer of {buf.numel()} bytes is too small for a batch of {self.nbytes} bytes")
        b, t, f = self.batch_size, self.seq_len, self.feature_dim
        out = []
        offset = 0
        for size, dtype, shape in zip(
            self._sizes,
            (self.dtype, torch.int32, torch.uint8, torch.int32),
            ((b, t, f), (b, t), (b, t), (b,)),
        ):
            out.append(buf[offset : offset + size].view(dtype).view(shape))
            offset += _round_up(size)
        return out[0], out[1], out[2], out[3]


@dataclass(frozen=True)
class WeightsLayout:
    """The frozen target embedding (and LM head when untied), sent once per registration."""

    vocab_size: int
    hidden_size: int
    tied: bool
    dtype: torch.dtype

    @property
    def _matrix_bytes(self) -> int:
        return self.vocab_size * self.hidden_size * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return _round_up(self._matrix_bytes) * (1 if self.tied else 2)

    def allocate(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(embed_weight, lm_head_weight); the same tensor twice when tied."""
        shape = (self.vocab_size, self.hidden_size)
        embed = buf[: self._matrix_bytes].view(self.dtype).view(shape)
        if self.tied:
            return embed, embed
        start = _round_up(self._matrix_bytes)
        head = buf[start : start + self._matrix_bytes].view(self.dtype).view(shape)
        return embed, head
