"""Which GPU a thread works on, which dtype the frozen target weights keep, and
where bfloat16 is the fast dtype.

CUDA's current device is per thread and every new thread starts on device 0.
Anything that reads the current device instead of a tensor's (Triton launches,
``torch.cuda.current_stream()`` / ``Event.record()`` without arguments, a new
CUDA context) then works on GPU 0 whatever ``drafter.device`` says, unless the
process was started with ``CUDA_VISIBLE_DEVICES``. So each process calls
:func:`use_device` before its first CUDA work, and so does every thread it
starts that touches CUDA, as the first line of its ``run``.
"""

from __future__ import annotations

import torch

__all__ = ["fast_bf16", "head_dtype", "resolve_dtype", "use_device"]


def use_device(device: torch.device | str) -> None:
    """Make ``device`` the calling thread's current CUDA device; nothing for a non-CUDA device.

    A bare ``cuda`` (no index) means the current device, so it leaves it as is.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def head_dtype(device: torch.device | str, wire_dtype: torch.dtype) -> torch.dtype:
    """The dtype the drafter keeps the target's frozen embedding and LM head in.

    On CUDA the dtype they came in (the target's, e.g. bf16): the LM-head matmuls
    run on tensor cores with fp32 accumulation, and no fp32 copy of a ``[V, H]``
    head sits in GPU memory. Elsewhere fp32: bf16 matmuls are slow on CPUs.
    """
    return wire_dtype if torch.device(device).type == "cuda" else torch.float32


def fast_bf16(device: torch.device | str) -> bool:
    """Whether bf16 matmuls on ``device`` beat fp32 ones: a CUDA GPU with bf16 support, or a CPU
    with AVX512-BF16 or AMX (there oneDNN's bf16 matmul runs about 3x fp32's; on AVX2-only CPUs
    it is emulated and about 4x slower, docs/recipe.md)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def resolve_dtype(name: str, device: torch.device | str) -> str:
    """A configured dtype name with ``auto`` resolved: bfloat16 where :func:`fast_bf16`, else float32."""
    if name != "auto":
        return name
    return "bfloat16" if fast_bf16(device) else "float32"
