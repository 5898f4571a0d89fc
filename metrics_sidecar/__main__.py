"""``dflash-metrics --config FILE [--set KEY=VALUE ...]`` (also ``python -m metrics_sidecar``).

The job's metrics sidecar: binds metrics.address (ZeroMQ PULL) and receives the
metric records of every process of the run (target, drafters, dflash-eval
--watch) and aggregates them over windows of metrics.window_s seconds; each
window goes to run.root_dir/run.name/metrics.jsonl, to Weights & Biases
(one run per drafter plus one for the target, in one group named after the
job; metrics.wandb_mode: offline by default, under the run directory's
wandb/; empty metrics.wandb_* keys fall back to WANDB_* variables) and to one
human log line. Training never waits for it: started late,
stopped or restarted, the other processes keep going.

The flags below override single keys for ad-hoc runs and tests; a job config
sets the same keys for every process.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import zmq

from common import cli
from common.config import Config, ConfigError, load_config
from common.logging_setup import setup_logging
from common.sockets import SocketFactory
from metrics_sidecar.sidecar import MetricsSidecar, SidecarBindError
from metrics_sidecar.wandb_layout import WandbSettingsError

logger = logging.getLogger("metrics_sidecar")

PROG = "dflash-metrics"
EXIT_BIND_FAILED = 2
EPILOG = """\
exit status: 0 stopped cleanly (SIGTERM/SIGINT), 2 bad config or the address
cannot be bound."""


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=cli.help_text(__doc__), epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_config_args(p, config_help="TOML job config; [run], [metrics] and [security] are used",
                        set_example="metrics.window_s=5")
    # Direct flags win over the config and --set (handy for ad-hoc runs and tests).
    p.add_argument("--address", help="ZeroMQ address to bind (PULL); same as --set metrics.address=...")
    p.add_argument("--run-dir", type=Path, help="run directory to write to; same as setting run.root_dir and "
                   "run.name (default: run.root_dir/run.name)")
    p.add_argument("--run-name", default=None, help="job name in W&B: prefix of its run names and default group "
                   "(default: the run directory's name)")
    p.add_argument("--window-s", type=float, help="seconds per aggregation window; same as --set metrics.window_s=...")
    p.add_argument("--max-records-per-window", type=int, default=10000,
                   help="a window ends early once it holds this many records (default 10000)")
    p.add_argument("--wandb-mode", choices=("offline", "online", "disabled"), help="same as --set metrics.wandb_mode=...")
    p.add_argument("--wandb-project", default=None, help="same as --set metrics.wandb_project=...")
    p.add_argument("--wandb-entity", default=None, help="same as --set metrics.wandb_entity=...")
    return p.parse_args(argv)


def _flag_overrides(args: argparse.Namespace) -> list[str]:
    """The direct flags as ``--set`` strings, so --print-config and validation see them."""
    flags = []
    for flag, key in (("address", "metrics.address"), ("window_s", "metrics.window_s"),
                      ("wandb_mode", "metrics.wandb_mode"), ("wandb_project", "metrics.wandb_project"),
                      ("wandb_entity", "metrics.wandb_entity")):
        value = getattr(args, flag)
        if value is not None:
            flags.append(cli.override(key, value))
    if args.run_dir is not None:
        run_dir = args.run_dir if args.run_dir.name not in ("", ".", "..") else args.run_dir.resolve()
        flags += [cli.override("run.root_dir", str(run_dir.parent)), cli.override("run.name", run_dir.name)]
    return flags


def _wandb_config(cfg: Config, path: str | None) -> dict:
    """The job's shared sections (all but [drafter]), recorded in every W&B run of the job."""
    shared = {f.name: dataclasses.asdict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name != "drafter"}
    return {"config_file": path or "", **shared}


def _drafter_section(path: str | None, overrides: list[str], drafter_id: str) -> dict:
    """One drafter's resolved [drafter] section ([drafter] + [drafters.<id>] + --set), for its W&B run.

    Resolved from this sidecar's config file and overrides, as `dflash-drafter --id ID`
    with the same ones would; a drafter started with --set flags of its own differs.
    """
    try:
        cfg = load_config(path, [*overrides, cli.override("drafter.id", drafter_id)])
    except (ConfigError, OSError) as exc:
        logger.warning("[wandb] the [drafter] section of %s cannot be resolved: %s", drafter_id, exc)
        return {"id": drafter_id}
    return dataclasses.asdict(cfg.drafter)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    overrides = [*cli.config_overrides(args), *_flag_overrides(args)]
    cfg = cli.load_job_config(PROG, args.config, overrides)
    if cfg is None:
        return EXIT_BIND_FAILED
    if args.print_config:
        return cli.print_config(cfg, PROG, args.config, overrides)
    run_dir = cfg.run.path
    setup_logging("metrics", run_dir / "logs")
    # Own W&B service, never one inherited from the launcher: that one can still
    # hold a killed sidecar's stream of this run id, and init would then fail
    # with "run ID ... is in use", leaving the restarted sidecar without W&B.
    os.environ.pop("WANDB_SERVICE", None)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()  # only sets a flag; run() notices, drains and returns

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        sidecar = MetricsSidecar(
            cfg.metrics.address,
            run_dir,
            args.run_name or Path(run_dir).resolve().name,
            window_s=cfg.metrics.window_s,
            max_records_per_window=args.max_records_per_window,
            # Empty W&B settings fall back to WANDB_MODE, WANDB_PROJECT, ... (wandb_layout.py).
            wandb_mode=cfg.metrics.wandb_mode,
            wandb_project=cfg.metrics.wandb_project,
            wandb_entity=cfg.metrics.wandb_entity,
            wandb_group=cfg.metrics.wandb_group,
            wandb_dir=cfg.metrics.wandb_dir,
            wandb_config=_wandb_config(cfg, args.config),
            drafter_config=functools.partial(_drafter_section, args.config, overrides),
            max_drafter_runs=cfg.metrics.wandb_max_drafter_runs,
            stop_event=stop,
            sockets=SocketFactory(zmq.Context.instance(), cfg.security.curve_dir),
        )
    except (SidecarBindError, WandbSettingsError) as exc:
        logger.error("%s", exc)
        return EXIT_BIND_FAILED
    try:
        sidecar.run()
    except BaseException:
        sidecar.close()
        raise
    else:
        sidecar.close()
    logger.info("[shutdown] metrics sidecar exited cleanly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
