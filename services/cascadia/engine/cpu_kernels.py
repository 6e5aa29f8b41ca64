"""The project's own CPU operations, built from source into an OpenVINO extension on first use.

`kernels/int8_expert_bank.cpp` runs an expert bank on int8 weights and int8 inputs (AVX-512 VNNI),
reading each chosen expert's weights once per call: the CPU plugin's grouped banks spend more on
their per-expert nodes than on the weights at decode sizes, and its fused kernel multiplies in f32.

The library is compiled once per source, OpenVINO version and compiler into
`<cache root>/kernels/<digest>/` (the cache root of `cascadia.engine.mapped`) with the C++ compiler
`$CXX` (else `g++`) and the headers the OpenVINO wheel ships. Where it cannot be built, the engine runs
the plugin's grouped banks instead and says so once.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import openvino as ov
from openvino.utils.node_factory import NodeFactory

from cascadia import cpu_isa
from cascadia.engine.mapped import cache_root
from cascadia.engine.settings import EngineSettings

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "int8_expert_bank.cpp"
LIBRARY_NAME = "libcascadia_cpu_kernels.so"
OP_NAME = "Int8ExpertBank"
# the kernel's input quantisation group and its packed weight block (16 channels by 4 inputs)
GROUP = 32
LANES, QUAD = 16, 4
VNNI_FLAGS = ("avx512f", "avx512bw", "avx512_vnni")
COMPILE_TIMEOUT_S = 300.0


class KernelUnavailable(RuntimeError):
    """The CPU kernels could not be built here (no compiler, or it failed)."""


def _openvino_dir() -> Path:
    return Path(ov.__file__).parent


def _runtime_library(name: str) -> Path:
    """The versioned shared library of the wheel (it ships no unversioned link names)."""
    found = sorted((_openvino_dir() / "libs").glob(f"{name}.so*"))
    if not found:
        raise KernelUnavailable(f"the OpenVINO wheel has no {name}.so under {_openvino_dir() / 'libs'}")
    return found[0]


def compile_command(compiler: str, output: Path) -> list[str]:
    ov_dir = _openvino_dir()
    return [
        compiler,
        "-std=c++17",
        "-O3",
        "-fPIC",
        "-shared",
        "-fvisibility=hidden",
        "-DOV_THREAD=OV_THREAD_TBB_ADAPTIVE",
        f"-I{ov_dir / 'include'}",
        "-o",
        str(output),
        str(SOURCE),
        str(_runtime_library("libopenvino")),
        str(_runtime_library("libtbb")),
    ]


def _digest(compiler: str) -> str:
    flags = " ".join(compile_command("", Path()))
    parts = [SOURCE.read_bytes(), ov.get_version().encode(), compiler.encode(), flags.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


@functools.cache
def library() -> Path:
    """The built extension, compiling it when this source has not been built here before."""
    compiler = os.environ.get("CXX") or "g++"
    if shutil.which(compiler) is None:
        raise KernelUnavailable(f"no C++ compiler '{compiler}' to build the CPU kernels (set CXX)")
    target = cache_root() / "kernels" / _digest(compiler) / LIBRARY_NAME
    if target.exists():
        return target
    log.info("building the CPU kernels into %s", target.parent)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / LIBRARY_NAME
            done = subprocess.run(
                compile_command(compiler, built), capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S
            )
            if done.returncode != 0:
                raise KernelUnavailable(f"building the CPU kernels failed:\n{done.stderr.strip()[-2000:]}")
            os.replace(built, target)  # atomic: processes building at once each rename a whole library
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"building the CPU kernels under {target.parent} failed: {exc}") from exc
    return target


@functools.cache
def _factory() -> NodeFactory:
    factory = NodeFactory()
    factory.add_extension(str(library()))
    return factory


def add_to(core: ov.Core, settings: EngineSettings) -> None:
    """Let `core` read and compile the graphs these settings build, when they may hold the kernels
    (the IR `mapped` writes and reads back included)."""
    if "vnni" in (settings.expert_kernel_path, settings.compressed_kernel_path) and expert_bank_available():
        core.add_extension(str(library()))


@functools.cache
def cpu_runs_vnni() -> bool:
    flags = set(cpu_isa.cpu_flags(cpu_isa.read_cpuinfo(), VNNI_FLAGS))
    return all(flag in flags for flag in VNNI_FLAGS)


@functools.cache
def expert_bank_available() -> bool:
    """Whether banks may run on the kernel here: the CPU has AVX-512 VNNI and the library builds."""
    if not cpu_runs_vnni():
        return False
    try:
        library()
    except KernelUnavailable as exc:
        log.warning("expert banks run as the plugin's grouped matmuls: %s", exc)
        return False
    return True


def fits(hidden: int, inner: int) -> bool:
    """Whether a bank of this hidden size and expert width fits the kernel's groups and blocks."""
    return hidden % GROUP == 0 and inner % GROUP == 0


def pack(values: np.ndarray) -> np.ndarray:
    """int8 weights [E, N, K] in the kernel's layout [E, N/16, K/4, 16, 4]: for each block of 16 output
    channels, 4 consecutive inputs of each channel side by side, as one VNNI product reads them."""
    experts, n, k = values.shape
    blocks = values.reshape(experts, n // LANES, LANES, k // QUAD, QUAD)
    return np.ascontiguousarray(blocks.transpose(0, 1, 3, 2, 4))


def expert_bank(
    x: ov.Output,
    index: ov.Output,
    weight: ov.Output,
    gate_up: np.ndarray,
    gate_up_scale: np.ndarray,
    down: np.ndarray,
    down_scale: np.ndarray,
) -> ov.Node:
    """The kernel's node: rows `x` [T, H] through the experts `index` [T, K] names, weighted by `weight`
    [T, K]. `gate_up` [E, 2I, H] (gate rows, then up rows) and `down` [E, H, I] are int8 with one f32
    scale per output channel ([E, 2I] and [E, H])."""
    constants = [
        ov.op.Constant(pack(gate_up)),
        ov.op.Constant(np.ascontiguousarray(gate_up_scale, dtype=np.float32)),
        ov.op.Constant(pack(down)),
        ov.op.Constant(np.ascontiguousarray(down_scale, dtype=np.float32)),
    ]
    return _factory().create(OP_NAME, [x, index, weight, *(c.output(0) for c in constants)], {})
