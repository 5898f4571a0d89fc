"""``dflash-eval``: how good is a trained drafter for the real target?

    dflash-eval runs/demo --drafter d0                 # latest checkpoint, once
    dflash-eval runs/demo --drafter d0 --step 40 --json out.json
    dflash-eval --watch runs/demo --drafter d0 --every-s 60   # each new checkpoint

Loads the run's target (``runs/<name>/config.toml``) and a drafter checkpoint,
runs DFlash speculative decoding (tools/speculative.py) on the run's held-out
prompts (the conversations ``data.heldout_fraction`` keeps out of training,
cut before the first assistant turn) or on ``--prompts FILE.jsonl``, and
reports:

- tau: tokens produced per draft-and-verify step (over all prompts, with its
  standard error over the prompts, and per prompt);
- acceptance rate per block position;
- the EAL proxy from training (last ``eal`` of the drafter in ``metrics.jsonl``
  at or before the checkpoint's step; a perfect proxy predicts tau = 1 + EAL);
- wall-clock tokens/s of speculative and plain target decoding on the same
  prompts and machine, and their ratio (the speed-up).

At temperature 0 (the default) speculative output must equal the target's
greedy output; mismatches are counted and reported.

``--watch`` evaluates each new checkpoint as it appears (training is never
paused) and pushes ``eval/tau``, ``eval/tau_stderr``, ``eval/accept/pos_k``
and ``eval/tokens_per_s`` to the metrics sidecar as ``drafter/<id>`` at the
checkpoint's step. Each report is also written to
``runs/<name>/eval/<drafter>/step-N.json``.

Exit status: 0 done, 1 nothing to evaluate (no checkpoint), 2 bad arguments,
config, model or data.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from common import cli
from common.metric_names import DRAFTER_SOURCE, Drafter, Eval

logger = logging.getLogger("tools.eval")


class EvalError(RuntimeError):
    """Something the user pointed at cannot be evaluated; the message says why."""


# ---------------------------------------------------------------------------
# Run directory
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int


def find_checkpoint(run_dir: Path, drafter_id: str, step: int | None = None) -> Checkpoint | None:
    """The checkpoint ``latest`` names (or ``step-N``), or None when there is none yet.

    Reads the layout drafter_worker/checkpoint.py writes:
    ``checkpoints/<drafter>/latest`` holds the name of the newest ``step-N``.
    """
    root = run_dir / "checkpoints" / drafter_id
    if step is not None:
        path = root / f"step-{step}"
    else:
        pointer = root / "latest"
        try:
            name = pointer.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None
        path = root / name
    state = path / "trainer_state.json"
    try:
        data = json.loads(state.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if step is not None:
            raise EvalError(f"no checkpoint {path} (the drafter keeps only its last few; "
                            f"see {root})") from None
        return None  # pruned or being replaced between the two reads; the caller retries
    return Checkpoint(path=path, step=int(data["step"]))


def training_eal(run_dir: Path, drafter_id: str, step: int) -> float | None:
    """The drafter's last training ``eal`` at or before ``step`` in ``metrics.jsonl``."""
    source = DRAFTER_SOURCE(drafter_id)
    found: float | None = None
    try:
        handle = open(run_dir / "metrics.jsonl", encoding="utf-8")
    except FileNotFoundError:
        return None
    with handle:
        for line in handle:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            if not isinstance(record, dict) or record.get("source") != source:
                continue
            record_step, values = record.get("step"), record.get("values")
            if not isinstance(record_step, int) or record_step > step or not isinstance(values, dict):
                continue
            value = values.get(Drafter.EAL)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                found = float(value)
    return found


# ---------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------


