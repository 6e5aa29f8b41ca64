"""Where a stage's graphs come from: built from weights, written once as a converted stage, or read back.

A stage is a fixed list of named graphs (`stage_graph_names`): `embed`, `layer{i}` (or, with experts
at another precision, `layer{i}.attention`, `layer{i}.experts`, `layer{i}.post`) and `head`. The
engine asks a store for each by name with a function that would build it; a store that holds the
graph already never calls it, so a shard started from a converted stage reads no checkpoint tensor
and quantises nothing: it maps the IR's weight files and compiles.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import openvino as ov

from cascadia.engine import mapped
from cascadia.engine.settings import EngineSettings

Build = Callable[[], ov.Model]


class GraphStore(Protocol):
    def model(self, name: str, build: Build) -> ov.Model: ...


def stage_graph_names(start: int, end: int, first: bool, last: bool, settings: EngineSettings) -> list[str]:
    """The graphs an Inkling stage of layers [start, end) consists of, in the order they are built."""
    names = ["embed"] if first else []
    for i in range(start, end):
        if settings.split_expert_graph:
            names += [f"layer{i}.attention", f"layer{i}.experts", f"layer{i}.post"]
        else:
            names.append(f"layer{i}")
    return names + (["head"] if last else [])


class BuiltGraphs:
    """Graphs built from the weights, their constants moved to a file mapping when the settings say so."""

    def __init__(self, core: ov.Core, settings: EngineSettings) -> None:
        self._core, self._settings = core, settings

    def model(self, name: str, build: Build) -> ov.Model:
        model = build()
        if self._settings.map_weights:
            return mapped.mapped_copy(self._core, model, self._settings.device) or model
        return model


class WrittenGraphs:
    """Graphs built and written as OpenVINO IR under `directory` (name.xml, name.bin), for `ReadGraphs`."""

    def __init__(self, core: ov.Core, settings: EngineSettings, directory: Path) -> None:
        self._core, self._settings, self.directory = core, settings, Path(directory)

    def save(self, name: str, build: Build) -> Path:
        """Build graph `name` and write it; nothing of it stays in memory."""
        path = self.directory / f"{name}.xml"
        mapped.save_ir(self._core, build(), path, self._settings.device)
        return path


class ReadGraphs:
    """Graphs a converted stage holds, read from `directory`; asking for one it lacks is an error."""

    def __init__(self, core: ov.Core, settings: EngineSettings, directory: Path) -> None:
        self._core, self._settings, self.directory = core, settings, Path(directory)

    def model(self, name: str, build: Build) -> ov.Model:
        path = self.directory / f"{name}.xml"
        if not path.is_file():
            raise FileNotFoundError(f"{self.directory}: the converted stage has no graph '{name}'")
        return mapped.read_ir(self._core, path, self._settings.device)
