"""Command-line options every entry point that reads a job config shares.

    parser = argparse.ArgumentParser(prog="dflash-target", ...)
    add_config_args(parser)                     # --config, --set, --print-config
    args = parser.parse_args(argv)
    cfg = load_job_config("dflash-target", args.config, config_overrides(args))
    if cfg is None:
        return 2                                # the error is already printed
    if args.print_config:
        return print_config(cfg, "dflash-target", args.config, config_overrides(args))

Resolution order, last wins: built-in defaults, the TOML file (``--config``,
else ``$DFLASH_CONFIG``), ``$DFLASH_RUN_NAME`` as ``run.name``, the entry
point's own flags (``--id``), then ``--set`` in the order given. The
environment variables are the ones ``deploy/run_process.sh`` and the systemd
environment file use, so a shell that sourced that file runs the same job.

``--print-config`` writes the resolved configuration as TOML, each key under
its one-line doc (the ``_doc`` text of ``common/config.py``), and the output
is itself a config file: ``load_config`` of it gives the same values.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, Sequence

from common.config import Config, ConfigError, _toml_value, drafter_ids_in, load_config

ENV_CONFIG = "DFLASH_CONFIG"
ENV_RUN_NAME = "DFLASH_RUN_NAME"

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def add_config_args(
    parser: argparse.ArgumentParser,
    *,
    config_help: str = "TOML job config",
    set_example: str = "data.max_samples=100",
    env: bool = True,
    config: bool = True,
) -> None:
    """Add ``--config`` (unless ``config=False``: the config comes from elsewhere, e.g. a run
    directory), ``--set`` and ``--print-config``. With ``env``, ``--config`` defaults to
    ``$DFLASH_CONFIG`` (read when the parser is built)."""
    if config:
        default = (os.environ.get(ENV_CONFIG) or None) if env else None
        where = f"default: ${ENV_CONFIG}, else built-in defaults" if env else "default: built-in defaults"
        parser.add_argument("--config", default=default, metavar="FILE", help=f"{config_help} ({where})")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override one config key (repeatable), e.g. --set {set_example}")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved configuration as TOML, each key under its doc, and exit")


def env_overrides(environ: dict[str, str] | None = None) -> list[str]:
    """``--set`` equivalents of the environment: ``$DFLASH_RUN_NAME`` -> ``run.name``."""
    environ = os.environ if environ is None else environ
    name = environ.get(ENV_RUN_NAME, "")
    return [f"run.name={toml_value(name)}"] if name else []


def config_overrides(args: argparse.Namespace, *, env: bool = True, flags: Sequence[str] = ()) -> list[str]:
    """The overrides in the order they apply: environment, the entry point's own ``flags``, ``--set``."""
    return [*(env_overrides() if env else []), *flags, *args.overrides]


def override(key: str, value: Any) -> str:
    """A ``--set`` string for ``key`` whose value is written as TOML (a flag that names a key)."""
    return f"{key}={toml_value(value)}"


def load_job_config(prog: str, path: str | Path | None, overrides: Sequence[str]) -> Config | None:
    """The validated config, or None after printing ``PROG: config error: ...`` to stderr."""
    try:
        return load_config(path, list(overrides))
    except ConfigError as exc:
        print(f"{prog}: config error: {exc}", file=sys.stderr)
    except OSError as exc:  # e.g. a config path that is a directory
        print(f"{prog}: config error: cannot read {path}: {exc}", file=sys.stderr)
    return None


def print_config(cfg: Config, prog: str, path: str | Path | None, overrides: Sequence[str],
                 note: str = "") -> int:
    """Write :func:`config_toml` to stdout; returns exit status 0."""
    sys.stdout.write(config_toml(cfg, header=_header(cfg, prog, path, overrides, note)))
    sys.stdout.flush()
    return 0


def config_toml(cfg: Config, header: str = "") -> str:
    """``cfg`` as TOML, every key under its doc as a comment, its default after it where it differs."""
    lines = [comment for line in header.splitlines() for comment in _comment(line)]
    if lines:
        lines.append("")
    for section in dataclasses.fields(cfg):
        values = getattr(cfg, section.name)
        lines.append(f"[{section.name}]")
        for f in dataclasses.fields(values):
            lines += _comment(f.metadata.get("doc", ""))
            value = getattr(values, f.name)
            default = _declared_default(f)
            line = f"{_key(f.name)} = {toml_value(value)}"
            if default is not dataclasses.MISSING and value != default:
                line += f"  # default: {toml_value(default)}"
            lines.append(line)
        lines.append("")
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    """A TOML value; tables (dict config values) as inline tables."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return _toml_value(value)


def help_text(doc: str | None) -> str:
    """A module docstring as ``--help`` text: reST ``literals`` lose their double backquotes."""
    return (doc or "").replace("``", "")


def _declared_default(f: dataclasses.Field) -> Any:
    """The field's default as declared (before ``__post_init__`` fills in derived values)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _key(name: str) -> str:
    return name if _BARE_KEY.fullmatch(name) else _toml_value(name)


def _comment(doc: str, width: int = 88) -> list[str]:
    return [f"# {line}" for line in textwrap.wrap(doc, width - 2, break_on_hyphens=False, break_long_words=False)] if doc else []


def _header(cfg: Config, prog: str, path: str | Path | None, overrides: Sequence[str], note: str) -> str:
    source = f"{path}" if path else "built-in defaults (no --config)"
    lines = [f"Resolved configuration of {prog}: {source}"]
    if overrides:
        lines.append("overrides, in order: " + " ".join(overrides))
    if path and not note:
        try:
            ids = drafter_ids_in(path)
        except (OSError, ValueError):
            ids = []
        if ids:
            note = (f"The file's [drafters.<id>] tables ({', '.join(ids)}) apply to one drafter each "
                    f"(below: drafter {cfg.drafter.id}'s); `dflash-drafter --id ID --print-config` "
                    "shows another's.")
    if note:
        lines.append(note)
    lines.append("Each key is under its doc; a value that is not the built-in default says which that is.")
    return "\n".join(lines)