def heldout_prompts(tokenizer: Any, cfg: Any, limit: int) -> list[list[int]]:
    """Prompts of the run's held-out conversations: the tokens before the first assistant token."""
    from target_server.data import DataError, build_dataset

    if cfg.data.heldout_fraction <= 0:
        raise EvalError("the run holds out no conversations (data.heldout_fraction = 0); "
                        "pass --prompts FILE.jsonl")
    # max_samples=1: the held-out split does not depend on it, and the
    # training side then needs no tokenizing.
    try:
        dataset = build_dataset(tokenizer, cfg.data.source, max_seq_len=cfg.data.max_seq_len, seed=cfg.data.seed,
                                heldout_fraction=cfg.data.heldout_fraction, max_samples=1,
                                data_format=cfg.data.format, chat_template_kwargs=cfg.data.chat_template_kwargs,
                                num_proc=cfg.data.num_proc, cache_dir=cfg.data.cache_dir)
    except DataError as exc:
        raise EvalError(str(exc)) from None
    prompts = []
    for sample in dataset.heldout:
        mask = sample.loss_mask.tolist()
        first = mask.index(1) if 1 in mask else 0
        if first > 0:
            prompts.append(sample.input_ids[:first].tolist())
        if len(prompts) == limit:
            break
    if not prompts:
        raise EvalError(f"no held-out conversation of {cfg.data.source!r} has a prompt before its answer; "
                        f"pass --prompts FILE.jsonl")
    return prompts


def file_prompts(tokenizer: Any, path: Path, limit: int) -> list[list[int]]:
    """Prompts from a chat JSONL file: each conversation up to its last user turn, with the generation prompt."""
    from target_server.data import DataError, load_conversations

    try:
        conversations = load_conversations(str(path), seed=0)
    except DataError as exc:
        raise EvalError(str(exc)) from None
    prompts = []
    for messages in conversations:
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            continue
        head = messages[: users[-1] + 1]
        text = tokenizer.apply_chat_template(head, tokenize=False, add_generation_prompt=True)
        prompts.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
        if len(prompts) == limit:
            break
    if not prompts:
        raise EvalError(f"{path}: no conversation with a user turn")
    return prompts


