"""`cascadia bench engine`: each precision with each expert kernel asked for, through the real command."""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time

import numpy as np
import pytest

from cascadia.bench.engine import OTHER_OPS, op_breakdowns, step_weight_bytes, uniform_routed
from cascadia.cpu_isa import AMX_FLAGS, ONEDNN_ISA_VARIABLE, cpu_flags, isa_cap, read_cpuinfo
from cascadia.engine.batch import Segment
from cascadia.engine.engine import StageEngine
from cascadia.engine.settings import EngineSettings, preset
from cascadia.model.config import load_shape
from cascadia.model.formats import stored_bytes
from cascadia.model.loader import load_stage
from tests.services.test_cli import cascadia


def test_each_expert_kernel_is_measured_under_its_own_label(tiny, tmp_path):
    done = cascadia(
        "bench", "engine", "--model", str(tiny), "--out", str(tmp_path), "--streams", "1,4",
        "--precisions", "f32,int8", "--expert-kernels", "auto,fused", "--steps", "2", "--repeats", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "engine.json").read_text())
    kernels = {label: entry["expert_kernel"] for label, entry in summary["engine"].items()}
    assert kernels == {"f32": "grouped", "f32 fused": "fused", "int8": "fused", "int8 fused": "fused"}
    assert "GatherMatmul" not in summary["engine"]["f32"]["fused_ops"]
    assert summary["engine"]["f32 fused"]["fused_ops"].get("GatherMatmul") == 3
    for entry in summary["engine"].values():
        assert set(entry["decode"]) == {"1", "4"} and all(r["tokens_per_s"] > 0 for r in entry["decode"].values())
    # the kernels of one precision are timed in turn, and each after the first against it, round by round
    for count in ("1", "4"):
        base, other = summary["engine"]["f32"]["decode"][count], summary["engine"]["f32 fused"]["decode"][count]
        assert len(base["rounds_s"]) == len(other["rounds_s"]) == 2
        assert other["paired_vs_f32"] == pytest.approx(median_ratio(base["rounds_s"], other["rounds_s"]))
        assert "paired_vs_f32" not in base
    # transformers runs its rounds in turn with each precision's engines, and each ratio is paired with it
    for label, entry in summary["engine"].items():
        beside = summary["transformers"]["passes"][label.split()[0]]
        for count, result in entry["decode"].items():
            oracle = beside["decode"][count]["rounds_s"]
            assert result["vs_transformers_f32"] == pytest.approx(median_ratio(oracle, result["rounds_s"]))
            # what an engine reading only its floor's bytes would reach against the same transformers rounds
            at_floor = int(count) / result["floor_step_s"] / beside["decode"][count]["tokens_per_s"]
            assert result["floor_vs_transformers_f32"] == pytest.approx(at_floor)
        prefill = median_ratio(beside["prefill"]["rounds_s"], entry["prefill_rounds_s"])
        assert entry["prefill_vs_transformers_f32"] == pytest.approx(prefill)
    assert summary["transformers"]["decode"] == summary["transformers"]["passes"]["f32"]["decode"]
    # both floors divide the same step bytes: their fractions differ by the two rates' ratio
    assert set(summary["matvec_bytes_per_s"]) == set(summary["read_bandwidth_bytes_per_s"]) == {"f32", "int8"}
    for label, entry in summary["engine"].items():
        matvec = summary["matvec_bytes_per_s"][label.split()[0]]
        assert matvec > 0
        for result in entry["decode"].values():
            ratio = result["fraction_of_matvec_floor"] / result["fraction_of_floor"]
            assert ratio == pytest.approx(summary["read_bandwidth_bytes_per_s"][label.split()[0]] / matvec)
    # the floor counts the experts transformers' router chose for the same kind of rows
    shape = load_shape(tiny)
    for entry in summary["engine"].values():
        for count, result in entry["decode"].items():
            routed = result["floor_routed_experts"]
            assert result["floor_routing"] == "measured"
            if count == "1":
                assert routed == shape.num_experts_per_tok  # one row's top-k are distinct
            else:
                assert shape.num_experts_per_tok < routed <= shape.n_routed_experts
    # the machine it ran on, and how much of each step's weights its last-level cache could hold
    machine = summary["machine"]
    assert machine["device"] == "CPU" and machine["logical_cpus"] >= 1
    assert "FP32" in machine["device_capabilities"] and machine["versions"]["openvino"].startswith("2026.4.1")
    amx_cap = isa_cap("auto", cpu_flags(read_cpuinfo(), AMX_FLAGS), os.environ)
    assert machine["onednn_max_cpu_isa"] == (amx_cap or os.environ.get(ONEDNN_ISA_VARIABLE) or None)
    for label, entry in summary["engine"].items():
        bandwidth = summary["read_bandwidth_bytes_per_s"][label.split()[0]]
        for result in entry["decode"].values():
            assert result["step_weight_bytes"] == pytest.approx(result["floor_step_s"] * bandwidth)
            if machine["last_level_cache_bytes"] is not None:
                share = min(1.0, machine["last_level_cache_bytes"] / result["step_weight_bytes"])
                assert result["cache_share_of_step_bytes"] == pytest.approx(share)
    assert (tmp_path / "engine.png").stat().st_size > 0


