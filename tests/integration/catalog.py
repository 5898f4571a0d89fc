"""The metric catalog in docs/metrics.md: its tables, and expanded to concrete series names."""

from __future__ import annotations

import re

from common.metric_names import Drafter
from tests.conftest import ROOT

# Section title (the start of its "## " heading) -> the prefix of its series in metrics.jsonl.
SECTIONS = {
    "Per drafter": "drafter/{id}/",
    "Target": "target/",
    "Pipeline": "pipeline/",
    "The sidecar": "sidecar/",
    "Evaluation": "drafter/{id}/",
}
CUDA_ONLY = set(Drafter.CUDA_ONLY)


def catalog_tables() -> dict[str, list[str]]:
    """Section title -> the series its table lists, as written there (`acc/pos_<k>`, prefix not included)."""
    tables: dict[str, list[str]] = {}
    section = None
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        if line.startswith("## "):
            section = next((title for title in SECTIONS if line[3:].startswith(title)), None)
            continue
        if section is None or not line.startswith("| `"):
            continue
        tables.setdefault(section, []).extend(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return tables


def catalog_series(drafters: list[str], block_size: int, num_buckets: int) -> set[str]:
    """Every series a job without evaluation and without CUDA logs, with `<k>` and `<i>` expanded."""
    names: set[str] = set()
    for section, keys in catalog_tables().items():
        if section == "Evaluation":
            continue
        prefix = SECTIONS[section]
        for key in keys:
            if key in CUDA_ONLY:
                continue
            expanded = [key]
            if "<k>" in key:
                expanded = [key.replace("<k>", str(k)) for k in range(1, block_size)]
            if "<i>" in key:
                expanded = [key.replace("<i>", str(i)) for i in range(num_buckets)]
            for p in ([prefix.format(id=d) for d in drafters] if "{id}" in prefix else [prefix]):
                names.update(p + k for k in expanded)
    return names
