"""``make quality``: train one drafter with the quality recipe and measure it against the real target.

    python deploy/quality.py --config configs/quality.toml [--set key=value ...] [--train-minutes 50]

Starts the job the way the demo does (metrics sidecar, target server, drafter,
each its own process) plus one ``dflash-eval --watch`` process per drafter that
evaluates every new checkpoint with real speculative decoding, so W&B and the
report show ``eval/tau`` against wall-clock minutes. Training ends
``--train-minutes`` after the start (the drafter checkpoints on SIGTERM; the
recipe's cosine, ``drafter.decay_minutes``, ends there on the drafter's own
clock), or earlier when the target has served the recipe's epochs. Then a final
evaluation on held-out prompts (target-generated answers the drafter never
trained on) measures tau, acceptance per block position and speculative vs
plain greedy tokens/s side by side, verifying every draft of the block; a
second one does it again the way the target's device decodes fastest: on a
CPU, where every verified token costs, only the first ``--draft-tokens`` drafts
of each block (1: the target over two tokens costs about one plain step, over
five 1.5), optionally cut where the drafter's own confidence falls below
``--draft-confidence``. The drafter is exported; the summary is printed and
written to ``<run>/summary.json``.

The hour is kept on any host: the final evaluations get the minutes left of
``--total-minutes`` counted from ``--started-at`` (``make quality`` passes the
moment make started, so building ``.venv`` counts), shared in proportion to
their prompts, and each stops starting prompts that would end past its share
(``dflash-eval --time-limit-s``). A slow host decodes fewer held-out prompts
(the summary says how many of how many) instead of running past the hour.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.config import ConfigError, drafter_ids_in, load_config  # noqa: E402
from common.devices import resolve_dtype  # noqa: E402
from deploy.demo import STOP_TIMEOUT_S, _plots, summarize  # noqa: E402
from deploy.launcher import Job  # noqa: E402
from metrics_sidecar.wandb_reader import offline_upload_lines  # noqa: E402
from tools.eval import of_requested, stderr_text  # noqa: E402

TRAIN_MINUTES = 47.0  # training stops this long after the start; the hour holds it with evaluation and export
# tau's standard error over 16 prompts is about 0.10 at tau 2, over 64 about 0.05 (docs/recipe.md, session 24):
# the headline evaluation takes 64, the one with fewer drafts (its speed ratio; tau 1.5 +- 0.035 on 16) 16.
EVAL_PROMPTS = 64
FEWER_EVAL_PROMPTS = 16
# On a CPU in float32 every verified token costs: the target over 2 tokens takes about one plain step,
# over 3-4 1.25 and over 5 1.5, so one draft a step is the fastest decoding there (docs/recipe.md,
# session 22). A bf16 CPU target (prepacked weights) and a GPU verify a block for the price of a token
# (session 35: every draft 1.62x plain greedy, one draft a step 1.35x).
CPU_DRAFT_TOKENS = 1
TOTAL_MINUTES = 60.0  # the whole run, .venv included where make passes --started-at
# The headline evaluation's tau needs about 16 prompts for a standard error near 0.1 at tau 2.
MIN_EVAL_PROMPTS = 16
MIN_FEWER_EVAL_PROMPTS = 4
EXPORT_RESERVE_S = 30.0  # the export (no target load), the summary and its plots, per drafter
DRAFTER_STOP_TIMEOUT_S = 120.0  # drafters stopped by --train-minutes checkpoint first
FINAL_EVAL_TIMEOUT_S = 3600.0
EXPORT_TIMEOUT_S = 600.0


def _eval_final(tools: Job, drafter_id: str, args: argparse.Namespace, time_limit_s: float, *,
                fewer: bool = False) -> dict | None:
    """The final evaluation: every draft of the block verified, or (``fewer``) the device's fastest decoding."""
    name = f"final-{drafter_id}" + ("-fewer" if fewer else "")
    out = tools.run_dir / "eval" / f"{name}.json"
    prompts = args.fewer_eval_prompts if fewer else args.eval_prompts
    least = min(prompts, MIN_FEWER_EVAL_PROMPTS if fewer else MIN_EVAL_PROMPTS)
    cmd = [sys.executable, "-m", "tools.eval", str(tools.run_dir), "--drafter", drafter_id,
           "--num-prompts", str(prompts), "--max-new-tokens", str(args.eval_tokens),
           "--time-limit-s", f"{time_limit_s:.0f}", "--min-prompts", str(least),
           "--threads", str(args.eval_threads), "--json", str(out), *_eval_dtype(args)]
    if fewer:
        cmd += ["--draft-confidence", str(args.draft_confidence)]
        if args.draft_tokens:
            cmd += ["--draft-tokens", str(args.draft_tokens)]
    code = tools.run(f"eval-{name}", cmd, FINAL_EVAL_TIMEOUT_S)
    if code != 0 or not out.is_file():
        print(f"quality: final evaluation of {drafter_id} failed (exit {code}); see {tools.log_dir}", file=sys.stderr)
        return None
    return json.loads(out.read_text())


