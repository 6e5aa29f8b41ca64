"""The engine against the transformers oracle, on tiny configs that exercise every branch."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset16 as ops
import pytest
import torch

from cascadia.engine import graphs
from cascadia.engine.batch import Segment
from cascadia.engine.compiled import compile_config
from cascadia.engine.engine import StageEngine
from cascadia.engine.generate import generate
from cascadia.engine.settings import EngineSettings, preset
from cascadia.model.checkpoint import load_stage
from cascadia.model.config import load_shape
from cascadia.sampling_params import SamplingParams
from tests.oracle import dequantised_oracle, greedy, layer_outputs, load_oracle, relative_rms

PROMPTS = {
    "short": [1, 17, 250, 3, 99, 480, 12, 7, 300, 45, 45, 46],
    "long": [1, *range(20, 70)],
}


def whole_model(path, settings=None):
    shape = load_shape(path)
    return StageEngine(load_stage(path, 0, shape.num_layers), settings or EngineSettings())


def run_prompt(engine: StageEngine, ids: list[int]) -> tuple[list[np.ndarray], np.ndarray]:
    trace: list[np.ndarray] = []
    engine.open("s")
    result = engine.step([Segment("s", 0, len(ids))], np.array(ids), trace=trace)
    engine.close("s")
    return trace, result.logits


def run_streams_together(engine: StageEngine, prompts: list[list[int]]) -> list[np.ndarray]:
    """Every prompt's prefill in one step, then one decode row per stream: each step's hidden rows."""
    names = [f"s{n}" for n in range(len(prompts))]
    for name in names:
        engine.open(name)
    segments = [Segment(name, 0, len(ids)) for name, ids in zip(names, prompts, strict=True)]
    prefill = engine.step(segments, np.concatenate([np.array(ids) for ids in prompts]))
    decode = engine.step(
        [Segment(name, len(ids), 1) for name, ids in zip(names, prompts, strict=True)], np.arange(2, 2 + len(prompts))
    )
    for name in names:
        engine.close(name)
    return [prefill.hidden, decode.hidden]


@pytest.mark.parametrize("variant", ["tiny", "tiny-alt"])
@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_every_layer_matches_the_oracle_in_f32(checkpoints, variant, prompt):
    path = checkpoints[variant]
    ids = PROMPTS[prompt]
    ref_layers, ref_logits = layer_outputs(load_oracle(path), ids)
    ours_layers, ours_logits = run_prompt(whole_model(path), ids)
    assert len(ours_layers) == len(ref_layers)
    for i, (ours, ref) in enumerate(zip(ours_layers, ref_layers, strict=True)):
        assert relative_rms(ours, ref) <= 1e-4, f"layer {i}"
    assert relative_rms(ours_logits, ref_logits) <= 1e-4
    assert (ours_logits.argmax(-1) == ref_logits.argmax(-1)).all()


@pytest.mark.parametrize("variant", ["tiny", "tiny-alt"])
def test_greedy_ids_match_transformers_generate(checkpoints, variant):
    path = checkpoints[variant]
    oracle = load_oracle(path)
    engine = whole_model(path)
    for ids in PROMPTS.values():
        expected = greedy(oracle, ids, 40)
        got = generate(engine, ids, SamplingParams(max_tokens=40), prefill_window=8).token_ids
        assert got == expected


@pytest.mark.parametrize("mode", ["bf16", "f16", "int8", "int4", "w8a8", "w4a8"])
def test_low_precision_layers_stay_within_one_percent_of_the_dequantised_oracle(tiny, mode):
    """Each layer, fed the oracle's input rows, against the oracle run on the dequantised weights."""
    settings = preset(mode)
    shape = load_shape(tiny)
    oracle = load_oracle(tiny)
    dequantised_oracle(oracle, load_stage(tiny, 0, shape.num_layers), settings)
    ids = PROMPTS["long"]
    ref_layers, ref_logits = layer_outputs(oracle, ids)
    for i in range(shape.num_layers):
        engine = StageEngine(load_stage(tiny, i, i + 1), settings)
        engine.open("s")
        trace: list[np.ndarray] = []
        inputs = np.array(ids) if i == 0 else ref_layers[i - 1]
        result = engine.step([Segment("s", 0, len(ids))], inputs, trace=trace)
        assert relative_rms(trace[0], ref_layers[i]) <= 0.01, f"layer {i}"
    assert relative_rms(result.logits, ref_logits) <= 0.01


