"""`cascadia bench fleet`: the chain against one process, and the cost of one hop on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from cascadia.bench.hop import hop_cost
from cascadia.engine.sampling import SamplingParams
from cascadia.model.loader import load_shape
from cascadia.router.local import LocalFleet
from cascadia.router.netem import EmulatedNetwork, LinkShape
from cascadia.router.pipeline import PipelineDriver
from cascadia.router.scheduler import Request, SchedulerConfig


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


async def _fleet_round(driver: PipelineDriver, streams: int, config: FleetBenchConfig, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    vocab = load_shape(config.model).unpadded_vocab_size
    requests = [
        Request(
            f"b{seed}-{i}",
            tuple(int(t) for t in rng.integers(3, vocab, size=config.prompt_tokens)),
            SamplingParams(max_tokens=config.new_tokens),
        )
        for i in range(streams)
    ]
    start = time.perf_counter()
    results = await asyncio.gather(*(driver.generate(r) for r in requests))
    end = time.perf_counter()
    first = [r.first_token_at - start for r in results]
    # steady decode: from the moment every stream has its first token, tokens still to come
    decode_start = max(r.first_token_at for r in results)
    after = sum(1 for r in results for t in r.token_times if t > decode_start)
    return {
        "phase_tokens_per_s": sum(len(r.tokens) for r in results) / (end - start),
        "decode_tokens_per_s": after / (end - decode_start) if after else 0.0,
        "ttft_median_s": statistics.median(first),
        "last_first_token_s": decode_start - start,
    }


async def _run_fleet(fleet: LocalFleet, config: FleetBenchConfig, console: Console) -> dict[str, Any]:
    group = config.rows_per_group  # a prefill window fills a group
    sched = SchedulerConfig(stages=fleet.shards, rows_per_group=group, prefill_window=group)
    driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, sched, frame_timeout=600)
    await driver.start()
    try:
        await driver.wait_ready(timeout=900)
        await _fleet_round(driver, 1, config, seed=999)  # warm-up
        out = {}
        for n in config.streams:
            with console.status(f"{fleet.shards} shard(s): {n} streams"):
                out[str(n)] = await _fleet_round(driver, n, config, seed=n)
            console.print(f"{fleet.shards} shard(s) {n:3d} streams: {out[str(n)]['decode_tokens_per_s']:.1f} tok/s")
        return out
    finally:
        await driver.stop()


def run_fleet_bench(config: FleetBenchConfig, console: Console) -> dict[str, Any]:
    config.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"model": str(config.model), "hop": asyncio.run(hop_cost()), "fleets": {}}
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
    for shards in config.shards:
        with contextlib.ExitStack() as stack:
            network = stack.enter_context(EmulatedNetwork(shards, config.link)) if config.link else None
            fleet = LocalFleet(config.model, shards, config.precision, network=network)
            fleet.start(log_dir=config.out)
            try:
                summary["fleets"][str(shards)] = asyncio.run(_run_fleet(fleet, config, console))
            finally:
                fleet.stop()
    if "1" in summary["fleets"]:
        base = summary["fleets"]["1"]
        for results in summary["fleets"].values():
            for n, r in results.items():
                r["pipeline_efficiency"] = r["decode_tokens_per_s"] / base[n]["decode_tokens_per_s"]
    (config.out / "fleet.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(summary, config.out / "fleet.png")
    return summary


def _plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
