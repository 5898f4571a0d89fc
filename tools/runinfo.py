"""What the shell launchers need to know about a job config, as shell assignments.

    info=$(python -m tools.runinfo --config FILE [--set KEY=VALUE ...]) || exit 2
    eval "$info"

sets ``RUN_NAME``, ``RUN_DIR`` (absolute), ``CONTROL_ADDRESS``, ``DRAFTER_IDS``
(space-separated, from the ``[drafters.<id>]`` tables, else ``drafter.id``),
``TARGET_STOP_TIMEOUT_S`` and ``DRAFTER_STOP_TIMEOUT_S`` (the largest over the
drafters, each with its own table applied). A bad config prints one line to
stderr and exits 2, with nothing on stdout.
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
import sys
from pathlib import Path

from common.config import ConfigError, drafter_ids_in, load_config

_ID = re.compile(r"[A-Za-z0-9_-]+")  # no ".": tmux reads it as a pane separator


def describe(config: str, overrides: list[str]) -> dict[str, str]:
    cfg = load_config(config, overrides)
    ids = drafter_ids_in(config) or [cfg.drafter.id]
    for drafter_id in ids:
        if not _ID.fullmatch(drafter_id):
            raise ConfigError(f"[drafters.{drafter_id}]: a drafter id used by the launchers must match {_ID.pattern}")
    drafter_stop = max(
        load_config(config, [f'drafter.id="{d}"', *overrides]).drafter.stop_timeout_s for d in ids
    )
    return {
        "RUN_NAME": cfg.run.name,
        "RUN_DIR": str(Path(cfg.run.path).resolve()),
        "CONTROL_ADDRESS": cfg.control.address,
        "DRAFTER_IDS": " ".join(ids),
        "TARGET_STOP_TIMEOUT_S": str(math.ceil(cfg.target.stop_timeout_s)),
        "DRAFTER_STOP_TIMEOUT_S": str(math.ceil(drafter_stop)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.runinfo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    try:
        info = describe(args.config, args.overrides)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    for key, value in info.items():
        print(f"{key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
