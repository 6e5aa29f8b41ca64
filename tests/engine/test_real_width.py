"""Layers at the 975B model's real width (hidden 6144, 64 heads of 128, experts of 3072, dense 24576) from
bf16 and FP8 checkpoints: exact against transformers, quantised as read exactly as the graph would, the
converted form equal to the checkpoint's, and memory within what the plan says, measured as a memory
cgroup enforces it. A few experts and a small vocabulary keep each checkpoint near 2 GB."""

from __future__ import annotations

import gc
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from cascadia.bench.measured import MemoryCgroup, run_measured
from cascadia.bench.stage import serve_measured, source_bytes, stage_plan
from cascadia.engine.batch import Segment
from cascadia.engine.engine import StageEngine
from cascadia.engine.generate import generate
from cascadia.engine.settings import preset
from cascadia.engine.weights import packed_store
from cascadia.model.checkpoint import StageReader, TensorSource, load_stage
from cascadia.model.synthetic_real import write_real_width
from cascadia.sampling_params import SamplingParams
from tests.engine.test_engine_numerics import run_prompt
from tests.oracle import dequantised_oracle, greedy, layer_outputs, load_oracle, relative_rms

pytestmark = pytest.mark.slow

LAYERS, EXPERTS, VOCAB = 2, 4, 1024
IDS = [1, 17, 250, 3, 99, 500, 7, 8, 300, 41, 12, 13, 600, 5, 77, 901, 2, 44]
GIB = 2**30


@pytest.fixture(scope="module")
def big_files(tmp_path_factory) -> Iterator[Path]:
    """A directory for this module's checkpoints, removed when the module ends: each is gigabytes, and
    pytest keeps the temporary directories of the last runs."""
    root = tmp_path_factory.mktemp("real-width")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def scratch(big_files, request) -> Iterator[Path]:
    path = big_files / request.node.name.replace("[", "-").replace("]", "")
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def real_width(big_files) -> Path:
    return write_real_width(big_files / "bf16", LAYERS, EXPERTS, VOCAB, "bf16")


@pytest.fixture(scope="module")
def oracle(real_width, big_files) -> dict:
    """transformers in f32 on the bf16 checkpoint: layer outputs, logits, greedy ids, and the checkpoint
    it writes back in f32 (its own conversion of the bf16 values), then the model is dropped."""
    model = load_oracle(real_width)
    layers, logits = layer_outputs(model, IDS)
    ids = greedy(model, IDS, 6)
    twin = big_files / "f32-twin"
    model.save_pretrained(str(twin))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (twin / name).write_bytes((real_width / name).read_bytes())
    del model
    gc.collect()
    return {"layers": layers, "logits": logits, "greedy": ids, "twin": twin}


def _engine(path: Path, precision: str = "f32", allocate=None) -> StageEngine:
    settings = preset(precision)
    return StageEngine(StageReader(path, 0, LAYERS, settings.stored_forms, allocate), settings)


def test_a_bf16_checkpoint_at_real_width_matches_transformers_in_f32(real_width, oracle):
    engine = _engine(real_width)
    layers, logits = run_prompt(engine, IDS)
    for i, (ours, ref) in enumerate(zip(layers, oracle["layers"], strict=True)):
        assert relative_rms(ours, ref) <= 1e-4, f"layer {i}"
    assert relative_rms(logits, oracle["logits"]) <= 1e-4
    assert (logits.argmax(-1) == oracle["logits"].argmax(-1)).all()
    assert generate(engine, IDS, SamplingParams(max_tokens=6)).token_ids == oracle["greedy"]


def test_the_same_weights_in_bf16_and_in_f32_give_identical_outputs(real_width, oracle):
    assert TensorSource(oracle["twin"]).dtype("lm_head.weight") == "F32"
    _, from_bf16 = run_prompt(_engine(real_width), IDS)
    gc.collect()
    _, from_f32 = run_prompt(_engine(oracle["twin"]), IDS)
    assert np.array_equal(from_bf16, from_f32)


def test_the_published_layout_of_the_same_model_gives_identical_outputs(real_width, scratch):
    published = write_real_width(scratch / "published", LAYERS, EXPERTS, VOCAB, "bf16", layout="published")
    assert TensorSource(published).has("model.llm.layers.1.mlp.experts.w13_weight")
    _, ours = run_prompt(_engine(real_width, "int8"), IDS)
    gc.collect()
    _, theirs = run_prompt(_engine(published, "int8"), IDS)
    assert np.array_equal(ours, theirs)


