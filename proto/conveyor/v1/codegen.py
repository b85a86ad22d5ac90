"""Regenerates the committed gRPC stubs from the .proto files beside this module.

The stubs are committed so that an install needs no code generation; `tests/checks/test_proto_stubs.py` runs this
into a temporary folder and diffs, so a .proto edit without regenerated stubs fails CI.
Run with `make proto` (or `python -m conveyor.v1.codegen`).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO_ROOT = HERE.parent.parent  # the folder that holds conveyor/v1/*.proto


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
