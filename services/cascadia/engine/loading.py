"""The engine of a stage from whatever holds its weights: a converted stage (its graphs mapped, nothing
quantised), an Inkling checkpoint (each layer read and quantised as its graph is built), or another
model's weights (read whole, then compiled)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from cascadia.engine import converted
from cascadia.engine.engine import StageEngine
from cascadia.engine.memory import release_unused_memory
from cascadia.engine.settings import EngineSettings
from cascadia.engine.weights import packed_store
from cascadia.model.checkpoint import CheckpointError, StageReader
from cascadia.model.loader import is_gguf, load_shape, load_stage

# (what, done, total): a phase begins with done 0, then each graph compiled counts one
Progress = Callable[[str, int, int], None]


class StageLoadError(ValueError):
    """The weights cannot give this stage: a converted stage of other layers or settings, a broken checkpoint."""


def load_engine(
    model_dir: Path,
    settings: EngineSettings,
    start: int | None = None,
    end: int | None = None,
    precision: str | None = None,
    progress: Progress | None = None,
    log: Callable[[str], None] | None = None,
) -> StageEngine:
    """The engine of layers [start, end) (default: all). `log` takes the reader's lines (a tensor a line
    on a long read); `progress` the phases and the graphs compiled."""
    shape = load_shape(model_dir)
    start = 0 if start is None else start
    end = shape.num_layers if end is None else end
    total = end - start + int(start == 0) + int(end == shape.num_layers)
    report = progress or (lambda _what, _done, _total: None)

    def compiled(what: str, done: int, total: int) -> None:
        report(f"compiling {what}", done, total)

    if converted.is_converted(model_dir):
        try:
            store = converted.open_converted(model_dir, settings, start, end, precision)
        except converted.ConvertedStageError as exc:
            raise StageLoadError(str(exc)) from None
        report("mapping and compiling", 0, total)
        layers = converted.ConvertedLayers(shape, start, end)
        engine = StageEngine(layers, settings, progress=compiled, graph_store=store)
    elif shape.family == "inkling" and not is_gguf(model_dir):
        report("reading and compiling", 0, total)
        try:
            reader = StageReader(model_dir, start, end, settings.stored_forms, packed_store, log)
        except CheckpointError as exc:
            raise StageLoadError(str(exc)) from None
        engine = StageEngine(reader, settings, progress=compiled)
    else:
        weights = load_stage(model_dir, start, end)
        report("compiling", 0, total)
        # the compiled stage holds its own copy: the file's arrays and compile-time buffers can go
        reload = functools.partial(load_stage, model_dir, start, end)
        engine = StageEngine(weights, settings, progress=compiled, reload=reload)
        del weights
    release_unused_memory()
    return engine
