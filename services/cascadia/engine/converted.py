"""A stage's deployment form: its graphs as OpenVINO IR with the weights already stored as they run.

`convert` reads a checkpoint one layer at a time (each weight quantised as it is read, never a layer
range in f32) and writes, under the output directory, every graph the stage consists of
(`graph_store.stage_graph_names`), the checkpoint's config and tokenizer files (so the directory
serves as `--model` for the layers it holds), and last `cascadia-stage.json`: what it holds (layer
range, precision, device, the settings its graphs depend on) and a digest of its inputs. The files
are written to a sibling directory and moved into place whole, so an interrupted run leaves nothing a
shard would load; running it again on the same inputs finds the digest and writes nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import openvino as ov

from cascadia import __version__
from cascadia.engine import cpu_kernels
from cascadia.engine.compiled import graph_builder
from cascadia.engine.graph_store import ReadGraphs, WrittenGraphs, stage_graph_names
from cascadia.engine.settings import EngineSettings
from cascadia.engine.weights import packed_store
from cascadia.model.checkpoint import StageReader, TensorSource

MANIFEST = "cascadia-stage.json"
FORMAT_VERSION = 1
GRAPHS_DIR = "graphs"
# files beside the weights that readers of a checkpoint directory look for
CARRIED_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
)
# settings that change only how a stage runs, not its graphs
RUNTIME_ONLY = frozenset({"context", "rewind_slack", "threads", "map_weights", "planned_streams", "profile_ops"})


class ConvertedStageError(ValueError):
    """A converted stage asked for layers or settings it was not converted for."""


@dataclass(frozen=True)
class ConvertResult:
    out: str
    start_layer: int
    end_layer: int
    precision: str
    device: str
    bytes_written: int
    seconds: float
    peak_rss_bytes: int
    up_to_date: bool


def graph_settings(settings: EngineSettings) -> dict[str, object]:
    """The settings a stage's graphs depend on, as a converted stage records them."""
    return {k: v for k, v in asdict(settings).items() if k not in RUNTIME_ONLY}


