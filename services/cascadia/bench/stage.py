"""`cascadia bench stage`: one stage at the 975B model's real width, from checkpoint to serving.

For each precision: the conversion's throughput (GB/s of source read) and peak memory; the shard's
start-up from the converted form and from the checkpoint; the memory it holds after decode steps
against `cascadia plan`'s total for it (anonymous memory, which the kernel cannot reclaim, and the
same shard run inside a memory cgroup whose limit is the plan's total); decode step time per layer at
several row counts, as a fraction of the bandwidth floor (the weight bytes the step must read, each
distinct expert once, over the machine's measured read bandwidth). Every process is a child of its
own, so that no measurement inherits another's memory.

`python -m cascadia.bench.stage serve MODEL PRECISION A:B ROWS,ROWS STEPS` is the serving child.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cascadia.bench.measured import MemoryCgroup, run_measured
from cascadia.bench.report import pyplot, write_report

GIB = 2**30


@dataclass(frozen=True)
class StageBenchConfig:
    out: Path
    model: Path | None = None  # a real-width checkpoint; None: write one
    layers: int = 2
    experts: int = 8
    vocab: int = 4096
    start: int = 0
    end: int | None = None
    precisions: tuple[str, ...] = ("int4", "int8")
    rows: tuple[int, ...] = (1, 8, 32)
    steps: int = 16


def _child_serve(model: Path, precision: str, start: int, end: int, rows: list[int], steps: int) -> dict[str, Any]:
    import numpy as np

    from cascadia.bench.measured import smaps
    from cascadia.engine.batch import Segment
    from cascadia.engine.loading import load_engine
    from cascadia.engine.settings import preset

    began = time.monotonic()
    engine = load_engine(model, preset(precision, planned_streams=max(rows)), start, end, precision)
    loaded_s = time.monotonic() - began
    anon_loaded = smaps(os.getpid()).get("Anonymous", 0)
    out: dict[str, Any] = {"load_s": loaded_s, "anon_loaded_bytes": anon_loaded, "steps": {}}
    width = engine.shape.hidden_size
    rng = np.random.default_rng(0)
    for count in rows:
        names = [(count, r) for r in range(count)]
        for name in names:
            engine.open(name)
        times = []
        for position in range(steps):
            segments = [Segment(name, position, 1) for name in names]
            if engine.is_first:
                tokens = rng.integers(3, engine.shape.unpadded_vocab_size, count)
            else:
                tokens = rng.standard_normal((count, width), dtype=np.float32)
            t0 = time.perf_counter()
            engine.step(segments, tokens)
            times.append(time.perf_counter() - t0)
        for name in names:
            engine.close(name)
        # the first steps allocate the runtime's buffers and repack weights: the later half is the rate
        out["steps"][str(count)] = statistics.median(times[steps // 2 :])
    out["anon_serving_bytes"] = smaps(os.getpid()).get("Anonymous", 0)
    out["rss_serving_bytes"] = smaps(os.getpid()).get("Rss", 0)
    return out


def serve_measured(
    model: Path, precision: str, start: int, end: int, rows: tuple[int, ...], steps: int, limit: int | None = None
) -> dict[str, Any]:
    """The serving child, measured (inside a memory cgroup of `limit` bytes when given)."""
    argv = [sys.executable, "-m", "cascadia.bench.stage", "serve", str(model), precision, f"{start}:{end}"]
    measured = run_measured([*argv, ",".join(map(str, rows)), str(steps)], limit=limit)
    result: dict[str, Any] = {
        "returncode": measured.returncode,
        "peak_anon_bytes": measured.peak_anon_bytes,
        "peak_rss_bytes": measured.peak_rss_bytes,
        "cgroup": measured.cgroup,
        "limit_bytes": limit,
    }
    if measured.returncode == 0:
        result.update(json.loads(measured.stdout.strip().splitlines()[-1]))
    else:
        result["stderr"] = measured.stderr[-2000:]
    return result


def convert_measured(model: Path, out: Path, precision: str, start: int, end: int) -> dict[str, Any]:
    argv = [sys.executable, "-m", "cascadia.cli", "convert", "--model", str(model), "--out", str(out)]
    argv += ["--precision", precision, "--layers", f"{start}:{end}", "--json"]
    measured = run_measured(argv)
    if measured.returncode != 0:
        raise RuntimeError(f"convert failed: {measured.stderr[-2000:]}")
    result = json.loads(measured.stdout.strip().splitlines()[-1])
    result.update(peak_anon_bytes=measured.peak_anon_bytes, peak_rss_bytes=measured.peak_rss_bytes)
    return result


def source_bytes(model: Path, start: int, end: int) -> int:
    """Bytes of the checkpoint's tensors a conversion of layers [start, end) reads."""
    from cascadia.engine.converted import stage_tensor_prefixes
    from cascadia.model.checkpoint import StageReader, TensorSource

    source = TensorSource(model)
    try:
        prefixes = stage_tensor_prefixes(StageReader(model, start, end))
        return sum(source.nbytes(n) for n in source.names() if any(n.startswith(p) for p in prefixes))
    finally:
        source.close()


