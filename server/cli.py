"""The `tierps` command."""

from __future__ import annotations

import argparse
from pathlib import Path

from tierps.server.storage_demo import run_storage_demo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tierps", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="stream a Zipf trace through a table 4x larger than its host budget "
        "(the storage demo, until the shard service and client land)",
    )
    demo.add_argument("--data-dir", type=Path, default=Path("tierps-data"))
    demo.add_argument("--dim", type=int, default=32)
    demo.add_argument("--host-mb", type=int, default=64, help="host tier budget, MiB")
    demo.add_argument("--steps", type=int, default=150, help="batches to stream")
    demo.add_argument("--batch", type=int, default=16384, help="keys per batch")
    demo.add_argument("--keep", action="store_true", help="continue from the last run's rows")
    args = parser.parse_args(argv)
    if args.command == "demo":
        run_storage_demo(
            args.data_dir,
            dim=args.dim,
            host_mb=args.host_mb,
            steps=args.steps,
            batch=args.batch,
            keep=args.keep,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
