"""Stage weights the device plugin reads through a file mapping instead of holding in anonymous memory.

A graph built in memory carries its weights as constants in the process's heap, and the CPU plugin
keeps them beside its own repacked layout: every weight twice, both anonymous. Written as OpenVINO IR
and read back, the constants map the IR's weight file instead: the system can drop those pages under
pressure and read them again when touched, as it does for any file. The files are removed as soon as
they are read; the mapping keeps the data until the last constant is gone.

The directory is `$CASCADIA_CACHE_DIR`, else `$XDG_CACHE_HOME/cascadia`, else `~/.cache/cascadia`. It
must be on a disk: on tmpfs the pages would stay in memory. When it cannot be written, the weights
stay in memory and the process says so once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import openvino as ov

from cascadia.engine.settings import EngineSettings

log = logging.getLogger(__name__)

CACHE_ENV = "CASCADIA_CACHE_DIR"
# where device plugins keep compiled kernels between starts (OpenVINO's CACHE_DIR), on the node's disk
COMPILE_CACHE_ENV = "CASCADIA_COMPILE_CACHE_DIR"

# a directory is removed seconds after it is written, unless its process died in between; one this old is
# left over (writing even a large stage's weights takes minutes)
STALE_AFTER_S = 3600.0

_warned = False
_swept: set[Path] = set()  # cache roots already cleared of leftovers by this process


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cascadia"


def stale_dirs(root: Path, now: float, max_age_s: float = STALE_AFTER_S) -> list[Path]:
    """Directories this module left under `root` whose process died before removing them."""
    return [d for d in root.glob("stage-*") if d.is_dir() and now - d.stat().st_mtime > max_age_s]


def _rt_info(model: ov.Model) -> dict[str, dict[str, int | str]]:
    """Each op's run-time info that a plugin may read (PagedAttention's head sizes), by op name."""
    kept: dict[str, dict[str, int | str]] = {}
    for op in model.get_ops():
        info = op.get_rt_info()
        values = {key: info[key].value for key in info}
        plain = {key: value for key, value in values.items() if isinstance(value, int | str)}
        if plain:
            kept[op.get_friendly_name()] = plain
    return kept


def _restore_rt_info(model: ov.Model, kept: dict[str, dict[str, int | str]]) -> None:
    """Put back what the IR serialiser dropped (it keeps only some run-time info)."""
    for op in model.get_ops():
        info = op.get_rt_info()
        for key, value in kept.get(op.get_friendly_name(), {}).items():
            if key not in info:
                info[key] = value


def _flush(path: Path) -> None:
    """Write the file's pages to disk now, while the stage loads, rather than in the background once it
    serves: the kernel writes dirty pages back seconds later, a stage's worth of them competing with
    the first steps for the CPU and the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


RT_INFO_SUFFIX = ".rtinfo.json"


def save_ir(core: ov.Core, model: ov.Model, path: Path, device: str) -> None:
    """Write `model` as IR at `path` (.xml, .bin, and the run-time info the serialiser drops), flushed."""
    core.get_versions(device)
    ov.save_model(model, path, compress_to_fp16=False)
    _flush(path.with_suffix(".bin"))
    path.with_suffix(RT_INFO_SUFFIX).write_text(json.dumps(_rt_info(model)))


def read_ir(core: ov.Core, path: Path, device: str) -> ov.Model:
    """An IR written by `save_ir`, its constants mapping the weight file."""
    core.get_versions(device)  # the IR reader knows a plugin's own ops once the core has loaded it
    model = core.read_model(path)
    info = path.with_suffix(RT_INFO_SUFFIX)
    if info.is_file():
        _restore_rt_info(model, json.loads(info.read_text()))
    return model


def mapped_copy(core: ov.Core, model: ov.Model, device: str) -> ov.Model | None:
    """`model` with its constants mapping a weight file, or None when no file could be written."""
    global _warned
    root = cache_root()
    kept = _rt_info(model)
    # the IR reader knows a plugin's own ops (PagedAttention) once the core has loaded that plugin
    core.get_versions(device)
    try:
        root.mkdir(parents=True, exist_ok=True)
        if root not in _swept:
            for leftover in stale_dirs(root, time.time()):
                shutil.rmtree(leftover, ignore_errors=True)
            _swept.add(root)
        with tempfile.TemporaryDirectory(dir=root, prefix="stage-") as tmp:
            path = Path(tmp) / "stage.xml"
            ov.save_model(model, path, compress_to_fp16=False)
            _flush(path.with_suffix(".bin"))
            mapped = core.read_model(path)
    except (OSError, RuntimeError) as exc:
        if not _warned:
            log.warning("weights stay in memory: cannot write them under %s (%s); set %s", root, exc, CACHE_ENV)
            _warned = True
        return None
    _restore_rt_info(mapped, kept)
    return mapped


def use_compile_cache(core: ov.Core, device: str) -> Path | None:
    """Point the core at `$CASCADIA_COMPILE_CACHE_DIR`, so that the iGPU compiles its kernels once per
    node rather than at every start. Not on the CPU: its cached blobs would hold a second copy of the
    stage's weights, and it compiles in seconds."""
    where = os.environ.get(COMPILE_CACHE_ENV)
    if not where or device.upper().startswith("CPU"):
        return None
    path = Path(where)
    path.mkdir(parents=True, exist_ok=True)
    core.set_property({"CACHE_DIR": str(path)})
    return path


def compile_model(core: ov.Core, model: ov.Model, settings: EngineSettings, config: dict[str, str]) -> ov.CompiledModel:
    """Compile `model` for the settings' device, its weights read through a file mapping when the
    settings say so (and a file can be written)."""
    if settings.map_weights:
        model = mapped_copy(core, model, settings.device) or model
    return core.compile_model(model, settings.device, config)
