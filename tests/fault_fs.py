"""A real full disk for fault tests: a small tmpfs mounted in the test's tmp dir (as root;
the tests using it skip with the reason where mounting is not permitted), and a filler file
that takes all but a chosen number of its bytes."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(where: Path, megabytes: int = 30) -> Iterator[Path]:
    """A tmpfs of `megabytes` MiB mounted at `where` (created), unmounted afterwards."""
    where.mkdir(parents=True, exist_ok=True)
    mount = shutil.which("mount")
    if mount is None or os.geteuid() != 0:
        pytest.skip("a real full disk needs `mount -t tmpfs` as root; not root here")
    done = subprocess.run(
        [mount, "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(fs: Path, leave_bytes: int) -> Path:
    """Write a filler file taking all of fs's free space but about leave_bytes."""
    filler = fs / "filler"
    free = shutil.disk_usage(fs).free
    with open(filler, "ab") as out:
        out.write(b"\0" * max(0, free - leave_bytes))
    return filler
