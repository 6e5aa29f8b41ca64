"""`cascadia bench fleet`: the chain against one process, and the cost of one hop on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from cascadia.bench.hop import hop_cost
from cascadia.bench.report import pyplot, write_report
from cascadia.model.loader import load_shape
from cascadia.router.local import LocalFleet
from cascadia.router.netem import EmulatedNetwork, LinkShape
from cascadia.router.pipeline import PipelineDriver
from cascadia.router.scheduler import Request, SchedulerConfig
from cascadia.sampling_params import SamplingParams


@dataclass(frozen=True)
class FleetBenchConfig:
    model: Path
    out: Path
    shards: tuple[int, ...] = (1, 4)
    streams: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 88)
    prompt_tokens: int = 16
    new_tokens: int = 32
    rows_per_group: int = 8
    precision: str = "f32"
    link: LinkShape | None = None  # shards behind emulated links instead of loopback
    # One group on the chain at a time measures what the pipeline itself costs; on this machine more
    # frames in flight only make the stages contend for the same cores.
    frames_in_flight: int = 1
    repeats: int = 3


def chain_costs(before: Sequence[Any], after: Sequence[Any], seconds: float) -> dict[str, Any]:
    """Where a run's frame time went, from every stage's `Stats` before and after it: each stage's
    busy ms per frame, and what is left for the hops and the router."""
    frames = after[0].frames_computed - before[0].frames_computed
    if frames <= 0:
        return {"frames": 0}
    stages = [(b.compute_seconds - a.compute_seconds) / frames * 1e3 for a, b in zip(before, after, strict=True)]
    frame_ms = seconds / frames * 1e3
    return {"frames": frames, "frame_ms": frame_ms, "stage_ms": stages, "chain_ms": frame_ms - sum(stages)}


async def _fleet_round(
    driver: PipelineDriver, streams: int, config: FleetBenchConfig, seed: int, vocab: int
) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    requests = [
        Request(
            f"b{seed}-{i}",
            tuple(int(t) for t in rng.integers(3, vocab, size=config.prompt_tokens)),
            SamplingParams(max_tokens=config.new_tokens),
        )
        for i in range(streams)
    ]
    before = await driver.stage_stats()
    start = time.perf_counter()
    results = await asyncio.gather(*(driver.generate(r) for r in requests))
    end = time.perf_counter()
    costs = chain_costs(before, await driver.stage_stats(), end - start)
    first = [r.first_token_at - start for r in results]
    # steady decode: from the moment every stream has its first token, tokens still to come
    decode_start = max(r.first_token_at for r in results)
    after = sum(1 for r in results for t in r.token_times if t > decode_start)
    return {
        "phase_tokens_per_s": sum(len(r.tokens) for r in results) / (end - start),
        "decode_tokens_per_s": after / (end - decode_start) if after else 0.0,
        "ttft_median_s": statistics.median(first),
        "last_first_token_s": decode_start - start,
        "frame_ms": costs.get("frame_ms", 0.0),
        "stages_busy_ms": sum(costs.get("stage_ms", [])),
        "chain_ms": costs.get("chain_ms", 0.0),
    }


def _medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


async def _run_fleets(fleets: dict[int, LocalFleet], config: FleetBenchConfig, console: Console) -> dict[str, Any]:
    """Every stream count runs `repeats` times on every fleet in turn, so a slow spell of this shared
    machine falls on all of them alike; medians per fleet, and each repeat's decode rate against the
    first fleet's in the same repeat."""
    group = config.rows_per_group  # a prefill window fills a group
    vocab = load_shape(config.model).unpadded_vocab_size
    drivers: dict[int, PipelineDriver] = {}
    for shards, fleet in fleets.items():
        sched = SchedulerConfig(  # every round computes its prompts: no state is kept from earlier rounds
            stages=shards,
            rows_per_group=group,
            prefill_window=group,
            frames_in_flight=config.frames_in_flight,
            keep_finished=0,
        )
        drivers[shards] = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, sched, frame_timeout=600)
    try:
        for driver in drivers.values():
            await driver.start()
            await driver.wait_ready(timeout=900)
            await _fleet_round(driver, 1, config, 999, vocab)  # warm-up
        out: dict[str, Any] = {str(shards): {} for shards in fleets}
        base = next(iter(fleets))
        for n in config.streams:
            runs: dict[int, list[dict[str, float]]] = {shards: [] for shards in fleets}
            for repeat in range(config.repeats):
                for shards, driver in drivers.items():
                    with console.status(f"{n} streams, repeat {repeat + 1}/{config.repeats}: {shards} shard(s)"):
                        runs[shards].append(await _fleet_round(driver, n, config, n, vocab))
            for shards, shard_runs in runs.items():
                result = _medians(shard_runs)
                if shards != base:
                    paired = [
                        run["decode_tokens_per_s"] / first["decode_tokens_per_s"]
                        for run, first in zip(shard_runs, runs[base], strict=True)
                    ]
                    result["pipeline_efficiency"] = statistics.median(paired)
                out[str(shards)][str(n)] = result
                efficiency = f", {result['pipeline_efficiency']:.2f} of {base}" if shards != base else ""
                console.print(
                    f"{shards} shard(s) {n:3d} streams: {result['decode_tokens_per_s']:.1f} tok/s{efficiency} "
                    f"(frame {result['frame_ms']:.1f} ms: stages {result['stages_busy_ms']:.1f}, "
                    f"hops and router {result['chain_ms']:.1f})"
                )
        return out
    finally:
        for driver in drivers.values():
            await driver.stop()


