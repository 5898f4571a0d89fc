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
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import protocol as P  # noqa: E402
from common.auth import status_credential  # noqa: E402
from common.config import ConfigError, drafter_ids_in, load_config  # noqa: E402


def _start(name: str, module: str, args: list[str], log_dir: Path) -> subprocess.Popen:
    log_dir.mkdir(parents=True, exist_ok=True)
    # stderr also lands in logs/<process>.log through the process's own logging;
    # this file keeps anything printed before logging is set up (e.g. a crash on import).
    out = open(log_dir / f"{name}.console", "w")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _status(address: str, ctx: zmq.Context, run_dir: Path) -> P.Status | None:
    try:
        credential = status_credential(run_dir)
    except (OSError, ValueError):
        return None  # the target has not created the run's keys yet
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(P.StatusRequest(auth=credential).encode())
        if sock.poll(1000):
            msg = P.decode(sock.recv())
            return msg if isinstance(msg, P.Status) else None
        return None
    finally:
        sock.close()


def _stop(proc: subprocess.Popen, timeout_s: float) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


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


def measure_tau(run_dir: Path, drafter_ids: list[str], prompts: int = 3, tokens: int = 32) -> dict[str, dict | None]:
    """A short real evaluation of each drafter's last checkpoint (``dflash-eval``, one process per
    drafter, in parallel): tau measured with the target, next to the training EAL proxy."""
    procs = {}
    for drafter_id in drafter_ids:
        out = run_dir / "eval" / f"demo-{drafter_id}.json"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "tools.eval", str(run_dir), "--drafter", drafter_id, "--num-prompts", str(prompts),
               "--max-new-tokens", str(tokens), "--no-baseline", "--threads", "1", "--json", str(out)]
        console = open(run_dir / "logs" / f"eval-{drafter_id}.console", "w")
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        procs[drafter_id] = (subprocess.Popen(cmd, cwd=ROOT, stdout=console, stderr=subprocess.STDOUT, env=env), out, console)
    results: dict[str, dict | None] = {}
    for drafter_id, (proc, out, console) in procs.items():
        proc.wait()
        console.close()
        results[drafter_id] = json.loads(out.read_text()) if proc.returncode == 0 and out.is_file() else None
    return results


def tau_lines(results: dict[str, dict | None]) -> list[str]:
    lines = []
    for drafter_id, report in results.items():
        if report is None:
            lines.append(f"  drafter/{drafter_id}: evaluation failed (see logs/eval-{drafter_id}.console)")
            continue
        eal = report.get("training_eal")
        proxy = f"the training EAL proxy predicts {1 + eal:.2f}" if eal is not None else "no EAL proxy logged"
        rates = " ".join(f"{r:.2f}" for r in report["acceptance_rate"][:4])
        lines.append(f"  drafter/{drafter_id}: measured tau {report['tau']:.2f} ({report['num_prompts']} held-out prompts, "
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
    common_args = ["--config", args.config, *[f"--set={o}" for o in args.overrides]]
    log_dir = run_dir / "logs"
    procs: dict[str, subprocess.Popen] = {}
    started = time.monotonic()
    ctx = zmq.Context()
    try:
        procs["metrics"] = _start("metrics", "metrics_sidecar", common_args, log_dir)
        procs["target"] = _start("target", "target_server", common_args, log_dir)
        for drafter_id in drafter_ids:
            procs[drafter_id] = _start(f"drafter-{drafter_id}", "drafter_worker", [*common_args, "--id", drafter_id], log_dir)
        print(f"demo: started sidecar, target and drafters {', '.join(drafter_ids)}; logs in {log_dir}")
        budget = cfg.drafter.max_steps
        last_print = 0.0
        while any(procs[d].poll() is None for d in drafter_ids):
            time.sleep(1.0)
            elapsed = time.monotonic() - started
            if elapsed > args.timeout_s:
                print(f"demo: giving up after {args.timeout_s:.0f}s", file=sys.stderr)
                return 1
            for name in ("target", "metrics"):
                if procs[name].poll() is not None:
                    print(f"demo: {name} exited with {procs[name].returncode}; see {log_dir}/{name}.log", file=sys.stderr)
                    return 1
            if elapsed - last_print >= 10.0:
                last_print = elapsed
                status = _status(cfg.control.address, ctx, cfg.run.path)
                if status is None:
                    print(f"demo: [{elapsed:5.0f}s] target is starting (loading the model, tokenizing the data)")
                else:
                    parts = [f"{d['id']} step {d['step']}/{budget or '-'}" for d in sorted(status.drafters, key=lambda d: d["id"])]
                    print(f"demo: [{elapsed:5.0f}s] {' | '.join(parts) or 'drafters registering'}"
                          f" | target {status.tokens_per_s:.0f} tok/s, queue {status.queue_depth}")
        failed = {d: procs[d].returncode for d in drafter_ids if procs[d].returncode != 0}
        if failed:
            print(f"demo: drafters failed: {failed}; see {log_dir}", file=sys.stderr)
            return 1
    finally:
        codes = {}
        for name in ["target", *drafter_ids, "metrics"]:
            if name in procs:
                codes[name] = _stop(procs[name], timeout_s=60.0)
        ctx.term()
    lines, ok = summarize(run_dir)
    lines += tau_lines(measure_tau(run_dir, drafter_ids))
    elapsed = time.monotonic() - started
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    print(f"\n=== DFlash demo summary ({elapsed:.0f}s) ===")
    print("\n".join(lines))
    print(f"  run directory: {run_dir}")
    print(f"  process exit codes: {codes}")
    if offline:
        print(f"  W&B offline run: {offline[-1]}")
        print(f"  upload it with: wandb sync {offline[-1]}")
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
