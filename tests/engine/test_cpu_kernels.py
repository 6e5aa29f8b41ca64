"""The project's int8 expert kernel: its arithmetic, its place in the engine's graphs, its fallbacks."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset16 as ops
import pytest

from cascadia.engine import cpu_kernels, graphs
from cascadia.engine.batch import Segment
from cascadia.engine.engine import StageEngine
from cascadia.engine.settings import FfnForm, preset
from cascadia.engine.weights import quantize
from cascadia.model.checkpoint import ExpertWeights, load_stage
from cascadia.model.config import load_shape
from tests.engine.test_engine_numerics import PROMPTS, run_prompt
from tests.oracle import relative_rms

needs_vnni = pytest.mark.skipif(not cpu_kernels.cpu_runs_vnni(), reason="the CPU has no AVX-512 VNNI")


def _codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows quantised as the kernel does: symmetric int8 in groups of 32, one f32 scale per group."""
    groups = values.astype(np.float32).reshape(values.shape[0], -1, cpu_kernels.GROUP)
    largest = np.abs(groups).max(axis=-1, keepdims=True)
    inverse = np.where(largest > 0, np.float32(127) / np.where(largest > 0, largest, 1), 0).astype(np.float32)
    codes = np.clip(np.rint(groups * inverse), -127, 127).astype(np.int64)
    return codes, (largest / np.float32(127)).astype(np.float32)