def test_the_floor_reads_each_chosen_expert_once(tiny):
    shape = load_shape(tiny)
    sparse = sum(not shape.is_dense(i) for i in range(shape.num_layers))
    one_expert = 3 * stored_bytes((shape.moe_intermediate_size, shape.hidden_size), "f32")
    uniform = step_weight_bytes(shape, "f32", 4)
    assert step_weight_bytes(shape, "f32", 4, uniform_routed(shape, 4)) == pytest.approx(uniform)
    assert uniform - step_weight_bytes(shape, "f32", 4, 3.0) == pytest.approx(
        (uniform_routed(shape, 4) - 3.0) * one_expert * sparse
    )


def test_the_floor_reads_weights_computed_in_bf16_as_two_bytes_a_value(tiny):
    """bf16 arithmetic folds f32-stored experts and head into bf16 constants: the step reads half their bytes."""
    shape = load_shape(tiny)
    h = shape.hidden_size
    per_routed = {
        mode: step_weight_bytes(shape, mode, 4, 4.0) - step_weight_bytes(shape, mode, 4, 3.0)
        for mode in ("f32", "bf16")
    }
    assert per_routed["bf16"] == pytest.approx(per_routed["f32"] / 2)
    f32_only = step_weight_bytes(shape, "f32", 4, 3.0) - step_weight_bytes(shape, "bf16", 4, 3.0)
    head = stored_bytes((shape.unpadded_vocab_size, h), "f32")
    dense = sum(shape.is_dense(i) for i in range(shape.num_layers)) * 3 * shape.intermediate_size * h * 4
    sparse = sum(not shape.is_dense(i) for i in range(shape.num_layers))
    experts = sparse * (3.0 + shape.n_shared_experts) * 3 * shape.moe_intermediate_size * h * 4
    assert f32_only == pytest.approx((head + dense + experts) / 2)


def median_ratio(base: list[float], own: list[float]) -> float:
    return statistics.median(b / o for b, o in zip(base, own, strict=True))


