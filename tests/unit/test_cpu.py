"""Everything that depends on the CPU kind, on each kind the project lands on, faked: whatever CPU runs these
tests, each kind's branch is taken. A kind is its /proc/cpuinfo (abridged) and what torch's oneDNN check answers
there, the two things `conveyor.cpu` reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from benchmarks import compare, compare_report, deploy, onednn_report
from conveyor import cpu
from conveyor.shard.layers import gemm

BASE_FLAGS = "fpu tsc msr pae cx8 apic sep cmov clflush mmx fxsr sse sse2 ht syscall nx lm pni ssse3 fma cx16 sse4_1"
AVX2_FLAGS = BASE_FLAGS + " sse4_2 movbe popcnt aes xsave avx f16c rdrand bmi1 avx2 bmi2 adx sha_ni"
AVX512_FLAGS = AVX2_FLAGS + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni"


@dataclass(frozen=True)
class Kind:
    name: str  # the test id
    model: str
    flags: str
    onednn_bf16: bool  # torch.ops.mkldnn._is_mkldnn_bf16_supported() there
    vendor: str

    def cpuinfo(self) -> str:
        return "".join(
            f"processor\t: {n}\nvendor_id\t: {self.vendor}\nmodel name\t: {self.model}\nflags\t\t: {self.flags}\n\n"
            for n in range(2)
        )


INTEL, AMD = "GenuineIntel", "AuthenticAMD"
AMD_EPYC = Kind("amd-epyc-avx2", "AMD EPYC 7B12 64-Core Processor", AVX2_FLAGS, False, AMD)
AMD_ZEN4 = Kind("amd-epyc-zen4", "AMD EPYC 9R14 96-Core Processor", AVX512_FLAGS + " avx512_bf16", True, AMD)
XEON_BF16 = Kind(
    "xeon-avx512-bf16-vnni", "Intel(R) Xeon(R) Platinum 8380H CPU", AVX512_FLAGS + " avx512_bf16", True, INTEL
)
XEON_AMX = Kind(
    "xeon-amx",
    "Intel(R) Xeon(R) Platinum 8480+",
    AVX512_FLAGS + " avx512_bf16 avx_vnni avx512_fp16 amx_bf16 amx_tile amx_int8",
    True,
    INTEL,
)
KINDS = [AMD_EPYC, AMD_ZEN4, XEON_BF16, XEON_AMX]
XEON_AVX512_ONLY = Kind("xeon-avx512-no-bf16", "Intel(R) Xeon(R) Gold 6148 CPU", AVX512_FLAGS, True, INTEL)


def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: Kind) -> None:
    """This process sees `kind`; the switch is unset, as on a machine nobody configured."""
    (tmp_path / "cpuinfo").write_text(kind.cpuinfo())
    monkeypatch.setattr(cpu, "CPUINFO", tmp_path / "cpuinfo")
    monkeypatch.setattr(cpu, "torch_bf16", lambda: kind.onednn_bf16)
    monkeypatch.delenv(cpu.BF16_SWITCH, raising=False)
    monkeypatch.delenv(cpu.VARIANT_SWITCH, raising=False)
    monkeypatch.delenv("CONVEYOR_GEMM", raising=False)


# --- what the benchmark records (compare_report.machine) ---------------------------------------------------------


@pytest.mark.parametrize(
    "kind, avx512, avx512_bf16, vnni, amx",
    [
        pytest.param(AMD_EPYC, False, False, False, False, id=AMD_EPYC.name),
        pytest.param(AMD_ZEN4, True, True, True, False, id=AMD_ZEN4.name),
        pytest.param(XEON_BF16, True, True, True, False, id=XEON_BF16.name),
        pytest.param(XEON_AMX, True, True, True, True, id=XEON_AMX.name),
    ],
)
def test_machine_probe_records_each_cpu_kind(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: Kind, avx512: bool, avx512_bf16: bool, vnni: bool, amx: bool
) -> None:
    fake(monkeypatch, tmp_path, kind)
    m = compare_report.machine()
    assert (m["cpu"], m["cores"]) == (kind.model, cpu.usable_cores())
    assert (m["avx512"], m["avx512_bf16"], m["vnni"], m["amx"]) == (avx512, avx512_bf16, vnni, amx)
    assert m["native_bf16"] is kind.onednn_bf16
    assert m["kernels"] == ("avx512_bf16" if avx512_bf16 else "avx2")  # every AVX-512 kind here has bf16
    assert compare_report.machine_line(m) == (
        f"machine: {kind.model}, {cpu.usable_cores()} cores, AVX-512 {avx512}, avx512_bf16 {avx512_bf16}, "
        f"VNNI {vnni}, AMX {amx}, oneDNN bf16 {kind.onednn_bf16}, torch {torch.__version__}, "
        + onednn_report.summary(m["onednn"])  # the real machine's oneDNN, which the fake flags do not reach
    )


def test_the_switch_off_makes_a_xeon_look_like_an_epyc_to_everything(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The flags stay what the CPU has; what the code does with bf16 follows the switch."""
    fake(monkeypatch, tmp_path, XEON_AMX)
    monkeypatch.setenv(cpu.BF16_SWITCH, "0")
    m = compare_report.machine()
    assert m["amx"] and not m["native_bf16"]
    assert compare.parse_args([]).dtypes == ["float32"]
    assert gemm.kernel(torch.empty(4, 4, dtype=torch.bfloat16)) == "torch"


