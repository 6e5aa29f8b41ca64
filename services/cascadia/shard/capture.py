"""Capture: what a stage computed, frame by frame, to safetensors files for replay and offline evaluation.

Each recorded frame keeps the rows of captured streams: their segments (stream, start, length,
drafted tokens), the token ids they carry, the stage's FP32 input rows (token ids on the first
stage), its output rows (on the last stage the final states before the norm) and, on the last
stage, the sampled tokens. With `every_layer` each layer's output rows are kept too. Only streams
opened after capture was switched on are recorded, from their first row, so a replay can rebuild
their state. A byte budget bounds everything a capture holds; when a frame would pass it, capture
stops (the files written so far stay valid) and says so -- serving is never disturbed.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

log = logging.getLogger("cascadia.shard")
FLUSH_BYTES = 64 * 2**20  # frames held in memory before a file is written


class CaptureError(ValueError):
    """A capture request that cannot be carried out (bad budget, unusable directory)."""


@dataclass(frozen=True)
class CaptureSettings:
    directory: Path
    budget_bytes: int
    streams: frozenset[str] = frozenset()  # empty: every stream opened from now on
    every_layer: bool = False

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0:
            raise CaptureError(f"capture budget must be positive, got {self.budget_bytes} bytes")


@dataclass(frozen=True)
class StageInfo:
    """What a replay needs to know of the stage that recorded a file."""

    stage: int
    start_layer: int
    end_layer: int
    model: str
    hidden_size: int
    settings: dict[str, str]


@dataclass
class RecordedBlock:
    stream: str
    start: int
    length: int
    draft: int  # drafted tokens at the block's end (verified on the last stage)


@dataclass
class CaptureRecorder:
    settings: CaptureSettings
    info: StageInfo
    captured: set[str] = field(default_factory=set)
    used_bytes: int = 0
    full: bool = False
    files: list[str] = field(default_factory=list)
    _pending: list[dict[str, np.ndarray]] = field(default_factory=list)
    _pending_names: list[list[str]] = field(default_factory=list)
    _pending_bytes: int = 0

    def __post_init__(self) -> None:
        try:
            self.settings.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CaptureError(f"capture directory {self.settings.directory}: {exc.strerror}") from None
        if not os.access(self.settings.directory, os.W_OK):
            raise CaptureError(f"capture directory {self.settings.directory} is not writable")

    def opened(self, stream: str) -> None:
        if not self.full and (not self.settings.streams or stream in self.settings.streams):
            self.captured.add(stream)

    def closed(self, stream: str) -> None:
        self.captured.discard(stream)

    def record(
        self,
        blocks: Sequence[RecordedBlock],
        token_ids: Sequence[int],
        inputs: np.ndarray,
        outputs: np.ndarray,
        layer_outputs: Sequence[np.ndarray] = (),
        sampled: Sequence[tuple[str, int]] = (),
    ) -> None:
        """One frame's rows (every block, in order); only captured streams' rows are kept."""
        keep, rows, offset = [], [], 0
        for block in blocks:
            if block.stream in self.captured:
                keep.append(block)
                rows.extend(range(offset, offset + block.length))
            offset += block.length
        if not keep or self.full:
            return
        index = np.asarray(rows, dtype=np.int64)
        names = sorted({b.stream for b in keep})
        entry: dict[str, np.ndarray] = {
            "segments": np.array([[names.index(b.stream), b.start, b.length, b.draft] for b in keep], dtype=np.int32),
            "token_ids": np.asarray(token_ids, dtype=np.int32)[index],
            "outputs": np.ascontiguousarray(outputs[index], dtype=np.float32),
        }
        entry["inputs" if inputs.ndim == 2 else "input_ids"] = np.ascontiguousarray(
            inputs[index], dtype=np.float32 if inputs.ndim == 2 else np.int32
        )
        if self.settings.every_layer:
            for i, layer in enumerate(layer_outputs):
                entry[f"layer{self.info.start_layer + i}"] = np.ascontiguousarray(layer[index], dtype=np.float32)
        chosen = [(names.index(s), t) for s, t in sampled if s in names]
        if chosen:
            entry["sampled"] = np.array(chosen, dtype=np.int32)
        size = sum(a.nbytes for a in entry.values())
        if self.used_bytes + size > self.settings.budget_bytes:
            self.full = True
            self.captured.clear()
            log.warning(
                "capture budget of %d bytes is full: capture stopped, %d files kept",
                self.settings.budget_bytes,
                len(self.files) + bool(self._pending),
            )
            self.flush()
            return
        self._pending.append(entry)
        self._pending_names.append(names)
        self._pending_bytes += size
        self.used_bytes += size
        if self._pending_bytes >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        tensors = {f"{n}.{key}": value for n, entry in enumerate(self._pending) for key, value in entry.items()}
        name = f"stage{self.info.stage:02d}-{os.getpid()}-{len(self.files):05d}.safetensors"
        metadata = {
            "cascadia.capture": "1",
            "stage": str(self.info.stage),
            "layers": f"{self.info.start_layer}:{self.info.end_layer}",
            "model": self.info.model,
            "hidden_size": str(self.info.hidden_size),
            "settings": json.dumps(self.info.settings),
            "frames": str(len(self._pending)),
            "streams": json.dumps(self._pending_names),
        }
        save_file(tensors, str(self.settings.directory / name), metadata=metadata)
        self.files.append(name)
        self._pending, self._pending_names, self._pending_bytes = [], [], 0


@dataclass
class CapturedFrame:
    blocks: list[RecordedBlock]
    token_ids: np.ndarray  # [T] the ids the rows carry
    inputs: np.ndarray  # [T, H] FP32 rows, or [T] token ids on the first stage
    outputs: np.ndarray  # [T, H]
    layers: dict[int, np.ndarray]  # layer index -> its output rows, when every layer was captured
    sampled: list[tuple[str, int]]  # the last stage's tokens, in order


@dataclass
class StageCapture:
    info: StageInfo
    frames: list[CapturedFrame]


def read_capture(path: Path) -> dict[int, StageCapture]:
    """Every capture file under `path` (a directory or one file), by stage, frames in recording order."""
    from safetensors import safe_open

    path = Path(path)
    files = (
        sorted(path.glob("stage*.safetensors"), key=lambda f: (f.stat().st_mtime_ns, f.name))
        if path.is_dir()
        else [path]
    )
    if not files:
        raise CaptureError(f"{path}: no capture files (stageNN-*.safetensors)")
    stages: dict[int, StageCapture] = {}
    for file in files:
        with safe_open(str(file), framework="numpy") as handle:
            meta = handle.metadata() or {}
            if meta.get("cascadia.capture") != "1":
                raise CaptureError(f"{file}: not a capture file")
            start, end = (int(x) for x in meta["layers"].split(":"))
            info = StageInfo(
                int(meta["stage"]), start, end, meta["model"], int(meta["hidden_size"]), json.loads(meta["settings"])
            )
            stage = stages.setdefault(info.stage, StageCapture(info, []))
            keys = set(handle.keys())
            for n, names in enumerate(json.loads(meta["streams"])):
                segments = handle.get_tensor(f"{n}.segments")
                blocks = [RecordedBlock(names[int(i)], int(a), int(b), int(d)) for i, a, b, d in segments]
                inputs = handle.get_tensor(f"{n}.inputs" if f"{n}.inputs" in keys else f"{n}.input_ids")
                layers = {int(k.split(".layer")[1]): handle.get_tensor(k) for k in keys if k.startswith(f"{n}.layer")}
                sampled = []
                if f"{n}.sampled" in keys:
                    sampled = [(names[int(i)], int(t)) for i, t in handle.get_tensor(f"{n}.sampled")]
                stage.frames.append(
                    CapturedFrame(
                        blocks,
                        handle.get_tensor(f"{n}.token_ids"),
                        inputs,
                        handle.get_tensor(f"{n}.outputs"),
                        layers,
                        sampled,
                    )
                )
    return stages


@dataclass
class ConfirmedStream:
    """A stream as the fleet settled it: the ids it was fed and the final state of every confirmed row."""

    tokens: list[int]  # x_0 .. x_N: every confirmed row's id, then the last sampled token
    final_states: np.ndarray  # [N, H] final states before the norm, rows 0 .. N-1
    prompt_length: int


def confirmed_streams(last: StageCapture) -> dict[str, ConfirmedStream]:
    """Replay the last stage's bookkeeping: a verified block keeps its accepted drafts and the row before them."""
    rows: dict[str, dict[int, tuple[int, np.ndarray]]] = {}
    after: dict[str, int] = {}
    prompt: dict[str, int] = {}
    for frame in last.frames:
        tokens: dict[str, list[int]] = {}
        for stream, token in frame.sampled:
            tokens.setdefault(stream, []).append(token)
        offset = 0
        for block in frame.blocks:
            got = tokens.get(block.stream, [])
            keep = len(got) if block.draft else block.length
            seen = rows.setdefault(block.stream, {})
            for t in [t for t in seen if t >= block.start]:  # a rewind: later rows are gone
                del seen[t]
            for i in range(keep):
                seen[block.start + i] = (int(frame.token_ids[offset + i]), frame.outputs[offset + i])
            if got:
                prompt.setdefault(block.stream, block.start + block.length)
                after[block.stream] = got[-1]
            offset += block.length
    out = {}
    for stream, seen in rows.items():
        if stream not in after or sorted(seen) != list(range(len(seen))):
            continue  # never sampled, or its first rows were not captured
        ordered = [seen[t] for t in range(len(seen))]
        out[stream] = ConfirmedStream(
            [t for t, _ in ordered] + [after[stream]], np.stack([r for _, r in ordered]), prompt[stream]
        )
    return out
