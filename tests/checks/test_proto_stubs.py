"""The committed gRPC stubs are exactly what the .proto files generate (proto/codegen.py, beside the package)."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "proto" / "codegen.py"
_spec = importlib.util.spec_from_file_location("codegen", SCRIPT)
codegen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(codegen)


def test_regenerating_the_stubs_changes_nothing(tmp_path: Path) -> None:
    codegen.generate(tmp_path)
    generated = sorted((tmp_path / "conveyor" / "v1").glob("*_pb2*.py*"))
    assert generated, "protoc wrote nothing"
    for fresh in generated:
        committed = codegen.HERE / fresh.name
        assert committed.exists(), f"{fresh.name} is generated but not committed: run `make proto`"
        assert committed.read_text() == fresh.read_text(), f"{fresh.name} is stale: run `make proto`"
    committed_stubs = sorted(p.name for p in codegen.HERE.glob("*_pb2*.py*"))
    assert committed_stubs == [p.name for p in generated], "a committed stub has no .proto any more"
