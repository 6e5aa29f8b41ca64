"""`cascadia bench context`: time to first token and decode time against prompt length, and KV memory.

One engine holds the whole model with a context budget for the longest prompt; each prompt is
prefilled in windows, then a few tokens are decoded over that history. With several streams, each
gets a prompt of the length and they decode together, one batched step per token. Time to first token is
fitted as aN + bN² (least squares), so the quadratic share is visible.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from cascadia.bench.report import pyplot, write_report
from cascadia.engine.batch import Segment


@dataclass(frozen=True)
class ContextBenchConfig:
    model: Path
    out: Path
    lengths: tuple[int, ...] = (1024, 4096, 16384)
    prefill_window: int = 256
    decode_steps: int = 8
    streams: int = 1  # streams with a prompt of each length, decoded together
    precision: str = "f32"
    kv_precision: str = "f32"


def fit_linear_quadratic(lengths: list[int], seconds: list[float]) -> tuple[float, float]:
    """(a, b) of t = aN + bN² by least squares."""
    n = np.asarray(lengths, dtype=np.float64)
    design = np.stack([n, n * n], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, np.asarray(seconds, dtype=np.float64), rcond=None)
    return float(a), float(b)


def run_context_bench(config: ContextBenchConfig, console: Console) -> dict[str, Any]:
    from cascadia.engine.engine import StageEngine
    from cascadia.engine.settings import preset
    from cascadia.model.loader import load_shape, load_stage

    config.out.mkdir(parents=True, exist_ok=True)
    shape = load_shape(config.model)
    budget = max(config.lengths) + config.decode_steps + 1
    settings = preset(config.precision, context=budget, kv_precision=config.kv_precision)
    with console.status("loading"):
        engine = StageEngine(load_stage(config.model, 0, shape.num_layers), settings)
    rng = np.random.default_rng(0)
    rows = []
    for n in config.lengths:
        streams = [f"context-{n}-{b}" for b in range(config.streams)]
        ttft, token = 0.0, np.zeros(len(streams), dtype=np.int64)
        for b, stream in enumerate(streams):
            ids = rng.integers(3, shape.unpadded_vocab_size, size=n)
            engine.open(stream)
            started = time.perf_counter()
            with console.status(f"{n} tokens, stream {b + 1} of {len(streams)}"):
                for start in range(0, n, config.prefill_window):
                    m = min(config.prefill_window, n - start)
                    logits = engine.step([Segment(stream, start, m)], ids[start : start + m], np.array([m - 1])).logits
            if b == 0:  # the first stream's prompt meets an idle engine, as a lone request does
                ttft = time.perf_counter() - started
            token[b] = int(np.argmax(logits[0]))
        steps = []
        with console.status(f"{n} tokens: decoding {len(streams)} streams together"):
            for i in range(config.decode_steps):
                tick = time.perf_counter()
                logits = engine.step([Segment(s, n + i, 1) for s in streams], token).logits
                steps.append(time.perf_counter() - tick)
                token = np.argmax(logits, axis=-1)
        state = sum(engine.stream_bytes(stream) for stream in streams)
        for stream in streams:
            engine.close(stream)
        rows.append(
            {
                "prompt_tokens": n,
                "ttft_s": ttft,
                "decode_ms": statistics.median(steps) * 1e3,
                "decode_tokens_per_s": len(streams) / statistics.median(steps),
                "state_bytes": state,
                "bytes_per_position": state / (n * len(streams)),
            }
        )
        console.print(f"{n:7d} tokens: first token {ttft:8.2f} s, decode step {rows[-1]['decode_ms']:7.2f} ms")
    a, b = fit_linear_quadratic([r["prompt_tokens"] for r in rows], [r["ttft_s"] for r in rows])
    summary: dict[str, Any] = {
        "model": str(config.model),
        "prefill_window": config.prefill_window,
        "streams": config.streams,
        "precision": config.precision,
        "kv_precision": config.kv_precision,
        "kv_bytes_per_position": engine.kv_bytes_per_position(),
        "rows": rows,
        "fit": {"a_s_per_token": a, "b_s_per_token2": b},
    }
    by_n = {r["prompt_tokens"]: r for r in rows}
    for low, high, key in ((4096, 32768, "ttft_ratio_32k_over_4k"), (4096, 16384, "ttft_ratio_16k_over_4k")):
        if low in by_n and high in by_n:
            summary[key] = by_n[high]["ttft_s"] / by_n[low]["ttft_s"]
    for high in (65536, 16384):
        if 4096 in by_n and high in by_n:
            summary[f"decode_ratio_{high // 1024}k_over_4k"] = by_n[high]["decode_ms"] / by_n[4096]["decode_ms"]
    write_report(config.out, "context", summary, _plot)
    return summary


def _plot(summary: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    rows = summary["rows"]
    n = np.array([r["prompt_tokens"] for r in rows], dtype=np.float64)
    a, b = summary["fit"]["a_s_per_token"], summary["fit"]["b_s_per_token2"]
    grid = np.geomspace(n.min(), n.max(), 50)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].loglog(n, [r["ttft_s"] for r in rows], "o", label="measured")
    axes[0].loglog(grid, a * grid + b * grid * grid, "-", label=f"{a:.2e} N + {b:.2e} N²")
    axes[0].set_xlabel("prompt tokens")
    axes[0].set_ylabel("time to first token (s)")
    axes[0].legend()
    axes[1].semilogx(n, [r["decode_ms"] for r in rows], "o-")
    axes[1].set_xlabel("history (tokens)")
    axes[1].set_ylabel(f"decode ms / step ({summary['streams']} streams)")
    fig.suptitle(f"Long context ({Path(summary['model']).name}, KV {summary['kv_precision']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
