"""Regenerate the Python code of the wire contract: `python proto/generate.py`.

The .proto file is compiled as if it lived at tierps/proto/, so the generated gRPC module
imports its messages as `tierps.proto.tierps_service_pb2` (protoc writes absolute imports
from the include root). tests/unit/test_proto_generated.py fails when the committed code is
stale; grpcio-tools is pinned in pyproject.toml so the output is reproducible.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ("tierps_service.proto",)
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Compile every .proto of this folder into out_dir; returns the files written."""
    from grpc_tools import protoc  # a dev dependency: only needed to regenerate

    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "tierps" / "proto"
        package.mkdir(parents=True)
        for proto in PROTOS:
            shutil.copy(HERE / proto, package / proto)
            args = [
                "grpc_tools.protoc",
                f"--proto_path={tmp}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                f"tierps/proto/{proto}",
            ]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {proto}")
            stem = proto.removesuffix(".proto")
            for suffix in SUFFIXES:
                target = out_dir / (stem + suffix)
                shutil.copy(package / (stem + suffix), target)
                written.append(target)
    return written


if __name__ == "__main__":
    for path in generate(HERE):
        print(f"wrote {path.relative_to(HERE.parent)}", file=sys.stderr)