def test_no_cpuinfo_means_unknown_model_and_no_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cpu, "CPUINFO", tmp_path / "absent")
    monkeypatch.setattr(cpu, "torch_bf16", lambda: False)
    monkeypatch.delenv(cpu.BF16_SWITCH, raising=False)
    monkeypatch.delenv(cpu.VARIANT_SWITCH, raising=False)
    here = cpu.probe()
    assert (here.model, here.flags, here.avx512, here.amx, here.amd) == ("?", frozenset(), False, False, False)


# --- the switch --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_bf16_switch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: Kind) -> None:
    fake(monkeypatch, tmp_path, kind)
    assert cpu.onednn_bf16() is kind.onednn_bf16
    monkeypatch.setenv(cpu.BF16_SWITCH, "0")
    assert cpu.onednn_bf16() is False
    monkeypatch.setenv(cpu.BF16_SWITCH, "1")
    if kind.onednn_bf16:
        assert cpu.onednn_bf16() is True
    else:
        with pytest.raises(RuntimeError, match="no bf16 kernels"):
            cpu.onednn_bf16()
    monkeypatch.setenv(cpu.BF16_SWITCH, "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        cpu.onednn_bf16()


# --- compare.py's default run --------------------------------------------------------------------------------------


def _not_deployed(spec: deploy.ConveyorSpec, timeout: float) -> None:
    raise deploy.DeploymentFailed(f"{spec.name}: not started by this test")


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_compare_runs_bf16_systems_by_default_only_where_onednn_has_bf16(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: Kind
) -> None:
    """The systems and ceilings a default run plans, named as it names them; nothing is started (each Conveyor
    deployment fails at once, the peers and the bare forward are skipped)."""
    fake(monkeypatch, tmp_path, kind)
    monkeypatch.setattr(compare.deploy, "conveyor", _not_deployed)
    args = compare.parse_args(["--skip-vllm", "--skip-llamacpp", "--skip-transformers", "--skip-bare"])
    args.model_dir = tmp_path
    bf16 = kind.onednn_bf16
    assert args.dtypes == (["float32", "bfloat16"] if bf16 else ["float32"])
    at_batch_1: dict = {}  # the bare forward at batch 1, after each Conveyor continuous (skipped here)
    systems = [o.system for o in compare.run_systems(args, {"single": None}, {"--scheduling"}, at_batch_1)]
    assert systems == [
        "conveyor-continuous",
        "conveyor-static",
        "conveyor-sequential",
        "vllm-cpu",
        "vllm-cpu-default",
        "llama.cpp",
        "transformers-serve",
    ] + (["conveyor-continuous-bf16", "vllm-cpu-bf16", "llama.cpp-bf16", "transformers-serve-bf16"] if bf16 else [])
    assert list(at_batch_1) == ["bare forward, batch 1"] + (["bare forward, batch 1-bf16"] if bf16 else [])
    ceilings = list(compare.run_ceilings(args, None))
    assert ceilings == ["bare forward", "bare forward, F.linear (MKL)"] + (["bare forward-bf16"] if bf16 else [])
    # Asked for, bfloat16 runs on any CPU (slowly where oneDNN has no bf16 kernels).
    assert compare.parse_args(["--dtypes", "float32,bfloat16"]).dtypes == ["float32", "bfloat16"]


# --- the GEMM each linear layer gets -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_gemm_choice_on_each_cpu_kind(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: Kind) -> None:
    """`auto` packs float32 for oneDNN on every kind, bfloat16 only where oneDNN has bf16 kernels; float16 and
    CONVEYOR_GEMM=torch keep F.linear; CONVEYOR_GEMM=onednn refuses what cannot be packed rather than run slowly."""
    fake(monkeypatch, tmp_path, kind)
    f32, bf16, f16 = (torch.empty(8, 4, dtype=d) for d in (torch.float32, torch.bfloat16, torch.float16))
    assert gemm.kernel(f32) == "onednn"
    assert gemm.kernel(bf16) == ("onednn" if kind.onednn_bf16 else "torch")
    assert gemm.kernel(f16) == "torch"
    monkeypatch.setenv("CONVEYOR_GEMM", "torch")
    assert [gemm.kernel(w) for w in (f32, bf16, f16)] == ["torch"] * 3
    monkeypatch.setenv("CONVEYOR_GEMM", "onednn")
    assert gemm.kernel(f32) == "onednn"
    if kind.onednn_bf16:
        assert gemm.kernel(bf16) == "onednn"
    else:
        with pytest.raises(ValueError, match="cannot pack a torch.bfloat16 weight"):
            gemm.kernel(bf16)


@pytest.mark.parametrize("kind, widens", [(AMD_EPYC, True), (AMD_ZEN4, False), (XEON_BF16, True), (XEON_AMX, False)])
def test_bf16_prompts_widen_where_bf16_computes_slower(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: Kind, widens: bool
) -> None:
    """A Xeon without AMX (and any CPU without avx512_bf16) computes bf16 prompts through a float32 copy; an AMX
    Xeon and an AMD CPU with avx512_bf16 compute them in bf16 (shard/layers/gemm.py says what each measured)."""
    fake(monkeypatch, tmp_path, kind)
    assert cpu.probe().amd is (kind.vendor == AMD)
    assert gemm.widens(cpu.probe()) is widens


@pytest.mark.parametrize(
    "kind, rows",
    [(AMD_EPYC, 9), (XEON_AVX512_ONLY, 9), (XEON_BF16, gemm.WIDE_ROWS)],
    ids=[AMD_EPYC.name, XEON_AVX512_ONLY.name, XEON_BF16.name],
)
def test_without_avx512_bf16_the_float32_copy_serves_past_the_small_rows_kernel(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: Kind, rows: int
) -> None:
    """Where oneDNN converts every bf16 product (no avx512_bf16), a bf16 layer's float32 copy takes every step the
    small-rows kernel does not; with avx512_bf16 only steps of WIDE_ROWS tokens and more."""
    fake(monkeypatch, tmp_path, kind)
    monkeypatch.delenv("CONVEYOR_ONEDNN_ROWS", raising=False)
    assert gemm.widens(cpu.probe())
    assert gemm.wide_rows(cpu.probe()) == rows
    if rows != gemm.WIDE_ROWS:
        assert rows == gemm.small_rows(cpu.probe()) + 1


# --- threads ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "local_ranks, cores, environ, expected",
    [
        (1, 64, {}, None),  # alone: torch's own count
        (2, 64, {}, 32),
        (3, 2, {}, 1),  # more ranks than cores: one thread each, never 0
        (2, 64, {"OMP_NUM_THREADS": "2"}, None),  # a container's share, set by whoever knows it
    ],
)
def test_threads_per_rank(local_ranks: int, cores: int, environ: dict[str, str], expected: int | None) -> None:
    assert cpu.threads_per_rank(local_ranks, cores, environ) == expected