def test_a_head_stored_in_f32_runs_in_bf16_when_asked_and_a_compressed_one_stays_f32(tiny):
    """The bf16 preset's head: its matmul in bf16 (logits within 1% of the f32 head's, not equal to
    them); an int8 head is left in f32 arithmetic whatever the setting says."""
    weights = load_stage(tiny, 0, load_shape(tiny).num_layers)
    ids = PROMPTS["long"]
    assert preset("bf16").head_compute == "bf16"
    _, bf16_head = run_prompt(StageEngine(weights, preset("bf16")), ids)
    _, f32_head = run_prompt(StageEngine(weights, preset("bf16", head_compute="f32")), ids)
    assert 0 < relative_rms(bf16_head, f32_head) <= 0.01
    _, int8 = run_prompt(StageEngine(weights, preset("int8")), ids)
    _, int8_asked_bf16 = run_prompt(StageEngine(weights, preset("int8", head_compute="bf16")), ids)
    np.testing.assert_array_equal(int8_asked_bf16, int8)
    with pytest.raises(ValueError, match="head_compute 'f16' is not one of f32, bf16"):
        EngineSettings(head_compute="f16")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["f16", "int8", "int4"])
def test_weight_only_quantisation_is_exact_end_to_end_on_the_cpu(tiny, mode):
    """With f32 arithmetic, compressed weights give the dequantised oracle's logits and greedy ids."""
    settings = preset(mode)
    weights = load_stage(tiny, 0, load_shape(tiny).num_layers)
    oracle = load_oracle(tiny)
    dequantised_oracle(oracle, weights, settings)
    ids = PROMPTS["long"]
    _, ref_logits = layer_outputs(oracle, ids)
    _, ours_logits = run_prompt(StageEngine(weights, settings), ids)
    assert relative_rms(ours_logits, ref_logits) <= 1e-3
    assert (ours_logits.argmax(-1) == ref_logits.argmax(-1)).all()