def _eval_dtype(args: argparse.Namespace) -> list[str]:
    """The evaluations' target dtype, where --eval-dtype names another than the config's."""
    return ["--set", f"target.dtype={args.eval_dtype}"] if args.eval_dtype else []


def _export(tools: Job, drafter_id: str) -> Path | None:
    out = tools.run_dir / "export" / drafter_id
    cmd = [sys.executable, "-m", "tools.export", str(tools.run_dir), "--drafter", drafter_id, "--out", str(out)]
    return out if tools.run(f"export-{drafter_id}", cmd, EXPORT_TIMEOUT_S) == 0 else None


def _time_limits(stages: list[int], deadline: float, drafters: int):
    """Each final evaluation's seconds: its share, by prompts, of what is left before the deadline.

    A generator over ``stages`` (prompts of each evaluation, in order), asked for the next limit
    just before that evaluation starts, so an evaluation that ended early leaves its time to the
    later ones. The exports' reserve comes off first."""
    for i, prompts in enumerate(stages):
        left = deadline - time.time() - EXPORT_RESERVE_S * drafters
        yield max(0.0, left * prompts / sum(stages[i:]))


def _cut(report: dict) -> tuple[str, str]:
    """(" of 64", "the hour's limit cut the rest") where the time limit left prompts undecoded, else empty."""
    of = of_requested(report)
    return of, "the hour's limit cut the rest" if of else ""


