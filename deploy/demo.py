"""Run the whole job on one machine: metrics sidecar, target server, every drafter.

Each component is its own OS process, started the way an operator would start
it (``python -m ...``). The launcher watches the drafters, shows progress
toward their step budget (asking the target over its control socket), stops
the target and sidecar with SIGTERM once the drafters are done, and prints a
summary read back from the run's ``metrics.jsonl``.

    python deploy/demo.py --config configs/demo.toml [--set key=value ...] [--keep]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.config import ConfigError, drafter_ids_in, load_config  # noqa: E402
from deploy.launcher import Job  # noqa: E402
from metrics_sidecar.wandb_reader import offline_upload_lines  # noqa: E402
from tools.eval import stderr_text  # noqa: E402

STOP_TIMEOUT_S = 60.0  # per stage of the shutdown (target, drafters, sidecar), after SIGTERM
EVAL_TIMEOUT_S = 900.0  # for the short evaluations of measure_tau, all drafters together


def summarize(run_dir: Path) -> tuple[list[str], bool]:
    """Summary lines from metrics.jsonl; ok is False if a drafter's loss is missing or not finite."""
    by_source: dict[str, list[dict]] = {}
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            by_source.setdefault(rec["source"], []).append(rec)
    lines, ok = [], True
    drafters = sorted(s for s in by_source if s.startswith("drafter/"))
    for source in drafters:
        recs = [r for r in by_source[source] if "loss" in r["values"]]
        if not recs:
            ok = False
            lines.append(f"  {source}: no loss reported")
            continue
        first, last = recs[0]["values"], recs[-1]["values"]
        tps = [r["values"]["tokens_per_s"] for r in recs[1:]] or [first["tokens_per_s"]]
        finite = all(math.isfinite(r["values"]["loss"]) for r in recs)
        ok &= finite
        lines.append(
            f"  {source}: steps={recs[-1]['step']} loss {first['loss']:.3f} -> {last['loss']:.3f} "
            f"eal {first.get('eal', 0):.2f} -> {last.get('eal', 0):.2f} tokens/s={sum(tps) / len(tps):.0f}"
            + ("" if finite else "  (NON-FINITE LOSS)")
        )
    target = [r["values"]["tokens_per_s"] for r in by_source.get("target", []) if r["values"].get("tokens_per_s")]
    if target:
        lines.append(f"  target: tokens/s={sum(target) / len(target):.0f} (mean over windows while capturing)")
    if not drafters:
        ok = False
    return lines, ok


def measure_tau(run_dir: Path, drafter_ids: list[str], prompts: int, tokens: int) -> dict[str, dict | None]:
    """A short real evaluation of each drafter's last checkpoint (``dflash-eval``, one process per
    drafter, in parallel): tau measured with the target, next to the training EAL proxy."""
    outs = {drafter_id: run_dir / "eval" / f"demo-{drafter_id}.json" for drafter_id in drafter_ids}
    with Job(None, run_dir) as evals:
        for drafter_id, out in outs.items():
            out.unlink(missing_ok=True)
            evals.start_command(f"eval-{drafter_id}", [
                sys.executable, "-m", "tools.eval", str(run_dir), "--drafter", drafter_id, "--num-prompts", str(prompts),
                "--max-new-tokens", str(tokens), "--no-baseline", "--threads", "1", "--json", str(out)])
        deadline = time.monotonic() + EVAL_TIMEOUT_S
        codes = {d: evals.finish(f"eval-{d}", deadline - time.monotonic()) for d in drafter_ids}
    return {d: json.loads(out.read_text()) if codes[d] == 0 and out.is_file() else None for d, out in outs.items()}


def tau_lines(results: dict[str, dict | None]) -> list[str]:
    lines = []
    for drafter_id, report in results.items():
        if report is None:
            lines.append(f"  drafter/{drafter_id}: evaluation failed (see logs/eval-{drafter_id}.console)")
            continue
        eal = report.get("training_eal")
        proxy = f"the training EAL proxy predicts {1 + eal:.2f}" if eal is not None else "no EAL proxy logged"
        rates = " ".join(f"{r:.2f}" for r in report["acceptance_rate"][:4])
        lines.append(f"  drafter/{drafter_id}: measured tau {report['tau']:.2f}{stderr_text(report)} "
                     f"({report['num_prompts']} held-out prompts, "
                     f"acceptance at positions 1-4: {rates}); {proxy}")
    return lines


