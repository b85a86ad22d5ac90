"""`make bench` records which implementation oneDNN ran per dtype and row count (benchmarks/onednn_report.py):
read from oneDNN's verbose log: this machine's, and a log written in oneDNN's format for an AMX Xeon (its ISA line and
implementation names as oneDNN spells them; not captured on one)."""

from __future__ import annotations

from benchmarks import onednn_report

AMX_LOG = """onednn_verbose,v1,info,oneDNN v3.12.0 (commit 80afa71049cd69a3df32adcccb623b12cd7baa22)
onednn_verbose,v1,info,cpu,isa:Intel AVX-512 with Intel DL Boost and bfloat16 support and Intel AMX
conveyor-onednn-report bfloat16 1
onednn_verbose,v1,primitive,exec,cpu,reorder,jit:uni,undef,src:bf16::blocked:ab::f0,,,256x512,0.1
onednn_verbose,v1,primitive,exec,cpu,inner_product,brg_matmul:avx512_core_bf16,forward_inference,src:bf16,,,mb1ic512oc256,0.02
conveyor-onednn-report bfloat16 32
onednn_verbose,v1,primitive,exec,cpu,inner_product,brg_matmul:avx512_core_amx,forward_inference,src:bf16,,,mb32ic512oc256,0.01
"""


def test_an_amx_xeons_report_names_the_tiles() -> None:
    found = onednn_report.parse(AMX_LOG)
    assert found["isa"].startswith("Intel AVX-512") and "AMX" in found["isa"]
    assert found["bfloat16"] == {"1": "brg_matmul:avx512_core_bf16", "32": "brg_matmul:avx512_core_amx"}
    assert "bfloat16 brg_matmul:avx512_core_amx at 32 rows" in onednn_report.summary(found)


def test_this_machine_reports_every_row_count_in_float32() -> None:
    found = onednn_report.report()
    assert found.get("isa") and set(found["float32"]) == {str(r) for r in onednn_report.ROWS}
    assert all(found["float32"].values())
