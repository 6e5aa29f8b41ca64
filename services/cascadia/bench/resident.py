"""Resident memory of a stage: a fresh process loads and compiles a layer range as a shard does, decodes
a few tokens, and reports how far its resident set grew, against the size of the model's file.

The baseline is taken after the process has compiled a one-node model on the device, so that the
plugin's code and thread pools (paid once per process, whatever it serves) are not counted as the
model's. A GGUF file is also loaded by OpenVINO GenAI's `LLMPipeline` the same way, as the peer.

`python -m cascadia.bench.resident MODEL START:END [--weights-in-memory]` (or `MODEL genai`) is the
child; `measure_resident` runs one child per range so that no range inherits another's allocations.
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


def _load_plugin(device: str = "CPU") -> None:
    """Compile a one-node model, so that the device plugin's libraries and threads are in place."""
    import numpy as np
    import openvino as ov
    import openvino.opset16 as ops

    x = ops.parameter([1, 8], np.float32)
    request = ov.Core().compile_model(ov.Model([ops.relu(x)], [x]), device).create_infer_request()
    request.infer({0: np.ones((1, 8), np.float32)})


def _growth(layers: Any, before: Any, loaded: Any, serving: Any) -> dict[str, Any]:
    """Resident growth in MiB (psutil memory_info records). Anonymous memory is what the system cannot
    reclaim without swap; the rest of the resident set is pages of files, dropped under pressure and
    read again when touched."""

    def anon(info: Any) -> int:
        return info.rss - info.shared

    return {
        "layers": layers,
        "loaded_mib": (loaded.rss - before.rss) / MIB,
        "serving_mib": (serving.rss - before.rss) / MIB,
        "serving_anon_mib": (anon(serving) - anon(before)) / MIB,
    }


def _child(model: Path, start: int, end: int, map_weights: bool = True) -> dict[str, Any]:
    import numpy as np
    import psutil

    from cascadia.engine.batch import Segment
    from cascadia.engine.loading import load_engine
    from cascadia.engine.settings import EngineSettings

    _load_plugin()
    process = psutil.Process()
    before = process.memory_info()
    engine = load_engine(model, EngineSettings(map_weights=map_weights), start, end)
    loaded = process.memory_info()
    engine.open("resident")
    width = engine.shape.hidden_size
    for position in range(STEPS):
        rows = np.array([3 + position]) if engine.is_first else np.full((1, width), 0.01, np.float32)
        engine.step([Segment("resident", position, 1)], rows)
    return _growth([start, end], before, loaded, process.memory_info())


def _genai_child(model: Path) -> dict[str, Any]:
    """The same growth for GenAI's LLMPipeline over the whole GGUF file, with our f32 mode's settings."""
    import openvino_genai
    import psutil

    from cascadia.bench.peer import genai_pipeline

    _load_plugin()
    process = psutil.Process()
    before = process.memory_info()
    pipe = genai_pipeline(model)
    loaded = process.memory_info()
    config = openvino_genai.GenerationConfig(max_new_tokens=STEPS, ignore_eos=True)
    pipe.generate("The lighthouse keeper", config)
    return _growth("genai", before, loaded, process.memory_info())


def _run_child(model: Path, what: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "cascadia.bench.resident", str(model), what],
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_resident(model: Path, ranges: list[tuple[int, int]], genai: bool = False) -> dict[str, Any]:
    """Each range's resident growth, each measured in a process of its own (and GenAI's, with `genai`)."""
    out: dict[str, Any] = {"file_mib": model_bytes(model) / MIB, "steps": STEPS, "ranges": []}
    for start, end in ranges:
        out["ranges"].append(_run_child(model, f"{start}:{end}"))
    if genai:
        out["genai"] = _run_child(model, "genai")
    return out


if __name__ == "__main__":
    path = Path(sys.argv[1])
    if sys.argv[2] == "genai":
        result = _genai_child(path)
    else:
        first, last = (int(x) for x in sys.argv[2].split(":"))
        # `--weights-in-memory`: the graphs keep their constants in memory (EngineSettings.map_weights off)
        result = _child(path, first, last, map_weights="--weights-in-memory" not in sys.argv[3:])
    sys.stdout.write(json.dumps(result) + "\n")
