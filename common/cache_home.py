"""Where the project's caches live on this machine (the tokenized data, the converted models)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir_from_env(env_var: str, name: str) -> Path | None:
    """``$<env_var>`` (``off``: no cache), else ``$XDG_CACHE_HOME/dflash/<name>`` (``~/.cache/dflash/<name>``)."""
    value = os.environ.get(env_var, "")
    if value.strip().lower() == "off":
        return None
    if value:
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dflash" / name