def stage_plan(model: Path, precision: str, start: int, end: int, streams: int):
    """`cascadia plan`'s stage for these layers on one node, sized for `streams`, as the shard is started."""
    from cascadia.engine.settings import preset
    from cascadia.model.loader import load_shape
    from cascadia.planner import PlanRequest, plan_stage

    settings = preset(precision)
    request = PlanRequest.from_settings(("node",), 1 << 50, settings, streams=streams)
    return plan_stage(load_shape(model), request, "node", start, end), request


def run_stage_bench(config: StageBenchConfig, say) -> dict[str, Any]:
    from cascadia.bench.engine import read_bandwidth
    from cascadia.bench.machine import describe, machine_summary
    from cascadia.model.loader import load_shape
    from cascadia.model.synthetic_real import write_real_width
    from cascadia.planner import stage_step_bytes

    config.out.mkdir(parents=True, exist_ok=True)
    machine = machine_summary()
    say(f"machine: {describe(machine)}")
    model = config.model
    if model is None:
        model = config.out / "model"
        if not (model / "model.safetensors.index.json").is_file():
            say(f"writing a real-width checkpoint: {config.layers} layers, {config.experts} experts")
            write_real_width(model, config.layers, config.experts, config.vocab, progress=say)
    shape = load_shape(model)
    end = shape.num_layers if config.end is None else config.end
    start = config.start
    bandwidth = read_bandwidth()
    say(f"read bandwidth {bandwidth / 1e9:.1f} GB/s")
    source = source_bytes(model, start, end)
    results: dict[str, Any] = {}
    for precision in config.precisions:
        say(f"{precision}: converting layers {start}:{end} ({source / GIB:.2f} GiB of source)")
        out = config.out / f"converted-{precision}-{start}-{end}"
        converted = convert_measured(model, out, precision, start, end)
        converted["source_bytes"] = source
        converted["gb_per_s"] = source / 1e9 / converted["seconds"] if converted["seconds"] else None
        plan, request = stage_plan(model, precision, start, end, max(config.rows))
        say(f"{precision}: plan {plan.total_bytes / GIB:.2f} GiB; serving from the checkpoint, then converted")
        direct = serve_measured(model, precision, start, end, (1,), 4)
        limit = plan.total_bytes if MemoryCgroup.available() else None
        served = serve_measured(out, precision, start, end, config.rows, config.steps, limit)
        floors = {}
        for rows in config.rows:
            step_bytes = stage_step_bytes(shape, plan, request, rows)
            measured_s = served.get("steps", {}).get(str(rows))
            floor_s = step_bytes / bandwidth
            floors[str(rows)] = {
                "step_s": measured_s,
                "step_s_per_layer": measured_s / (end - start) if measured_s else None,
                "step_bytes": step_bytes,
                "floor_s": floor_s,
                "fraction_of_floor": floor_s / measured_s if measured_s else None,
            }
        bound = 1.10 * plan.total_bytes + 512 * 2**20
        results[precision] = {
            "convert": converted,
            "convert_peak_over_output_bytes": converted["peak_anon_bytes"] - converted["bytes_written"],
            "plan": asdict(plan) | {"total_bytes": plan.total_bytes},
            "direct": direct,
            "converted": served,
            "startup_speedup": direct.get("load_s", 0) / served["load_s"] if served.get("load_s") else None,
            "anon_vs_plan": served.get("anon_serving_bytes", 0) / plan.total_bytes,
            "within_bound": served.get("anon_serving_bytes", bound + 1) <= bound and served["returncode"] == 0,
            "decode": floors,
        }
        say(
            f"{precision}: convert {converted['seconds']:.1f} s, peak {converted['peak_anon_bytes'] / GIB:.2f} GiB "
            f"for {converted['bytes_written'] / GIB:.2f} GiB written; start-up {direct.get('load_s', 0):.1f} s direct, "
            f"{served.get('load_s', 0):.1f} s converted; serving holds "
            f"{served.get('anon_serving_bytes', 0) / GIB:.2f} GiB of the plan's {plan.total_bytes / GIB:.2f} GiB"
            + (f" (cgroup limit {limit / GIB:.2f} GiB, OOM kills {served['cgroup'].get('oom_kills')})" if limit else "")
        )
        for rows, floor in floors.items():
            if floor["step_s"]:
                say(
                    f"{precision}: {rows} rows {floor['step_s'] * 1e3:.1f} ms a step, "
                    f"{floor['fraction_of_floor']:.2f} of the floor"
                )
    summary = {
        "machine": machine,
        "model": str(model),
        "layers": [start, end],
        "shape": {"hidden": shape.hidden_size, "experts": shape.n_routed_experts, "vocab": shape.vocab_size},
        "read_bandwidth_bytes_per_s": bandwidth,
        "precisions": results,
    }
    write_report(config.out, "stage", summary, plot_stage)
    return summary


