"""CPU seconds of processes, read from Linux's /proc: the one reader the benchmarks share."""

from __future__ import annotations

import os
from pathlib import Path


def _stat_cpu_s(stat: Path) -> tuple[int, float] | None:
    """(parent pid, user + system CPU seconds of every thread) of a /proc/<pid>/stat; None
    where the process has exited meanwhile."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_s(pids: list[int | None]) -> float:
    """CPU seconds the processes (None: not running) have used so far."""
    total = 0.0
    for pid in pids:
        read = None if pid is None else _stat_cpu_s(Path(f"/proc/{pid}/stat"))
        total += 0.0 if read is None else read[1]
    return total


def children_cpu_s(parent: int) -> float:
    """CPU seconds the processes whose parent is `parent` have used so far (0 where there
    is no /proc)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        read = _stat_cpu_s(stat)
        if read is not None and read[0] == parent:
            total += read[1]
    return total
