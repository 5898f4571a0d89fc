"""``dflash-target --config FILE [--set KEY=VALUE ...]`` (also ``python -m target_server``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from common import cli
from common.durable_io import replace_durably
from common.logging_setup import setup_logging
from common.shutdown import install_stop_handlers, mark_exited

logger = logging.getLogger("target_server")

PROG = "dflash-target"
DESCRIPTION = """\
Serve a target model's hidden states to DFlash drafter workers.

Loads target.model, tokenizes data.source with the chat template, captures the
DFlash layers batch by batch and sends each batch to the registered drafters
(dflash-drafter) over the data plane; serves the control socket
(control.address) that drafters and dflash-status talk to. Writes the resolved
config, logs and the run key under run.root_dir/run.name/.
"""
EPILOG = """\
exit status: 0 stopped cleanly (SIGTERM/SIGINT), 2 bad config, model, data or
start-up (the message says which)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_config_args(parser)
    parser.add_argument("--replica", type=int, help="which target replica this process is (same as --set target.replica=R)")
    args = parser.parse_args(argv)
    flags = [cli.override("target.replica", args.replica)] if args.replica is not None else []
    overrides = cli.config_overrides(args, flags=flags)
    cfg = cli.load_job_config(PROG, args.config, overrides)
    if cfg is None:
        return 2
    cfg = cfg.for_replica(cfg.target.replica)  # its own address, store port and device
    if args.print_config:
        return cli.print_config(cfg, PROG, args.config, overrides)
    run_dir = cfg.run.path
    name = "target" if cfg.target.replicas == 1 else f"target-{cfg.target.replica}"
    setup_logging(name, run_dir / "logs")
    run_dir.mkdir(parents=True, exist_ok=True)
    # config.toml (the job's, read by dflash-eval and dflash-export) from replica 0; each other replica's own.
    replace_durably(run_dir / ("config.toml" if cfg.target.replica == 0 else f"config-{name}.toml"),
                    cfg.to_toml().encode())

    # Imported after logging is set up: torch/transformers take a few seconds.
    from target_server.data import DataError
    from common.model_loader import ModelLoadError
    from target_server.server import StartupError, TargetServer

    server = TargetServer(cfg)
    # Handlers only set a flag; the control loop notices within one poll.
    install_stop_handlers(server.stop_event, cfg.target.stop_timeout_s, "target")
    try:
        server.start()
        server.serve()
    except (StartupError, ModelLoadError, DataError, ValueError) as exc:
        logger.error("[fatal] %s", exc)
        server.close()
        return 2
    except BaseException:
        logger.exception("[fatal] target server crashed")
        server.close()
        raise
    else:
        server.close()
    mark_exited()
    logger.info("[shutdown] target server stopped cleanly")
    if server.threads_left:
        # A thread still inside a bounded C++ wait would abort the interpreter's
        # shutdown; everything durable is done, so leave without it.
        logger.info("[shutdown] not waiting for %s", ", ".join(server.threads_left))
        logging.shutdown()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
