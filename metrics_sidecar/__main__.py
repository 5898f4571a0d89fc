"""Entry point: `python -m metrics_sidecar --address ... --run-dir runs/r1`.

Flags for now; the shared config (common/config.py) replaces them later.
Exit codes: 0 clean stop (SIGTERM/SIGINT), 2 cannot bind the address.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import zmq

from common.config import ConfigError, load_config
from common.logging_setup import setup_logging
from common.sockets import SocketFactory
from metrics_sidecar.sidecar import MetricsSidecar, SidecarBindError

logger = logging.getLogger("metrics_sidecar")

EXIT_BIND_FAILED = 2


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dflash-metrics", description=__doc__)
    p.add_argument("--config", help="TOML job config (the [run] and [metrics] sections are used)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set metrics.window_s=5")
    # Direct flags win over the config (handy for ad-hoc runs and tests).
    p.add_argument("--address", help="ZeroMQ address to bind (PULL); default metrics.address")
    p.add_argument("--run-dir", type=Path, help="runs/<name>/ directory; default run.root_dir/run.name")
    p.add_argument("--run-name", default=None, help="W&B run name (default: the run directory's name)")
    p.add_argument("--window-s", type=float, help="seconds per aggregation window; default metrics.window_s")
    p.add_argument("--max-records-per-window", type=int, default=10000)
    p.add_argument("--wandb-mode", choices=("offline", "online", "disabled"), help="default metrics.wandb_mode")
    p.add_argument("--wandb-project", default=None)
    p.add_argument("--wandb-entity", default=None)
    return p.parse_args(argv)


def _wandb_config(cfg, path: str | None) -> dict:
    """The resolved job config, so the W&B run records what was trained."""
    import dataclasses

    return {"config_file": path or "", **dataclasses.asdict(cfg)}


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"dflash-metrics: config error: {exc}", file=sys.stderr)
        return EXIT_BIND_FAILED
    run_dir = args.run_dir or cfg.run.path
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
            args.address or cfg.metrics.address,
            run_dir,
            args.run_name or Path(run_dir).resolve().name,
            window_s=args.window_s or cfg.metrics.window_s,
            max_records_per_window=args.max_records_per_window,
            wandb_mode=args.wandb_mode or cfg.metrics.wandb_mode,
            wandb_project=args.wandb_project or cfg.metrics.wandb_project,
            wandb_entity=args.wandb_entity or cfg.metrics.wandb_entity or None,
            wandb_config=_wandb_config(cfg, args.config),
            stop_event=stop,
            sockets=SocketFactory(zmq.Context.instance(), cfg.security.curve_dir),
        )
    except SidecarBindError as exc:
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
