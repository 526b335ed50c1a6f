"""CPU seconds of processes, read from Linux's /proc: the one reader the benchmarks share."""

from __future__ import annotations

import os
from pathlib import Path


def _stat(stat: Path) -> tuple[str, int, float] | None:
    """(name, parent pid, user + system CPU seconds) of a /proc/<pid>/stat (every thread's)
    or /proc/<pid>/task/<tid>/stat (that thread's); None where it has exited meanwhile."""
    try:
        text = stat.read_text()
    except OSError:
        return None
    name = text[text.index("(") + 1 : text.rindex(")")]
    fields = text.rsplit(")", 1)[1].split()
    return name, int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stat_cpu_s(stat: Path) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of a /proc stat file; None where it has exited."""
    read = _stat(stat)
    return None if read is None else read[1:]


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


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds so far of a process's threads, summed by thread name (/proc's comm: the
    OS's name of each thread, which Python sets only where asked, see profile_shard_step)."""
    spent: dict[str, float] = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        read = _stat(stat)
        if read is not None:
            spent[read[0]] = spent.get(read[0], 0.0) + read[2]
    return spent
