"""``dflash-export``: a trained drafter as a Hugging Face DFlash draft model directory.

    dflash-export runs/demo --drafter d0 --out exported/d0            # latest checkpoint
    dflash-export runs/demo --drafter d0 --step 40 --dtype bfloat16 --out exported/d0-40

Writes, into ``--out``:

- ``config.json``: a ``Qwen3Config`` with ``architectures: ["DFlashDraftModel"]``,
  the ``dflash_config`` block (``block_size``, ``mask_token_id``,
  ``target_layer_ids``), the weights' ``dtype`` and
  ``auto_map: {"AutoModel": "dflash.DFlashDraftModel"}``;
- ``model.safetensors`` with the published parameter names, so the public
  reference ``DFlashDraftModel`` (``z-lab/dflash``) and the engines that serve
  DFlash drafters load it without missing or unexpected keys;
- ``dflash.py``: the model code (``drafter_worker/model/modeling_dflash.py``, torch and
  transformers only), so ``AutoModel.from_pretrained(out, trust_remote_code=True)``
  returns the drafter;
- ``README.md``: a model card (target, data, steps, block size, the last tau
  ``dflash-eval`` measured, how to load it).

The optimizer state and data cursor of the checkpoint are left behind. See
docs/export.md for loading and serving.

Exit status: 0 written, 1 no checkpoint yet, 2 bad arguments or checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

logger = logging.getLogger("tools.export")

DTYPES = ("float32", "bfloat16", "float16")
MODEL_CARD_NAME = "README.md"
_EVAL_NAME = re.compile(r"step-(\d+)\.json")


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


def export_drafter(checkpoint: Path, out: Path, *, dtype: str | None = None, run_dir: Path | None = None,
                   drafter_id: str | None = None) -> Path:
    """Write the drafter of ``checkpoint`` to ``out`` in the published DFlash layout; returns ``out``.

    ``dtype`` (``float32``, ``bfloat16``, ``float16``) casts the weights;
    ``None`` keeps the checkpoint's. ``config.json`` records the dtype. The
    model card reads the checkpoint's ``trainer_state.json`` and, given
    ``run_dir``, the run's ``config.toml`` and ``eval/<drafter_id>/`` reports.
    """
    import torch

    from drafter_worker.model.dflash_model import load_drafter, save_drafter

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
    save_drafter(out, drafter, with_code=True)
    card = model_card(drafter, _read_state(checkpoint), out_name=out.name, run_dir=run_dir, drafter_id=drafter_id)
    tmp = out / (MODEL_CARD_NAME + ".tmp")
    tmp.write_text(card, encoding="utf-8")
    os.replace(tmp, out / MODEL_CARD_NAME)
    logger.info("[export] %s -> %s (%s, %d parameters)", checkpoint, out,
                str(drafter.fc.weight.dtype).removeprefix("torch."), sum(p.numel() for p in drafter.parameters()))
    return out


# ---------------------------------------------------------------------------
# Model card
# ---------------------------------------------------------------------------


def _read_state(checkpoint: Path) -> dict[str, Any]:
    try:
        return json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # a bare drafter directory: the card says what it cannot know


def _run_config(run_dir: Path | None) -> dict[str, Any]:
    if run_dir is None:
        return {}
    try:
        return tomllib.loads((run_dir / "config.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def last_eval(run_dir: Path | None, drafter_id: str | None, step: int | None) -> dict[str, Any] | None:
    """The newest ``dflash-eval`` report of the drafter at or before ``step`` (any step when None)."""
    if run_dir is None or drafter_id is None:
        return None
    found: list[tuple[int, Path]] = []
    for path in (run_dir / "eval" / drafter_id).glob("step-*.json"):
        match = _EVAL_NAME.fullmatch(path.name)
        if match and (step is None or int(match.group(1)) <= step):
            found.append((int(match.group(1)), path))
    for _, path in sorted(found, reverse=True):
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(report.get("tau"), (int, float)):
            return report
    return None


def _rates(values: list[Any]) -> str:
    return " ".join("-" if not isinstance(v, (int, float)) or math.isnan(v) else f"{v:.2f}" for v in values)


def model_card(drafter: Any, state: dict[str, Any], *, out_name: str, run_dir: Path | None = None,
               drafter_id: str | None = None) -> str:
    """The exported directory's ``README.md``."""
    config = drafter.config
    run_cfg = _run_config(run_dir)
    target_cfg, data_cfg = run_cfg.get("target", {}), run_cfg.get("data", {})
    step = state.get("step")
    target = state.get("model_id") or target_cfg.get("model") or "unknown"
    target_detail = f"`{target}`"
    if target_cfg.get("model") and target_cfg.get("model") != target:
        target_detail += f" (run config `target.model = \"{target_cfg['model']}\"`)"
    data = f"`{data_cfg['source']}`" if data_cfg.get("source") else "unknown (no run config.toml)"
    if step is None:
        steps = "unknown (no trainer_state.json)"
    else:
        steps = f"{step}"
        if state.get("tokens_trained"):
            steps += f" ({state['tokens_trained']:,} trained tokens)"
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    layers = f"{config.num_hidden_layers} ({', '.join(layer_types)})"
    if "sliding_attention" in layer_types:
        layers += f"; sliding window {config.sliding_window} positions"
    dtype = str(drafter.fc.weight.dtype).removeprefix("torch.")
    params = sum(p.numel() for p in drafter.parameters())

    rows = [
        ("target model", target_detail),
        ("training data", data),
        ("steps trained", steps),
    ]
    if state.get("init_from"):
        rows.append(("initialised from", f"`{state['init_from']}`"))
    rows += [
        ("block size", f"{drafter.block_size} (slot 0 holds the last verified token; up to "
                       f"{drafter.block_size - 1} drafted per pass)"),
        ("draft layers", layers),
        ("target layers read", f"{drafter.target_layer_ids} (`hidden_states[i + 1]` in transformers' indexing)"),
        ("mask token id", str(drafter.mask_token_id)),
        ("weights", f"{dtype}, {params / 1e6:.2f}M parameters"),
    ]
    if drafter.draft_vocab_size:
        rows.append(("draft vocabulary", f"{drafter.draft_vocab_size} of {config.vocab_size} target tokens "
                                         "(`draft_vocab`; other tokens are never drafted)"))
    if drafter.draft_head is not None:
        rows.append(("LM head", "its own rows for the draft vocabulary (`draft_head`), trained from the target's; "
                                "`compute_logits` uses them instead of the head it is passed"))
    report = last_eval(run_dir, drafter_id, step)
    if report is None:
        tau = "not measured" + (f" (run `dflash-eval {run_dir} --drafter {drafter_id} --step {step}`)"
                                if run_dir is not None and drafter_id and step is not None else "")
    else:
        tau = (f"**{report['tau']:.2f}** (accepted tokens per target pass, greedy) at step {report.get('step')}"
               f"{'' if report.get('step') == step else f' (these weights: step {step})'}, "
               f"on {report.get('num_prompts', '?')} prompts ({report.get('prompt_source', 'unknown source')}), "
               f"at most {report.get('max_new_tokens', '?')} new tokens")
        if report.get("acceptance_rate"):
            tau += f"; acceptance at block positions 1-{len(report['acceptance_rate'])}: " \
                   f"{_rates(report['acceptance_rate'])}"
    rows.append(("measured tau", tau))

    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    vocab_note = ""
    if drafter.draft_vocab_size:
        vocab_note = (
            "\nThis drafter scores a draft vocabulary (`draft_vocab` tensor, `dflash_config.draft_vocab_size`"
            f"{'; its own head rows: `draft_head`' if drafter.draft_head is not None else ''}): "
            "load it with the shipped `dflash.py`; implementations that do not know that tensor "
            "(the reference `z-lab/dflash` model, serving engines) refuse or ignore it.\n"
        )
    return f"""---
library_name: transformers
tags:
- dflash
- speculative-decoding
- draft-model
---

# DFlash drafter for {target}

A DFlash block-diffusion draft model (arXiv 2602.06036) for speculative decoding
with the target model {target_detail}, trained with dflash-stream. It drafts a
block of tokens in one pass, conditioned on the target's hidden states; it has no
embedding or LM head of its own and uses the target's.

| | |
| --- | --- |
{table}
{vocab_note}
## Load

```python
import torch
from transformers import AutoModel

drafter = AutoModel.from_pretrained("{out_name}", trust_remote_code=True, dtype="auto")

# features: the target's hidden states after layers drafter.target_layer_ids, concatenated
#   (hidden_states[i + 1] for each id), [B, C, {len(drafter.target_layer_ids)} * hidden]
# block: [anchor, mask, ..., mask] ids ({drafter.block_size} slots; mask id {drafter.mask_token_id})
positions = torch.arange(C + drafter.block_size)[None]
hidden = drafter(target_hidden=features, noise_embedding=target.get_input_embeddings()(block),
                 position_ids=positions)
logits = drafter.compute_logits(hidden[:, 1:], target.get_output_embeddings())  # drafts for slots 1..
```

`dflash.py` in this directory is the model code (torch and transformers only).
`config.json` has the published DFlash layout (`architectures: ["DFlashDraftModel"]`,
`dflash_config`), so engines that serve DFlash drafters read it as they read
the published ones; see dflash-stream's `docs/export.md` for serving.
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash-export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="run directory, e.g. runs/demo")
    p.add_argument("--drafter", default="d0", help="drafter id (default d0)")
    p.add_argument("--step", type=int, help="export checkpoint step-N instead of the latest")
    p.add_argument("--out", type=Path, required=True,
                   help="directory to write config.json, model.safetensors, dflash.py and README.md to")
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
        export_drafter(path, args.out, dtype=args.dtype, run_dir=args.run_dir, drafter_id=args.drafter)
    except ExportError as exc:
        print(f"dflash-export: {exc}", file=sys.stderr)
        return 2
    print(f"exported {path} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