def plot_stage(summary: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    precisions = list(summary["precisions"])
    fig, (memory, speed) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.25
    for n, (label, get) in enumerate(
        (
            ("plan total", lambda r: r["plan"]["total_bytes"]),
            ("serving, anonymous", lambda r: r["converted"].get("anon_serving_bytes", 0)),
            ("convert peak", lambda r: r["convert"]["peak_anon_bytes"]),
        )
    ):
        memory.bar(
            [i + n * width for i in range(len(precisions))],
            [get(summary["precisions"][p]) / GIB for p in precisions],
            width,
            label=label,
        )
    memory.set_xticks([i + width for i in range(len(precisions))], precisions)
    memory.set_ylabel("GiB")
    memory.set_title("memory against the plan")
    memory.legend(loc="lower right")
    for p in precisions:
        decode = summary["precisions"][p]["decode"]
        rows = [int(r) for r in decode if decode[r]["fraction_of_floor"]]
        speed.plot(rows, [decode[str(r)]["fraction_of_floor"] for r in rows], marker="o", label=p)
    speed.set_xscale("log", base=2)
    speed.set_xlabel("rows a step")
    speed.set_ylabel("fraction of the bandwidth floor")
    speed.set_title("decode step")
    speed.legend()
    fig.suptitle(f"stage {summary['layers'][0]}:{summary['layers'][1]} at real width, {summary['machine']['cpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        first, last = (int(x) for x in sys.argv[4].split(":"))
        counts = [int(x) for x in sys.argv[5].split(",")]
        print(json.dumps(_child_serve(Path(sys.argv[2]), sys.argv[3], first, last, counts, int(sys.argv[6]))))
