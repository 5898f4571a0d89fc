"""Small helpers shared by the benchmarks in ``bench/`` (not used by the services).

Named ``benchlib`` rather than ``common`` because running ``python
bench/<script>.py`` puts ``bench/`` first on ``sys.path``, where a
``common.py`` would hide the project's ``common`` package.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.ports import free_ports  # noqa: E402,F401  (re-exported for the benchmarks)

# Nothing a benchmark runs may reach a model hub or W&B's servers.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}
for _key, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_key, _value)


def median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else float("nan")


def write_json(path: str | Path | None, data: dict[str, Any]) -> None:
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def offline_env(threads: int | None = None) -> dict[str, str]:
    """What a benchmark subprocess adds to its environment: offline, and ``threads`` OpenMP/MKL threads if given."""
    env = dict(OFFLINE_ENV)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
        env["MKL_NUM_THREADS"] = str(threads)
    return env


def child_env(threads: int | None = None) -> dict[str, str]:
    """Environment of a benchmark subprocess: offline, repository on the path, unbuffered."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **offline_env(threads)}


def run_script(args: list[str], out: Path, *, timeout_s: float, log: Path, threads: int | None = None) -> dict[str, Any]:
    """Run ``python <args...> --out <out>`` and return the JSON it wrote there.

    Its stdout and stderr go to ``log``; a failure raises ``RuntimeError`` with
    the end of that log.
    """
    out.unlink(missing_ok=True)
    start = time.monotonic()
    with open(log, "w", encoding="utf-8") as sink:
        try:
            proc = subprocess.run(
                [sys.executable, *args, "--out", str(out)], stdout=sink, stderr=subprocess.STDOUT,
                env=child_env(threads), cwd=ROOT, timeout=timeout_s,
            )
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    if code != 0 or not out.exists():
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(args)} failed ({code}) after {time.monotonic() - start:.0f}s:\n{tail}")
    return json.loads(out.read_text(encoding="utf-8"))


def drafter_trainer(target_config: Any, *, num_target_layers: int, vocab_size: int, layer_ids: list[int],
                    drafter_cfg: Any, device: Any = "cpu", dtype: Any = None) -> Any:
    """A ``DrafterTrainer`` built like the drafter worker builds it from the target's WELCOME.

    ``dtype`` None keeps the worker's float32 weights.
    """
    import torch

    from drafter_worker.model.dflash_model import DFlashDrafter, make_drafter_config
    from drafter_worker.trainer import DrafterTrainer, make_optimizer

    c = target_config
    heads = int(c.num_attention_heads)
    rope_theta = getattr(c, "rope_theta", None) or (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    config = make_drafter_config(
        hidden_size=int(c.hidden_size), num_attention_heads=heads,
        num_key_value_heads=drafter_cfg.num_key_value_heads or int(getattr(c, "num_key_value_heads", heads)),
        head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
        intermediate_size=int(c.intermediate_size), vocab_size=vocab_size,
        rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)), rope_theta=float(rope_theta),
        max_position_embeddings=int(getattr(c, "max_position_embeddings", 4096)),
        num_hidden_layers=drafter_cfg.num_layers, num_target_layers=num_target_layers, target_layer_ids=layer_ids,
        block_size=drafter_cfg.block_size, mask_token_id=0,
        draft_vocab_size=min(drafter_cfg.draft_vocab_size, vocab_size), layer_types=drafter_cfg.layer_types,
        sliding_window=drafter_cfg.sliding_window,
    )
    torch.manual_seed(drafter_cfg.seed)
    model = DFlashDrafter(config)
    if model.draft_vocab_size:
        model.set_draft_vocab(list(range(model.draft_vocab_size)))  # the worker takes the data's most used tokens
    model = model.to(device=device, dtype=dtype)
    generator = torch.Generator(device=device)
    generator.manual_seed(drafter_cfg.seed)
    trainer = DrafterTrainer(drafter_cfg, model, make_optimizer(drafter_cfg, model), generator, 0)
    if drafter_cfg.distill_weight > 0:  # the soft-target loss reads the last captured layer through the final norm
        if layer_ids[-1] != num_target_layers - 1:
            raise ValueError(f"drafter.distill_weight needs the target's last layer captured, not {layer_ids}")
        trainer.teacher_norm = (torch.ones(int(c.hidden_size), device=device), float(getattr(c, "rms_norm_eps", 1e-6)))
    return trainer
