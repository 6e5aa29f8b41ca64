"""What a benchmark ran on: the CPU, its last-level cache, the OpenVINO device and the versions measured.

The build machines change from one day to the next (an AVX2 EPYC, an AVX-512 EPYC, a Xeon with AMX),
and a ratio means little without the machine it was taken on, so each benchmark's JSON carries this.
"""

from __future__ import annotations

import os
import re
from importlib import metadata
from pathlib import Path
from typing import Any

from cascadia.cpu_isa import ONEDNN_ISA_VARIABLE, cpu_flags, cpu_model_name, read_cpuinfo

SYSFS_CACHE = Path("/sys/devices/system/cpu/cpu0/cache")
MEASURED_PACKAGES = ("openvino", "torch", "transformers")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def cache_size_bytes(text: str) -> int:
    """A cache size as sysfs ("491520K") or lscpu ("480 MiB") writes it, in bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise ValueError(f"cache size '{text}' is not a number of bytes with an optional K, M or G")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def last_level_cache_bytes(cache_dir: Path = SYSFS_CACHE) -> int | None:
    """Size of the highest-level data or unified cache the first CPU reports; None where nothing is reported."""
    best: tuple[int, int] | None = None
    for index in sorted(cache_dir.glob("index*")):
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            size = cache_size_bytes((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and (best is None or level > best[0]):
            best = (level, size)
    return best[1] if best is not None else None


def cache_share(step_bytes: float, cache_bytes: int | None) -> float | None:
    """The share of a step's weight bytes the last-level cache could hold at most (1.0: all of them)."""
    if cache_bytes is None or step_bytes <= 0:
        return None
    return min(1.0, cache_bytes / step_bytes)


def package_versions(names: tuple[str, ...] = MEASURED_PACKAGES) -> dict[str, str]:
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def machine_summary(device: str = "CPU") -> dict[str, Any]:
    import openvino as ov

    core = ov.Core()
    cpuinfo = read_cpuinfo()
    return {
        "cpu": cpu_model_name(cpuinfo),
        "cpu_flags": cpu_flags(cpuinfo),
        "logical_cpus": os.cpu_count(),
        # the cap oneDNN's kernels ran under (None: every instruction set the CPU has)
        "onednn_max_cpu_isa": os.environ.get(ONEDNN_ISA_VARIABLE) or None,
        "last_level_cache_bytes": last_level_cache_bytes(),
        "device": device,
        "device_name": core.get_property(device, "FULL_DEVICE_NAME"),
        "device_capabilities": list(core.get_property(device, "OPTIMIZATION_CAPABILITIES")),
        "versions": package_versions(),
    }


def describe(machine: dict[str, Any]) -> str:
    """One line for a benchmark's console."""
    cache = machine.get("last_level_cache_bytes")
    cache_text = f"{cache / (1 << 20):.0f} MiB last-level cache" if cache else "no cache size reported"
    flags = " ".join(machine.get("cpu_flags", [])) or "none of the wide-vector flags"
    return f"{machine.get('cpu') or 'unknown CPU'} ({flags}), {machine.get('logical_cpus')} logical CPUs, {cache_text}"