def _project(rows: np.ndarray, values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """rows [R, K] times int8 weights [N, K] with per-channel scales [N], inputs quantised in groups."""
    codes, row_scales = _codes(rows)
    grouped = values.astype(np.int64).reshape(values.shape[0], -1, cpu_kernels.GROUP)
    dots = np.einsum("rgk,ngk->rng", codes, grouped).astype(np.float32)  # exact integer products
    return (dots * row_scales[:, None, :, 0]).sum(-1) * scale[None, :]


def _bank_reference(x, index, weight, gate_up, gate_up_scale, down, down_scale) -> np.ndarray:
    inner = gate_up.shape[1] // 2
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(index.shape[1]):
            e = int(index[t, k])
            lifted = _project(x[t : t + 1], gate_up[e], gate_up_scale[e])[0]
            gate, up = lifted[:inner], lifted[inner:]
            mixed = gate / (1 + np.exp(-gate)) * up * weight[t, k]
            out[t] += _project(mixed[None], down[e], down_scale[e])[0]
    return out


def _bank(seed: int, experts: int, hidden: int, inner: int):
    rng = np.random.default_rng(seed)
    gate_up = quantize((rng.standard_normal((experts, 2 * inner, hidden)) * 0.05).astype(np.float32), "int8")
    down = quantize((rng.standard_normal((experts, hidden, inner)) * 0.05).astype(np.float32), "int8")
    return gate_up.values, gate_up.scale[..., 0], down.values, down.scale[..., 0]


def _compiled_bank(experts: int, hidden: int, per_row: int, index_type: str, bank) -> ov.CompiledModel:
    x = ops.parameter([-1, hidden], np.float32)
    index = ops.parameter([-1, per_row], np.dtype(index_type.replace("i", "int")))
    weight = ops.parameter([-1, per_row], np.float32)
    node = cpu_kernels.expert_bank(x.output(0), index.output(0), weight.output(0), *bank)
    core = ov.Core()
    core.add_extension(str(cpu_kernels.library()))
    config = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": "2"}
    return core.compile_model(ov.Model([node.output(0)], [x, index, weight]), "CPU", config)


def _routing(rng: np.random.Generator, rows: int, experts: int, per_row: int, crowd: bool):
    if crowd:  # every row chooses expert 1 first: one expert with more rows than the kernel's row tile
        index = np.stack([np.r_[1, rng.choice(np.r_[0, 2:experts], per_row - 1, replace=False)] for _ in range(rows)])
    else:
        index = np.stack([rng.choice(experts, per_row, replace=False) for _ in range(rows)])
    weight = rng.random((rows, per_row)).astype(np.float32)
    return index.reshape(rows, per_row), weight


@needs_vnni
@pytest.mark.parametrize(("rows", "crowd", "index_type"), [(1, False, "i32"), (5, False, "i64"), (19, True, "i32")])
def test_the_bank_is_its_quantised_arithmetic_and_near_the_dequantised_weights(rows, crowd, index_type):
    """Against the same arithmetic in numpy (inputs quantised in groups of 32, integer products): equal to
    float rounding; against f32 inputs on the dequantised weights, within the w8a8 bar. Sizes that leave
    partial blocks and row tiles."""
    experts, hidden, inner, per_row = 6, 96, 32, 3
    bank = _bank(0, experts, hidden, inner)
    compiled = _compiled_bank(experts, hidden, per_row, index_type, bank)
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    index, weight = _routing(rng, rows, experts, per_row, crowd)
    got = compiled.create_infer_request().infer([x, index.astype(index_type.replace("i", "int")), weight])[0]
    expected = _bank_reference(x, index, weight, *bank)
    assert relative_rms(got, expected) <= 1e-5
    gate_up, gate_up_scale, down, down_scale = bank
    exact = np.zeros_like(x)
    for t in range(rows):
        for k in range(per_row):
            e = index[t, k]
            lifted = (gate_up[e] * gate_up_scale[e][:, None]) @ x[t]
            gate, up = lifted[:inner], lifted[inner:]
            exact[t] += (down[e] * down_scale[e][:, None]) @ (gate / (1 + np.exp(-gate)) * up * weight[t, k])
    assert 1e-4 < relative_rms(got, exact) <= 0.02


@needs_vnni
def test_a_row_comes_out_the_same_whatever_rows_share_its_call():
    """Each row's sum is made in its own choices' order, so batching never changes a stream's result."""
    experts, hidden, inner, per_row = 8, 64, 32, 2
    bank = _bank(1, experts, hidden, inner)
    request = _compiled_bank(experts, hidden, per_row, "i32", bank).create_infer_request()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((24, hidden)).astype(np.float32)
    index, weight = _routing(rng, 24, experts, per_row, crowd=True)
    together = request.infer([x, index.astype(np.int32), weight])[0].copy()
    for row in (0, 13, 23):
        alone = request.infer([x[row : row + 1], index[row : row + 1].astype(np.int32), weight[row : row + 1]])[0]
        np.testing.assert_array_equal(alone[0], together[row])
    empty = request.infer([x[:0], index[:0].astype(np.int32), weight[:0]])[0]
    assert empty.shape == (0, hidden)


@needs_vnni
def test_an_expert_index_out_of_range_is_an_error_not_a_crash():
    experts, hidden, inner = 4, 32, 32
    request = _compiled_bank(experts, hidden, 1, "i32", _bank(3, experts, hidden, inner)).create_infer_request()
    x = np.ones((2, hidden), np.float32)
    with pytest.raises(RuntimeError, match="expert index 4 out of range"):
        request.infer([x, np.array([[0], [4]], np.int32), np.ones((2, 1), np.float32)])
    assert request.infer([x, np.array([[0], [3]], np.int32), np.ones((2, 1), np.float32)])[0].shape == (2, hidden)
    with pytest.raises(RuntimeError, match="must have the same rows"):
        request.infer([x, np.array([[0]], np.int32), np.ones((1, 1), np.float32)])
    with pytest.raises(RuntimeError, match="must have the same rows"):
        request.infer([x, np.array([[0], [1]], np.int32), np.ones((3, 1), np.float32)])


def test_w8a8_banks_take_the_kernel_on_the_cpu_only():
    assert preset("w8a8").ffn_form.compressed_experts == "vnni"
    assert preset("w8a8", device="GPU").ffn_form.compressed_experts == "fused"
    assert preset("w8a8", expert_kernel="grouped").ffn_form.compressed_experts == "grouped"
    # the kernel's groups are 32 wide: other groups keep the plugin's grouped matmuls
    assert preset("w8a8", activation_quant_group=64).ffn_form.compressed_experts == "grouped"
    assert preset("int8").ffn_form.compressed_experts == "fused"
    with pytest.raises(ValueError, match="expert_kernel 'vnni' .* needs activation_quant_group 32 .* got 0"):
        preset("int8", expert_kernel="vnni")


def test_banks_the_kernel_cannot_take_run_grouped(monkeypatch):
    """int4 weights, a width off its groups, or no kernel on this machine: the plugin's grouped form."""
    form = FfnForm(dense="matmul", experts="grouped", compressed_experts="vnni")
    rng = np.random.default_rng(0)

    def bank(hidden: int, inner: int) -> ExpertWeights:
        return ExpertWeights(
            rng.standard_normal((4, inner, hidden)).astype(np.float32),
            rng.standard_normal((4, inner, hidden)).astype(np.float32),
            rng.standard_normal((4, hidden, inner)).astype(np.float32),
        )

    monkeypatch.setattr(cpu_kernels, "expert_bank_available", lambda: True)
    assert graphs._bank_form(bank(64, 32), "int8", form) == "vnni"
    assert graphs._bank_form(bank(64, 32), "int4", form) == "grouped"
    assert graphs._bank_form(bank(64, 48), "int8", form) == "grouped"
    assert graphs._bank_form(bank(64, 32), "f32", form) == "grouped"
    monkeypatch.setattr(cpu_kernels, "expert_bank_available", lambda: False)
    assert graphs._bank_form(bank(64, 32), "int8", form) == "grouped"


def test_without_a_compiler_the_kernels_are_unavailable_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("CASCADIA_CACHE_DIR", str(tmp_path))
    cpu_kernels.library.cache_clear()
    cpu_kernels.expert_bank_available.cache_clear()
    try:
        with pytest.raises(cpu_kernels.KernelUnavailable, match="no C.. compiler 'no-such-compiler'"):
            cpu_kernels.library()
        assert not cpu_kernels.expert_bank_available()
    finally:
        cpu_kernels.library.cache_clear()
        cpu_kernels.expert_bank_available.cache_clear()


def test_a_cache_directory_that_cannot_be_written_leaves_the_kernels_unavailable(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("CASCADIA_CACHE_DIR", str(blocked))
    cpu_kernels.library.cache_clear()
    try:
        with pytest.raises(cpu_kernels.KernelUnavailable, match=f"under {blocked}/kernels/.* failed"):
            cpu_kernels.library()
    finally:
        cpu_kernels.library.cache_clear()


def test_a_source_that_does_not_compile_says_what_the_compiler_said(monkeypatch, tmp_path):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", broken)
    monkeypatch.setenv("CASCADIA_CACHE_DIR", str(tmp_path / "cache"))
    cpu_kernels.library.cache_clear()
    try:
        with pytest.raises(cpu_kernels.KernelUnavailable, match="building the CPU kernels failed"):
            cpu_kernels.library()
        assert not list((tmp_path / "cache").rglob(cpu_kernels.LIBRARY_NAME))
    finally:
        cpu_kernels.library.cache_clear()


@needs_vnni
def test_a_w8a8_engine_runs_its_banks_on_the_kernel_near_the_grouped_matmuls(tiny):
    """The tiny preset in w8a8: its sparse layers' banks on the kernel (the plugin runs it as a Reference
    node), each layer within a fraction of the w8a8 bar of the plugin's grouped banks on the same
    quantised inputs, and the first sparse layer not equal to them (a different kernel ran)."""
    weights = load_stage(tiny, 0, load_shape(tiny).num_layers)
    kernel = StageEngine(weights, preset("w8a8"))
    grouped = StageEngine(weights, preset("w8a8", expert_kernel="grouped"))
    assert kernel.runtime_ops()[-1].get("Reference", 0) >= 1
    assert "Reference" not in grouped.runtime_ops()[-1]
    ids = PROMPTS["long"]
    kernel_layers, kernel_logits = run_prompt(kernel, ids)
    grouped_layers, grouped_logits = run_prompt(grouped, ids)
    sparse = [i for i, layer in enumerate(weights.layers) if layer.router is not None]
    assert sparse
    for i in range(len(weights.layers)):
        assert relative_rms(kernel_layers[i], grouped_layers[i]) <= 0.01, f"layer {i}"
    assert relative_rms(kernel_layers[sparse[0]], grouped_layers[sparse[0]]) > 0
    assert relative_rms(kernel_logits, grouped_logits) <= 0.02


@needs_vnni
def test_the_kernel_steps_streams_at_their_own_positions_as_each_alone(tiny):
    """Prefill and decode rows of two streams in one step through w8a8 on the kernel give each stream's
    logits as stepped alone."""
    engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), preset("w8a8"))
    ids = np.array(PROMPTS["long"])
    alone = {}
    for name, prompt in (("a", ids[:6]), ("b", ids[10:17])):
        engine.open(name)
        engine.step([Segment(name, 0, len(prompt) - 1)], prompt[:-1])
        alone[name] = engine.step([Segment(name, len(prompt) - 1, 1)], prompt[-1:]).logits[-1]
        engine.close(name)
    engine.open("a")
    engine.open("b")
    engine.step([Segment("a", 0, 5)], ids[:5])
    together = engine.step([Segment("a", 5, 1), Segment("b", 0, 7)], np.concatenate([ids[5:6], ids[10:17]])).logits
    for name, row in (("a", together[0]), ("b", together[-1])):
        np.testing.assert_allclose(row, alone[name], rtol=0, atol=2e-5 * np.abs(alone[name]).max(), err_msg=name)


def test_packing_puts_four_inputs_of_sixteen_channels_side_by_side():
    """The layout one VNNI product reads: per block of 16 output channels, 4 consecutive inputs each."""
    rng = np.random.default_rng(9)
    q = quantize(rng.standard_normal((2, 64, 32)).astype(np.float32), "int8")
    packed = cpu_kernels.pack(q.values)
    assert packed.shape == (2, 4, 8, 16, 4)
    # block 1, inputs 4..7 of channel 16 + 3
    np.testing.assert_array_equal(packed[0, 1, 1, 3], q.values[0, 19, 4:8])