# --- --dtype auto -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, bf16_checkpoint_runs_in",
    [
        pytest.param(AMD_EPYC, "float32", id=AMD_EPYC.name),
        pytest.param(AMD_ZEN4, "bfloat16", id=AMD_ZEN4.name),
        pytest.param(XEON_AVX512_ONLY, "float32", id=XEON_AVX512_ONLY.name),  # oneDNN converts: no faster
        pytest.param(XEON_BF16, "bfloat16", id=XEON_BF16.name),
        pytest.param(XEON_AMX, "bfloat16", id=XEON_AMX.name),
    ],
)
def test_dtype_auto_on_each_cpu_kind(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: Kind, bf16_checkpoint_runs_in: str
) -> None:
    from conveyor.shard.runtime.device import choose_dtype, device_bf16

    fake(monkeypatch, tmp_path, kind)
    here = torch.device("cpu")
    assert choose_dtype("auto", "bfloat16", here, device_bf16(here)) == bf16_checkpoint_runs_in
    assert choose_dtype("auto", "float16", here, device_bf16(here)) == bf16_checkpoint_runs_in
    assert choose_dtype("auto", "float32", here, device_bf16(here)) == "float32"
    assert choose_dtype("bfloat16", "float32", here, device_bf16(here)) == "bfloat16"  # asked for: taken
    monkeypatch.setenv(cpu.BF16_SWITCH, "0")
    assert choose_dtype("auto", "bfloat16", here, device_bf16(here)) == "float32"


# --- the kernels' variant -----------------------------------------------------------------------------------------

