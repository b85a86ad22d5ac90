"""Regenerates the committed gRPC stubs from the .proto files in conveyor/v1/ beside this script.

The stubs are committed so that an install needs no code generation, nor grpcio-tools: this script stays beside the
package, not in it. `tests/checks/test_proto_stubs.py` runs it into a temporary folder and diffs, so a .proto edit
without regenerated stubs fails CI. Run with `make proto` (or `python proto/codegen.py`).
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent  # the folder that holds conveyor/v1/*.proto
HERE = PROTO_ROOT / "conveyor" / "v1"  # the protos and their committed stubs


def proto_files() -> list[Path]:
    return sorted(HERE.glob("*.proto"))


def generate(out_root: Path) -> None:
    """Writes conveyor/v1/*_pb2.py, *_pb2.pyi and *_pb2_grpc.py under `out_root`."""
    from grpc_tools import protoc

    out_root.mkdir(parents=True, exist_ok=True)
    for proto in proto_files():
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            str(proto.relative_to(PROTO_ROOT)),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


def main() -> None:
    generate(PROTO_ROOT)
    print(f"regenerated stubs for {[p.name for p in proto_files()]}", file=sys.stderr)


if __name__ == "__main__":
    main()
