"""Generate the Python gRPC stubs for every .proto under this directory.

    python -m gpuvirt.k8s.proto.generate          # rewrite the committed stubs

Needs grpcio-tools (the `test` extra pins the version the committed stubs came from).
Paths are given relative to src/, so the stubs import each other as
``gpuvirt.k8s.proto...`` and each file has a unique name in the descriptor pool.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[2]  # .../src


def protos() -> list[Path]:
    return sorted(HERE.rglob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Write the stubs under `out` (as `out/gpuvirt/k8s/proto/...`); return their paths."""
    from grpc_tools import protoc

    names = [str(p.relative_to(SRC)) for p in protos()]
    args = ["protoc", f"-I{SRC}", f"--python_out={out}", f"--grpc_python_out={out}", *names]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(out.rglob("*_pb2*.py"))


if __name__ == "__main__":
    for path in generate(SRC):
        print(path.relative_to(SRC))
    sys.exit(0)
