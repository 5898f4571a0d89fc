"""``dflash-drafter --config FILE --id d1 [--set KEY=VALUE ...]`` (also ``python -m drafter_worker``).

Under torchrun every process is one rank of the drafter:
``torchrun --nproc-per-node W --max-restarts K -m drafter_worker --config FILE --group g0``.
"""

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
Train one DFlash drafter on the hidden states live targets (dflash-target) stream.

Registers with every target replica (control.address, or control.replica_addresses;
waiting for those not up yet), receives batches over the data plane, trains,
checkpoints into run.root_dir/run.name/checkpoints/<id>/ and pushes metrics to
the sidecar (dflash-metrics). Restarted with the same command it resumes from
its last checkpoint. Settings come from [drafter], then [drafters.<id>], then --set.

Under torchrun (--nproc-per-node W) the W processes are the ranks of one drafter:
each receives its own batches, DDP averages the gradients, rank 0 writes the
checkpoint; a restart (torchrun --max-restarts) resumes all ranks from it.
"""
EPILOG = """\
exit status: 0 done or stopped (SIGTERM/SIGINT: checkpoint first), 2 bad config
or refused by the target, 3 training stopped (ten non-finite steps in a row, or
three failed checkpoint writes in a row)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_config_args(parser, set_example="drafter.learning_rate=3e-4")
    parser.add_argument("--id", "--group", dest="id",
                        help="drafter id (same as --set drafter.id=ID); picks up [drafters.ID] from the config. "
                             "Under torchrun every rank trains this one drafter (the group)")
    args = parser.parse_args(argv)
    overrides = cli.config_overrides(args, flags=[cli.override("drafter.id", args.id)] if args.id else [])
    cfg = cli.load_job_config(PROG, args.config, overrides)
    if cfg is None:
        return 2
    from drafter_worker.rank_group import RunIdentity

    identity = RunIdentity.from_env()
    try:
        cfg = cfg.for_local_rank(identity.local_rank)  # its device
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        return cli.print_config(cfg, PROG, args.config, overrides, 
                                note=f"[drafter] is drafter {cfg.drafter.id}'s: [drafter] with [drafters.{cfg.drafter.id}] "
                                     "and the overrides applied")
    name = f"drafter-{cfg.drafter.id}" if identity.world_size == 1 else f"drafter-{cfg.drafter.id}.{identity.rank}"
    setup_logging(name, cfg.run.path / "logs")

    from drafter_worker.worker import DrafterWorker, FatalError, TrainingStopped

    worker = DrafterWorker(cfg, identity)
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
        _exit_now_if_threads_left(worker, 1)
        raise
    worker.close()
    mark_exited()
    logger.info("[shutdown] drafter %s finished (%s) at step %d", cfg.drafter.id, outcome,
                worker.trainer.step if worker.trainer else 0)
    _exit_now_if_threads_left(worker, 0)
    return 0


def _exit_now_if_threads_left(worker, code: int) -> None:
    """A receive still inside a bounded C++ wait would abort interpreter shutdown; what had
    to be written is written (or logged, after a crash), so leave without it."""
    if [t for t in worker.threads_left if any(a.name == t and a.is_alive() for a in threading.enumerate())]:
        logging.shutdown()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
