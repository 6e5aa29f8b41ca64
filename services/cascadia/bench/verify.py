"""What a verify block costs: one stream's step time by its rows, in one process.

Speculation pays when a round's extra tokens outweigh what its extra rows cost. A block of k drafts
is k + 1 rows of one stream; these figures say how that cost grows with k on this device, both with
every step the same size and with each block following a one-row step, as a speculating stream's
rounds alternate (the CPU plugin's compressed-weight kernels run slower on the first call after the
row count changes).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from cascadia.engine.engine import Segment, StageEngine
from cascadia.engine.settings import EngineSettings
from cascadia.model.loader import load_shape, load_stage

HISTORY = 64  # positions already in the stream when the blocks are measured


def measure_verify_cost(model: Path, sizes: Sequence[int], runs: int, console: Console) -> dict[str, Any]:
    """Median ms of a step of each size, back to back and right after a one-row step; ratios to one row."""
    shape = load_shape(model)
    with console.status("compiling the whole model in one process"):
        engine = StageEngine(load_stage(model, 0, shape.num_layers), EngineSettings())
    stream = "verify-cost"
    engine.open(stream)
    engine.step([Segment(stream, 0, HISTORY)], np.arange(HISTORY) % shape.vocab_size, np.array([HISTORY - 1]))

    def block(rows: int) -> None:
        engine.step([Segment(stream, HISTORY, rows)], np.arange(rows) % shape.vocab_size)
        engine.rewind(stream, HISTORY)

    out: dict[str, Any] = {"history": HISTORY, "steady_ms": {}, "after_one_row_ms": {}}
    try:
        with console.status("verify blocks by rows"):
            for rows in sorted({1, *sizes}):
                block(rows)  # warm-up at this size
                steady, after = [], []
                for _ in range(runs):
                    started = time.perf_counter()
                    block(rows)
                    steady.append(time.perf_counter() - started)
                for _ in range(runs):
                    block(1)
                    started = time.perf_counter()
                    block(rows)
                    after.append(time.perf_counter() - started)
                out["steady_ms"][str(rows)] = statistics.median(steady) * 1e3
                out["after_one_row_ms"][str(rows)] = statistics.median(after) * 1e3
    finally:
        engine.close(stream)
    one = out["steady_ms"]["1"]
    out["steady_vs_one_row"] = {k: v / one for k, v in out["steady_ms"].items()}
    out["after_one_row_vs_one_row"] = {k: v / one for k, v in out["after_one_row_ms"].items()}
    steady = {k: round(v, 1) for k, v in out["steady_ms"].items()}
    after = {k: round(v, 1) for k, v in out["after_one_row_ms"].items()}
    console.print(f"verify blocks, ms by rows: back to back {steady}, after a one-row step {after}")
    return out
