"""How much memory the feature cache may still take before the machine runs short.

On CPU the cache lives in host RAM, shared with the drafters on the same node,
so the bound is the smallest of the kernel's ``MemAvailable`` and, for every
cgroup above this process that sets a memory limit (a container, a systemd
unit with ``MemoryMax=``), that limit minus what the cgroup uses. A cgroup's
usage counts the page cache, whose inactive part the kernel reclaims before
it kills anything, so that part is left out (as ``docker stats`` does). On CUDA
it is the device's free memory plus what torch's allocator holds unused.
"""

from __future__ import annotations

from pathlib import Path

import torch

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a huge page-aligned number


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _inactive_file(stat: Path) -> int:
    # cgroup v1's usage counts the children too, as its total_inactive_file does; v2 has only inactive_file.
    found: dict[str, int] = {}
    try:
        for line in stat.read_text().splitlines():
            key, _, value = line.partition(" ")
            if key in ("inactive_file", "total_inactive_file") and value.strip().isdigit():
                found[key] = int(value)
    except OSError:
        pass
    return found.get("total_inactive_file", found.get("inactive_file", 0))


def _meminfo_available(proc: Path) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headrooms(proc: Path, root: Path) -> list[int]:
    """Limit minus usage of every memory-limited cgroup from this process's own up to the root."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    out: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # cgroup v2 (unified): mounted at the root, or at root/unified on a hybrid host
            mount = root if (root / "cgroup.controllers").exists() else root / "unified"
            files = ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):  # cgroup v1
            mount = root / "memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        group = mount / rel.lstrip("/")
        while True:
            limit, usage = _read_int(group / files[0]), _read_int(group / files[1])
            if limit is not None and usage is not None and limit < _NO_LIMIT:
                out.append(limit - max(0, usage - _inactive_file(group / "memory.stat")))
            if group == mount or mount not in group.parents:
                break
            group = group.parent
    return out


def host_available_bytes(proc: Path = PROC, cgroup_root: Path = CGROUP_ROOT) -> int | None:
    """Bytes of host RAM this process may still take; None where Linux does not say."""
    known = [b for b in [_meminfo_available(proc), *_cgroup_headrooms(proc, cgroup_root)] if b is not None]
    return max(0, min(known)) if known else None


def available_bytes(device: torch.device) -> int | None:
    """Bytes the feature cache may still take on ``device``; None where that is unknown."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type == "cpu":
        return host_available_bytes()
    return None
