"""The metric catalog in docs/metrics.md, expanded to concrete series names."""

from __future__ import annotations

import re

from tests.conftest import ROOT

_SECTIONS = {"Per drafter": "drafter/{id}/", "Target": "target/", "Pipeline": "pipeline/", "The sidecar": "sidecar/"}
CUDA_ONLY = {"mem_allocated_gb", "mem_peak_gb"}


def catalog_series(drafters: list[str], block_size: int, num_buckets: int) -> set[str]:
    names: set[str] = set()
    prefix = None
    for line in (ROOT / "docs" / "metrics.md").read_text().splitlines():
        if line.startswith("## "):
            prefix = next((p for title, p in _SECTIONS.items() if line[3:].startswith(title)), None)
            continue
        if prefix is None or not line.startswith("| `"):
            continue
        for key in re.findall(r"`([^`]+)`", line.split("|")[1]):
            if key in CUDA_ONLY:
                continue
            keys = [key]
            if "<k>" in key:
                keys = [key.replace("<k>", str(k)) for k in range(1, block_size)]
            if "<i>" in key:
                keys = [key.replace("<i>", str(i)) for i in range(num_buckets)]
            for p in ([prefix.format(id=d) for d in drafters] if "{id}" in prefix else [prefix]):
                names.update(p + k for k in keys)
    return names
