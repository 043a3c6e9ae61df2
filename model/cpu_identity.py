"""Which CPU this is: ``/proc/cpuinfo``'s model name (what ``lscpu`` shows as "Model name"), its family and model
numbers, which of the bf16 instructions that decide ``dtype: auto`` (`model.dtype.BF16_CPU_FLAGS`: ``amx_bf16``,
``avx512_bf16``) it has, and which of the vector and matrix extensions the CPU kernels branch on
(`KERNEL_CPU_FLAGS`). A benchmark record (`benchmarks.guard_record`) and a kernel plan (`engine.kernel_tuning`) are
kept per CPU by it.

The model name alone does not tell the machines here apart: under KVM a Zen 1 and a Zen 4 both say "AMD EPYC",
and they serve different dtypes (float32 and bf16). `CpuIdentity.key` therefore joins all three::

    AMD EPYC (family 25, model 17; avx512_bf16)
    Intel(R) Xeon(R) Platinum 8480+ (family 6, model 143; amx_bf16 avx512_bf16)
    AMD EPYC (family 23, model 1; no bf16)
"""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

from kvrelay.model.dtype import BF16_CPU_FLAGS

# the extensions the kernels (ours, oneDNN's) choose code paths by, in the order `CpuIdentity.kernel_label` names them
KERNEL_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True, slots=True)
class CpuIdentity:
    model_name: str
    family: str
    model: str
    bf16_flags: tuple[str, ...]  # the flags of BF16_CPU_FLAGS this CPU reports, sorted
    kernel_flags: tuple[str, ...] = ()  # the flags of KERNEL_CPU_FLAGS it reports, in that order

    @property
    def key(self) -> str:
        """The name records are kept under (see the module doc)."""
        flags = " ".join(self.bf16_flags) or "no bf16"
        return f"{self.model_name} (family {self.family}, model {self.model}; {flags})"

    @property
    def kernel_label(self) -> str:
        """What a kernel plan is kept under: ``AMD EPYC (family 25, model 17) [avx2 avx512f avx512_bf16 ...]``."""
        return f"{self.model_name} (family {self.family}, model {self.model}) [{' '.join(self.kernel_flags)}]"

    def describe(self) -> str:
        """``AMD EPYC (family 25, model 17): amx_bf16 no, avx512_bf16 yes``."""
        flags = ", ".join(f"{f} {'yes' if f in self.bf16_flags else 'no'}" for f in sorted(BF16_CPU_FLAGS))
        return f"{self.model_name} (family {self.family}, model {self.model}): {flags}"


def parse_cpuinfo(text: str) -> CpuIdentity:
    """The identity of the first processor block of ``/proc/cpuinfo`` text (``name<TAB>: value`` lines, blocks
    separated by a blank line). A field that is missing reads ``?``; a missing model name (ARM kernels print
    none) is `platform.machine`'s."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        name, sep, value = line.partition(":")
        if sep:
            fields.setdefault(name.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    return CpuIdentity(model_name=fields.get("model name") or platform.machine() or "?",
                       family=fields.get("cpu family", "?"), model=fields.get("model", "?"),
                       bf16_flags=tuple(sorted(flags & BF16_CPU_FLAGS)),
                       kernel_flags=tuple(f for f in KERNEL_CPU_FLAGS if f in flags))


def this_cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuIdentity:
    """`parse_cpuinfo` of this machine (of empty text where there is no ``/proc/cpuinfo``)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    return parse_cpuinfo(text)
