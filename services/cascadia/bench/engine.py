"""`cascadia bench engine`: decode and prefill throughput against transformers and the bandwidth floor.

Everything is measured in one run on one checkpoint: our engine per precision mode, transformers
in f32 with the same thread count, and the machine's read bandwidth, so every figure is a ratio.
Each precision's engines and transformers run their rounds in turn, and the ratios between them are
medians of per-round ratios: this shared machine's slow spells, which can halve a rate for minutes,
fall on both sides of every ratio.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from cascadia.bench.machine import cache_share, describe, machine_summary
from cascadia.bench.report import pyplot, write_report
from cascadia.engine.batch import Segment
from cascadia.engine.compiled import compile_config
from cascadia.engine.engine import StageEngine
from cascadia.engine.settings import EngineSettings, preset
from cascadia.engine.weights import WeightFormat, stored_bytes
from cascadia.model.config import ModelShape, load_shape
from cascadia.model.loader import load_stage

PROMPT_TOKENS = 16
SETTLE_S = 0.5  # quiet before each timed round
PREFILL_TOKENS = 128

ORACLE = "transformers f32"
DecodeRound = Callable[[int, int, np.random.Generator], float]
PrefillRound = Callable[[np.ndarray], float]


@dataclass(frozen=True)
class EngineBenchConfig:
    model: Path | None
    out: Path
    streams: tuple[int, ...] = (1, 8, 32)
    precisions: tuple[str, ...] = ("f32", "bf16", "int8", "int4")
    # each precision with each of these expert kernels ("auto": the one the device picks)
    expert_kernels: tuple[str, ...] = ("auto",)
    # and each way of calling a stage's layers: "joined" (one model, one call per step) or "apart"
    # (one model and call per layer); "apart" entries are labelled "... per layer"
    layer_calls: tuple[str, ...] = ("joined",)
    steps: int = 16
    repeats: int = 3
    oracle: bool = True
    threads: int = 0
    # compile the engines with the plugin's op timing and break a decode step down by op kind at each
    # stream count (`op_ms`); the timing costs a little, so the rates of such a run read a bit low
    op_times: bool = False


def read_bandwidth(gib: float = 2.0, threads: int | None = None, repeats: int = 5) -> float:
    """Bytes per second a full-machine read of a buffer far larger than the caches achieves (median)."""
    threads = threads or os.cpu_count() or 1
    buffer = np.ones(int(gib * 2**30) // 8, dtype=np.float64)
    chunks = np.array_split(buffer, threads)
    rates = []
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.sum, chunks))
            rates.append(buffer.nbytes / (time.perf_counter() - start))
    return statistics.median(rates)


def matvec_bandwidth(
    shape: ModelShape, settings: EngineSettings, total_bytes: int = 512 * 2**20, most: int = 256, repeats: int = 5
) -> float:
    """Weight bytes per second the device's own matmul kernel reads at one row, for this precision.

    Matrices shaped like one expert's stacked gate and up, stored in the settings' expert format, as
    many as make `total_bytes` in f32 (far more than the caches hold) but no more than `most`, each
    multiplied once by one row per call. This is the floor the plugin's kernels allow, beside the one
    the memory allows; a step's attention and head weights are counted at the experts' rate.
    """
    import openvino as ov
    import openvino.opset16 as ops

    from cascadia.engine.graphs import linear

    rows, cols = 2 * shape.moe_intermediate_size, shape.hidden_size
    count = min(most, max(1, total_bytes // (rows * cols * 4)))
    rng = np.random.default_rng(3)
    x = ops.parameter([1, cols], np.float32, name="x")
    outputs = []
    for i in range(count):
        weight = rng.standard_normal((rows, cols), dtype=np.float32)
        product = linear(x, weight, settings.expert_weights, f"matvec.{i}")
        # one number per matrix keeps the outputs small; the matmul itself reads every weight
        outputs.append(ops.reduce_sum(product, ops.constant(np.int64(1)), keep_dims=True))
    model = ov.Model([ops.concat(outputs, 1)], [x], "matvec")
    config = compile_config(settings, settings.expert_compute)
    request = ov.Core().compile_model(model, settings.device, config).create_infer_request()
    del model, outputs
    row = rng.standard_normal((1, cols), dtype=np.float32)
    request.infer({0: row})
    seconds = _median_time(lambda: request.infer({0: row}), repeats)
    return count * stored_bytes((rows, cols), settings.expert_weights) / seconds


def expected_distinct(experts: int, top_k: int, rows: int) -> float:
    """Expected distinct experts that `rows` rows choosing top_k of `experts` (uniformly) touch."""
    return experts * (1.0 - (1.0 - top_k / experts) ** rows)


def uniform_routed(shape: ModelShape, rows: int) -> float:
    return expected_distinct(shape.n_routed_experts, shape.num_experts_per_tok, rows)


def step_weight_bytes(shape: ModelShape, settings_name: str, streams: int, routed: float | None = None) -> float:
    """Weight bytes one decode step over `streams` rows must read: each distinct expert once.

    `routed`: the distinct routed experts a sparse layer's step chooses, as measured; without it, as
    many as uniformly random rows would choose.
    """
    s = preset(settings_name)
    experts = read_format(s.expert_weights, s.ffn_form.compute)
    h = shape.hidden_size
    total = 0.0
    for i in range(shape.num_layers):
        a = shape.layer_attention(i)
        for rows, cols in ((a.q_width, h), (a.kv_width, h), (a.kv_width, h), (a.num_heads * shape.d_rel, h)):
            total += stored_bytes((rows, cols), s.attention_weights)
        total += stored_bytes((h, a.q_width), s.attention_weights)
        if shape.is_dense(i):
            total += stored_bytes((3 * shape.intermediate_size, h), experts)
        else:
            one_expert = 3 * stored_bytes((shape.moe_intermediate_size, h), experts)
            touched = routed if routed is not None else uniform_routed(shape, streams)
            total += one_expert * (touched + shape.n_shared_experts)
            total += 4 * (shape.n_routed_experts + shape.n_shared_experts) * h  # f32 router
    total += stored_bytes((shape.unpadded_vocab_size, h), read_format(s.head_weights, s.head_compute))
    return total


def read_format(stored: WeightFormat, compute: str) -> WeightFormat:
    """The format whose bytes a matmul reads: f32 weights computed in bf16 are folded into bf16
    constants, two bytes a value like f16's."""
    return "f16" if stored == "f32" and compute == "bf16" else stored


