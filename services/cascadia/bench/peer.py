"""`cascadia bench peer`: our engine and our fleet against OpenVINO GenAI on the same GGUF file, one run.

Both sides use the file's weights as stored (Q4_1 / Q8_0 blocks), f32 arithmetic, an f32 KV cache
and no int8 activation quantisation. Greedy decoding of real prompts with EOS ignored, so every
measurement decodes the same number of tokens. Every repeat runs GenAI and each of ours in turn (the
fleet's runs alternate with GenAI's too), and each ratio is of medians from the same interleaved runs,
so a slow spell of this shared machine falls on both sides.
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from cascadia.bench.fleet import chain_costs
from cascadia.bench.report import pyplot, write_report
from cascadia.engine.batch import Segment
from cascadia.engine.engine import StageEngine
from cascadia.sampling_params import SamplingParams

# Our f32 mode's settings, spelled for GenAI: f32 arithmetic, f32 KV cache, no int8 activations
GENAI_F32 = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def genai_pipeline(model: Path, device: str = "CPU", **extra: Any):
    """GenAI's LLMPipeline on a GGUF file with the same precision settings as our f32 mode."""
    import openvino_genai

    return openvino_genai.LLMPipeline(str(model), device, **GENAI_F32, **extra)


@dataclass(frozen=True)
class PeerBenchConfig:
    model: Path
    out: Path
    streams: tuple[int, ...] = (1, 8)
    new_tokens: int = 64
    repeats: int = 3
    shards: int = 3  # 0: skip the fleet
    # one-process runs as (dense FFN, Llama attention): the FFN as all-active expert slices and as
    # plain matmuls, attention through PagedAttention (the CPU's default) and through our block graph
    variants: tuple[tuple[str, str], ...] = (("experts", "paged"), ("matmul", "paged"), ("matmul", "blocks"))


@dataclass(frozen=True)
class Timing:
    ttft_s: float
    decode_tokens_per_s: float  # aggregate over the streams, after the first token


def _median(runs: list[Timing]) -> dict[str, float]:
    return {
        "ttft_s": statistics.median(r.ttft_s for r in runs),
        "decode_tokens_per_s": statistics.median(r.decode_tokens_per_s for r in runs),
        "runs": len(runs),
    }


def time_genai(pipe, prompt: str, streams: int, new_tokens: int) -> Timing:
    """A batch of `streams` copies of the prompt through GenAI's own scheduler (text in, as its API takes batches)."""
    import openvino_genai

    config = openvino_genai.GenerationConfig()
    config.max_new_tokens, config.do_sample, config.ignore_eos = new_tokens, False, True
    config.apply_chat_template = False
    start = time.perf_counter()
    result = pipe.generate([prompt] * streams, config)
    total = time.perf_counter() - start
    ttft = result.perf_metrics.get_ttft().mean / 1e3
    return Timing(ttft, streams * (new_tokens - 1) / max(total - ttft, 1e-9))


def time_engine(engine: StageEngine, prompt_ids: list[int], streams: int, new_tokens: int) -> Timing:
    """Every stream prefilled in one step, then batched greedy decode steps over all of them."""
    names = [f"bench-{i}" for i in range(streams)]
    for name in names:
        engine.open(name)
    try:
        n = len(prompt_ids)
        start = time.perf_counter()
        ids = np.array(prompt_ids * streams)
        last = np.arange(1, streams + 1) * n - 1
        logits = engine.step([Segment(s, 0, n) for s in names], ids, last).logits
        tokens = logits.argmax(-1)
        first = time.perf_counter()
        for step in range(new_tokens - 1):
            logits = engine.step([Segment(s, n + step, 1) for s in names], tokens).logits
            tokens = logits.argmax(-1)
        end = time.perf_counter()
        return Timing(first - start, streams * (new_tokens - 1) / (end - first))
    finally:
        for name in names:
            engine.close(name)


async def _time_fleet(driver, prompt_ids: list[int], streams: int, new_tokens: int, tag: str) -> Timing:
    from cascadia.router.scheduler import Request

    params = SamplingParams(max_tokens=new_tokens)
    requests = [Request(f"{tag}-{i}", tuple(prompt_ids), params) for i in range(streams)]
    start = time.perf_counter()
    results = await asyncio.gather(*(driver.generate(r) for r in requests))
    end = time.perf_counter()
    decode_start = max(r.first_token_at for r in results)
    after = sum(1 for r in results for t in r.token_times if t > decode_start)
    ttft = statistics.median(r.first_token_at - start for r in results)
    return Timing(ttft, after / (end - decode_start) if after else 0.0)


def _interleaved(contenders: dict[str, Callable[[int], Timing]], streams: tuple[int, ...], repeats: int):
    """Each stream count: one warm-up each, then `repeats` rounds that run every contender once in turn,
    so a slow spell of this shared machine falls on all of them alike. Medians per contender."""
    results: dict[str, dict[str, Any]] = {name: {} for name in contenders}
    for n in streams:
        runs: dict[str, list[Timing]] = {name: [] for name in contenders}
        for fn in contenders.values():
            fn(n)
        for _ in range(repeats):
            for name, fn in contenders.items():
                runs[name].append(fn(n))
        for name in contenders:
            results[name][str(n)] = _median(runs[name])
    return results


