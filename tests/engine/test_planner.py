"""The fleet planner, from tables: fixed and balanced splits, and fleets that cannot fit."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

from cascadia.engine.batch import Segment
from cascadia.engine.engine import StageEngine
from cascadia.engine.settings import EngineSettings
from cascadia.model.checkpoint import load_stage
from cascadia.model.config import load_shape
from cascadia.planner import (
    GIB,
    PlanError,
    PlanRequest,
    floor_throughput,
    parse_size,
    plan_fleet,
    preset_shape,
)

FLEET = tuple(f"pc-{i:02d}" for i in range(1, 12))


def test_the_seed_split_of_six_layers_per_node_fits_the_975b_model_on_eleven_64gb_nodes():
    shape = preset_shape("inkling-975b")
    plan = plan_fleet(shape, PlanRequest(FLEET, 61 * GIB, layers_per_node=6))
    assert plan.ranges == [(6 * i, 6 * i + 6) for i in range(11)]
    assert [s.node for s in plan.stages] == list(FLEET)
    assert all(s.total_bytes <= 61 * GIB for s in plan.stages)
    # the first node's two dense layers make it lighter; the last carries the head
    assert plan.stages[0].weight_bytes < plan.stages[1].weight_bytes < plan.stages[-1].weight_bytes


def test_the_automatic_split_fits_and_says_why_it_differs():
    shape = preset_shape("inkling-975b")
    request = PlanRequest(FLEET, 61 * GIB)
    fixed = plan_fleet(shape, PlanRequest(FLEET, 61 * GIB, layers_per_node=6))
    auto = plan_fleet(shape, request)
    assert auto.mode == "balanced"
    ranges = auto.ranges
    assert ranges[0][0] == 0 and ranges[-1][1] == 66
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # contiguous, no gaps
    assert max(s.total_bytes for s in auto.stages) <= max(s.total_bytes for s in fixed.stages)
    assert ranges != fixed.ranges
    assert ranges[0][1] > 6  # node 0 holds the light dense layers, so it takes more
    assert "pc-01" in auto.note and "lighter" in auto.note


@pytest.mark.parametrize(
    ("request_kw", "message"),
    [
        ({"nodes": FLEET[:5]}, "exceed their 61.0 GiB"),
        ({"layers_per_node": 5}, "need 14 nodes; the fleet has 11"),
        ({"expert_weights": "f16", "layers_per_node": 6}, "exceed"),
        ({"node_memory": GIB}, "leaves nothing"),
        ({"nodes": ()}, "no nodes"),
    ],
)
def test_a_fleet_that_cannot_hold_the_model_says_why(request_kw, message):
    kw = {"nodes": FLEET, "node_memory": 61 * GIB} | request_kw
    with pytest.raises(PlanError, match=message):
        plan_fleet(preset_shape("inkling-975b"), PlanRequest(**kw))


def test_kv_budget_counts_against_node_memory():
    shape = preset_shape("inkling-975b")
    small = plan_fleet(shape, PlanRequest(FLEET, 61 * GIB, layers_per_node=6, streams=8))
    big = plan_fleet(shape, PlanRequest(FLEET, 61 * GIB, layers_per_node=6, streams=88))
    assert big.stages[1].kv_bytes > small.stages[1].kv_bytes > 0
    with pytest.raises(PlanError, match="KV"):
        plan_fleet(shape, PlanRequest(FLEET, 61 * GIB, layers_per_node=6, context=512 * 1024))


@pytest.mark.parametrize("kv_precision", ["f32", "u8"])
def test_planned_state_is_what_an_engine_holds_once_its_streams_fill_their_context(tiny, kv_precision):
    """Three streams on a stage sized for them (as the operator starts shards) stepped together to the
    end of their budget, against the plan's state for the same stage: ring slots, global-layer blocks
    and far stacks all count."""
    shape = load_shape(tiny)
    streams, context = 3, 400
    settings = EngineSettings(context=context, kv_precision=kv_precision, planned_streams=streams)
    engine = StageEngine(load_stage(tiny, 0, shape.num_layers), settings)
    names = [f"s{n}" for n in range(streams)]
    for name in names:
        engine.open(name)
    rng = np.random.default_rng(0)
    position, window = 0, 64
    while position < context:  # prompts in windows, then a decode row at the last position
        rows = min(window, context - 1 - position) or 1
        segments = [Segment(name, position, rows) for name in names]
        engine.step(segments, rng.integers(3, shape.unpadded_vocab_size, size=rows * streams))
        position += rows
    request = PlanRequest(("a",), 64 * GIB, streams=streams, context=context, kv_precision=kv_precision)
    stage = plan_fleet(shape, request).stages[0]
    assert stage.far_stack_bytes > 0
    assert engine.held_state_bytes() == stage.state_bytes
    alone = plan_fleet(shape, PlanRequest(("a",), 64 * GIB, streams=streams, context=context, streams_per_step=1))
    assert alone.stages[0].far_stack_bytes == 0  # a lone stream's far blocks are read in place


def test_far_stacks_count_only_for_contexts_past_the_band_and_streams_stepped_together():
    shape = preset_shape("inkling-975b")

    def stacks(**kw) -> int:
        return plan_fleet(shape, PlanRequest(FLEET, 64 * GIB, layers_per_node=6, **kw)).stages[1].far_stack_bytes

    assert stacks(context=1024) == 0  # within the relative-bias band: no far keys
    long = {"context": 8192, "streams": 16}
    assert stacks(**long, streams_per_step=1) == 0
    assert stacks(**long, streams_per_step=8) * 2 == stacks(**long)  # None: every stream in one step
    assert stacks(**long, streams_per_step=64) == stacks(**long)  # never more than the planned streams


def test_floor_throughput_grows_with_streams_and_saturates():
    shape = preset_shape("inkling-975b")
    request = PlanRequest(FLEET, 61 * GIB, layers_per_node=6)
    plan = plan_fleet(shape, request)
    rates = [floor_throughput(shape, plan, request, n, 100e9) for n in (1, 8, 88, 176)]
    assert rates == sorted(rates)
    assert rates[1] == pytest.approx(8 * rates[0], rel=0.05)  # fewer groups than stages: linear
    assert rates[3] < 2 * rates[2]  # distinct experts saturate: sub-linear


def test_small_checkpoint_plans_on_two_nodes(tiny):
    shape = load_shape(tiny)
    plan = plan_fleet(shape, PlanRequest(("a", "b"), GIB, runtime_overhead=GIB // 2))
    assert plan.ranges[0][0] == 0 and plan.ranges[-1][1] == shape.num_layers and len(plan.stages) == 2


@pytest.mark.parametrize(("text", "value"), [("64Gi", 64 * GIB), ("1.5G", 1_500_000_000), ("512Mi", 512 * 2**20)])
def test_sizes_parse_like_kubernetes_quantities(text, value):
    assert parse_size(text) == value


def test_bad_sizes_are_named():
    with pytest.raises(PlanError, match="'lots'"):
        parse_size("lots")


def _plan(*args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "cascadia.cli", "plan", "--preset", "inkling-975b", "--node-memory", "61Gi", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_plan_command_prints_json_for_the_975b_preset():
    done = _plan("--nodes", "11", "--layers-per-node", "6", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [p["startLayer"] for p in out["plan"]] == list(range(0, 66, 6))
    assert set(out["floorTokensPerS"]) >= {"1", "88", "176"}
    bad = _plan("--nodes", "3")
    assert bad.returncode == 2 and "exceed" in bad.stderr


def test_the_small_preset_has_inklings_shape_at_a_quarter_of_the_size():
    small, large = preset_shape("inkling-small-276b"), preset_shape("inkling-975b")

    def billions(shape, count) -> float:
        return (sum(count(i) for i in range(shape.num_layers)) + 2 * shape.vocab_size * shape.hidden_size) / 1e9

    # the text model alone (no MTP head, no vision or audio towers): a few percent under the headline figures
    assert 250 < billions(small, small.layer_parameter_count) < 276
    assert 11.5 < billions(small, small.active_layer_parameter_count) < 12.5
    assert [i for i, a in enumerate(small.attention) if a.kind == "global"] == [5, 11, 17, 23, 29, 35, 41]
    assert small.is_dense(1) and not small.is_dense(2) and large.num_layers == 66
    plan = plan_fleet(small, PlanRequest(tuple(f"pc-{i}" for i in range(4)), parse_size("61Gi")))
    assert plan.ranges[0][0] == 0 and plan.ranges[-1][1] == 42
    with pytest.raises(PlanError, match="exceed"):
        plan_fleet(small, PlanRequest(("pc-0", "pc-1"), parse_size("61Gi"), layers_per_node=21))
