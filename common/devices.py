"""Which GPU a thread works on, and which dtype the frozen target weights keep.

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

__all__ = ["head_dtype", "use_device"]


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
