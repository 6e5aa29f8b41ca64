"""Which instruction sets the CPU offers, and whether the CPU plugin's oneDNN kernels may use AMX.

On a Xeon with AMX the plugin runs every bf16 matmul on AMX tiles, which pay off for many rows but
not for the few rows of a decode step: there the bank's GatherMatmul pads each expert's rows to a
tile, and in most processes measured it read the weights far slower than the AVX-512 BF16 kernels
(bf16 at one stream ran 1.45x faster without AMX, docs/bench/history/benchmarks-log.md "AMX off for decode"). oneDNN
takes its instruction-set cap from ONEDNN_MAX_CPU_ISA once per process, when the plugin first asks,
so the choice is made for the process before any CPU model compiles, not per engine.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

CPUINFO = Path("/proc/cpuinfo")
PROCESS_MAPS = Path("/proc/self/maps")
ONEDNN_ISA_VARIABLE = "ONEDNN_MAX_CPU_ISA"
AMX_VARIABLE = "CASCADIA_CPU_AMX"
CPU_PLUGIN_LIBRARY = "libopenvino_intel_cpu_plugin"
# the highest oneDNN level below the AMX ones: AVX-512 with BF16, VNNI and FP16 kept
BELOW_AMX = "AVX512_CORE_FP16"
AmxChoice = Literal["auto", "on", "off"]
AMX_CHOICES: tuple[AmxChoice, ...] = ("auto", "on", "off")
AMX_FLAGS = ("amx_bf16", "amx_int8", "amx_fp16")
# the instruction sets that decide which matmul kernels the plugin and torch can pick
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "amx_fp16")


def read_cpuinfo(cpuinfo: Path = CPUINFO) -> str:
    """The kernel's CPU description; empty where there is none (another OS, a sandbox)."""
    try:
        return cpuinfo.read_text()
    except OSError:
        return ""


def _first_cpu_field(cpuinfo: str, name: str) -> str | None:
    match = re.search(rf"^{name}\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    return match.group(1).strip() if match else None


def cpu_model_name(cpuinfo: str) -> str | None:
    return _first_cpu_field(cpuinfo, "model name")


def cpu_flags(cpuinfo: str, wanted: tuple[str, ...] = KERNEL_FLAGS) -> list[str]:
    """Which of `wanted` the first CPU's flags list, in `wanted`'s order."""
    flags = set((_first_cpu_field(cpuinfo, "flags") or "").split())
    return [flag for flag in wanted if flag in flags]


def cap_allows_amx(cap: str) -> bool:
    """Whether a ONEDNN_MAX_CPU_ISA value leaves the AMX kernels in (their names say AMX, or no cap)."""
    return "AMX" in cap.upper() or cap.upper() in ("ALL", "DEFAULT")


def isa_cap(amx: str, flags: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The ONEDNN_MAX_CPU_ISA value a process should set for the `amx` choice, or None to set nothing.

    "auto" keeps AMX out of a CPU that has it, since serving spends its time in decode steps, and
    leaves a cap the user set themselves alone; "on" and "off" are explicit, so a cap the user set
    that says otherwise is an error rather than a silent winner (one that agrees is kept).
    """
    if amx not in AMX_CHOICES:
        raise ValueError(f"CPU AMX choice '{amx}' is not one of {', '.join(AMX_CHOICES)}")
    user_cap = environ.get(ONEDNN_ISA_VARIABLE, "")
    if user_cap:
        if amx != "auto" and cap_allows_amx(user_cap) != (amx == "on"):
            raise ValueError(f"AMX '{amx}' contradicts {ONEDNN_ISA_VARIABLE}={user_cap} set in the environment")
        return None
    if amx == "off" or (amx == "auto" and any(flag in AMX_FLAGS for flag in flags)):
        return BELOW_AMX
    return None


def cpu_plugin_loaded(maps: Path = PROCESS_MAPS) -> bool:
    """Whether this process has mapped the CPU plugin, whose oneDNN has then fixed its cap."""
    try:
        return CPU_PLUGIN_LIBRARY in maps.read_text()
    except OSError:
        return False


def apply_amx_choice(amx: str) -> str | None:
    """Set this process's cap (inherited by the processes it starts) for `amx`; returns the cap set.

    Raises ValueError for an unknown choice or one that contradicts the environment, and
    RuntimeError for "on" or "off" when the CPU plugin has already loaded, since oneDNN would no
    longer read the cap; "auto" is only a preference, and leaves such a process as it is.
    """
    cap = isa_cap(amx, cpu_flags(read_cpuinfo(), AMX_FLAGS), os.environ)
    if cap is not None and os.environ.get(ONEDNN_ISA_VARIABLE) != cap:
        if cpu_plugin_loaded():
            if amx == "auto":
                return None
            raise RuntimeError(
                f"AMX '{amx}' must be chosen before the CPU plugin loads: oneDNN has already read its cap"
            )
        os.environ[ONEDNN_ISA_VARIABLE] = cap
    # the processes this one starts (shards, benchmarks' children) make the same choice
    os.environ[AMX_VARIABLE] = amx
    return cap