def _median_time(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def timed_decode_steps(
    engine: StageEngine,
    streams: int,
    steps: int,
    vocab: int,
    rng: np.random.Generator,
    after_step: Callable[[], None] | None = None,
) -> list[float]:
    """Seconds of each of `steps` decode steps of `streams` streams, each stream first prefilled with a
    short prompt; `after_step` runs after each step, outside its time. The streams close at the end."""
    names = [f"s{i}" for i in range(streams)]
    for name in names:
        engine.open(name)
    ids = rng.integers(3, vocab, size=streams * PROMPT_TOKENS)
    engine.step([Segment(n, 0, PROMPT_TOKENS) for n in names], ids, np.array([PROMPT_TOKENS - 1]))
    tokens = rng.integers(3, vocab, size=streams)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        engine.step([Segment(n, PROMPT_TOKENS + step, 1) for n in names], tokens)
        times.append(time.perf_counter() - start)
        if after_step is not None:
            after_step()
    for name in names:
        engine.close(name)
    return times


def engine_decode_round(engine: StageEngine, vocab: int) -> DecodeRound:
    """Seconds for `steps` decode steps of `streams` streams, each first prefilled with a short prompt."""

    def run(streams: int, steps: int, rng: np.random.Generator) -> float:
        return sum(timed_decode_steps(engine, streams, steps, vocab, rng))

    return run


def decode_op_times(engine: StageEngine, streams: int, steps: int, vocab: int) -> dict[str, Any]:
    """Milliseconds per decode step of `streams` streams, by op kind, beside the step's wall time (means over
    `steps` steps).

    The op times are the plugin's own timers. On the mini preset they added up to 0.7-1.7 times the
    step's wall time on an AMD EPYC and 0.6-2.6 times on a Xeon with AMX, differing from process to
    process, so they say roughly where a step's time goes, not what each op costs nor what is left
    over (a native profile places it better).
    """
    totals: dict[str, float] = {}

    def add_op_times() -> None:
        for kind, seconds in engine.op_times().items():
            totals[kind] = totals.get(kind, 0.0) + seconds

    walls = timed_decode_steps(engine, streams, steps, vocab, np.random.default_rng(1), add_op_times)
    op_ms = {k: 1e3 * v / steps for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}
    return {"step_ms": 1e3 * statistics.fmean(walls), "ops_ms": sum(op_ms.values()), "op_ms": op_ms}


def engine_prefill_round(engine: StageEngine) -> PrefillRound:
    """Seconds for one stream's prompt `ids` in one step."""

    def run(ids: np.ndarray) -> float:
        engine.open("p")
        start = time.perf_counter()
        engine.step([Segment("p", 0, len(ids))], ids, np.array([len(ids) - 1]))
        elapsed = time.perf_counter() - start
        engine.close("p")
        return elapsed

    return run


class Oracle:
    """transformers' InklingForCausalLM in f32 on the same checkpoint, timed in turn with the engines."""

    def __init__(self, model_dir: Path, threads: int) -> None:
        import torch
        from transformers import InklingForCausalLM

        if threads:
            torch.set_num_threads(threads)
        self.model = InklingForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        # routed experts each sparse layer chose per decode step, by stream count (the last round's
        # mean): what a step must read, where the floor would otherwise assume uniform routing
        self.routed_experts: dict[int, float] = {}
        self._choices: list[Any] | None = None  # each router call's expert ids while a round decodes
        for module in self.model.modules():
            if type(module).__name__ == "InklingTopkRouter":
                module.register_forward_hook(self._keep_choice)

    def _keep_choice(self, _module: Any, _inputs: Any, outputs: Any) -> None:
        if self._choices is not None:
            self._choices.append(outputs[2])  # (logits, weights, indices, shared gammas); counted after the round

    def decode_round(self, streams: int, steps: int, rng: np.random.Generator) -> float:
        import torch
        from transformers import DynamicCache

        vocab = self.model.config.unpadded_vocab_size or self.model.config.vocab_size
        with torch.no_grad():
            cache = DynamicCache(config=self.model.config)
            ids = torch.from_numpy(rng.integers(3, vocab, size=(streams, PROMPT_TOKENS)))
            self.model(ids, past_key_values=cache, use_cache=True)
            token = torch.from_numpy(rng.integers(3, vocab, size=(streams, 1)))
            self._choices = []
            start = time.perf_counter()
            for _ in range(steps):
                self.model(token, past_key_values=cache, use_cache=True)
            elapsed = time.perf_counter() - start
            self.routed_experts[streams] = statistics.mean(len(torch.unique(ids)) for ids in self._choices)
            self._choices = None
            return elapsed

    def prefill_round(self, ids: np.ndarray) -> float:
        import torch

        with torch.no_grad():
            start = time.perf_counter()
            self.model(torch.from_numpy(ids)[None])
            return time.perf_counter() - start


def timed_rounds(
    contenders: dict[str, Callable[[], float]], repeats: int, settle_s: float = SETTLE_S
) -> dict[str, list[float]]:
    """Every contender once to warm up, then `repeats` rounds of each taken in turn (the order reversed
    every other round), so a slow spell of this shared machine falls on all of them alike.

    Each round starts after `settle_s` of quiet: torch's OpenMP threads keep spinning for a while
    after its last parallel region, and on two cores they take one from the round after them (an
    engine round right after transformers' ran 5-12% slower per step than one started 0.5 s later).
    """
    for round_once in contenders.values():
        round_once()  # the first inference allocates
    rounds: dict[str, list[float]] = {label: [] for label in contenders}
    for repeat in range(repeats):
        order = list(contenders) if repeat % 2 == 0 else list(reversed(contenders))
        for label in order:
            time.sleep(settle_s)
            rounds[label].append(contenders[label]())
    return rounds


def rounds_beside_oracle(
    contenders: dict[str, Callable[[], float]], oracle_round: Callable[[], float] | None, repeats: int
) -> dict[str, list[float]]:
    """`timed_rounds` of the contenders, with transformers' rounds (under `ORACLE`) among them when given."""
    if oracle_round is not None:
        contenders = {**contenders, ORACLE: oracle_round}
    return timed_rounds(contenders, repeats)


def floor_vs_transformers(streams: int, floor_s: float, transformers_tokens_per_s: float) -> float:
    """The ratio to transformers of an engine that only read its step's weights at the measured bandwidth.

    No engine reading its weights from memory passes it, so it says which speed goals a machine's
    memory leaves within reach: where transformers already reads near the floor, it is below 2.
    """
    return streams / floor_s / transformers_tokens_per_s


def paired(base: list[float], own: list[float]) -> float:
    """Median over the rounds of the base's time over this one's: own's speed relative to the base's."""
    return statistics.median(b / o for b, o in zip(base, own, strict=True))


def measure_decode(
    engines: dict[str, StageEngine], oracle: Oracle | None, streams: int, steps: int, repeats: int, vocab: int
) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """Decode rounds of every engine (and transformers, when given) taken in turn.

    Each engine's step time is the median of its rounds; every engine after the first gets
    `paired_vs_<first>`, and each `vs_transformers_f32`, the medians of the per-round ratios.
    """
    rng = np.random.default_rng(0)
    contenders: dict[str, Callable[[], float]] = {
        label: functools.partial(engine_decode_round(engine, vocab), streams, steps, rng)
        for label, engine in engines.items()
    }
    oracle_round = functools.partial(oracle.decode_round, streams, steps, rng) if oracle is not None else None
    rounds = rounds_beside_oracle(contenders, oracle_round, repeats)

    def rates(times: list[float]) -> dict[str, Any]:
        step_time = statistics.median(times) / steps
        return {"step_s": step_time, "tokens_per_s": streams / step_time, "rounds_s": times}

    first = next(iter(engines))
    out: dict[str, dict[str, Any]] = {}
    for label in engines:
        out[label] = rates(rounds[label])
        if label != first:
            out[label][f"paired_vs_{first}"] = paired(rounds[first], rounds[label])
        if oracle is not None:
            out[label]["vs_transformers_f32"] = paired(rounds[ORACLE], rounds[label])
    return out, rates(rounds[ORACLE]) if oracle is not None else None


def measure_prefill(
    engines: dict[str, StageEngine], oracle: Oracle | None, repeats: int, vocab: int
) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
    """One stream's 128-token prompt through every engine (and transformers) in turn, as `measure_decode`."""
    ids = np.random.default_rng(1).integers(3, vocab, size=PREFILL_TOKENS)
    contenders: dict[str, Callable[[], float]] = {
        label: functools.partial(engine_prefill_round(engine), ids) for label, engine in engines.items()
    }
    oracle_round = functools.partial(oracle.prefill_round, ids) if oracle is not None else None
    rounds = rounds_beside_oracle(contenders, oracle_round, repeats)

    def rates(times: list[float]) -> dict[str, Any]:
        return {"tokens_per_s": PREFILL_TOKENS / statistics.median(times), "rounds_s": times}

    out = {label: rates(rounds[label]) for label in engines}
    if oracle is not None:
        for label in engines:
            out[label]["vs_transformers_f32"] = paired(rounds[ORACLE], rounds[label])
    return out, rates(rounds[ORACLE]) if oracle is not None else None


def measure_dense_layer(model_dir: Path, shape: ModelShape, repeats: int) -> dict[str, Any] | None:
    """A dense MLP call as all-active expert slices (our path) against a plain dense graph."""
    import openvino as ov

    from cascadia.engine import graphs

    dense = [i for i in range(shape.num_layers) if shape.is_dense(i)]
    if not dense:
        return None
    layer = load_stage(model_dir, dense[0], dense[0] + 1).layers[0]
    core = ov.Core()
    config = {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
    sliced = core.compile_model(graphs.dense_mlp_graph(shape, layer, "experts"), "CPU", config).create_infer_request()
    plain = core.compile_model(graphs.dense_mlp_graph(shape, layer, "matmul"), "CPU", config).create_infer_request()
    out: dict[str, Any] = {"layer": dense[0]}
    for rows in (1, 8):
        x = np.random.default_rng(2).standard_normal((rows, shape.hidden_size)).astype(np.float32)
        timings = {}
        for name, request in (("expert_slices", sliced), ("plain_dense", plain)):
            request.infer({0: x})
            timings[name] = _median_time(lambda r=request, x=x: [r.infer({0: x}) for _ in range(20)], repeats) / 20
        expected = plain.infer({0: x})[0]
        # the two paths sum in different orders: compare against the output's own scale
        np.testing.assert_allclose(sliced.infer({0: x})[0], expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())
        out[f"rows_{rows}_ms"] = {k: v * 1e3 for k, v in timings.items()}
    return out


def ensure_model(config: EngineBenchConfig, console: Console) -> Path:
    if config.model is not None:
        return config.model
    from cascadia.model.synthetic import SyntheticSpec, write_checkpoint

    path = config.out / "mini-checkpoint"
    if not (path / "model.safetensors").is_file():
        with console.status(f"writing the mini preset to {path}"):
            write_checkpoint(path, SyntheticSpec(preset="mini", seed=0))
    return path


def run_engine_bench(config: EngineBenchConfig, console: Console) -> dict[str, Any]:
    config.out.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model(config, console)
    shape = load_shape(model_dir)
    summary: dict[str, Any] = {
        "model": str(model_dir),
        "config": {k: str(v) for k, v in asdict(config).items()},
        # both floors per precision, measured just before its rounds: this shared machine's bandwidth
        # drifts by up to 2x over the minutes a run takes
        "read_bandwidth_bytes_per_s": {},
        # stored weight bytes per second of the device's one-row matmul (`matvec_bandwidth`)
        "matvec_bytes_per_s": {},
        "params": sum(shape.layer_parameter_count(i) for i in range(shape.num_layers)),
        "machine": machine_summary(),
        "engine": {},
    }
    console.print(describe(summary["machine"]))
    cache_bytes = summary["machine"]["last_level_cache_bytes"]
    oracle = None
    if config.oracle:
        with console.status("loading transformers f32"):
            oracle = Oracle(model_dir, config.threads)
        # transformers runs in turn with each precision's engines; its figures per precision's pass
        summary["transformers"] = {"passes": {}}
    vocab = shape.unpadded_vocab_size
    weights = load_stage(model_dir, 0, shape.num_layers)
    for mode in config.precisions:
        labels = {
            (kernel, calls): " ".join(
                [mode, *([kernel] if kernel != "auto" else []), *(["per layer"] if calls == "apart" else [])]
            )
            for kernel in config.expert_kernels
            for calls in config.layer_calls
        }
        with console.status(f"{mode}: read bandwidth and the device's matrix-vector rate"):
            bandwidth = read_bandwidth()
            matvec = matvec_bandwidth(shape, preset(mode, threads=config.threads))
        summary["read_bandwidth_bytes_per_s"][mode] = bandwidth
        summary["matvec_bytes_per_s"][mode] = matvec
        console.print(
            f"{mode}: read bandwidth {bandwidth / 1e9:.1f} GB/s; "
            f"the device's one-row matmul reads {matvec / 1e9:.1f} GB/s of stored weights"
        )
        engines: dict[str, StageEngine] = {}
        for (kernel, calls), label in labels.items():
            with console.status(f"compiling {label}"):
                settings = preset(
                    mode,
                    threads=config.threads,
                    expert_kernel=kernel,
                    joined_layers=calls == "joined",
                    profile_ops=config.op_times,
                )
                engines[label] = StageEngine(weights, settings)
            summary["engine"][label] = {
                "decode": {},
                "expert_kernel": settings.expert_kernel_path,
                "joined_layers": engines[label].joined_layers,
                "fused_ops": engines[label].runtime_ops()[-1],
            }
        beside: dict[str, Any] = {"decode": {}}
        for count in config.streams:
            with console.status(f"{mode}: decode at {count} streams"):
                results, beside["decode"][str(count)] = measure_decode(
                    engines, oracle, count, config.steps, config.repeats, vocab
                )
            # the experts transformers' router chose for the same kind of rows, when it ran beside
            measured = oracle.routed_experts.get(count) if oracle is not None else None
            routed = measured if measured is not None else uniform_routed(shape, count)
            step_bytes = step_weight_bytes(shape, mode, count, routed)
            floor_s = step_bytes / bandwidth
            for label, result in results.items():
                result["floor_routed_experts"] = routed
                result["floor_routing"] = "measured" if measured is not None else "uniform"
                result["floor_step_s"] = floor_s
                result["step_weight_bytes"] = step_bytes
                # how much of what a step reads the last-level cache could keep between steps, at best
                result["cache_share_of_step_bytes"] = cache_share(step_bytes, cache_bytes)
                result["fraction_of_floor"] = floor_s / result["step_s"]
                result["fraction_of_matvec_floor"] = step_bytes / matvec / result["step_s"]
                versus = ""
                if oracle is not None:
                    at_floor = floor_vs_transformers(count, floor_s, beside["decode"][str(count)]["tokens_per_s"])
                    result["floor_vs_transformers_f32"] = at_floor
                    versus = f", {result['vs_transformers_f32']:.2f}x transformers, {at_floor:.2f}x at the floor"
                summary["engine"][label]["decode"][str(count)] = result
                console.print(
                    f"{label:12s} {count:3d} streams: {result['tokens_per_s']:8.1f} tok/s "
                    f"({result['fraction_of_floor']:.2f} of the bandwidth floor{versus})"
                )
            if config.op_times:
                for label, engine in engines.items():
                    with console.status(f"{label}: op times at {count} streams"):
                        breakdown = decode_op_times(engine, count, config.steps, vocab)
                    summary["engine"][label]["decode"][str(count)]["op_times"] = breakdown
                    top = ", ".join(f"{k} {v:.1f}" for k, v in list(breakdown["op_ms"].items())[:4])
                    console.print(
                        f"{label:12s} {count:3d} streams: a step {breakdown['step_ms']:.1f} ms, its ops "
                        f"{breakdown['ops_ms']:.1f} ms ({top})"
                    )
        with console.status(f"{mode}: prefill"):
            prefill, beside["prefill"] = measure_prefill(engines, oracle, config.repeats, vocab)
        for label, result in prefill.items():
            summary["engine"][label]["prefill_tokens_per_s"] = result["tokens_per_s"]
            summary["engine"][label]["prefill_rounds_s"] = result["rounds_s"]
            if oracle is not None:
                summary["engine"][label]["prefill_vs_transformers_f32"] = result["vs_transformers_f32"]
        if oracle is not None:
            summary["transformers"]["passes"][mode] = beside
        engines.clear()  # before the next precision's engines compile
    del weights, oracle
    if config.oracle:
        # the plot's bars: transformers as measured beside the first precision
        first = summary["transformers"]["passes"][config.precisions[0]]
        summary["transformers"]["decode"] = first["decode"]
        summary["transformers"]["prefill_tokens_per_s"] = first["prefill"]["tokens_per_s"]
    with console.status("dense layer both ways"):
        summary["dense_layer"] = measure_dense_layer(model_dir, shape, config.repeats)
    write_report(config.out, "engine", summary, plot_engine)
    return summary


def plot_engine(summary: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    breakdowns = op_breakdowns(summary)
    fig, axes = plt.subplots(1, 2 if breakdowns else 1, figsize=(15 if breakdowns else 8, 4.5), squeeze=False)
    ax = axes[0][0]
    series = {mode: entry["decode"] for mode, entry in summary["engine"].items()}
    if "transformers" in summary:
        series["transformers f32"] = summary["transformers"]["decode"]
    counts = sorted({int(c) for s in series.values() for c in s})
    width = 0.8 / len(series)
    floor_label = "bandwidth floor"
    for i, (name, decode) in enumerate(series.items()):
        places = [j + i * width for j in range(len(counts))]
        ax.bar(places, [decode[str(c)]["tokens_per_s"] for c in counts], width, label=name)
        for place, count in zip(places, counts, strict=True):
            if "floor_step_s" in decode[str(count)]:  # the rate of a step that only read its weights
                floor_rate = count / decode[str(count)]["floor_step_s"]
                ax.hlines(floor_rate, place - width / 2, place + width / 2, colors="black", label=floor_label)
                floor_label = "_nolegend_"
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(counts))], [f"{c} streams" for c in counts])
    ax.set_ylabel("decode tokens / s")
    ax.set_yscale("log")
    ax.set_ylim(top=ax.get_ylim()[1] * 4)  # room for the legend above the highest floor
    ax.set_title(f"Engine decode throughput ({summary['params'] / 1e9:.2f}B-parameter Inkling config)")
    ax.legend(loc="upper left", ncols=3, fontsize="small")
    if breakdowns:
        plot_op_times(axes[0][1], breakdowns)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


