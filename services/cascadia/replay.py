"""Replay: recompute a layer range from captured inputs and measure how far it lands from what the fleet ran.

This is how a new precision or device is checked against real traffic: the captured frames are fed
again, in their recorded order and batches (a block that starts before a stream's position is the
rewind the fleet made), and every layer whose output was captured is compared row for row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from cascadia.engine.batch import Segment
from cascadia.engine.engine import StageEngine
from cascadia.shard.capture import CapturedFrame, CaptureError, StageCapture


@dataclass
class Deviation:
    """Running comparison of replayed rows against captured ones."""

    rows: int = 0
    squared_diff: float = 0.0
    squared_ref: float = 0.0
    max_diff: float = 0.0
    max_ref: float = 0.0

    def add(self, ours: np.ndarray, ref: np.ndarray) -> None:
        diff = ours.astype(np.float64) - ref.astype(np.float64)
        self.rows += len(ref)
        self.squared_diff += float(np.sum(diff**2))
        self.squared_ref += float(np.sum(ref.astype(np.float64) ** 2))
        self.max_diff = max(self.max_diff, float(np.abs(diff).max(initial=0.0)))
        self.max_ref = max(self.max_ref, float(np.abs(ref).max(initial=0.0)))

    @property
    def relative_rms(self) -> float:
        return float(np.sqrt(self.squared_diff / self.squared_ref)) if self.squared_ref else 0.0

    @property
    def relative_max(self) -> float:
        return self.max_diff / self.max_ref if self.max_ref else 0.0


@dataclass
class ReplayReport:
    start_layer: int
    end_layer: int
    frames: int
    layers: dict[int, Deviation] = field(default_factory=dict)
    argmax_rows: int = 0
    argmax_agree: int = 0

    @property
    def argmax_agreement(self) -> float | None:
        return self.argmax_agree / self.argmax_rows if self.argmax_rows else None

    def as_dict(self) -> dict:
        return {
            "layers": f"{self.start_layer}:{self.end_layer}",
            "frames": self.frames,
            "per_layer": {
                str(layer): {
                    "rows": d.rows,
                    "relative_rms": d.relative_rms,
                    "relative_max": d.relative_max,
                }
                for layer, d in sorted(self.layers.items())
            },
            "argmax_agreement": self.argmax_agreement,
        }


def _aligned(a: list[CapturedFrame], b: list[CapturedFrame]) -> bool:
    """Two stages' frames describe the same rows (captured over the same window of traffic)."""
    return len(a) == len(b) and all(
        [(x.stream, x.start, x.length) for x in fa.blocks] == [(x.stream, x.start, x.length) for x in fb.blocks]
        for fa, fb in zip(a, b, strict=True)
    )


def plan_replay(
    stages: dict[int, StageCapture], start: int, end: int
) -> tuple[list[CapturedFrame], Callable[[CapturedFrame], np.ndarray], dict[int, list[np.ndarray]]]:
    """The frames to feed, where their inputs come from, and each captured layer's expected outputs."""
    source: StageCapture | None = None
    for stage in stages.values():
        if stage.info.start_layer == start:
            source, read_input = stage, (lambda f: f.inputs)
            break
    if source is None:
        for stage in stages.values():
            if stage.frames and (start - 1) in stage.frames[0].layers:
                source, read_input = stage, (lambda f, layer=start - 1: f.layers[layer])
                break
    if source is None:
        raise CaptureError(
            f"no captured input for layer {start}: capture a stage starting there, or every layer (--every-layer)"
        )
    frames = source.frames
    expected: dict[int, list[np.ndarray]] = {}
    for stage in stages.values():
        if not _aligned(stage.frames, frames):
            continue
        if start < stage.info.end_layer <= end:
            expected[stage.info.end_layer - 1] = [f.outputs for f in stage.frames]
        for layer in stage.frames[0].layers if stage.frames else {}:
            if start <= layer < end:
                expected[layer] = [f.layers[layer] for f in stage.frames]
    if not expected:
        raise CaptureError(f"no captured output inside layers {start}:{end} lines up with the inputs")
    return frames, read_input, expected


def replay(engine: StageEngine, stages: dict[int, StageCapture], progress: Callable[[int, int], None] | None = None):
    """Feed the captured frames through `engine` (layers engine.start_layer:engine.end_layer) and compare."""
    start, end = engine.start_layer, engine.end_layer
    frames, read_input, expected = plan_replay(stages, start, end)
    report = ReplayReport(start, end, len(frames))
    for layer in expected:
        report.layers[layer] = Deviation()
    for n, frame in enumerate(frames):
        segments = []
        for block in frame.blocks:
            if block.stream not in engine.streams:
                if block.start != 0:
                    raise CaptureError(f"stream {block.stream}: captured from position {block.start}, not its start")
                engine.open(block.stream)
            elif block.start < engine.position(block.stream):
                engine.rewind(block.stream, block.start)  # the fleet rewound rejected drafts here
            segments.append(Segment(block.stream, block.start, block.length))
        trace: list[np.ndarray] = []
        result = engine.step(segments, read_input(frame), trace=trace)
        for i, rows in enumerate(trace):
            layer = start + i
            if layer in expected:
                report.layers[layer].add(rows, expected[layer][n])
        if engine.is_last and end - 1 in expected:
            ours = result.logits.argmax(-1)
            theirs = engine.head_logits(expected[end - 1][n]).argmax(-1)
            report.argmax_rows += len(ours)
            report.argmax_agree += int((ours == theirs).sum())
        if progress is not None:
            progress(n + 1, len(frames))
    for stream in list(engine.streams):
        engine.close(stream)
    return report