def stop_token_ids(tokenizer: Any, model: Any) -> list[int]:
    ids = set()
    for value in (getattr(tokenizer, "eos_token_id", None),
                  getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


# ---------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------


def evaluate(
    target: Any,
    drafter: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_tokens: Sequence[int] = (),
    temperature: float = 0.0,
    seed: int = 0,
    baseline: bool = True,
    draft_tokens: int | None = None,
    denoise_passes: int | None = None,
    draft_confidence: float = 0.0,
    prompt_lookup: bool = False,
    deadline: float | None = None,
    min_prompts: int = 1,
) -> dict[str, Any]:
    """Speculative (and, with ``baseline``, plain) decoding of ``prompts``; returns the report numbers.

    ``draft_tokens`` caps the drafts each step verifies (default: the whole block); ``denoise_passes``
    sets the drafting passes a block takes (default: the drafter's own, ``drafter.denoise_passes``);
    ``draft_confidence`` ends each step's drafts where the drafter's own chance that all of them are
    right falls below it (0: never). ``prompt_lookup`` drafts by prompt lookup wherever the sequence's
    last tokens occurred before, by the drafter elsewhere (:mod:`tools.prompt_lookup`). With a
    ``deadline`` (``time.monotonic()``), no prompt starts that would end after it at the pace so far,
    once ``min_prompts`` are decoded: the prompts keep their order, so a shorter evaluation is a
    prefix of the full one."""
    from common.model_loader import embedding_weights
    from tools.speculative import DFlashProposer, evaluation_decoding

    embed, head, _ = embedding_weights(target)
    num_layers = int(target.config.get_text_config().num_hidden_layers)
    if embed.shape[0] <= drafter.mask_token_id or max(drafter.target_layer_ids) >= num_layers:
        raise EvalError(f"the drafter (mask token {drafter.mask_token_id}, target layers "
                        f"{drafter.target_layer_ids}) does not fit the target (vocabulary {embed.shape[0]}, "
                        f"{num_layers} layers): it was trained for another target")
    try:
        proposer = DFlashProposer(drafter, embed, head, denoise_passes, draft_confidence)
    except ValueError as exc:
        raise EvalError(str(exc)) from None
    if prompt_lookup:
        from tools.prompt_lookup import PromptLookupProposer

        proposer = PromptLookupProposer(proposer, head.shape[0], head.device)
    if draft_tokens is None:
        draft_tokens = proposer.block_size - 1
    if not 1 <= draft_tokens <= proposer.block_size - 1:
        raise EvalError(f"--draft-tokens must be in 1..{proposer.block_size - 1} for a block of {proposer.block_size}")
    with evaluation_decoding(target, drafter):
        return _decode_all(target, proposer, prompts, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens,
                           temperature=temperature, seed=seed, baseline=baseline, draft_tokens=draft_tokens,
                           device=embed.device, deadline=deadline, min_prompts=min_prompts)


def _decode_all(target: Any, proposer: Any, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                stop_tokens: Sequence[int], temperature: float, seed: int, baseline: bool,
                draft_tokens: int, device: Any, deadline: float | None = None,
                min_prompts: int = 1) -> dict[str, Any]:
    import torch

    from common.progress import Progress
    from tools.speculative import SpecStats, plain_generate, speculative_generate

    def gen() -> torch.Generator:
        return torch.Generator(device=device).manual_seed(seed)

    # Warm-up (allocator, kernels) so the first timed prompt is not penalised.
    speculative_generate(target, proposer, prompts[0], max_new_tokens=min(4, max_new_tokens), draft_tokens=draft_tokens)
    if baseline:
        plain_generate(target, prompts[0], max_new_tokens=min(4, max_new_tokens))

    stats = SpecStats(proposer.block_size)
    passes_before = proposer.passes_taken
    lookups_before = getattr(proposer, "lookup_steps", 0)
    per_prompt = []
    spec_tokens = spec_s = plain_tokens = plain_s = 0.0
    mismatches = 0
    loop_started = time.monotonic()
    # A bar on a terminal; under --watch, systemd or a test a log line every 30 s.
    with Progress("[eval] prompts", total=len(prompts), unit="prompt", logger=logger) as progress:
        for i, prompt in enumerate(prompts):
            if deadline is not None and i >= min_prompts:
                per_prompt_s = (time.monotonic() - loop_started) / i
                if time.monotonic() + per_prompt_s > deadline:
                    logger.info("[eval] time limit: %d of %d prompts decoded", i, len(prompts))
                    break
            spec = speculative_generate(target, proposer, prompt, max_new_tokens=max_new_tokens,
                                        stop_token_ids=stop_tokens, temperature=temperature, generator=gen(),
                                        draft_tokens=draft_tokens)
            stats.add(spec)
            spec_tokens += len(spec.tokens)
            spec_s += spec.total_s
            row = {"prompt_tokens": len(prompt), "new_tokens": len(spec.tokens), "tau": spec.tau,
                   "steps": len(spec.step_tokens), "spec_s": spec.total_s}
            if baseline:
                plain = plain_generate(target, prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_tokens,
                                       temperature=temperature, generator=gen())
                plain_tokens += len(plain.tokens)
                plain_s += plain.total_s
                row["plain_s"] = plain.total_s
                if temperature == 0 and plain.tokens != spec.tokens:
                    mismatches += 1
                    logger.warning("[eval] prompt %d: speculative output differs from greedy decoding "
                                   "(first difference at token %d)", i, _first_difference(spec.tokens, plain.tokens))
            per_prompt.append(row)
            logger.debug("[eval] prompt %d/%d: %d new tokens, tau %.2f", i + 1, len(prompts), len(spec.tokens), spec.tau)
            progress.update()

    report: dict[str, Any] = {
        "num_prompts": len(per_prompt),
        "prompts_requested": len(prompts),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "block_size": proposer.block_size,
        "draft_tokens": draft_tokens,
        "denoise_passes": proposer.denoise_passes,
        "draft_confidence": proposer.draft_confidence,
        "drafts_per_step": stats.drafted_total / max(1, stats.steps),
        "drafting_passes_per_step": (proposer.passes_taken - passes_before) / max(1, stats.steps),
        "prompt_lookup": hasattr(proposer, "lookup_steps"),
        "lookup_steps_frac": (getattr(proposer, "lookup_steps", 0) - lookups_before) / max(1, stats.steps),
        "tau": stats.tau,
        "tau_stderr": tau_stderr([row["tau"] * row["steps"] for row in per_prompt],
                                 [row["steps"] for row in per_prompt]),
        "tau_per_prompt": [row["tau"] for row in per_prompt],
        "acceptance_rate": stats.acceptance_rate(),
        "conditional_acceptance_rate": stats.conditional_acceptance_rate(),
        "steps": stats.steps,
        "generated_tokens": int(spec_tokens),
        "spec_tokens_per_s": spec_tokens / spec_s if spec_s else float("nan"),
        "per_prompt": per_prompt,
    }
    if baseline:
        report["plain_tokens_per_s"] = plain_tokens / plain_s if plain_s else float("nan")
        report["speedup"] = report["spec_tokens_per_s"] / report["plain_tokens_per_s"]
        if temperature == 0:
            report["greedy_mismatches"] = mismatches
    return report


def tau_stderr(tokens: Sequence[float], steps: Sequence[float]) -> float:
    """Standard error of tau = sum(tokens) / sum(steps) over prompts (the ratio estimator's,
    by the delta method): how far another draw of as many prompts would move it. NaN below 2 prompts."""
    n = len(steps)
    if n < 2 or not sum(steps):
        return float("nan")
    tau = sum(tokens) / sum(steps)
    spread = sum((y - tau * x) ** 2 for y, x in zip(tokens, steps)) / (n - 1)
    return math.sqrt(n * spread) / sum(steps)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def metric_values(report: dict[str, Any]) -> dict[str, float]:
    """What ``--watch`` pushes to the sidecar (names under ``drafter/<id>/``)."""
    values = {
        Eval.TAU: report["tau"],
        Eval.TAU_MIN: min(report["tau_per_prompt"]),
        Eval.TAU_STDERR: report["tau_stderr"],
        Eval.TOKENS_PER_S: report["spec_tokens_per_s"],
    }
    for k, rate in enumerate(report["acceptance_rate"], start=1):
        if not math.isnan(rate):
            values[Eval.ACCEPT_POS(k)] = rate
    if "speedup" in report:
        values[Eval.SPEEDUP] = report["speedup"]
    return {k: float(v) for k, v in values.items() if not math.isnan(float(v))}


def stderr_text(report: dict[str, Any]) -> str:
    """`` +- 0.045`` (tau's standard error over the prompts), or nothing when it is not known."""
    err = report.get("tau_stderr")
    return "" if err is None or math.isnan(err) else f" +- {err:.3f}"


def of_requested(report: dict[str, Any]) -> str:
    """" of M" when --time-limit-s left some of the M prompts undecoded; else nothing."""
    requested = report.get("prompts_requested", report["num_prompts"])
    return f" of {requested}" if requested > report["num_prompts"] else ""


def format_report(report: dict[str, Any]) -> str:
    eal = report.get("training_eal")
    rates = " ".join(f"{r:.2f}" for r in report["acceptance_rate"])
    lines = [
        f"=== DFlash eval: {report['run']} drafter {report['drafter']} step {report['step']} ===",
        f"  target: {report['target']}  prompts: {report['num_prompts']}"
        f"{of_requested(report) + ', time limit' if of_requested(report) else ''} "
        f"({report['prompt_source']})  "
        f"max new tokens: {report['max_new_tokens']}  temperature: {report['temperature']:g}",
        f"  tau: {report['tau']:.3f}{stderr_text(report)} tokens/step (block size {report['block_size']}, "
        f"{report.get('denoise_passes', 1)} drafting pass{'es' if report.get('denoise_passes', 1) > 1 else ''}"
        + (f", drafts cut below confidence {report['draft_confidence']:g}: {report['drafts_per_step']:.2f} "
           f"drafts and {report['drafting_passes_per_step']:.2f} passes a step" if report.get("draft_confidence") else "")
        + (f", prompt lookup drafting {report['lookup_steps_frac']:.0%} of the steps"
           if report.get("prompt_lookup") else "")
        + "; "
        f"per prompt min {min(report['tau_per_prompt']):.2f} max {max(report['tau_per_prompt']):.2f})",
        "  training EAL proxy: " + (f"{eal:.3f} (predicts tau {1 + eal:.3f})" if eal is not None else "not found"),
        f"  acceptance rate by block position 1..{report['block_size'] - 1}: {rates}",
        f"  speculative: {report['spec_tokens_per_s']:.1f} tokens/s",
    ]
    if "speedup" in report:
        lines.append(f"  plain target: {report['plain_tokens_per_s']:.1f} tokens/s  "
                     f"speed-up: {report['speedup']:.2f}x")
    if report.get("greedy_mismatches"):
        lines.append(f"  WARNING: {report['greedy_mismatches']} prompt(s) differ from greedy decoding")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dflash-eval", description=cli.help_text(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, help="run directory, e.g. runs/demo")
    p.add_argument("--drafter", default="d0", help="drafter id (default d0)")
    p.add_argument("--step", type=int, help="evaluate checkpoint step-N instead of the latest")
    p.add_argument("--checkpoint", type=Path, help="evaluate this drafter directory (config.json + model.safetensors)")
    p.add_argument("--prompts", type=Path, help="chat JSONL to take prompts from instead of the held-out split")
    p.add_argument("--num-prompts", type=int, help="prompts to decode (default 8; 4 with --watch)")
    p.add_argument("--max-new-tokens", type=int, help="tokens per prompt (default 64; 32 with --watch)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--draft-tokens", type=int, help="drafts the target verifies per step (default: block size - 1); "
                   "fewer cost less to verify where later positions are rarely accepted")
    p.add_argument("--denoise-passes", type=int, help="drafting passes a block takes (default: the drafter's "
                   "own, set by drafter.denoise_passes in training); 1 drafts the block in one parallel pass")
    p.add_argument("--draft-confidence", type=float, default=0.0, help="end a step's drafts before the first "
                   "slot where the drafter's own probability that it and every draft before it are right falls "
                   "below this: those slots are neither refined nor verified (0 = never, the default). On a CPU, "
                   "where each verified token costs, 0.2-0.5 ran fastest (docs/recipe.md)")
    p.add_argument("--prompt-lookup", action="store_true", help="draft by prompt lookup wherever the sequence's "
                   "last 2-4 tokens occurred before (what followed them), by the drafter elsewhere: what a serving "
                   "engine that puts a lookup in front of the drafter would get (docs/recipe.md)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--no-baseline", action="store_true", help="skip plain target decoding (no speed-up)")
    p.add_argument("--baseline", action="store_true", help="with --watch: also time plain decoding")
    p.add_argument("--time-limit-s", type=float, help="start no prompt that would end more than this many seconds "
                   "after the command started, at the pace so far (the report says how many were decoded)")
    p.add_argument("--min-prompts", type=int, default=1, help="with --time-limit-s: decode at least this many")
    p.add_argument("--threads", type=int, help="torch CPU threads (default target.threads, else torch's)")
    p.add_argument("--json", type=Path, help="also write the report here")
    # The config is the run's own (RUN_DIR/config.toml); --set overrides its keys.
    cli.add_config_args(p, config=False, env=False, set_example="target.device=cuda:0")
    p.add_argument("--watch", action="store_true", help="evaluate each new checkpoint until stopped")
    p.add_argument("--every-s", type=float, default=60.0, help="with --watch: seconds between checks")
    p.add_argument("--max-evals", type=int, default=0, help="with --watch: stop after N evaluations (0 = never)")
    p.add_argument("--until-step", type=int, default=0, help="with --watch: stop after a checkpoint >= this step")
    p.add_argument("--metrics-address", help="with --watch: sidecar address (default metrics.address)")
    args = p.parse_args(argv)
    if args.num_prompts is None:
        args.num_prompts = 4 if args.watch else 8
    if args.max_new_tokens is None:
        args.max_new_tokens = 32 if args.watch else 64
    for name in ("num_prompts", "max_new_tokens", "min_prompts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    if args.every_s <= 0:
        p.error("--every-s must be > 0")
    if args.time_limit_s is not None and (args.watch or not args.time_limit_s >= 0):
        p.error("--time-limit-s must be >= 0 and applies to one evaluation, not --watch")
    if args.watch and (args.step is not None or args.checkpoint):
        p.error("--watch follows the latest checkpoint; drop --step/--checkpoint")
    return args


def _setup(args: argparse.Namespace):
    """Config, target, tokenizer and prompts of the run."""
    import torch

    from common.config import ConfigError, load_config
    from common.devices import resolve_dtype
    from common.model_loader import ModelLoadError, load_target
    from common.packing import dtype_from_name

    config_path = args.run_dir / "config.toml"
    if not config_path.is_file():
        raise EvalError(f"{args.run_dir} is not a run directory (no config.toml); pass runs/<name>")
    try:
        cfg = load_config(config_path, args.overrides)
    except ConfigError as exc:
        raise EvalError(f"config error: {exc}") from None
    threads = args.threads if args.threads is not None else cfg.target.threads
    if threads:
        torch.set_num_threads(threads)
    dtype = dtype_from_name(resolve_dtype(cfg.target.dtype, cfg.target.device))
    try:
        loaded = load_target(cfg.target.model, device=cfg.target.device, dtype=dtype,
                             tokenizer_source=cfg.target.tokenizer or None)
    except ModelLoadError as exc:
        raise EvalError(str(exc)) from None
    if args.prompts:
        prompts = file_prompts(loaded.tokenizer, args.prompts, args.num_prompts)
        prompt_source = str(args.prompts)
    else:
        prompts = heldout_prompts(loaded.tokenizer, cfg, args.num_prompts)
        prompt_source = f"held-out {cfg.data.source}"
    logger.info("[eval] %d prompts from %s (mean %.0f tokens)", len(prompts), prompt_source,
                sum(map(len, prompts)) / len(prompts))
    stops = [] if args.ignore_eos else stop_token_ids(loaded.tokenizer, loaded.model)
    return cfg, loaded, prompts, prompt_source, stops


def _load_drafter(path: Path, target: Any) -> Any:
    from drafter_worker.model.dflash_model import load_drafter

    weight = target.get_input_embeddings().weight
    try:
        drafter = load_drafter(path, device=weight.device)
    except (OSError, ValueError) as exc:
        raise EvalError(f"cannot load the drafter from {path}: {exc}") from None
    return drafter.to(dtype=weight.dtype).eval()


def _evaluate_checkpoint(args, cfg, loaded, prompts, prompt_source, stops, path: Path, step: int | None,
                         baseline: bool) -> dict[str, Any]:
    from common.packing import dtype_name

    drafter = _load_drafter(path, loaded.model)
    started = time.monotonic()
    deadline = None if args.time_limit_s is None else args.command_started + args.time_limit_s
    report = evaluate(loaded.model, drafter, prompts, max_new_tokens=args.max_new_tokens, stop_tokens=stops,
                      temperature=args.temperature, seed=args.seed, baseline=baseline, draft_tokens=args.draft_tokens,
                      denoise_passes=args.denoise_passes, draft_confidence=args.draft_confidence,
                      prompt_lookup=args.prompt_lookup, deadline=deadline, min_prompts=args.min_prompts)
    eal = training_eal(args.run_dir, args.drafter, step) if step is not None else None
    report = {
        "run": str(args.run_dir), "drafter": args.drafter, "step": step, "checkpoint": str(path),
        "target": loaded.model_id, "target_dtype": dtype_name(loaded.model.dtype),
        "prompt_source": prompt_source, "training_eal": eal, "tau_predicted_by_eal": None if eal is None else 1 + eal,
        "eval_s": time.monotonic() - started, **report,
    }
    return report


def _json_safe(value: Any) -> Any:
    """NaN (a block position never drafted) as null: strict JSON readers refuse NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _write_report(report: dict[str, Any], run_dir: Path, extra: Path | None) -> None:
    report = _json_safe(report)
    paths = [extra] if extra else []
    if report["step"] is not None:
        paths.append(run_dir / "eval" / report["drafter"] / f"step-{report['step']}.json")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n", encoding="utf-8")
        tmp.replace(path)


def _run_once(args: argparse.Namespace) -> int:
    if not (args.run_dir / "config.toml").is_file():
        raise EvalError(f"{args.run_dir} is not a run directory (no config.toml); pass runs/<name>")
    if args.checkpoint:
        path, step = args.checkpoint, None
        state = path / "trainer_state.json"
        if state.is_file():
            step = int(json.loads(state.read_text(encoding="utf-8"))["step"])
    else:
        found = find_checkpoint(args.run_dir, args.drafter, args.step)
        if found is None:
            print(f"dflash-eval: drafter {args.drafter} has no checkpoint in "
                  f"{args.run_dir / 'checkpoints' / args.drafter} yet", file=sys.stderr)
            return 1
        path, step = found.path, found.step
    cfg, loaded, prompts, prompt_source, stops = _setup(args)
    report = _evaluate_checkpoint(args, cfg, loaded, prompts, prompt_source, stops, path, step,
                                  baseline=not args.no_baseline)
    _write_report(report, args.run_dir, args.json)
    print(format_report(report))
    return 0


def _watch(args: argparse.Namespace) -> int:
    stop = threading.Event()
    # Handlers only set the flag; the loop notices between evaluations.
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _watch_loop(args, stop)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _watch_loop(args: argparse.Namespace, stop: threading.Event) -> int:
    from common.metrics_client import MetricsPusher

    # Started together with the job, the watcher may come before the target
    # has written the run's config.toml.
    if not (args.run_dir / "config.toml").is_file():
        logger.info("[eval] waiting for %s to appear", args.run_dir / "config.toml")
        while not stop.is_set() and not (args.run_dir / "config.toml").is_file():
            stop.wait(min(args.every_s, 5.0))
        if stop.is_set():
            return 0
    cfg, loaded, prompts, prompt_source, stops = _setup(args)
    address = args.metrics_address or cfg.metrics.address
    pusher = MetricsPusher(address, DRAFTER_SOURCE(args.drafter))
    logger.info("[eval] watching %s for new checkpoints of %s every %gs; metrics to %s",
                args.run_dir, args.drafter, args.every_s, address)
    done = 0
    last_step: int | None = None
    try:
        while not stop.is_set():
            found = find_checkpoint(args.run_dir, args.drafter)
            if found is not None and found.step != last_step:
                try:
                    report = _evaluate_checkpoint(args, cfg, loaded, prompts, prompt_source, stops, found.path,
                                                  found.step, baseline=args.baseline)
                except EvalError as exc:
                    # Most likely pruned while being read: the next poll sees its successor.
                    logger.warning("[eval] step %d: %s; retrying at the next check", found.step, exc)
                else:
                    last_step = found.step
                    done += 1
                    _write_report(report, args.run_dir, None)
                    pusher.send(metric_values(report), step=found.step)
                    logger.info("[eval] %s step %d: tau %.3f (training EAL %s), %.1f tokens/s",
                                args.drafter, found.step, report["tau"],
                                "n/a" if report["training_eal"] is None else f"{report['training_eal']:.3f}",
                                report["spec_tokens_per_s"])
                    if (args.max_evals and done >= args.max_evals) or (
                            args.until_step and found.step >= args.until_step):
                        break
            stop.wait(args.every_s)
    finally:
        pusher.close()
    logger.info("[shutdown] eval watcher for %s: %d checkpoint(s) evaluated", args.drafter, done)
    return 0


def _print_config(args: argparse.Namespace) -> int:
    path = args.run_dir / "config.toml"
    if not path.is_file():
        print(f"dflash-eval: {args.run_dir} is not a run directory (no config.toml); pass runs/<name>", file=sys.stderr)
        return 2
    cfg = cli.load_job_config("dflash-eval", path, args.overrides)
    if cfg is None:
        return 2
    return cli.print_config(cfg, "dflash-eval", path, args.overrides)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()  # --time-limit-s counts the model loads too
    args = _parse_args(argv)
    args.command_started = started
    if args.print_config:
        return _print_config(args)
    from common.logging_setup import setup_logging

    # The watcher is a long-running process of the run: it logs there too.
    setup_logging(f"eval-{args.drafter}", args.run_dir / "logs" if args.watch and args.run_dir.is_dir() else None)
    try:
        return _watch(args) if args.watch else _run_once(args)
    except EvalError as exc:
        print(f"dflash-eval: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