def is_converted(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_manifest(path: Path) -> dict:
    try:
        return json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConvertedStageError(f"{path}: unreadable {MANIFEST} ({exc})") from None


def code_digest(files: tuple[Path, ...] | None = None) -> str:
    """A digest of the code that builds a stage's graphs and stores its weights: a conversion made by
    other code is made again, even under the same version number."""
    hasher = hashlib.sha256()
    for path in files or _graph_code():
        hasher.update(Path(path).read_bytes())
    return hasher.hexdigest()


def _graph_code() -> tuple[Path, ...]:
    from cascadia.engine import compiled, graph_store, graphs, stage_graph, weights
    from cascadia.model import checkpoint, formats

    return tuple(Path(m.__file__) for m in (compiled, graph_store, graphs, stage_graph, weights, checkpoint, formats))


def _digest(reader: StageReader, precision: str, settings: EngineSettings) -> str:
    source = TensorSource(reader.model_dir)
    try:
        prefixes = stage_tensor_prefixes(reader)
        names = [n for n in source.names() if any(n.startswith(p) for p in prefixes)]
        tensors = source.source_digest(names)
    finally:
        source.close()
    key = {
        "tensors": tensors,
        "config": hashlib.sha256((reader.model_dir / "config.json").read_bytes()).hexdigest(),
        "layers": [reader.start_layer, reader.end_layer],
        "precision": precision,
        "settings": graph_settings(settings),
        "cascadia": __version__,
        "code": code_digest(),
        "openvino": ov.get_version(),
        "format": FORMAT_VERSION,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def stage_tensor_prefixes(reader: StageReader) -> list[str]:
    """Name prefixes of the checkpoint tensors a stage reads: its layers, and the embedding or the head."""
    published = reader.shape.layout == "published"
    layer = "model.llm.layers." if published else "model.layers."
    prefixes = [f"{layer}{i}." for i in range(reader.start_layer, reader.end_layer)]
    if reader.is_first:
        prefixes += ["model.llm.embed" if published else "model.embed_tokens."]
    if reader.is_last:
        prefixes += ["model.llm.norm.", "model.llm.unembed."] if published else ["model.norm.", "lm_head."]
    return prefixes


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def convert(
    model_dir: Path,
    out: Path,
    settings: EngineSettings,
    precision: str,
    start: int,
    end: int,
    progress: Callable[[str], None] | None = None,
) -> ConvertResult:
    """Write the deployment form of layers [start, end) of `model_dir` to `out` (see the module's text)."""
    began = time.monotonic()
    model_dir, out = Path(model_dir), Path(out)
    say = progress or (lambda _line: None)
    reader = StageReader(model_dir, start, end, settings.stored_forms, packed_store, say)
    digest = _digest(reader, precision, settings)
    if is_converted(out) and read_manifest(out).get("digest") == digest:
        say(f"{out} already holds layers {start}:{end} at {precision} from these inputs: nothing to do")
        return ConvertResult(str(out), start, end, precision, settings.device, 0, 0.0, _peak_rss(), True)
    names = stage_graph_names(start, end, reader.is_first, reader.is_last, settings)
    out.parent.mkdir(parents=True, exist_ok=True)
    for leftover in out.parent.glob(f".{out.name}.partial-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    core = ov.Core()
    cpu_kernels.add_to(core, settings)
    graphs_dir = partial / GRAPHS_DIR
    graphs_dir.mkdir(parents=True)
    written = WrittenGraphs(core, settings, graphs_dir)
    try:
        for n, name in enumerate(names, 1):
            t0 = time.monotonic()
            written.save(name, graph_builder(reader, settings, name))
            size = sum(f.stat().st_size for f in graphs_dir.glob(f"{name}.*"))
            say(f"converted {name} ({n}/{len(names)}): {size / 2**20:.1f} MiB in {time.monotonic() - t0:.1f} s")
        reader.release()
        for carried in CARRIED_FILES:
            if (model_dir / carried).is_file():
                shutil.copy2(model_dir / carried, partial / carried)
        total = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file())
        manifest = {
            "format": FORMAT_VERSION,
            "layers": [start, end],
            "first": reader.is_first,
            "last": reader.is_last,
            "num_layers": reader.shape.num_layers,
            "precision": precision,
            "device": settings.device,
            "settings": graph_settings(settings),
            "graphs": names,
            "bytes": total,
            "digest": digest,
            "source": str(model_dir.resolve()),
            "cascadia": __version__,
            "openvino": ov.get_version(),
        }
        (partial / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if out.exists():
            retired = out.parent / f".{out.name}.partial-old-{os.getpid()}"
            out.rename(retired)
            partial.rename(out)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    seconds = time.monotonic() - began
    say(f"wrote {out}: {total / 2**30:.2f} GiB in {seconds:.1f} s")
    return ConvertResult(str(out), start, end, precision, settings.device, total, seconds, _peak_rss(), False)


def open_converted(path: Path, settings: EngineSettings, start: int, end: int, precision: str | None = None):
    """The graph store of a converted stage, after checking it holds layers [start, end) in these settings."""
    manifest = read_manifest(path)
    held = tuple(manifest["layers"])
    what = f"{path} holds layers {held[0]}:{held[1]} converted at {manifest['precision']} for {manifest['device']}"
    if not held[0] <= start < end <= held[1]:
        raise ConvertedStageError(f"{what}; asked for layers {start}:{end}")
    if precision is not None and precision != manifest["precision"]:
        raise ConvertedStageError(f"{what}; asked for precision {precision}")
    wanted = graph_settings(settings)
    differ = sorted(k for k in wanted if manifest["settings"].get(k) != wanted[k])
    if differ:
        detail = ", ".join(f"{k} {wanted[k]!r} (converted: {manifest['settings'].get(k)!r})" for k in differ)
        raise ConvertedStageError(f"{what}; asked for {detail}")
    core = ov.Core()
    cpu_kernels.add_to(core, settings)
    return ReadGraphs(core, settings, Path(path) / GRAPHS_DIR)


class ConvertedLayers:
    """A converted stage's layers behind the interface of `StageReader`: the graphs hold the weights,
    so nothing is ever read from a checkpoint."""

    def __init__(self, shape, start: int, end: int) -> None:
        self.shape, self.start_layer, self.end_layer = shape, start, end
        self.is_first, self.is_last = start == 0, end == shape.num_layers

    def _none(self, *_args: object) -> None:
        raise ConvertedStageError("a converted stage holds graphs, not weights")

    layer = ends = weights = _none

    def release(self) -> None:
        pass


def held_layers(path: Path) -> tuple[int, int]:
    layers = read_manifest(path)["layers"]
    return int(layers[0]), int(layers[1])
