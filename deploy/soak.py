"""Soak: run the job for a while, killing and restarting a random process every minute.

Each period one process (a drafter, the target or the metrics sidecar) is
stopped with SIGTERM (it must exit 0) or SIGKILL, then started again with the
same command. At the end the soak checks every exit code, that no process
grew past a memory bound (the last incarnation of each process against the
first one's steady state), and the ledgers of every drafter group (its
members split one sample stream, so it is checked as a whole, completeness
included).

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
from deploy.launcher import Job  # noqa: E402
from drafter_worker.checkpoint import verify_group  # noqa: E402


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


SETTLE_S = {"target": 60.0, "metrics": 5.0}  # a restarted target loads its model before it serves
STOP_TIMEOUT_S = 120.0  # per stage of the final shutdown (drafters, target, sidecar)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.toml"))
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--restart-every-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rss-growth-mb", type=float, default=200.0,
                        help="fail when a process ends with more resident memory than this above the steady state "
                             "read one period after start")
    args = parser.parse_args(argv)
    overrides = ["run.name=\"soak\"", "drafter.max_steps=0"]
    cfg = load_config(args.config, overrides)
    ids = drafter_ids_in(args.config) or [cfg.drafter.id]
    run_dir = ROOT / cfg.run.path
    shutil.rmtree(run_dir, ignore_errors=True)
    rng = random.Random(args.seed)
    names = ["metrics", "target", *ids]
    wrong_exits: list[str] = []
    kills: list[str] = []
    with Job(args.config, run_dir, overrides=overrides) as job:
        try:
            job.start_metrics()
            job.start_target()
            for drafter_id in ids:
                job.start_drafter(drafter_id)
            # The target loads its model; drafters build theirs and allocate their buffers over the
            # first steps: the memory baseline is read once all of that is behind them.
            time.sleep(60 + args.restart_every_s)
            start_rss = {name: rss_mb(p.pid) for name, p in job.procs.items()}
            print("soak: resident memory at start (MB): " + ", ".join(f"{k}={v:.0f}" for k, v in start_rss.items()),
                  flush=True)
            deadline = time.monotonic() + 60 * args.minutes
            while time.monotonic() < deadline:
                time.sleep(min(args.restart_every_s, max(0.0, deadline - time.monotonic())))
                if time.monotonic() >= deadline:
                    break
                victim = rng.choice(names)
                how = rng.choice([signal.SIGTERM, signal.SIGKILL])
                job.send_signal(victim, how)
                code = job.wait(victim, 180)
                expected = 0 if how == signal.SIGTERM else -signal.SIGKILL
                if code != expected:
                    wrong_exits.append(f"{victim} exited {code} after {how.name} (expected {expected})")
                job.restart(victim)
                kills.append(f"{victim}:{how.name}")
                time.sleep(SETTLE_S.get(victim, 5.0))
                print(f"soak: {how.name} {victim} (exit {code}); "
                      + ", ".join(f"{k}={rss_mb(p.pid):.0f}MB" for k, p in job.procs.items()), flush=True)
            end_rss = {name: rss_mb(p.pid) for name, p in job.procs.items()}
            print("soak: resident memory at end (MB): " + ", ".join(f"{k}={v:.0f}" for k, v in end_rss.items()))
        finally:
            codes = job.stop(ids, STOP_TIMEOUT_S)
            codes.update(job.stop(["target"], STOP_TIMEOUT_S))
            codes.update(job.stop(["metrics"], STOP_TIMEOUT_S))
    print(f"soak: {len(kills)} kills ({', '.join(kills) or 'none'}); final exit codes {codes}")
    problems = wrong_exits + [f"{name} exited {code} on the final SIGTERM" for name, code in codes.items() if code != 0]
    problems += [f"{name} grew from {start_rss[name]:.0f} to {end_rss[name]:.0f} MB" for name in names
                 if end_rss[name] > start_rss[name] + args.rss_growth_mb]
    groups: dict[str, list[str]] = {}
    for d in ids:
        group = load_config(args.config, [f'drafter.id="{d}"', *overrides]).drafter.group
        groups.setdefault(group, []).append(d)
    for group, members in groups.items():
        report = verify_group(run_dir, members)
        print(f"soak: ledgers of group {group} ({', '.join(members)}): final steps {report.final_steps}, "
              f"{report.batches} batches, samples per epoch {report.samples_per_epoch}, complete epochs "
              f"{report.finished_epochs}: {'clean' if report.ok else '; '.join(report.problems)}")
        problems += report.problems
    for problem in problems:
        print(f"soak: FAILED: {problem}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
