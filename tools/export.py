"""``dflash-export``: a trained drafter as a Hugging Face-style DFlash draft model.

    dflash-export runs/demo --drafter d0 --out exported/d0            # latest checkpoint
    dflash-export runs/demo --drafter d0 --step 40 --dtype bfloat16 --out exported/d0-40

Writes ``config.json`` (a ``Qwen3Config`` with ``architectures:
["DFlashDraftModel"]`` and the ``dflash_config`` block: ``block_size``,
``mask_token_id``, ``target_layer_ids``) and ``model.safetensors`` with the
published parameter names, so the public reference ``DFlashDraftModel``
(``z-lab/dflash``) and the engines that serve DFlash drafters load it without
missing or unexpected keys. The optimizer state and data cursor of the
checkpoint are left behind.

Exit status: 0 written, 1 no checkpoint yet, 2 bad arguments or checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

logger = logging.getLogger("tools.export")

DTYPES = ("float32", "bfloat16", "float16")


class ExportError(RuntimeError):
    """The checkpoint cannot be exported; the message says why."""


def checkpoint_path(run_dir: Path, drafter_id: str, step: int | None = None) -> Path | None:
    """``checkpoints/<drafter>/step-N`` (the latest one by default), or None when there is none."""
    from drafter_worker.checkpoint import CheckpointStore

    store = CheckpointStore(run_dir, drafter_id, keep=1)
    if step is None:
        return store.latest()
    path = store.root / f"step-{step}"
    if not (path / "config.json").is_file():
        raise ExportError(f"no checkpoint {path} (the drafter keeps only its last few; see {store.root})")
    return path


def export_drafter(checkpoint: Path, out: Path, *, dtype: str | None = None) -> Path:
    """Write the drafter of ``checkpoint`` to ``out`` in the published DFlash layout; returns ``out``.

    ``dtype`` (``float32``, ``bfloat16``, ``float16``) casts the weights;
    ``None`` keeps the checkpoint's. ``config.json`` records the dtype.
    """
    import torch

    from common.dflash_model import load_drafter, save_drafter

    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    try:
        drafter = load_drafter(checkpoint)
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot load the drafter from {checkpoint}: {exc}") from None
    if dtype is not None:
        drafter = drafter.to(getattr(torch, dtype))
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} exists and is not a directory")
    save_drafter(out, drafter)
    logger.info("[export] %s -> %s (%s, %d parameters)", checkpoint, out,
                str(drafter.fc.weight.dtype).removeprefix("torch."), sum(p.numel() for p in drafter.parameters()))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash-export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="run directory, e.g. runs/demo")
    p.add_argument("--drafter", default="d0", help="drafter id (default d0)")
    p.add_argument("--step", type=int, help="export checkpoint step-N instead of the latest")
    p.add_argument("--out", type=Path, required=True, help="directory to write config.json and model.safetensors to")
    p.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: keep the checkpoint's)")
    args = p.parse_args(argv)

    from common.logging_setup import setup_logging

    setup_logging("export")
    try:
        path = checkpoint_path(args.run_dir, args.drafter, args.step)
        if path is None:
            print(f"dflash-export: drafter {args.drafter} has no checkpoint in "
                  f"{args.run_dir / 'checkpoints' / args.drafter} yet", file=sys.stderr)
            return 1
        export_drafter(path, args.out, dtype=args.dtype)
    except ExportError as exc:
        print(f"dflash-export: {exc}", file=sys.stderr)
        return 2
    print(f"exported {path} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