@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_weights_quantised_as_read_are_the_weights_the_graph_would_quantise(real_width, precision):
    """Each expert quantised as it is read (into OpenVINO-owned memory for int4) gives the very logits
    of the whole f32 stage quantised by the graph: the dequantised-oracle tests of the quantised modes
    hold for both."""
    _, as_read = run_prompt(_engine(real_width, precision, packed_store), IDS)
    gc.collect()
    held = StageEngine(load_stage(real_width, 0, LAYERS), preset(precision))
    _, in_graph = run_prompt(held, IDS)
    assert np.array_equal(as_read, in_graph)


def _torch_dequantised(fp8_dir: Path, out: Path) -> Path:
    """The FP8 checkpoint dequantised by torch's own E4M3 type and the block scales, saved in f32 with
    a config without the quantisation: what transformers loads as the oracle."""
    from safetensors import safe_open

    config = json.loads((fp8_dir / "config.json").read_text())
    block = config.pop("quantization_config")["weight_block_size"]
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    tensors: dict[str, torch.Tensor] = {}
    index = json.loads((fp8_dir / "model.safetensors.index.json").read_text())["weight_map"]
    for file_name in sorted(set(index.values())):
        with safe_open(str(fp8_dir / file_name), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                if name.endswith("_scale_inv"):
                    continue
                tensor = handle.get_tensor(name)
                if tensor.dtype == torch.float8_e4m3fn:
                    scale = handle.get_tensor(name + "_scale_inv")
                    n, k = tensor.shape[-2:]
                    grid = scale.repeat_interleave(block[0], -2)[..., :n, :].repeat_interleave(block[1], -1)[..., :k]
                    tensors[name] = tensor.to(torch.float32) * grid
                else:
                    tensors[name] = tensor.to(torch.float32)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_an_fp8_checkpoint_matches_its_dequantised_oracle(scratch):
    fp8 = write_real_width(scratch / "fp8", LAYERS, EXPERTS, VOCAB, "fp8")
    source = TensorSource(fp8)
    assert source.dtype("model.layers.1.mlp.experts.gate_up_proj") == "F8_E4M3"
    assert source.has("model.layers.1.mlp.experts.gate_up_proj_scale_inv")
    model = load_oracle(_torch_dequantised(fp8, scratch / "dequantised"))
    ref_layers, ref_logits = layer_outputs(model, IDS)
    del model
    gc.collect()
    layers, logits = run_prompt(_engine(fp8), IDS)
    for i, (ours, ref) in enumerate(zip(layers, ref_layers, strict=True)):
        assert relative_rms(ours, ref) <= 1e-4, f"layer {i}"
    assert (logits.argmax(-1) == ref_logits.argmax(-1)).all()


def test_int8_activations_on_int4_experts_stay_within_one_percent_of_the_dequantised_oracle(real_width):
    """w4a8 at the real width: each layer, fed the oracle's input rows, against transformers on the weights
    the stage holds; its attention stays unquantised (quantised attention inputs changed a 975B layer's
    expert choices), and its activations are really quantised (not equal to int4's f32-input layers)."""
    settings = preset("w4a8")
    assert (settings.expert_weights, settings.attention_weights, settings.activation_quant_group) == ("int4", "f32", 32)
    model = load_oracle(real_width)
    dequantised_oracle(model, load_stage(real_width, 0, LAYERS), settings)
    ref_layers, ref_logits = layer_outputs(model, IDS)
    del model
    gc.collect()
    for i in range(LAYERS):
        traces = {}
        for mode in ("w4a8", "int4"):
            engine = StageEngine(StageReader(real_width, i, i + 1, preset(mode).stored_forms), preset(mode))
            engine.open("s")
            trace: list[np.ndarray] = []
            inputs = np.array(IDS) if i == 0 else ref_layers[i - 1]
            result = engine.step([Segment("s", 0, len(IDS))], inputs, trace=trace)
            traces[mode] = trace[0]
            del engine
            gc.collect()
        assert relative_rms(traces["w4a8"], ref_layers[i]) <= 0.01, f"layer {i}"
        assert relative_rms(traces["w4a8"], traces["int4"]) > 1e-5, f"layer {i}"
    assert relative_rms(result.logits, ref_logits) <= 0.01


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cascadia.cli", *args], capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_a_converted_stage_serves_what_the_checkpoint_serves_and_its_conversion_fits(real_width, scratch, precision):
    out = scratch / "converted"
    argv = [sys.executable, "-m", "cascadia.cli", "convert", "--model", str(real_width), "--out", str(out)]
    measured = run_measured([*argv, "--precision", precision, "--json"])
    assert measured.returncode == 0, measured.stderr
    result = json.loads(measured.stdout.strip().splitlines()[-1])
    assert not result["up_to_date"] and result["bytes_written"] > 0
    # never a layer in f32: the process peaks within 1.5 GiB above what it writes
    assert measured.peak_anon_bytes <= result["bytes_written"] + 1.5 * GIB
    assert "converted layer1 (3/4)" in measured.stderr  # progress lines a pod log keeps
    ask = ("--prompt-ids", "1 17 250 3", "--precision", precision, "--json")
    direct = _cli("generate", "--model", str(real_width), *ask)
    served = _cli("generate", "--model", str(out), *ask)
    assert direct.returncode == served.returncode == 0, served.stderr
    assert json.loads(direct.stdout)["token_ids"] == json.loads(served.stdout)["token_ids"]
    again = _cli("convert", "--model", str(real_width), "--out", str(out), "--precision", precision, "--json")
    assert json.loads(again.stdout)["up_to_date"] and json.loads(again.stdout)["bytes_written"] == 0


def test_a_shard_at_real_width_holds_what_the_plan_says_inside_a_memory_cgroup_of_the_plan(real_width):
    """Loaded from the checkpoint (each layer read and quantised as its graph is built), the stage peaks
    within 1.5 GiB above what it then holds; after 16 decode steps of 8 streams it holds at most 1.10 x
    the plan + 512 MiB of anonymous memory, and serves inside a cgroup whose limit is the plan's total."""
    plan, _ = stage_plan(real_width, "int4", 0, LAYERS, 8)
    direct = serve_measured(real_width, "int4", 0, LAYERS, (8,), 16)
    assert direct["returncode"] == 0, direct.get("stderr")
    assert direct["peak_anon_bytes"] <= direct["anon_serving_bytes"] + 1.5 * GIB
    assert direct["anon_serving_bytes"] <= 1.10 * plan.total_bytes + 512 * 2**20
    if not MemoryCgroup.available():
        pytest.skip("no writable memory cgroup hierarchy (needs root)")
    limited = serve_measured(real_width, "int4", 0, LAYERS, (8,), 16, limit=plan.total_bytes)
    assert limited["returncode"] == 0 and limited["cgroup"]["oom_kills"] == 0, limited.get("stderr")
    assert limited["anon_serving_bytes"] <= 1.10 * plan.total_bytes + 512 * 2**20
    # the same shard under a limit far below its weights is killed: the limit is real
    starved = serve_measured(real_width, "int4", 0, LAYERS, (8,), 4, limit=plan.weight_bytes // 3)
    assert starved["returncode"] != 0 and starved["cgroup"]["oom_kills"] >= 1
    assert source_bytes(real_width, 0, LAYERS) > plan.weight_bytes


def test_an_f16_stage_on_the_cpu_holds_what_the_plan_says_though_the_plugin_widens_its_weights(real_width):
    """The CPU plugin holds f16 weights as f32, twice: the plan counts that copy, so the stage serves
    inside a cgroup of the plan (counted at their stored 2 bytes, it held 2.1x the plan)."""
    plan, _ = stage_plan(real_width, "f16", 0, LAYERS, 8)
    assert plan.plugin_copy_bytes > 2 * plan.weight_bytes
    limit = plan.total_bytes if MemoryCgroup.available() else None
    served = serve_measured(real_width, "f16", 0, LAYERS, (8,), 8, limit=limit)
    assert served["returncode"] == 0, served.get("stderr")
    assert served["anon_serving_bytes"] <= 1.10 * plan.total_bytes + 512 * 2**20
    assert served["anon_serving_bytes"] > plan.weight_bytes + plan.plugin_copy_bytes / 2  # the copy is real
