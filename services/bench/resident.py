"""Resident memory of a stage: a fresh process loads and compiles a layer range as a shard does, decodes
a few tokens, and reports how far its resident set grew, against the size of the model's file.

`python -m cascadia.bench.resident MODEL START:END` is the child; `measure_resident` runs one child per
range so that no range inherits another's allocations.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

STEPS = 16  # one-row decode steps after loading: the first ones allocate the runtime's buffers
MIB = 2**20


def model_bytes(model: Path) -> int:
    """The file's size, or a checkpoint directory's total."""
    return model.stat().st_size if model.is_file() else sum(p.stat().st_size for p in model.rglob("*") if p.is_file())


def _child(model: Path, start: int, end: int) -> dict[str, Any]:
    import numpy as np
    import psutil

    from cascadia.cli import load_engine
    from cascadia.engine.batch import Segment
    from cascadia.engine.settings import EngineSettings

    process = psutil.Process()
    before = process.memory_info().rss
    engine = load_engine(model, EngineSettings(), start, end)
    loaded = process.memory_info().rss
    engine.open("resident")
    width = engine.shape.hidden_size
    for position in range(STEPS):
        rows = np.array([3 + position]) if engine.is_first else np.full((1, width), 0.01, np.float32)
        engine.step([Segment("resident", position, 1)], rows)
    serving = process.memory_info().rss
    return {"layers": [start, end], "loaded_mib": (loaded - before) / MIB, "serving_mib": (serving - before) / MIB}


def measure_resident(model: Path, ranges: list[tuple[int, int]]) -> dict[str, Any]:
    """Each range's resident growth, each measured in a process of its own."""
    out: dict[str, Any] = {"file_mib": model_bytes(model) / MIB, "steps": STEPS, "ranges": []}
    for start, end in ranges:
        done = subprocess.run(
            [sys.executable, "-m", "cascadia.bench.resident", str(model), f"{start}:{end}"],
            capture_output=True,
            text=True,
            check=True,
            timeout=900,
        )
        out["ranges"].append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


if __name__ == "__main__":
    first, last = (int(x) for x in sys.argv[2].split(":"))
    sys.stdout.write(json.dumps(_child(Path(sys.argv[1]), first, last)) + "\n")
