"""``dflash-drafter --config FILE --id d1 [--set KEY=VALUE ...]`` (also ``python -m drafter_worker``)."""

from __future__ import annotations

import argparse
import logging
import os
import threading
import sys

from common import cli
from common.logging_setup import setup_logging
from common.shutdown import install_stop_handlers, mark_exited

logger = logging.getLogger("drafter_worker")

PROG = "dflash-drafter"
DESCRIPTION = """\
Train one DFlash drafter on the hidden states a live target (dflash-target) streams.

Registers with the target at control.address (waiting for it if it is not up
yet), receives batches over the data plane, trains, checkpoints into
run.root_dir/run.name/checkpoints/<id>/ and pushes metrics to the sidecar
(dflash-metrics). Restarted with the same command it resumes from its last
checkpoint. Settings come from [drafter], then [drafters.<id>], then --set.
"""
EPILOG = """\
exit status: 0 done or stopped (SIGTERM/SIGINT: checkpoint first), 2 bad config
or refused by the target, 3 training stopped (ten non-finite steps in a row, or
three failed checkpoint writes in a row)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_config_args(parser, set_example="drafter.learning_rate=3e-4")
    parser.add_argument("--id", help="drafter id (same as --set drafter.id=ID); picks up [drafters.ID] from the config")
    args = parser.parse_args(argv)
    overrides = cli.config_overrides(args, flags=[cli.override("drafter.id", args.id)] if args.id else [])
    cfg = cli.load_job_config(PROG, args.config, overrides)
    if cfg is None:
        return 2
    if args.print_config:
        return cli.print_config(cfg, PROG, args.config, overrides, 
                                note=f"[drafter] is drafter {cfg.drafter.id}'s: [drafter] with [drafters.{cfg.drafter.id}] "
                                     "and the overrides applied")
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
