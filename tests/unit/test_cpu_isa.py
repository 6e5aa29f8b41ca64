"""The CPU's instruction sets, and the per-process choice of AMX for the plugin's oneDNN kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cascadia.cpu_isa import (
    AMX_FLAGS,
    AMX_VARIABLE,
    BELOW_AMX,
    ONEDNN_ISA_VARIABLE,
    cpu_flags,
    cpu_model_name,
    cpu_plugin_loaded,
    isa_cap,
    read_cpuinfo,
)

AMX_CPU = ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8"]
HAS_AMX = bool(cpu_flags(read_cpuinfo(), AMX_FLAGS))


def test_only_the_kernel_deciding_flags_are_kept_in_their_order(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: Some CPU\nflags\t\t: fpu amx_int8 sse avx2 avx512f amx_bf16\n\nflags : other\n")
    text = read_cpuinfo(cpuinfo)
    assert cpu_model_name(text) == "Some CPU"
    assert cpu_flags(text) == ["avx2", "avx512f", "amx_bf16", "amx_int8"]
    missing = read_cpuinfo(tmp_path / "missing")
    assert missing == "" and cpu_flags(missing) == [] and cpu_model_name(missing) is None


def test_auto_keeps_amx_out_only_where_the_cpu_has_it_and_the_user_set_no_cap():
    assert isa_cap("auto", AMX_CPU, {}) == BELOW_AMX
    assert isa_cap("auto", ["avx2", "avx512f", "avx512_bf16"], {}) is None
    assert isa_cap("auto", AMX_CPU, {ONEDNN_ISA_VARIABLE: "AVX2"}) is None
    assert isa_cap("auto", AMX_CPU, {ONEDNN_ISA_VARIABLE: ""}) == BELOW_AMX


def test_on_and_off_are_explicit_and_keep_a_cap_that_agrees():
    assert isa_cap("on", AMX_CPU, {}) is None
    assert isa_cap("off", AMX_CPU, {}) == BELOW_AMX
    assert isa_cap("off", ["avx2"], {}) == BELOW_AMX  # a cap above the CPU changes nothing there
    assert isa_cap("off", AMX_CPU, {ONEDNN_ISA_VARIABLE: "AVX2"}) is None
    assert isa_cap("on", AMX_CPU, {ONEDNN_ISA_VARIABLE: "avx512_core_amx"}) is None
    assert isa_cap("on", AMX_CPU, {ONEDNN_ISA_VARIABLE: "ALL"}) is None


@pytest.mark.parametrize(("amx", "user_cap"), [("on", "AVX2"), ("on", BELOW_AMX), ("off", "AVX512_CORE_AMX")])
def test_an_explicit_choice_that_contradicts_the_users_cap_is_named(amx, user_cap):
    with pytest.raises(ValueError, match=f"'{amx}' contradicts {ONEDNN_ISA_VARIABLE}={user_cap}"):
        isa_cap(amx, AMX_CPU, {ONEDNN_ISA_VARIABLE: user_cap})


def test_an_unknown_choice_is_named():
    with pytest.raises(ValueError, match="'sometimes' is not one of auto, on, off"):
        isa_cap("sometimes", AMX_CPU, {})


def test_the_plugin_is_found_among_the_mapped_libraries(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /usr/lib/libc.so.6\n")
    assert not cpu_plugin_loaded(maps)
    maps.write_text("7f00-7f10 r-xp 0 08:01 1 /site-packages/openvino/libs/libopenvino_intel_cpu_plugin.so\n")
    assert cpu_plugin_loaded(maps)
    assert not cpu_plugin_loaded(tmp_path / "none")


# compiles one bf16 matmul on the CPU, applying a choice before ("early") or after ("late") the
# plugin loads, and prints the cap set, the kernels the matmul runs and the error of a late choice
KERNELS_AFTER_CHOICE = """
import json, os, sys
import numpy as np, openvino as ov, openvino.opset16 as ops
from cascadia.cpu_isa import apply_amx_choice
choice, when = sys.argv[1:]
cap = apply_amx_choice(choice) if when == "early" else None
x = ops.parameter([4, 256], np.float32)
model = ov.Model([ops.matmul(x, ops.constant(np.ones((128, 256), np.float32)), False, True)], [x])
compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "bf16"})
kinds = sorted({op.get_rt_info()["primitiveType"].astype(str) for op in compiled.get_runtime_model().get_ordered_ops()})
late = None
if when == "late":
    try:
        apply_amx_choice(choice)
    except RuntimeError as exc:
        late = str(exc)
print(json.dumps({"cap": cap, "kernels": kinds, "late": late, "inherited": os.environ.get("CASCADIA_CPU_AMX"),
                  "onednn": os.environ.get("ONEDNN_MAX_CPU_ISA")}))
"""


def _kernels_after(choice: str, when: str = "early") -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (ONEDNN_ISA_VARIABLE, AMX_VARIABLE)}
    run = subprocess.run(
        [sys.executable, "-c", KERNELS_AFTER_CHOICE, choice, when], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def test_off_caps_this_process_and_the_processes_it_starts():
    off = _kernels_after("off")
    assert off["cap"] == off["onednn"] == BELOW_AMX and off["inherited"] == "off"


@pytest.mark.skipif(not HAS_AMX, reason="the CPU has no AMX tiles to keep the plugin off")
def test_amx_off_keeps_the_bf16_matmul_off_amx():
    kernels = _kernels_after("off")["kernels"]
    assert any("bf16" in kind for kind in kernels) and not any("amx" in kind for kind in kernels)


def test_a_choice_after_the_plugin_loaded_is_refused_not_ignored():
    late = _kernels_after("off", "late")
    assert "before the CPU plugin loads" in late["late"]


def test_auto_after_the_plugin_loaded_leaves_the_process_as_it_is():
    late = _kernels_after("auto", "late")
    assert late["late"] is None and late["onednn"] is None


@pytest.mark.skipif(not HAS_AMX, reason="the CPU has no AMX tiles for the plugin to choose")
def test_amx_on_lets_the_plugin_run_bf16_on_amx_tiles():
    on = _kernels_after("on")
    assert on["cap"] is None and on["inherited"] == "on" and any("amx_bf16" in kind for kind in on["kernels"])
