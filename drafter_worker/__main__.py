"""``python -m drafter_worker --config FILE --id d1 [--set key=value ...]`` (console script ``dflash-drafter``)."""

from __future__ import annotations

import argparse
import logging
import os
import threading
import sys

from common.config import ConfigError, load_config
from common.logging_setup import setup_logging
from common.shutdown import install_stop_handlers, mark_exited

logger = logging.getLogger("drafter_worker")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-drafter", description="Train a DFlash drafter on a live target.")
    parser.add_argument("--config", help="TOML job config (default: built-in defaults)")
    parser.add_argument("--id", help="drafter id (same as --set drafter.id=ID); picks up [drafters.ID] from the config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, e.g. --set drafter.learning_rate=3e-4")
    args = parser.parse_args(argv)
    overrides = list(args.overrides)
    if args.id:
        overrides.insert(0, f"drafter.id={args.id!r}".replace("'", '"'))
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as exc:
        print(f"dflash-drafter: config error: {exc}", file=sys.stderr)
        return 2
    setup_logging(f"drafter-{cfg.drafter.id}", cfg.run.path / "logs")

    from drafter_worker.worker import DrafterWorker, FatalError, TrainingStopped

    worker = DrafterWorker(cfg)
    install_stop_handlers(worker.stop_event, cfg.drafter.stop_timeout_s, f"drafter {cfg.drafter.id}")
    try:
        outcome = worker.run()
    except FatalError as exc:
        logger.error("[fatal] %s", exc)
        worker.close()
        return 2
    except TrainingStopped as exc:
        logger.error("[fatal] %s", exc)
        worker.close()
        return 3
    except BaseException:
        logger.exception("[fatal] drafter %s crashed", cfg.drafter.id)
        worker.close()
        raise
    worker.close()
    mark_exited()
    logger.info("[shutdown] drafter %s finished (%s) at step %d", cfg.drafter.id, outcome,
                worker.trainer.step if worker.trainer else 0)
    if [t for t in worker.threads_left if any(a.name == t and a.is_alive() for a in threading.enumerate())]:
        # A receive still inside a bounded C++ wait would abort interpreter shutdown;
        # the checkpoint is written, so leave without it.
        logging.shutdown()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