def _eval_curve(run_dir: Path, drafter_id: str) -> list[tuple[float, int, float]]:
    """(minutes since the run's first record, step, tau) of every --watch evaluation."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    t0, points = None, []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        t0 = rec["time"] if t0 is None else min(t0, rec["time"])
        if rec.get("source") == f"drafter/{drafter_id}" and "eval/tau" in rec.get("values", {}):
            points.append((rec["time"], int(rec["step"]), float(rec["values"]["eval/tau"])))
    return [((t - t0) / 60.0, step, tau) for t, step, tau in points]


def _print_summary(run_dir: Path, args: argparse.Namespace, results: dict, fewer_eval: bool, *,
                   total_minutes: float, setup_minutes: float, train_minutes: float, timed_out: bool) -> bool:
    """Print the summary and write ``<run>/summary.json``; False where an evaluation is missing."""
    lines, ok = summarize(run_dir)
    plots = _plots(run_dir)

    setup = f", .venv {setup_minutes:.1f} of them" if setup_minutes >= 0.05 else ""
    print(f"\n=== DFlash quality summary ({total_minutes:.1f} min in all{setup}; {train_minutes:.1f} min of training"
          f"{', stopped by the time limit' if timed_out else ''}) ===")
    print("\n".join(lines))
    summary = {"config": args.config, "overrides": args.overrides, "total_minutes": total_minutes,
               "setup_minutes": setup_minutes,
               "train_minutes": train_minutes, "timed_out": timed_out, "drafters": {}}
    for drafter_id, result in results.items():
        report = result["report"]
        if report is None:
            ok = False
            print(f"  {drafter_id}: no final evaluation")
            continue
        rates = " ".join("n/a" if r is None else f"{r:.2f}" for r in report["acceptance_rate"])
        of, why = _cut(report)
        print(f"  {drafter_id} at step {report['step']}: tau {report['tau']:.3f}{stderr_text(report)} on "
              f"{report['num_prompts']}{of} held-out prompts ({why + '; ' if why else ''}{report['prompt_source']}, "
              f"{report.get('target_dtype', 'float32')} target, {report['max_new_tokens']} new tokens, block {report['block_size']}"
              + (f", {report['denoise_passes']} drafting passes" if report.get("denoise_passes", 1) > 1 else "") + ")")
        print(f"    acceptance by block position 1..{report['block_size'] - 1}: {rates}")
        print(f"    speculative {report['spec_tokens_per_s']:.1f} tok/s vs plain greedy {report['plain_tokens_per_s']:.1f} "
              f"tok/s: {report['speedup']:.2f}x (same machine, side by side)")
        fewer = result["fewer"]
        if fewer_eval and fewer is None:
            ok = False
            print("    no evaluation with fewer drafts a step")
        if fewer is not None:
            k = fewer["draft_tokens"]
            how = ["one draft a step" if k == 1 else f"the first {k} drafts of each block"]
            if fewer["draft_confidence"]:
                how.append(f"cut below confidence {fewer['draft_confidence']:g}")
            of, why = _cut(fewer)
            print(f"    verifying {', '.join(how)} ({fewer['drafts_per_step']:.2f} drafts a step instead of "
                  f"{report['drafts_per_step']:.2f}; {fewer['num_prompts']}{of} prompts{', ' + why if why else ''}): "
                  f"tau {fewer['tau']:.3f}{stderr_text(fewer)}, speculative "
                  f"{fewer['spec_tokens_per_s']:.1f} tok/s vs plain greedy {fewer['plain_tokens_per_s']:.1f} tok/s: "
                  f"{fewer['speedup']:.2f}x")
        for r in (report, fewer or {}):
            if r.get("greedy_mismatches"):
                print(f"    WARNING: {r['greedy_mismatches']} prompt(s) differ from plain greedy decoding")
        curve = result["tau_curve"]
        if curve:
            print("    tau during training (min: tau): " + ", ".join(f"{m:.0f}: {t:.2f}" for m, t in
                                                                  [(c[0], c[2]) for c in curve]))
        print(f"    exported drafter: {result['export'] or 'export failed'}")
        summary["drafters"][drafter_id] = {
            "step": report["step"], "tau": report["tau"], "tau_stderr": report.get("tau_stderr"),
            "num_prompts": report["num_prompts"], "prompts_requested": report.get("prompts_requested"),
            "acceptance_rate": report["acceptance_rate"],
            "spec_tokens_per_s": report["spec_tokens_per_s"], "plain_tokens_per_s": report["plain_tokens_per_s"],
            "speedup": report["speedup"], "export": result["export"], "tau_curve": curve,
        }
        if fewer is not None:
            summary["drafters"][drafter_id]["fewer_drafts"] = {
                k: fewer[k] for k in ("draft_tokens", "draft_confidence", "drafts_per_step", "num_prompts", "tau",
                                      "acceptance_rate", "spec_tokens_per_s", "plain_tokens_per_s", "speedup")}
    for line in offline_upload_lines(run_dir):  # one run per drafter plus the target, and the upload command
        print(f"  {line}")
    if plots:
        print("  plots: " + ", ".join(str(p) for p in plots))
    print(f"  run directory: {run_dir}")
    summary["plots"] = [str(p) for p in plots]
    tmp = run_dir / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    tmp.replace(run_dir / "summary.json")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "quality.toml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--train-minutes", type=float, default=TRAIN_MINUTES,
                        help=f"stop training this long after the start even if the plan is not finished (default "
                             f"{TRAIN_MINUTES:g}; the recipe's drafter.decay_minutes ends its cosine there)")
    parser.add_argument("--started-at", type=float,
                        help="Unix time the run's hour began (make quality passes when make started, so building "
                             ".venv counts; default: now)")
    parser.add_argument("--total-minutes", type=float, default=TOTAL_MINUTES,
                        help=f"the final evaluations decode fewer prompts (at least {MIN_EVAL_PROMPTS}) rather than "
                             f"end the run later than this after --started-at (default {TOTAL_MINUTES:g})")
    parser.add_argument("--eval-every-s", type=float, default=240.0,
                        help="how often the watcher evaluates the newest checkpoint (each evaluation takes CPU from training)")
    parser.add_argument("--eval-prompts", type=int, default=EVAL_PROMPTS,
                        help="held-out prompts of the final evaluation (every draft of the block verified)")
    parser.add_argument("--fewer-eval-prompts", type=int, default=FEWER_EVAL_PROMPTS,
                        help="held-out prompts of the evaluation with fewer drafts a step (--draft-tokens)")
    parser.add_argument("--eval-tokens", type=int, default=64, help="new tokens per prompt in the final evaluation")
    parser.add_argument("--eval-dtype", default="",
                        help="target.dtype of the evaluations (watcher and final); '' (default) = the config's, "
                             "which decodes exactly as greedy in bf16 too (tools/small_linears.py)")
    parser.add_argument("--eval-threads", type=int, default=2, help="torch threads of the final evaluation")
    parser.add_argument("--no-watch", action="store_true", help="no evaluation during training (final one only)")
    parser.add_argument("--progress-every-s", type=float, default=30.0,
                        help="how often a progress line (steps, target tokens/s, the watcher's newest tau) is printed")
    parser.add_argument("--draft-tokens", type=int,
                        help="also evaluate verifying only the first N drafts of each block (default "
                             f"{CPU_DRAFT_TOKENS} for a float32 CPU target, else 0 = the whole block)")
    parser.add_argument("--draft-confidence", type=float, default=0.0,
                        help="in that evaluation also end each step's drafts where the drafter's own chance that "
                             "all of them are right falls below this (default 0 = never)")
    args = parser.parse_args(argv)
    now = time.time()
    if args.started_at is None:
        args.started_at = now
    if not (now - 86400.0 <= args.started_at <= now + 1.0):
        print(f"quality: --started-at must be a Unix time within the last day, got {args.started_at:.0f} "
              f"(now {now:.0f})", file=sys.stderr)
        return 2
    if not args.total_minutes > 0:
        print(f"quality: --total-minutes must be > 0, got {args.total_minutes:g}", file=sys.stderr)
        return 2
    if not args.progress_every_s > 0:
        print(f"quality: --progress-every-s must be > 0, got {args.progress_every_s:g}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, args.overrides)
        drafter_ids = drafter_ids_in(args.config) or [cfg.drafter.id]
        if args.eval_dtype:  # refused now, not after the hour's training
            load_config(args.config, [*args.overrides, f"target.dtype={args.eval_dtype}"])
    except ConfigError as exc:
        print(f"quality: config error: {exc}", file=sys.stderr)
        return 2
    if args.draft_tokens is None:
        eval_dtype = resolve_dtype(args.eval_dtype or cfg.target.dtype, cfg.target.device)
        args.draft_tokens = CPU_DRAFT_TOKENS if cfg.target.device == "cpu" and eval_dtype == "float32" else 0
    if not 0 <= args.draft_tokens < cfg.drafter.block_size:
        print(f"quality: --draft-tokens must be in 0..{cfg.drafter.block_size - 1} for the recipe's block of "
              f"{cfg.drafter.block_size}, got {args.draft_tokens}", file=sys.stderr)
        return 2
    if not 0.0 <= args.draft_confidence < 1.0:
        print(f"quality: --draft-confidence must be in [0, 1), got {args.draft_confidence}", file=sys.stderr)
        return 2
    fewer_eval = bool(args.draft_tokens or args.draft_confidence)
    source = Path(cfg.data.source)
    # A file or dataset directory of the checkout must be there; any other source (a hub
    # dataset name, an absolute path) is the target's to resolve and report.
    if not source.is_absolute() and "/" in cfg.data.source and not (ROOT / source).exists():
        print(f"quality: the recipe's data {cfg.data.source} is missing; docs/recipe.md says how to make it",
              file=sys.stderr)
        return 2
    run_dir = cfg.run.path if cfg.run.path.is_absolute() else ROOT / cfg.run.path
    if run_dir.exists():
        shutil.rmtree(run_dir)
    started = time.monotonic()
    setup_minutes = (time.time() - args.started_at) / 60.0  # make's .venv, where make passed --started-at
    timed_out = False
    with Job(args.config, run_dir, overrides=args.overrides) as job:
        log_dir = job.log_dir
        try:
            job.start_all(drafter_ids, eval_watch_args=None if args.no_watch else [
                "--every-s", str(args.eval_every_s), "--num-prompts", "4", "--max-new-tokens", "32", "--threads", "1",
                *_eval_dtype(args)])
            print(f"quality: started sidecar, target, drafters {', '.join(drafter_ids)} and their eval watchers; "
                  f"logs in {log_dir}")
            last_print = 0.0
            train_started = None
            while any(job.poll(d) is None for d in drafter_ids):
                time.sleep(2.0)
                elapsed = time.monotonic() - started
                for name in ("target", "metrics"):
                    if job.poll(name) is not None:
                        print(f"quality: {name} exited with {job.poll(name)}; see {log_dir}/{name}.log", file=sys.stderr)
                        return 1
                status = job.status(cfg.control.address) if elapsed - last_print >= args.progress_every_s else None
                if status is not None:
                    last_print = elapsed
                    if train_started is None and any(d.step > 0 for d in status.drafters):
                        train_started = time.monotonic()
                    parts = [f"{d.id} step {d.step}" for d in sorted(status.drafters, key=lambda d: d.id)]
                    curve = [c for d in drafter_ids for c in _eval_curve(run_dir, d)[-1:]]
                    tau = f" | eval tau {curve[-1][2]:.2f} @ step {curve[-1][1]}" if curve else ""
                    print(f"quality: [{elapsed / 60:5.1f} min] {' | '.join(parts) or 'drafters registering'} | "
                          f"target {status.tokens_per_s:.0f} tok/s{tau}", flush=True)
                if elapsed > args.train_minutes * 60:
                    timed_out = True
                    print(f"quality: {args.train_minutes:g} minutes are up: stopping the drafters (they checkpoint)")
                    job.stop(drafter_ids, DRAFTER_STOP_TIMEOUT_S)
                    break
            failed = {d: job.poll(d) for d in drafter_ids if job.poll(d) not in (0, -15)}
            if failed:
                print(f"quality: drafters failed: {failed}; see {log_dir}", file=sys.stderr)
                return 1
        finally:
            codes = job.stop([f"eval-{d}" for d in drafter_ids], STOP_TIMEOUT_S)
            codes.update(job.stop(["target"], STOP_TIMEOUT_S))
            codes.update(job.stop(drafter_ids, STOP_TIMEOUT_S))
            codes.update(job.stop(["metrics"], STOP_TIMEOUT_S))
    train_minutes = (time.monotonic() - started) / 60.0

    results = {}
    per_drafter = [args.eval_prompts] + ([args.fewer_eval_prompts] if fewer_eval else [])
    limits = _time_limits(per_drafter * len(drafter_ids), args.started_at + args.total_minutes * 60.0,
                          len(drafter_ids))
    with Job(None, run_dir) as tools:
        for drafter_id in drafter_ids:
            report = _eval_final(tools, drafter_id, args, next(limits))
            fewer = _eval_final(tools, drafter_id, args, next(limits), fewer=True) if fewer_eval else None
            export = _export(tools, drafter_id)
            results[drafter_id] = {"report": report, "fewer": fewer, "export": str(export) if export else None,
                                   "tau_curve": _eval_curve(run_dir, drafter_id)}
    total_minutes = (time.monotonic() - started) / 60.0 + setup_minutes
    ok = _print_summary(run_dir, args, results, fewer_eval, total_minutes=total_minutes,
                        setup_minutes=setup_minutes, train_minutes=train_minutes, timed_out=timed_out)
    bad = {k: v for k, v in codes.items() if v not in (0, -15)}
    if bad:
        print(f"quality: processes did not exit cleanly: {bad}", file=sys.stderr)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