def run_fleet_bench(config: FleetBenchConfig, console: Console) -> dict[str, Any]:
    config.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {
        "model": str(config.model),
        "rows_per_group": config.rows_per_group,
        "frames_in_flight": config.frames_in_flight,
        "repeats": config.repeats,
        "hop": asyncio.run(hop_cost()),
        "fleets": {},
    }
    hop = summary["hop"]
    console.print(
        f"one hop of 8 x 6144 FP32 on loopback: {hop['median_ms']:.3f} ms round trip, "
        f"{hop['streamed_ms']:.3f} ms per frame streamed"
    )
    if config.link is not None:
        summary["link"] = {
            "rate": config.link.rate,
            "delay_ms": config.link.delay_ms,
            "loss_percent": config.link.loss_percent,
        }
        # each emulated network owns this process's namespaces: one fleet at a time
        for shards in config.shards:
            with EmulatedNetwork(shards, config.link) as network:
                fleet = LocalFleet(config.model, shards, config.precision, network=network)
                with _running(fleet, config.out):
                    summary["fleets"].update(asyncio.run(_run_fleets({shards: fleet}, config, console)))
        # fleets taken one after another: the ratio of medians, not of pairs
        first = summary["fleets"][str(config.shards[0])]
        for shards in config.shards[1:]:
            for n, result in summary["fleets"][str(shards)].items():
                base = first[n]["decode_tokens_per_s"]
                result["pipeline_efficiency"] = result["decode_tokens_per_s"] / base if base else 0.0
    else:
        with contextlib.ExitStack() as stack:
            fleets = {}
            for shards in config.shards:
                with console.status(f"starting {shards} shard(s)"):
                    fleets[shards] = stack.enter_context(
                        _running(LocalFleet(config.model, shards, config.precision), config.out)
                    )
            summary["fleets"] = asyncio.run(_run_fleets(fleets, config, console))
    write_report(config.out, "fleet", summary, _plot)
    return summary


@contextlib.contextmanager
def _running(fleet: LocalFleet, log_dir: Path) -> Iterator[LocalFleet]:
    fleet.start(log_dir=log_dir)
    try:
        yield fleet
    finally:
        fleet.stop()


def _plot(summary: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    for shards, results in summary["fleets"].items():
        counts = [int(n) for n in results]
        ax.plot(
            counts, [results[str(n)]["decode_tokens_per_s"] for n in counts], marker="o", label=f"{shards} shard(s)"
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate decode tokens / s")
    ax.set_title("Local fleet on one machine (stages share 2 cores)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
