"""Soak: run the job for a while, restarting a random drafter every minute.

Prints the resident memory of each process at the start and the end (a
restarted drafter is reported per instance) and checks every drafter's ledger.

    python deploy/soak.py --config configs/demo.toml --minutes 10
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.config import drafter_ids_in, load_config  # noqa: E402
from deploy.demo import _start, _stop  # noqa: E402
from drafter_worker.checkpoint import verify_lineage  # noqa: E402


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.toml"))
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--restart-every-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    overrides = ["run.name=\"soak\"", "drafter.max_steps=0"]
    cfg = load_config(args.config, overrides)
    ids = drafter_ids_in(args.config) or [cfg.drafter.id]
    run_dir = ROOT / cfg.run.path
    shutil.rmtree(run_dir, ignore_errors=True)
    common = ["--config", args.config, *[f"--set={o}" for o in overrides]]
    logs = run_dir / "logs"
    rng = random.Random(args.seed)
    procs = {"metrics": _start("metrics", "metrics_sidecar", common, logs),
             "target": _start("target", "target_server", common, logs)}
    for d in ids:
        procs[d] = _start(f"drafter-{d}", "drafter_worker", [*common, "--id", d], logs)
    time.sleep(60)  # let the target load and everything reach steady state
    start_rss = {name: rss_mb(p.pid) for name, p in procs.items()}
    print("soak: resident memory at start (MB): " + ", ".join(f"{k}={v:.0f}" for k, v in start_rss.items()), flush=True)
    deadline = time.monotonic() + 60 * args.minutes
    restarts = 0
    try:
        while time.monotonic() < deadline:
            time.sleep(min(args.restart_every_s, max(0.0, deadline - time.monotonic())))
            if time.monotonic() >= deadline:
                break
            victim = rng.choice(ids)
            before = rss_mb(procs[victim].pid)
            procs[victim].send_signal(signal.SIGTERM)
            code = procs[victim].wait(120)
            procs[victim] = _start(f"drafter-{victim}", "drafter_worker", [*common, "--id", victim], logs)
            restarts += 1
            time.sleep(5.0)  # let the new process get past exec before reading its memory
            print(f"soak: restarted {victim} (exit {code}, {before:.0f} MB before); "
                  + ", ".join(f"{k}={rss_mb(p.pid):.0f}MB" for k, p in procs.items()), flush=True)
        end_rss = {name: rss_mb(p.pid) for name, p in procs.items()}
        print("soak: resident memory at end (MB): " + ", ".join(f"{k}={v:.0f}" for k, v in end_rss.items()))
    finally:
        codes = {name: _stop(procs[name], 60) for name in [*ids, "target", "metrics"]}
    print(f"soak: {restarts} drafter restarts; exit codes {codes}")
    ok = all(c == 0 for c in codes.values())
    for d in ids:
        report = verify_lineage(run_dir, d)
        print(f"soak: ledger {d}: final step {report.final_step}, {report.batches} batches, samples per epoch "
              f"{report.samples_per_epoch}: {'clean' if report.ok else '; '.join(report.problems)}")
        ok &= report.ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
