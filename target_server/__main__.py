"""``python -m target_server --config FILE [--set key=value ...]`` (console script ``dflash-target``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from common.config import ConfigError, load_config
from common.logging_setup import setup_logging
from common.shutdown import install_stop_handlers, mark_exited

logger = logging.getLogger("target_server")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflash-target", description="Serve target hidden states to DFlash drafters.")
    parser.add_argument("--config", help="TOML job config (default: built-in defaults)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, e.g. --set data.max_samples=100")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"dflash-target: config error: {exc}", file=sys.stderr)
        return 2
    run_dir = cfg.run.path
    setup_logging("target", run_dir / "logs")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(cfg.to_toml())

    # Imported after logging is set up: torch/transformers take a few seconds.
    from target_server.data import DataError
    from target_server.model_loader import ModelLoadError
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