SKYLAKE_SP = Kind(
    "xeon-skylake-sp", "Intel(R) Xeon(R) Gold 6148 CPU", AVX512_FLAGS.replace(" avx512_vnni", ""), True, INTEL
)
CASCADE_LAKE = Kind("xeon-cascade-lake", "Intel(R) Xeon(R) Platinum 8259CL CPU", AVX512_FLAGS, True, INTEL)
BELOW_AVX2 = Kind("below-avx2", "Intel(R) Xeon(R) CPU E5-2670 0", BASE_FLAGS + " avx", False, INTEL)


@pytest.mark.parametrize(
    "kind, variant",
    [
        pytest.param(AMD_EPYC, "avx2", id=AMD_EPYC.name),
        pytest.param(AMD_ZEN4, "avx512_bf16", id=AMD_ZEN4.name),
        pytest.param(SKYLAKE_SP, "avx512", id=SKYLAKE_SP.name),
        pytest.param(CASCADE_LAKE, "avx512_vnni", id=CASCADE_LAKE.name),
        pytest.param(XEON_BF16, "avx512_bf16", id=XEON_BF16.name),
        pytest.param(XEON_AMX, "avx512_bf16", id=XEON_AMX.name),  # no kernel uses the tiles: oneDNN does
        pytest.param(BELOW_AVX2, None, id=BELOW_AVX2.name),  # the torch path
    ],
)
def test_each_cpu_kind_takes_the_most_capable_variant_it_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: Kind, variant: str | None
) -> None:
    fake(monkeypatch, tmp_path, kind)
    assert cpu.probe().kind == variant
    if variant is not None:
        assert {"-mavx2", "-mfma", "-mf16c"} <= set(cpu.compile_flags(variant))


@pytest.mark.parametrize("cap", list(cpu.KINDS))
def test_the_variant_switch_makes_a_zen4_look_like_each_lesser_kind(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cap: str
) -> None:
    """Everything that asks `probe` sees that kind's flags: the variant, the AVX-512 small-rows loop, bf16."""
    fake(monkeypatch, tmp_path, AMD_ZEN4)
    monkeypatch.setenv(cpu.VARIANT_SWITCH, cap)
    here = cpu.probe()
    assert here.kind == cap
    assert cpu.KINDS[cap] <= here.flags
    assert not {f for f in here.flags if f.startswith("avx512")} - cpu.KINDS[cap]
    assert {"sse4_2", "avx", "bmi2"} <= here.flags  # below the ladder: untouched
    assert here.avx512 is (cap != "avx2") and here.avx512_bf16 is (cap == "avx512_bf16")
    assert gemm.small_rows(here) == (gemm.SMALL_ROWS_AVX2 if cap == "avx2" else gemm.SMALL_ROWS_AVX512)


def test_the_variant_switch_refuses_a_kind_the_cpu_lacks_or_does_not_know(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake(monkeypatch, tmp_path, AMD_EPYC)
    monkeypatch.setenv(cpu.VARIANT_SWITCH, "avx512")
    with pytest.raises(ValueError, match="lacks avx512bw, avx512dq, avx512f, avx512vl"):
        cpu.probe()
    monkeypatch.setenv(cpu.VARIANT_SWITCH, "avx10")
    with pytest.raises(ValueError, match="must be one of avx2, avx512, avx512_vnni, avx512_bf16"):
        cpu.probe()
    monkeypatch.setenv(cpu.VARIANT_SWITCH, "avx2")
    assert cpu.probe().kind == "avx2"


ICE_LAKE = Kind("xeon-avx512-vnni", "Intel(R) Xeon(R) Platinum 8375C CPU", AVX512_FLAGS, False, INTEL)


@pytest.mark.parametrize(
    "kind, middle",
    [
        pytest.param(BELOW_AVX2, [], id=BELOW_AVX2.name),
        pytest.param(AMD_EPYC, [], id=AMD_EPYC.name),  # the AVX2 rerun is all there is
        pytest.param(ICE_LAKE, ["avx512"], id=ICE_LAKE.name),
        pytest.param(XEON_AMX, ["avx512", "avx512_vnni"], id=XEON_AMX.name),
    ],
)
def test_make_test_reruns_the_quantization_tests_under_each_middle_kind(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: Kind, middle: list[str]
) -> None:
    """`python -m conveyor.cpu` names the kinds between AVX2 (rerun already) and the machine's own (the suite's)."""
    fake(monkeypatch, tmp_path, kind)
    flags = cpu.probe().flags
    assert cpu.middle_kinds(flags) == middle
    runnable = cpu.runnable_kinds(flags)
    if runnable:
        assert runnable[0] == "avx2" and runnable[-1] == cpu.probe().kind
        monkeypatch.setenv(cpu.VARIANT_SWITCH, "avx2")  # the AVX2 rerun's process would name none
        assert cpu.middle_kinds(cpu.probe().flags) == []