OTHER_OPS = "other ops"


def op_breakdowns(summary: dict[str, Any], kinds: int = 2) -> dict[str, dict[str, float]]:
    """Per engine at its largest stream count with op times: ms per step of the op kinds among any
    engine's `kinds` longest, the rest of the ops, and the step's time outside its ops."""
    steps = {
        f"{label}, {max(timed, key=int)} streams": timed[max(timed, key=int)]
        for label, entry in summary["engine"].items()
        if (timed := {c: r["op_times"] for c, r in entry["decode"].items() if "op_times" in r})
    }
    totals: dict[str, float] = {}
    for step in steps.values():
        for kind, ms in sorted(step["op_ms"].items(), key=lambda kv: -kv[1])[:kinds]:
            totals[kind] = totals.get(kind, 0.0) + ms
    top = sorted(totals, key=lambda k: -totals[k])
    out: dict[str, dict[str, float]] = {}
    for name, step in steps.items():
        parts = {kind: step["op_ms"].get(kind, 0.0) for kind in top}
        parts[OTHER_OPS] = step["ops_ms"] - sum(parts.values())
        parts["outside the ops"] = max(step["step_ms"] - step["ops_ms"], 0.0)
        out[name] = parts
    return out


def plot_op_times(ax: Any, breakdowns: dict[str, dict[str, float]]) -> None:
    names = list(breakdowns)
    kinds = list(next(iter(breakdowns.values())))
    left = [0.0] * len(names)
    for kind in kinds:
        widths = [breakdowns[n][kind] for n in names]
        ax.barh(names, widths, left=left, label=kind)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("ms per decode step (the plugin's op timers)")
    ax.set_title("Where a decode step goes")
    ax.invert_yaxis()
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
