"""What refused one-message calls cost a shard, case by case (tests/refused_memory.py): a
real TLS + tokens `tierps serve` subprocess per case, 8 threads each sending a 250 MiB
PushGradientsUnary the shard must refuse, and the shard's peak RSS over its RSS before.

    python -m tests.bench.bench_refused_memory

It measures the server code of the working tree; to compare with another commit's server,
check out its server/ (e.g. `git checkout main -- server`), run it again, and restore.
Prints a table. Not part of the test run (the test in tests/integration/test_limits.py
asserts the bound).
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from tests.certs import make_certs
from tests.refused_memory import CALL_MIB, CALLS, CASES, measure, push_request, table


def main() -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "server"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(
        f"server code: {commit}{' with server/ changed' if dirty else ''}; "
        f"{CALLS} calls of {CALL_MIB} MiB each"
    )
    request = push_request(CALL_MIB << 20)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        certs = make_certs(Path(tmp) / "certs")
        for index, case in enumerate(CASES):
            directory = Path(tmp) / f"case{index}"
            directory.mkdir()
            results.append(measure(case, directory, certs, request))
            print(table(results[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(results))


if __name__ == "__main__":
    main()