def _plots(run_dir: Path) -> list[Path]:
    """Curves of the run as PNGs in run_dir/plots/ (tools/report.py); a failure only costs the plots."""
    from tools.report import ReportError, write_report

    try:
        return write_report(run_dir)
    except (ReportError, ImportError) as exc:
        print(f"demo: no plots: {exc}", file=sys.stderr)
        return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.toml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--keep", action="store_true", help="resume an existing run directory instead of starting fresh")
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="give up after this long")
    parser.add_argument("--eval-prompts", type=int, default=3, help="held-out prompts of the final tau measurement")
    # 16: an untrained drafter verifies a whole 16-token block for about one token, so every new token
    # costs a verify; 32 cost 12 s more an evaluation on 2 cores (tau 1.02 instead of 1.00).
    parser.add_argument("--eval-tokens", type=int, default=16, help="new tokens per prompt in the final tau measurement")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        drafter_ids = drafter_ids_in(args.config) or [cfg.drafter.id]
    except ConfigError as exc:
        print(f"demo: config error: {exc}", file=sys.stderr)
        return 2
    run_dir = cfg.run.path if cfg.run.path.is_absolute() else ROOT / cfg.run.path
    if run_dir.exists() and not args.keep:
        shutil.rmtree(run_dir)
        print(f"demo: starting fresh in {run_dir} (pass --keep to resume instead)")
    started = time.monotonic()
    with Job(args.config, run_dir, overrides=args.overrides) as job:
        log_dir = job.log_dir
        try:
            job.start_all(drafter_ids)
            print(f"demo: started sidecar, target and drafters {', '.join(drafter_ids)}; logs in {log_dir}")
            budget = cfg.drafter.max_steps
            last_print = 0.0
            while any(job.poll(d) is None for d in drafter_ids):
                time.sleep(1.0)
                elapsed = time.monotonic() - started
                if elapsed > args.timeout_s:
                    print(f"demo: giving up after {args.timeout_s:.0f}s", file=sys.stderr)
                    return 1
                for name in ("target", "metrics"):
                    if job.poll(name) is not None:
                        print(f"demo: {name} exited with {job.poll(name)}; see {log_dir}/{name}.log", file=sys.stderr)
                        return 1
                if elapsed - last_print >= 10.0:
                    last_print = elapsed
                    status = job.status(cfg.control.address)
                    if status is None:
                        print(f"demo: [{elapsed:5.0f}s] target is starting (loading the model, tokenizing the data)")
                    else:
                        parts = [f"{d.id} step {d.step}/{budget or '-'}" for d in sorted(status.drafters, key=lambda d: d.id)]
                        print(f"demo: [{elapsed:5.0f}s] {' | '.join(parts) or 'drafters registering'}"
                              f" | target {status.tokens_per_s:.0f} tok/s, queue {status.queue_depth}")
            failed = {d: job.poll(d) for d in drafter_ids if job.poll(d) != 0}
            if failed:
                print(f"demo: drafters failed: {failed}; see {log_dir}", file=sys.stderr)
                return 1
        finally:
            # The target, then any drafter still running, the sidecar last (it records everyone's last metrics).
            codes = job.stop(["target"], STOP_TIMEOUT_S)
            codes.update(job.stop(drafter_ids, STOP_TIMEOUT_S))
            codes.update(job.stop(["metrics"], STOP_TIMEOUT_S))
    lines, ok = summarize(run_dir)
    lines += tau_lines(measure_tau(run_dir, drafter_ids, args.eval_prompts, args.eval_tokens))
    elapsed = time.monotonic() - started
    wandb_lines = offline_upload_lines(run_dir)  # one run per drafter plus the target, and the upload command
    print(f"\n=== DFlash demo summary ({elapsed:.0f}s) ===")
    print("\n".join(lines))
    print(f"  run directory: {run_dir}")
    print(f"  process exit codes: {codes}")
    for line in wandb_lines:
        print(f"  {line}")
    report = _plots(run_dir)
    if report:
        print("  plots: " + ", ".join(str(p) for p in report))
    bad = {k: v for k, v in codes.items() if v != 0}
    if bad:
        print(f"demo: processes did not exit cleanly: {bad}", file=sys.stderr)
        return 1
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
