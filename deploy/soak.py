"""Soak: run the job for a while, killing and restarting a random process every minute.

Each period one process (a drafter, a target replica or the metrics sidecar)
is stopped with SIGTERM (it must exit 0) or SIGKILL, then started again with
the same command. A drafter trained by several ranks (its table lists more
than one drafter.devices) runs under torchrun through ``deploy.node
--run-group``; SIGKILL then kills all its ranks at once, as a crashed node
would. At the end the soak checks every exit code, that no process grew past
a memory bound (the last incarnation of each process against the first one's
steady state), and the lineage of every drafter
(``drafter_worker.checkpoint.verify_lineage``: its final checkpoint over the
ledgers of all its ranks, completeness of finished epochs included).

    python deploy/soak.py --config configs/demo.toml --minutes 10
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.config import load_config  # noqa: E402
from deploy.launcher import Job, _descendants  # noqa: E402
from deploy.node import resolve, torchrun_args  # noqa: E402
from drafter_worker.checkpoint import verify_lineage  # noqa: E402


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def rss_of(job: Job, name: str, groups) -> float:
    """Resident memory of ``name``; of a torchrun group, its ranks' (and torchrun's) too."""
    pid = job.procs[name].pid
    return rss_mb(pid) + (sum(rss_mb(p) for p in _descendants(pid)) if name in groups else 0.0)


SETTLE_S = {"target": 60.0, "metrics": 5.0}  # a restarted target loads its model before it serves


def settle_s(name: str) -> float:
    return SETTLE_S["target"] if name == "target" or name.startswith("target-") else SETTLE_S.get(name, 5.0)


def kill_tree(job: Job, name: str) -> None:
    """SIGKILL ``name`` and everything below it (a torchrun group's ranks die with it)."""
    proc = job.procs[name]
    below = _descendants(proc.pid)
    proc.send_signal(signal.SIGKILL)
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


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
    node = resolve(args.config, overrides, drafters="all")
    if node.problems:
        for _, problem in node.problems:
            print(f"soak: layout problem: {problem}")
        return 2
    cfg = load_config(args.config, overrides)
    ids = [d.id for d in node.drafters]
    groups = {d.id: d for d in node.drafters if d.torchrun}
    targets = [t.name for t in node.targets]
    run_dir = ROOT / cfg.run.path
    shutil.rmtree(run_dir, ignore_errors=True)
    rng = random.Random(args.seed)
    names = ["metrics", *targets, *ids]
    wrong_exits: list[str] = []
    kills: list[str] = []
    with Job(args.config, run_dir, overrides=overrides) as job:
        try:
            job.start_metrics()
            for t in node.targets:
                if t.replicas == 1:
                    job.start_target()
                else:
                    job.start(t.name, "target_server", "--replica", str(t.replica), log_name=t.name)
            for drafter_id in ids:
                if drafter_id in groups:
                    # deploy.node --run-group: torchrun's parent, relays SIGTERM to the ranks (exit 0).
                    job.start_command(drafter_id, [sys.executable, "-m", "deploy.node", "--config", str(args.config),
                                                   *(f"--set={o}" for o in overrides), "--run-group", drafter_id],
                                      log_name=f"drafter-{drafter_id}")
                    print(f"soak: {drafter_id}: torchrun {' '.join(torchrun_args(node, groups[drafter_id]))}",
                          flush=True)
                else:
                    job.start_drafter(drafter_id)
            # The target loads its model; drafters build theirs and allocate their buffers over the
            # first steps: the memory baseline is read once all of that is behind them.
            time.sleep(60 + args.restart_every_s)
            start_rss = {name: rss_of(job, name, groups) for name in job.procs}
            print("soak: resident memory at start (MB): " + ", ".join(f"{k}={v:.0f}" for k, v in start_rss.items()),
                  flush=True)
            deadline = time.monotonic() + 60 * args.minutes
            while time.monotonic() < deadline:
                time.sleep(min(args.restart_every_s, max(0.0, deadline - time.monotonic())))
                if time.monotonic() >= deadline:
                    break
                victim = rng.choice(names)
                how = rng.choice([signal.SIGTERM, signal.SIGKILL])
                if how == signal.SIGKILL and victim in groups:
                    kill_tree(job, victim)
                else:
                    job.send_signal(victim, how)
                code = job.wait(victim, 180)
                expected = 0 if how == signal.SIGTERM else -signal.SIGKILL
                if code != expected:
                    wrong_exits.append(f"{victim} exited {code} after {how.name} (expected {expected})")
                job.restart(victim)
                kills.append(f"{victim}:{how.name}")
                time.sleep(settle_s(victim))
                print(f"soak: {how.name} {victim} (exit {code}); "
                      + ", ".join(f"{k}={rss_of(job, k, groups):.0f}MB" for k in job.procs), flush=True)
            end_rss = {name: rss_of(job, name, groups) for name in job.procs}
            print("soak: resident memory at end (MB): " + ", ".join(f"{k}={v:.0f}" for k, v in end_rss.items()))
        finally:
            codes = job.stop(ids, STOP_TIMEOUT_S)
            codes.update(job.stop(targets, STOP_TIMEOUT_S))
            codes.update(job.stop(["metrics"], STOP_TIMEOUT_S))
    print(f"soak: {len(kills)} kills ({', '.join(kills) or 'none'}); final exit codes {codes}")
    problems = wrong_exits + [f"{name} exited {code} on the final SIGTERM" for name, code in codes.items() if code != 0]
    problems += [f"{name} grew from {start_rss[name]:.0f} to {end_rss[name]:.0f} MB" for name in names
                 if end_rss[name] > start_rss[name] + args.rss_growth_mb]
    for drafter_id in ids:
        report = verify_lineage(run_dir, drafter_id)
        print(f"soak: lineage of drafter {drafter_id} ({report.world_size} rank(s)): final step {report.final_step}, "
              f"{report.batches} batches, samples per epoch {report.samples_per_epoch}, complete epochs "
              f"{report.finished_epochs}: {'clean' if report.ok else '; '.join(report.problems)}")
        problems += report.problems
    for problem in problems:
        print(f"soak: FAILED: {problem}")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