def run_peer_bench(config: PeerBenchConfig, console: Console) -> dict[str, Any]:
    from cascadia.engine.settings import EngineSettings
    from cascadia.gateway.text import TextCodec
    from cascadia.model.loader import load_shape, load_stage

    config.out.mkdir(parents=True, exist_ok=True)
    prompt_ids = TextCodec.from_model(config.model).encode(PROMPT)
    summary: dict[str, Any] = {
        "model": config.model.name,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": config.new_tokens,
        "settings": GENAI_F32,
        "results": {},
    }
    shape = load_shape(config.model)
    pipe = genai_pipeline(config.model)
    contenders: dict[str, Callable[[int], Timing]] = {"genai": lambda n: time_genai(pipe, PROMPT, n, config.new_tokens)}
    for dense, attention in config.variants:
        settings = EngineSettings(dense_ffn=dense, llama_attention=attention)  # type: ignore[arg-type]
        with console.status(f"compiling engine-{dense}-{attention}"):
            engine = StageEngine(load_stage(config.model, 0, shape.num_layers), settings)
        contenders[f"engine-{dense}-{attention}"] = functools.partial(
            lambda e, n: time_engine(e, prompt_ids, n, config.new_tokens), engine
        )
    with console.status("GenAI and the engines, interleaved"):
        summary["results"] = _interleaved(contenders, config.streams, config.repeats)
    for name, result in summary["results"].items():
        console.print(f"{name}: {result}")
    with console.status("one dense FFN call both ways"):
        from cascadia.bench.engine import measure_dense_layer

        summary["dense_call"] = measure_dense_layer(config.model, shape, config.repeats)
    console.print(f"dense FFN call: {summary['dense_call']}")
    genai = summary["results"]["genai"]
    ratios = {name: _ratios(r, genai) for name, r in summary["results"].items() if name != "genai"}
    if config.shards:
        fleet_name = f"fleet-{config.shards}"
        beside = _run_fleet(config, prompt_ids, console, pipe)
        summary["results"][fleet_name] = beside[fleet_name]
        summary["results"]["genai-beside-fleet"] = beside["genai"]
        ratios[fleet_name] = _ratios(beside[fleet_name], beside["genai"])
    summary["ratios"] = ratios
    with console.status("resident memory of the whole model and of each shard's range"):
        from cascadia.bench.resident import measure_resident
        from cascadia.router.local import local_ranges

        ranges = [(0, shape.num_layers), *(local_ranges(config.model, config.shards) if config.shards else [])]
        summary["resident"] = measure_resident(config.model, ranges, genai=True)
    console.print(f"resident memory (MiB): {summary['resident']}")
    write_report(config.out, "peer", summary, _plot)
    return summary


def _median_costs(costs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure of `chain_costs` as its median over the runs."""
    costs = [c for c in costs if c["frames"]]
    if not costs:
        return {}
    return {
        "frames": statistics.median(c["frames"] for c in costs),
        "frame_ms": statistics.median(c["frame_ms"] for c in costs),
        "stage_ms": [statistics.median(c["stage_ms"][i] for c in costs) for i in range(len(costs[0]["stage_ms"]))],
        "chain_ms": statistics.median(c["chain_ms"] for c in costs),
    }


def _ratios(ours: dict[str, Any], genai: dict[str, Any]) -> dict[str, float]:
    return {n: ours[n]["decode_tokens_per_s"] / genai[n]["decode_tokens_per_s"] for n in ours}


def _run_fleet(config: PeerBenchConfig, prompt_ids: list[int], console: Console, pipe) -> dict[str, Any]:
    """The fleet's runs interleaved with GenAI's in this process (GenAI runs while the shards idle)."""
    from cascadia.router.local import LocalFleet
    from cascadia.router.pipeline import PipelineDriver

    fleet = LocalFleet(config.model, config.shards, "f32")
    fleet.start(log_dir=config.out)
    name = f"fleet-{config.shards}"

    async def go() -> dict[str, Any]:
        # every round computes its prompts (the same each round): no state is kept from earlier rounds
        driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, fleet.scheduler_config(keep_finished=0), 600)
        await driver.start()
        try:
            with console.status(f"starting {config.shards} shards"):
                await driver.wait_ready(timeout=600)
            results: dict[str, dict[str, Any]] = {name: {}, "genai": {}}
            for n in config.streams:
                await _time_fleet(driver, prompt_ids, n, config.new_tokens, f"warm-{n}")
                runs: dict[str, list[Timing]] = {name: [], "genai": []}
                costs = []
                for i in range(config.repeats):
                    runs["genai"].append(time_genai(pipe, PROMPT, n, config.new_tokens))
                    before, started = await driver.stage_stats(), time.perf_counter()
                    runs[name].append(await _time_fleet(driver, prompt_ids, n, config.new_tokens, f"run-{n}-{i}"))
                    costs.append(chain_costs(before, await driver.stage_stats(), time.perf_counter() - started))
                for key, timings in runs.items():
                    results[key][str(n)] = _median(timings)
                results[name][str(n)]["chain"] = _median_costs(costs)
            return results
        finally:
            await driver.stop()

    try:
        result = asyncio.run(go())
    finally:
        fleet.stop()
    console.print(f"fleet of {config.shards} (and GenAI beside it): {result}")
    return result


def _plot(summary: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    results = summary["results"]
    names = list(results)
    counts = list(results["genai"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        xs = np.arange(len(counts)) + k * width
        axes[0].bar(xs, [results[name][n]["decode_tokens_per_s"] for n in counts], width, label=name)
        axes[1].bar(xs, [results[name][n]["ttft_s"] for n in counts], width, label=name)
    for ax, label in zip(axes, ("aggregate decode tokens / s", "time to first token (s)"), strict=True):
        ax.set_xticks(np.arange(len(counts)) + 0.4 - width / 2, [f"{n} stream(s)" for n in counts])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"{summary['model']}: ours vs OpenVINO GenAI (same GGUF, f32 compute)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
