"""`cascadia bench model`: the 11-node fleet's decode throughput predicted from measured stage times.

The bandwidth floor (`planner.floor_throughput`) assumes every stage reads its weights at the full
memory bandwidth and nothing else costs time. This model replaces both assumptions with what was
measured here: the engine's fraction of the floor at each group size (`cascadia bench engine`), and
the chain's fixed cost per frame per stage (`cascadia bench fleet`: one shard process against the
in-process engine at one stream). The link is the fleet's gigabit Ethernet.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cascadia.bench.report import pyplot
from cascadia.model.config import ModelShape
from cascadia.planner import ROW_BYTES_PER_HIDDEN, FleetPlan, PlanRequest, floor_throughput, stage_step_bytes

SEED_MEASURED = {88: 60.29, 176: 57.72}  # the seed fleet's aggregate decode tok/s


@dataclass(frozen=True)
class Measured:
    fraction_of_floor: dict[int, float]  # rows per step -> engine throughput / bandwidth floor
    frame_overhead_s: float  # per frame per stage, beyond the engine step
    source: str


def interpolate(points: dict[int, float]) -> Callable[[int], float]:
    """Piecewise linear in log(rows), flat beyond the measured ends."""
    xs = sorted(points)

    def at(rows: int) -> float:
        if rows <= xs[0]:
            return points[xs[0]]
        if rows >= xs[-1]:
            return points[xs[-1]]
        hi = next(i for i, x in enumerate(xs) if x >= rows)
        a, b = xs[hi - 1], xs[hi]
        t = (math.log(rows) - math.log(a)) / (math.log(b) - math.log(a))
        return points[a] + t * (points[b] - points[a])

    return at


def predicted_throughput(
    shape: ModelShape,
    plan: FleetPlan,
    request: PlanRequest,
    streams: int,
    bandwidth: float,
    measured: Measured,
    link_bytes_per_s: float = 125e6,
    link_latency_s: float = 100e-6,
) -> float:
    """Decode tok/s with one group per stage in flight, each stage at its measured speed."""
    n = len(plan.stages)
    rows = max(1, math.ceil(streams / n))
    fraction = interpolate(measured.fraction_of_floor)(rows)
    hop = rows * shape.hidden_size * ROW_BYTES_PER_HIDDEN / link_bytes_per_s + link_latency_s
    stage = max(stage_step_bytes(shape, s, request, rows) / (bandwidth * fraction) for s in plan.stages)
    tick = stage + measured.frame_overhead_s + hop
    groups = min(n, math.ceil(streams / rows))
    return rows * groups / (n * tick)


def measured_from(engine_json: Path, fleet_json: Path, precision: str) -> Measured:
    engine = json.loads(engine_json.read_text())
    fleet = json.loads(fleet_json.read_text())
    decode = engine["engine"][precision]["decode"]
    fractions = {int(rows): point["fraction_of_floor"] for rows, point in decode.items()}
    one_shard = fleet["fleets"]["1"]["1"]["decode_tokens_per_s"]
    engine_f32_step = engine["engine"]["f32"]["decode"]["1"]["step_s"]
    overhead = max(0.0, 1.0 / one_shard - engine_f32_step)
    return Measured(fractions, overhead, f"{engine_json} ({precision}), {fleet_json}")


def run_model(
    shape: ModelShape,
    plan: FleetPlan,
    request: PlanRequest,
    measured: Measured,
    bandwidth: float,
    streams: list[int],
    out: Path,
) -> dict[str, Any]:
    rows = []
    for count in streams:
        floor = floor_throughput(shape, plan, request, count, bandwidth)
        predicted = predicted_throughput(shape, plan, request, count, bandwidth, measured)
        rows.append(
            {
                "streams": count,
                "floor_tokens_per_s": floor,
                "predicted_tokens_per_s": predicted,
                "seed_measured_tokens_per_s": SEED_MEASURED.get(count),
            }
        )
    result = {
        "plan": [(s.node, s.start_layer, s.end_layer) for s in plan.stages],
        "bandwidth_bytes_per_s": bandwidth,
        "measured": {
            "fraction_of_floor": measured.fraction_of_floor,
            "frame_overhead_s": measured.frame_overhead_s,
            "source": measured.source,
        },
        "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "model.json").write_text(json.dumps(result, indent=2))
    _plot(rows, out / "model.png")
    return result


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.5, 4))
    x = [r["streams"] for r in rows]
    ax.plot(x, [r["floor_tokens_per_s"] for r in rows], "o--", label="bandwidth floor")
    ax.plot(x, [r["predicted_tokens_per_s"] for r in rows], "o-", label="predicted from measured stages")
    seed = [(r["streams"], r["seed_measured_tokens_per_s"]) for r in rows if r["seed_measured_tokens_per_s"]]
    if seed:
        ax.plot(*zip(*seed, strict=True), "k*", markersize=12, label="seed fleet, measured")
    ax.set(xscale="log", xlabel="concurrent streams", ylabel="aggregate decode tok/s", title="Inkling 975B on 11 nodes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
