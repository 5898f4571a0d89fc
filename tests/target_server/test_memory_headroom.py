"""What the feature cache may still take: the kernel's MemAvailable and every memory-limited cgroup above us."""

from __future__ import annotations

from pathlib import Path

import torch

from target_server.memory_headroom import available_bytes, host_available_bytes

GB = 1 << 30


def fake_host(tmp_path: Path, cgroup_lines: str, available_kb: int) -> tuple[Path, Path]:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       32000000 kB\nMemFree:  100 kB\nMemAvailable:   {available_kb} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup_lines)
    root = tmp_path / "cgroup"
    root.mkdir()
    return proc, root


def write_group(group: Path, files: dict[str, str]) -> None:
    group.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (group / name).write_text(text)


def test_cgroup_v2_limit_of_a_parent_unit_bounds_the_host_memory(tmp_path):
    proc, root = fake_host(tmp_path, "0::/system.slice/dflash-target.service\n", 20 * GB // 1024)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    # The service itself sets no limit; its slice allows 8 GB and uses 7 GB, 2 GB of it reclaimable page cache.
    write_group(root / "system.slice" / "dflash-target.service",
                {"memory.max": "max\n", "memory.current": str(3 * GB), "memory.stat": "anon 1\ninactive_file 0\n"})
    write_group(root / "system.slice", {"memory.max": str(8 * GB), "memory.current": str(7 * GB),
                                        "memory.stat": f"anon 5\ninactive_file {2 * GB}\n"})
    assert host_available_bytes(proc, root) == 8 * GB - 5 * GB
    # Without the limit, the kernel's MemAvailable is the bound.
    write_group(root / "system.slice", {"memory.max": "max\n"})
    assert host_available_bytes(proc, root) == 20 * GB


def test_cgroup_v1_memory_controller_and_a_full_group(tmp_path):
    proc, root = fake_host(tmp_path, "5:cpu,cpuacct:/x\n4:memory:/docker/abc\n0::/\n", 20 * GB // 1024)
    write_group(root / "memory" / "docker" / "abc",
                {"memory.limit_in_bytes": str(4 * GB), "memory.usage_in_bytes": str(4 * GB + 5),
                 "memory.stat": "inactive_file 7\ntotal_inactive_file 0\n"})
    write_group(root / "memory", {"memory.limit_in_bytes": "9223372036854771712", "memory.usage_in_bytes": str(GB)})
    assert host_available_bytes(proc, root) == 0  # over its limit: nothing more may be taken


def test_this_machine_reports_its_memory():
    total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                 if line.startswith("MemTotal:"))
    free = available_bytes(torch.device("cpu"))
    assert free is not None and 0 < free <= total
    assert host_available_bytes(tmp := Path("/nonexistent"), tmp) is None  # no /proc: unknown, not zero