def test_a_stage_joined_and_called_layer_by_layer_are_timed_round_by_round(tiny, tmp_path):
    done = cascadia(
        "bench", "engine", "--model", str(tiny), "--out", str(tmp_path), "--streams", "2", "--precisions", "f32",
        "--layer-calls", "joined,apart", "--steps", "2", "--repeats", "2", "--no-oracle",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    engines = json.loads((tmp_path / "engine.json").read_text())["engine"]
    assert {label: entry["joined_layers"] for label, entry in engines.items()} == {"f32": True, "f32 per layer": False}
    joined, apart = engines["f32"]["decode"]["2"], engines["f32 per layer"]["decode"]["2"]
    assert apart["paired_vs_f32"] == pytest.approx(median_ratio(joined["rounds_s"], apart["rounds_s"]))
    # without transformers beside, the floor assumes uniformly random routing
    assert joined["floor_routing"] == "uniform"
    assert joined["floor_routed_experts"] == pytest.approx(uniform_routed(load_shape(tiny), 2))


def test_a_decode_step_is_broken_down_by_op_kind(tiny, tmp_path):
    done = cascadia(
        "bench", "engine", "--model", str(tiny), "--out", str(tmp_path), "--streams", "1,3", "--precisions", "f32",
        "--expert-kernels", "fused,grouped", "--layer-calls", "joined,apart", "--steps", "3", "--repeats", "1",
        "--no-oracle", "--op-times",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    engines = json.loads((tmp_path / "engine.json").read_text())["engine"]
    assert set(engines) == {"f32 fused", "f32 grouped", "f32 fused per layer", "f32 grouped per layer"}
    for label, entry in engines.items():
        for count in ("1", "3"):
            breakdown = entry["decode"][count]["op_times"]
            op_ms = breakdown["op_ms"]
            assert op_ms and all(v >= 0 for v in op_ms.values())
            assert breakdown["ops_ms"] == pytest.approx(sum(op_ms.values()))
            assert breakdown["ops_ms"] > 0 and breakdown["step_ms"] > 0
            kinds = {kind.split("/")[0] for kind in op_ms}
            # the bank's kernel shows in where the time went: the plugin's fused MoE op, or matmuls
            assert ("GatherMatmul" in kinds) == label.startswith("f32 fused"), label
            assert "FullyConnected" in kinds
    # the plot's bars: each engine's step at its most streams, its parts adding up to the step (or to its
    # ops, where the plugin's timers add up to more)
    summary = json.loads((tmp_path / "engine.json").read_text())
    bars = op_breakdowns(summary)
    assert set(bars) == {f"{label}, 3 streams" for label in engines}
    for label, parts in bars.items():
        step = engines[label.split(",")[0]]["decode"]["3"]["op_times"]
        assert sum(parts.values()) == pytest.approx(max(step["step_ms"], step["ops_ms"]))
        assert parts[OTHER_OPS] >= -1e-9
    assert (tmp_path / "engine.png").stat().st_size > 0


def test_op_times_need_an_engine_that_times_its_ops(tiny):
    shape = load_shape(tiny)
    plain = StageEngine(load_stage(tiny, 0, 1), preset("f32"))
    with pytest.raises(ValueError, match="profile_ops"):
        plain.op_times()
    timed = StageEngine(load_stage(tiny, 0, shape.num_layers), preset("f32", profile_ops=True))
    timed.open("s")
    timed.step([Segment("s", 0, 4)], np.arange(3, 7))
    per_kind = timed.op_times()
    assert per_kind and all(kind.count("/") == 1 for kind in per_kind)
    assert any(kind.startswith("Gather/") for kind in per_kind)  # the embedding's lookup


def test_an_unknown_layer_call_is_named_in_the_error(tmp_path):
    done = cascadia("bench", "engine", "--out", str(tmp_path), "--layer-calls", "joined,fused")
    assert done.returncode == 2
    assert "'fused' is not one of joined, apart" in done.stderr


def test_an_unknown_expert_kernel_is_named_in_the_error(tmp_path):
    done = cascadia("bench", "engine", "--out", str(tmp_path), "--expert-kernels", "fused,gemv")
    assert done.returncode == 2
    assert "'gemv' is not one of auto, fused, grouped, vnni" in done.stderr


def test_the_int8_kernel_asked_for_a_precision_without_int8_inputs_is_refused_before_anything_runs(tmp_path):
    done = cascadia("bench", "engine", "--out", str(tmp_path), "--precisions", "w8a8,int8", "--expert-kernels", "vnni")
    assert done.returncode == 2
    assert "--precisions int8 with --expert-kernels vnni" in done.stderr
    assert "needs activation_quant_group 32" in done.stderr
    assert not list(tmp_path.iterdir())


def test_the_device_picks_the_expert_kernel_unless_told():
    assert EngineSettings().expert_kernel_path == "grouped"
    assert EngineSettings(expert_weights="int8").expert_kernel_path == "fused"
    assert preset("bf16").expert_kernel_path == "fused"
    assert EngineSettings(device="GPU").expert_kernel_path == "fused"
    assert EngineSettings(expert_kernel="fused").expert_kernel_path == "fused"
    assert EngineSettings(device="GPU", expert_kernel="grouped").ffn_form.experts == "grouped"
    # banks read already compressed (a GGUF's blocks) keep the fused kernel unless one is named
    assert EngineSettings().ffn_form.compressed_experts == "fused"
    assert EngineSettings(expert_kernel="grouped").ffn_form.compressed_experts == "grouped"
    # int8 banks with int8 activations run on the project's int8 kernel on the CPU (grouped where it
    # cannot: tests/engine/test_cpu_kernels.py)
    assert preset("w8a8").expert_kernel_path == preset("w8a8").ffn_form.compressed_experts == "vnni"
    assert preset("w8a8", device="GPU").ffn_form.compressed_experts == "fused"
    assert preset("w8a8", expert_kernel="fused").ffn_form.compressed_experts == "fused"
    # bf16 experts run typed inside the residual stream's f32 graph; f16 ones (the iGPU's) apart
    assert preset("bf16").ffn_form.compute == "bf16" and not preset("bf16").split_expert_graph
    assert EngineSettings().ffn_form.compute == "f32"
    assert EngineSettings(expert_compute="f16").split_expert_graph


def test_a_negative_activation_group_is_refused():
    with pytest.raises(ValueError, match="activation_quant_group must be >= 0, got -32"):
        EngineSettings(activation_quant_group=-32)


def test_an_unknown_expert_kernel_setting_is_refused():
    with pytest.raises(ValueError, match="expert_kernel 'gemv' is not one of auto, fused, grouped"):
        EngineSettings(expert_kernel="gemv")  # type: ignore[arg-type]


def test_rounds_alternate_their_order_and_each_starts_after_a_quiet_spell():
    from cascadia.bench.engine import timed_rounds

    calls: list[tuple[str, float]] = []

    def contender(label: str):
        def round_once() -> float:
            calls.append((label, time.perf_counter()))
            return 1.0

        return round_once

    rounds = timed_rounds({"a": contender("a"), "b": contender("b")}, repeats=3, settle_s=0.05)
    assert rounds == {"a": [1.0] * 3, "b": [1.0] * 3}
    timed = calls[2:]  # after one warm-up round each
    assert [label for label, _ in timed] == ["a", "b", "b", "a", "a", "b"]
    assert all(later - earlier >= 0.05 for (_, earlier), (_, later) in itertools.pairwise(timed))


def test_context_bench_decodes_several_long_streams_together(tiny, tmp_path):
    """`--streams` gives every length that many prompts, decoded in one batch; state is counted for all."""
    summaries = {}
    for streams in (1, 3):
        out = tmp_path / str(streams)
        done = cascadia(
            "bench", "context", "--model", str(tiny), "--out", str(out), "--lengths", "40,150",
            "--prefill-window", "64", "--streams", str(streams),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        summaries[streams] = json.loads((out / "context.json").read_text())
        assert (out / "context.png").is_file()
    assert summaries[3]["streams"] == 3
    for alone, together in zip(summaries[1]["rows"], summaries[3]["rows"], strict=True):
        assert together["state_bytes"] == 3 * alone["state_bytes"] > 0
        assert together["bytes_per_position"] == alone["bytes_per_position"]
        assert together["decode_tokens_per_s"] == pytest.approx(3e3 / together["decode_ms"])
