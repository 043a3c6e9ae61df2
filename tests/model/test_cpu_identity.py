"""`model.cpu_identity`: the CPU a guard record or a kernel plan belongs to, read from ``/proc/cpuinfo`` text."""

from __future__ import annotations

import platform
from pathlib import Path

from kvrelay.model.cpu_identity import CpuIdentity, parse_cpuinfo, this_cpu

ZEN4_KVM = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu vme avx2 avx512f avx512_bf16 avx512_vnni
bugs\t\t: sysret_ss_attrs

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 23
model\t\t: 1
model name\t: AMD EPYC 7601 32-Core Processor
flags\t\t: fpu vme avx2
"""

SAPPHIRE_RAPIDS = """processor\t: 0
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
"""

KERNEL_FLAGS_ZEN4 = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni")
ZEN1_KVM = "processor\t: 0\ncpu family\t: 23\nmodel\t\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma\n"


def test_the_first_processor_block_names_the_cpu() -> None:
    cpu = parse_cpuinfo(ZEN4_KVM)
    assert cpu == CpuIdentity(model_name="AMD EPYC", family="25", model="17", bf16_flags=("avx512_bf16",),
                              kernel_flags=KERNEL_FLAGS_ZEN4)
    assert cpu.key == "AMD EPYC (family 25, model 17; avx512_bf16)"
    assert cpu.describe() == "AMD EPYC (family 25, model 17): amx_bf16 no, avx512_bf16 yes"


def test_bf16_flags_are_listed_sorted_or_said_absent() -> None:
    spr, zen1 = parse_cpuinfo(SAPPHIRE_RAPIDS), parse_cpuinfo(ZEN1_KVM)
    assert spr.key == "Intel(R) Xeon(R) Platinum 8480+ (family 6, model 143; amx_bf16 avx512_bf16)"
    assert spr.describe() == "Intel(R) Xeon(R) Platinum 8480+ (family 6, model 143): amx_bf16 yes, avx512_bf16 yes"
    assert zen1.key == "AMD EPYC (family 23, model 1; no bf16)"
    # Both VMs say "AMD EPYC": family and model keep their records apart.
    assert zen1.key != parse_cpuinfo(ZEN4_KVM).key


def test_the_kernel_label_names_the_extensions_the_kernels_branch_on() -> None:
    assert parse_cpuinfo(SAPPHIRE_RAPIDS).kernel_label == (
        "Intel(R) Xeon(R) Platinum 8480+ (family 6, model 143) [avx512f avx512_bf16 amx_tile amx_bf16 amx_int8]")
    assert parse_cpuinfo(ZEN1_KVM).kernel_label == "AMD EPYC (family 23, model 1) [avx2]"


def test_missing_fields_and_missing_file(tmp_path: Path) -> None:
    assert parse_cpuinfo("processor\t: 0\nflags\t: fpu\n") == CpuIdentity(platform.machine() or "?", "?", "?", ())
    assert this_cpu(tmp_path / "nope") == CpuIdentity(platform.machine() or "?", "?", "?", ())
    info = tmp_path / "cpuinfo"
    info.write_text(SAPPHIRE_RAPIDS)
    assert this_cpu(info) == parse_cpuinfo(SAPPHIRE_RAPIDS)