def test_w8a8_multiplies_its_experts_and_head_on_int8_inputs(tiny):
    """w8a8's experts and head multiply int8 activations: near the same weights with f32 activations, not
    equal to them; its attention keeps f32 weights, and the plugins' own default quantisation stays off."""
    settings = preset("w8a8")
    assert (settings.attention_weights, settings.head_weights, settings.expert_weights) == ("f32", "int8", "int8")
    assert compile_config(preset("int8"), "f32")["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == "0"
    assert compile_config(settings, "f32")["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == "32"
    # the iGPU plugin quantises by default where it has no systolic arrays, so int8 there says 0 as well
    assert compile_config(preset("int8", device="GPU"), "f16")["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == "0"
    assert compile_config(preset("w8a8", device="GPU.1"), "f16")["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == "32"
    assert "DYNAMIC_QUANTIZATION_GROUP_SIZE" not in compile_config(preset("int8", device="NPU"), "f16")
    weights = load_stage(tiny, 0, load_shape(tiny).num_layers)
    ids = PROMPTS["long"]
    quantised, _ = run_prompt(StageEngine(weights, settings), ids)
    exact, _ = run_prompt(StageEngine(weights, preset("w8a8", activation_quant_group=0)), ids)
    # the first layer, fed the same ids (later layers carry the earlier ones' differences; each layer
    # against the oracle: the test above)
    assert 1e-5 < relative_rms(quantised[0], exact[0]) <= 0.01
    final = np.random.default_rng(3).normal(size=(6, load_shape(tiny).hidden_size)).astype(np.float32)
    quantised_head = StageEngine(weights, settings).head_logits(final)
    exact_head = StageEngine(weights, preset("w8a8", activation_quant_group=0)).head_logits(final)
    assert 1e-5 < relative_rms(quantised_head, exact_head) <= 0.01


def test_split_expert_graph_with_power_of_two_rescaling_tracks_the_fused_path(tiny):
    """Experts in a compiled model of their own (as for f16 on the iGPU) give the fused path's result."""
    ids = PROMPTS["long"]
    settings = EngineSettings(expert_compute="f16", expert_kernel="grouped")
    assert settings.split_expert_graph and not EngineSettings(expert_compute="bf16").split_expert_graph
    fused_layers, fused_logits = run_prompt(whole_model(tiny), ids)
    split_layers, split_logits = run_prompt(whole_model(tiny, settings), ids)
    assert relative_rms(split_layers[0], fused_layers[0]) <= 0.01
    assert relative_rms(split_logits, fused_logits) <= 0.05


def test_both_checkpoint_layouts_give_identical_outputs(checkpoints):
    ids = PROMPTS["long"]
    for variant in ("tiny", "tiny-alt"):
        hf_layers, hf_logits = run_prompt(whole_model(checkpoints[variant]), ids)
        pub_layers, pub_logits = run_prompt(whole_model(checkpoints[variant + "-published"]), ids)
        for a, b in zip(hf_layers, pub_layers, strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(hf_logits, pub_logits)


def stepped_together(engine: StageEngine, first: int, rows_in, calls: list[int]) -> list[list[np.ndarray]]:
    """Three streams prefilled in windows of different lengths past the global layers' far band, then
    decoding together: every step's per-layer trace (and logits on a last stage). `calls` receives
    how many compiled-model calls each step made."""
    from cascadia.engine import compiled, runners
    from cascadia.engine import engine as engine_module

    calling = (compiled, engine_module, runners)  # every module that calls a compiled model

    seqs = {"a": np.resize(PROMPTS["long"], 150), "b": np.resize(PROMPTS["short"], 170), "c": np.arange(3, 140)}
    windows = {"a": 64, "b": 40, "c": 1}
    positions = dict.fromkeys(seqs, 0)
    for name in seqs:
        engine.open(name)
    traces = []
    counted = compiled.infer

    def counting(request, inputs, outputs=None):
        calls[-1] += 1
        return counted(request, inputs, outputs)

    for module in calling:
        module.infer = counting
    try:
        while any(positions[n] < len(seqs[n]) for n in seqs):
            segments = [
                Segment(n, positions[n], min(windows[n], len(seqs[n]) - positions[n]))
                for n in seqs
                if positions[n] < len(seqs[n])
            ]
            ids = np.concatenate([seqs[s.stream][s.start : s.start + s.length] for s in segments])
            trace: list[np.ndarray] = []
            calls.append(0)
            result = engine.step(segments, ids if first == 0 else rows_in(len(ids)), trace=trace)
            traces.append([*trace, *([] if result.logits is None else [result.logits])])
            for segment in segments:
                positions[segment.stream] += segment.length
    finally:
        for module in calling:
            module.infer = counted
    for name in seqs:
        engine.close(name)
    return traces


@pytest.mark.parametrize(
    ("first", "end", "kv", "experts"),
    [(0, 5, "f32", "f32"), (0, 5, "u8", "f32"), (2, 4, "f32", "f32"), (0, 5, "f32", "bf16")],
)
def test_a_stage_joined_into_one_model_equals_its_layers_called_one_by_one(tiny, first, end, kv, experts):
    """A stage's layers joined into one compiled model (one call per step) give each layer's outputs
    as the layers compiled and called one by one, first and middle stages, sliding and global layers,
    prefill windows and decode rows past the far band, with f32 and u8 keys and values, and with
    experts computed in bf16 inside the f32 stage."""
    shape = load_shape(tiny)
    weights = load_stage(tiny, first, end)
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((400, shape.hidden_size)).astype(np.float32)
    traces, calls, ops_of = {}, {}, {}
    for joined in (True, False):
        settings = EngineSettings(kv_precision=kv, joined_layers=joined, expert_compute=experts)
        engine = StageEngine(weights, settings)
        calls[joined] = []
        traces[joined] = stepped_together(engine, first, lambda n: rows[:n], calls[joined])
        ops_of[joined] = engine.runtime_ops()
    for step, (together, apart) in enumerate(zip(traces[True], traces[False], strict=True)):
        for n, (a, b) in enumerate(zip(together, apart, strict=True)):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max(), err_msg=f"step {step}, output {n}")
    around = int(first == 0) + int(weights.head is not None)  # the embedding and the head
    assert set(calls[True]) == {1 + around} and set(calls[False]) == {end - first + around}
    for together, apart in zip(ops_of[True], ops_of[False], strict=True):
        for kind in ("GatherMatmul", "FullyConnected", "MatMul"):
            assert together.get(kind, 0) == apart.get(kind, 0), (kind, together, apart)


@pytest.mark.parametrize("mode", ["f32", "bf16", "int8", "int4"])
def test_expert_banks_compile_to_fused_gather_matmuls(tiny, mode):
    """Routed + shared experts (and dense slices, the iGPU's form) run as fused MoE kernels, not a Tile over all."""
    engine = StageEngine(load_stage(tiny, 0, 3), preset(mode, dense_ffn="experts", expert_kernel="fused"))
    for layer_ops in engine.runtime_ops():
        assert layer_ops.get("GatherMatmul", 0) == 3, layer_ops
        assert "Tile" not in layer_ops and "ScatterElementsUpdate" not in layer_ops


def test_values_meant_for_bf16_round_to_nearest_even():
    """Activations (in the graph) and weights (on the host) go to bf16 rounded to nearest, ties to
    even, as torch rounds them, where the CPU plugin's own convert drops the low bits."""
    rng = np.random.default_rng(11)
    values = (rng.standard_normal((64, 64)) * 3).astype(np.float32)
    ties = values.view(np.uint32).copy()
    ties[:8] = (ties[:8] & 0xFFFF0000) | 0x8000  # exactly halfway between two bf16 values
    values = ties.view(np.float32)
    expected = torch.from_numpy(values).to(torch.bfloat16).float().numpy()
    x = ops.parameter([-1, 64], ov.Type.f32, name="x")
    model = ov.Model([ops.convert(graphs.to_compute(x, "bf16"), "f32")], [x])
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    np.testing.assert_array_equal(compiled({"x": values})[0], expected)
    np.testing.assert_array_equal(graphs.bf16_rounded(values), expected)
    assert not np.array_equal(values.view(np.uint32) & 0xFFFF0000, expected.view(np.uint32))


@pytest.mark.parametrize("kernel", ["fused", "grouped"])
def test_bf16_experts_run_in_bf16_inside_the_f32_stage(tiny, kernel):
    """The bf16 preset's stage is one compiled model: its expert matmuls run in bf16, its attention
    projections and router in f32."""
    shape = load_shape(tiny)
    engine = StageEngine(load_stage(tiny, 0, shape.num_layers), preset("bf16", expert_kernel=kernel))
    assert engine.joined_layers
    expert_op = "GatherMatmul" if kernel == "fused" else "FullyConnected"
    for layer, layer_ops in enumerate(engine.runtime_ops(precisions=True)):
        if not shape.is_dense(layer):
            assert layer_ops.get(f"{expert_op}/bf16", 0) >= 2, layer_ops
        assert layer_ops.get("FullyConnected/f32", 0) >= 2, layer_ops  # q/k/v/r stacked, then o


@pytest.mark.parametrize("mode", ["f32", "bf16", "int8", "int4"])
def test_grouped_experts_equal_the_fused_kernel(tiny, mode):
    """Each expert's rows as one matmul give the fused kernel's outputs, rows of many streams at once."""
    shape = load_shape(tiny)
    weights = load_stage(tiny, 0, shape.num_layers)
    engines = {kernel: StageEngine(weights, preset(mode, expert_kernel=kernel)) for kernel in ("fused", "grouped")}
    per_bank = 2 * (shape.n_routed_experts + shape.n_shared_experts)  # gate and up stacked, then down
    for layer, layer_ops in zip(range(shape.num_layers), engines["grouped"].runtime_ops(), strict=False):
        if not shape.is_dense(layer):
            assert "GatherMatmul" not in layer_ops and layer_ops.get("FullyConnected", 0) >= per_bank, layer_ops
    if mode == "bf16":
        # bf16 arithmetic rounds the two orders differently, and across layers a rounding can flip a
        # near-tie in routing: each bank is compared on the same inputs instead of the whole model
        for fused, grouped in zip(
            *(bank_outputs(weights, preset(mode, expert_kernel=k)) for k in ("fused", "grouped")), strict=True
        ):
            assert relative_rms(grouped, fused) <= 1e-2
        return
    outputs = {kernel: run_streams_together(engine, list(PROMPTS.values())) for kernel, engine in engines.items()}
    for fused, grouped in zip(outputs["fused"], outputs["grouped"], strict=True):
        assert relative_rms(grouped, fused) <= 1e-5


def bank_outputs(weights, settings: EngineSettings, rows: int = 24) -> list[np.ndarray]:
    """Each sparse layer's expert bank alone, in the settings' expert precision, on the same random rows."""
    shape = weights.shape
    rng = np.random.default_rng(5)
    x = rng.standard_normal((rows, shape.hidden_size)).astype(np.float32)
    e, s, top_k = shape.n_routed_experts, shape.n_shared_experts, shape.num_experts_per_tok
    # as the router lays them out: each row's chosen routed experts, then the shared ones
    routed = np.stack([rng.choice(e, top_k, replace=False) for _ in range(rows)])
    index = np.concatenate([routed, np.tile(np.arange(e, e + s), (rows, 1))], axis=1).astype(np.int32)
    weight = rng.random((rows, top_k + s)).astype(np.float32)
    outputs = []
    for layer in weights.layers:
        if shape.is_dense(layer.index):
            continue
        model = graphs.expert_graph(shape, layer, settings.expert_weights, 1.0, settings.ffn_form)
        # compiled as the engine compiles it: at the experts' precision when they run apart, else
        # (bf16 experts typed in the graph) at the residual stream's
        compute = settings.expert_compute if settings.split_expert_graph else settings.residual_compute
        compiled = ov.Core().compile_model(model, settings.device, compile_config(settings, compute))
        outputs.append(compiled({"mlp_input": x, "expert_index": index, "expert_weight": weight})["expert_out"])
    return outputs


@pytest.mark.parametrize("mode", ["f32", "bf16", "int4"])
def test_dense_slices_as_plain_matmuls_equal_the_expert_kernel(tiny, mode):
    """The CPU's form of what every row runs (its default): a dense MLP, and a sparse layer's shared
    experts beside its routed bank, as plain matmuls give the expert kernel's outputs."""
    shape = load_shape(tiny)
    assert shape.is_dense(0) and not shape.is_dense(1)
    weights = load_stage(tiny, 0, 2)
    ids = PROMPTS["long"]
    outputs, ops_by_form = {}, {}
    for form in ("experts", "matmul"):
        engine = StageEngine(weights, preset(mode, dense_ffn=form, expert_kernel="fused"))
        ops_by_form[form] = engine.runtime_ops()
        outputs[form] = run_prompt(engine, ids)[0]
    dense_ops, sparse_ops = ops_by_form["matmul"]
    assert "GatherMatmul" not in dense_ops and sparse_ops.get("GatherMatmul", 0) == 3
    # the shared experts' stacked gate and up, and their joined down projection
    sparse_slices = ops_by_form["experts"][1]
    assert sparse_ops.get("FullyConnected", 0) == sparse_slices.get("FullyConnected", 0) + 2, (
        sparse_ops,
        sparse_slices,
    )
    for matmul, slices in zip(outputs["matmul"], outputs["experts"], strict=True):
        assert relative_rms(matmul, slices) <= (1e-2 if mode == "bf16" else 1e-5)


@pytest.mark.slow
def test_a_prompt_of_thousands_of_tokens_in_windows_matches_transformers(tiny):
    """Far past the sliding window (8), the relative extent (12) and many prefill windows; every
    layer's last rows and the greedy continuation as the oracle computes them."""
    ids = [1, *np.random.default_rng(8).integers(3, 500, size=2999).tolist()]
    engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings(context=3100))
    engine.open("long")
    position, trace = 0, []
    while position < len(ids):
        n = min(256, len(ids) - position)
        trace = []
        logits = engine.step([Segment("long", position, n)], np.array(ids[position : position + n]), trace=trace)
        position += n
    model = load_oracle(tiny)
    layers, ref_logits = layer_outputs(model, ids)
    last = len(ids) - len(trace[0])  # the last window's rows
    for i, (ours, theirs) in enumerate(zip(trace, layers, strict=True)):
        assert relative_rms(ours, theirs[last:]) <= 1e-4, f"layer {i}"
    assert relative_rms(logits.logits, ref_logits[last:]) <= 1e-4
    ours = generate(whole_model(tiny, EngineSettings(context=3100)), ids, SamplingParams(max_tokens=8), 256)
    assert ours.token_ids == greedy(model, ids, 8)
