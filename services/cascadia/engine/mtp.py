"""Inkling's multi-token-prediction head on OpenVINO, and the chain that drafts with it.

At position t, depth k reads the token one step further ahead than depth k-1 (x_{t+k+1}) and the
state before it (the trunk's normed final state for k = 0, depth k-1's raw block output after that),
runs one dense decoder layer causally with its own KV and short-conv state, and predicts x_{t+k+2}.

`MtpHead` is the compute: the shared embedding, an input graph per depth, each depth's block as a
one-layer `StageEngine` (so it has the trunk's stream state, batching and rewinds), and a logits
graph. `MtpDrafter` keeps, per stream, what the chain needs between rounds: a depth's state is
committed only over positions whose inputs are all confirmed tokens (teacher-fed); rows that read a
drafted token are computed for the proposal and rewound right after it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import openvino as ov

from cascadia.engine import cpu_kernels, graphs, mapped
from cascadia.engine.batch import Segment
from cascadia.engine.compiled import Progress, compile_config, infer
from cascadia.engine.engine import StageEngine
from cascadia.engine.settings import EngineSettings
from cascadia.model.checkpoint import MtpWeights, StageWeights


class MtpHead:
    """Depths 0..D-1 of the head, each with per-stream state like a trunk stage."""

    def __init__(
        self,
        weights: MtpWeights,
        settings: EngineSettings,
        vocab: int | None = None,
        progress: Progress | None = None,
    ) -> None:
        shape = weights.shape
        self.shape = shape
        self.depths = len(weights.depths)
        self.vocab = min(vocab or shape.unpadded_vocab_size, shape.unpadded_vocab_size)
        core = ov.Core()
        cpu_kernels.add_to(core, settings)
        cfg = compile_config(settings, settings.residual_compute)
        total, done = 2 * self.depths + 2, 0

        def tick(what: str) -> None:
            nonlocal done
            done += 1
            if progress is not None:
                progress(what, done, total)

        embed = graphs.embed_graph(weights.embed, weights.embed_norm, shape.rms_norm_eps, settings.head_weights)
        self._embed = mapped.compile_model(core, embed, settings, cfg).create_infer_request()
        tick("MTP embedding")
        self._inputs: list[ov.InferRequest] = []
        self.blocks: list[StageEngine] = []
        for k, depth in enumerate(weights.depths):
            model = graphs.mtp_input_graph(
                shape,
                depth.hidden_norm,
                depth.embed_norm,
                depth.input_proj,
                weights.final_norm if k == 0 else None,
                settings.attention_weights,
            )
            self._inputs.append(mapped.compile_model(core, model, settings, cfg).create_infer_request())
            tick(f"MTP depth {k} input")
            block = StageWeights(shape, k, k + 1, (depth.block,), None, None, None, None)
            self.blocks.append(StageEngine(block, settings))
            tick(f"MTP depth {k} block")
        logits = graphs.head_graph(shape, None, weights.head, settings.head_weights, self.vocab, settings.head_compute)
        self._logits = mapped.compile_model(core, logits, settings, cfg).create_infer_request()
        tick("MTP head")

    def open(self, stream: Hashable) -> None:
        for block in self.blocks:
            block.open(stream)

    def close(self, stream: Hashable) -> None:
        for block in self.blocks:
            if stream in block.streams:
                block.close(stream)

    def adopt(self, source: Hashable, stream: Hashable) -> None:
        """`stream` takes over `source`'s state at every depth, where it stands."""
        for block in self.blocks:
            if source in block.streams:
                block.adopt(source, stream, block.position(source))

    def copy(self, source: Hashable, stream: Hashable) -> None:
        """Open `stream` holding `source`'s state at every depth, where it stands; `source` goes on as it was."""
        copied = []
        try:
            for block in self.blocks:
                if source in block.streams:
                    block.copy(source, stream, block.position(source))
                    copied.append(block)
        except Exception:  # a budget exceeded: nothing is left open
            for block in copied:
                block.close(stream)
            raise

    def position(self, depth: int, stream: Hashable) -> int:
        return self.blocks[depth].position(stream)

    def rewind(self, depth: int, stream: Hashable, position: int) -> None:
        self.blocks[depth].rewind(stream, position)

    def run_depth(self, depth: int, segments: Sequence[Segment], prev: np.ndarray, ahead_ids: np.ndarray) -> np.ndarray:
        """Depth `depth` over `segments`: rows' previous states and the ids one step ahead -> raw block outputs."""
        embedded = infer(self._embed, {"input_ids": np.asarray(ahead_ids, dtype=np.int32)})["hidden"]
        block_input = infer(
            self._inputs[depth],
            {"prev": np.ascontiguousarray(prev, dtype=np.float32), "embedded": embedded},
        )["block_input"]
        return self.blocks[depth].step(segments, block_input).hidden

    def logits(self, raw: np.ndarray) -> np.ndarray:
        return infer(self._logits, {"hidden": np.ascontiguousarray(raw, dtype=np.float32)})["logits"]


class MtpDrafter:
    """Drafts with an `MtpHead` for many streams at once, keeping every depth current on confirmed tokens."""

    # a depth that fell this far behind catches up even when no draft needs it, in windows of this size
    CATCH_UP = 64
    WINDOW = 256

    def __init__(self, head: MtpHead) -> None:
        self.head = head
        self._streams: dict[Hashable, _StreamRecord] = {}
        # inputs held behind each depth, so that a stream stepped back as far as the trunk allows (a later
        # prompt taking a finished stream over) can run its depths again from there
        self.keep_behind = head.blocks[0].settings.rewind_slack if head.blocks else 0

    @property
    def streams(self) -> list[Hashable]:
        return list(self._streams)

    def open(self, stream: Hashable) -> None:
        self.head.open(stream)
        self._streams[stream] = _StreamRecord(depths=self.head.depths)

    def close(self, stream: Hashable) -> None:
        if self._streams.pop(stream, None) is not None:
            self.head.close(stream)

    def adopt(self, source: Hashable, stream: Hashable, position: int) -> None:
        """`stream` takes over `source`'s record and depths, stepped back to `position` trunk rows (as the
        trunk's stages step the stream back when a later prompt takes a finished stream over). Its depths
        step back one row further than the trunk, so it must be within the rewind slack less one."""
        if stream in self._streams:
            raise ValueError(f"stream {stream!r} is already open")
        record = self._streams.pop(source)
        self.head.adopt(source, stream)
        self._streams[stream] = record
        # the token at `position` is the new prompt's, which may differ from the one `source` read there
        self._step_back(stream, min(position, record.rows), position)

    def copy(self, source: Hashable, stream: Hashable, position: int) -> None:
        """Open `stream` as a copy of `source`'s record and depths, stepped back to `position` trunk rows (a
        prompt that starts as `source`'s did and parts from it at `position`); `source` goes on as it was.
        Within the rewind slack less one, as `adopt`."""
        if stream in self._streams:
            raise ValueError(f"stream {stream!r} is already open")
        held = self._streams[source]
        # the rows' arrays are never written in place, only replaced or dropped: the dicts can share them
        record = _StreamRecord(held.depths, held.rows, list(held.tokens), dict(held.trunk))
        record.outputs = [dict(rows) for rows in held.outputs]
        self.head.copy(source, stream)
        self._streams[stream] = record
        self._step_back(stream, min(position, record.rows), position)

    def confirm(self, stream: Hashable, start: int, trunk_rows: np.ndarray, ids: Sequence[int]) -> None:
        """Trunk rows start.. (raw final states, before the final norm) and the ids they were fed."""
        record = self._streams[stream]
        if start != record.rows:
            raise ValueError(f"stream {stream!r}: confirmed rows start at {start}, expected {record.rows}")
        for offset, (row, token) in enumerate(zip(trunk_rows, ids, strict=True)):
            record.set_token(start + offset, int(token))
            record.trunk[start + offset] = np.array(row, dtype=np.float32)
        record.rows += len(ids)

    def sampled(self, stream: Hashable, token: int) -> None:
        """The token the trunk chose after its last confirmed row (x_N)."""
        record = self._streams[stream]
        record.set_token(record.rows, int(token))

    def rewind(self, stream: Hashable, position: int) -> None:
        """The trunk went back to `position` rows: forget what depended on later tokens."""
        if position < self._streams[stream].rows:
            self._step_back(stream, position, position + 1)

    def _step_back(self, stream: Hashable, rows: int, changed: int) -> None:
        """Keep `rows` trunk rows and the tokens before `changed`: depth k's row t read token t + k + 1,
        so each depth keeps the rows that read only tokens before `changed`."""
        record = self._streams[stream]
        record.rows = rows
        del record.tokens[changed:]
        for t in [t for t in record.trunk if t >= rows]:
            del record.trunk[t]
        for k in range(self.head.depths):
            keep = max(0, changed - k - 1)
            if self.head.position(k, stream) > keep:
                self.head.rewind(k, stream, keep)
            for t in [t for t in record.outputs[k] if t >= keep]:
                del record.outputs[k][t]

    def propose(self, wanted: dict[Hashable, int]) -> dict[Hashable, list[int]]:
        """Up to `wanted[stream]` drafted tokens after each stream's sampled token, all streams batched per depth."""
        head = self.head
        drafts: dict[Hashable, list[int]] = {s: [] for s in wanted}
        ready = [s for s in wanted if self._streams[s].has_sampled]
        self._catch_up(ready)
        fresh: dict[Hashable, dict[int, np.ndarray]] = {}  # depth k-1's outputs from this round
        for k in range(head.depths):
            batch = [
                Segment(s, head.position(k, s), self._streams[s].rows - head.position(k, s))
                for s in ready
                if k < wanted[s] and len(drafts[s]) == k and self._streams[s].rows > head.position(k, s)
            ]
            if not batch:
                break
            raw = head.run_depth(k, batch, *self._depth_inputs(k, batch, fresh, drafts))
            ends = np.cumsum([seg.length for seg in batch])
            choices = np.argmax(head.logits(raw[ends - 1]), axis=-1)  # each stream's last row drafts
            fresh = {}
            for seg, end, choice in zip(batch, ends, choices, strict=True):
                record, n = self._streams[seg.stream], self._streams[seg.stream].rows
                rows = raw[int(end) - seg.length : int(end)]
                fresh[seg.stream] = {seg.start + i: rows[i] for i in range(seg.length)}
                keep = min(seg.start + seg.length, max(seg.start, n - k))  # rows t <= n-1-k read confirmed ids
                for t in range(seg.start, keep):
                    record.outputs[k][t] = fresh[seg.stream][t]
                if head.position(k, seg.stream) > keep:
                    head.rewind(k, seg.stream, keep)
                drafts[seg.stream].append(int(choice))
                self._prune(seg.stream)
        return drafts

    def _depth_inputs(
        self,
        k: int,
        batch: Sequence[Segment],
        fresh: dict[Hashable, dict[int, np.ndarray]],
        drafts: dict[Hashable, list[int]],
    ) -> tuple[np.ndarray, np.ndarray]:
        """Depth k's inputs for the batch's rows: the previous depth's states (this round's `fresh` ones
        first; the trunk's for depth 0) and the ids k + 1 ahead (drafted ones past the sampled token)."""
        prev, ahead = [], []
        for seg in batch:
            record, n = self._streams[seg.stream], self._streams[seg.stream].rows
            fresh_rows = fresh.get(seg.stream, {})
            for t in range(seg.start, seg.start + seg.length):
                if k == 0:
                    prev.append(record.trunk[t])
                else:
                    prev.append(fresh_rows[t] if t in fresh_rows else record.outputs[k - 1][t])
                j = t + k + 1
                ahead.append(record.tokens[j] if j <= n else drafts[seg.stream][j - n - 1])
        return np.stack(prev), np.asarray(ahead)

    def _catch_up(self, streams: Sequence[Hashable]) -> None:
        """A depth more than CATCH_UP rows behind what it can commit catches up all the way, a window at a
        time (a long prompt must not become one step over all its rows)."""
        head = self.head
        for k in range(head.depths):
            targets = {}
            for s in streams:
                record = self._streams[s]
                # rows whose inputs are confirmed and whose previous depth is committed; depth 0 leaves
                # its last row to the drafting pass, which needs that row's logits
                end = record.rows - 1 if k == 0 else min(record.rows - k, head.position(k - 1, s))
                if end - head.position(k, s) >= self.CATCH_UP:
                    targets[s] = end
            while batch := [
                Segment(s, head.position(k, s), min(end - head.position(k, s), self.WINDOW))
                for s, end in targets.items()
                if head.position(k, s) < end
            ]:
                raw = head.run_depth(k, batch, *self._depth_inputs(k, batch, {}, {}))
                row = 0
                for seg in batch:
                    outputs = self._streams[seg.stream].outputs[k]
                    for t in range(seg.start, seg.start + seg.length):
                        outputs[t] = raw[row]
                        row += 1
                    self._prune(seg.stream)

    def _prune(self, stream: Hashable) -> None:
        """Drop what no depth will read again, even after stepping back `keep_behind` rows: trunk states
        below depth 0's commit, outputs below the next depth's."""
        record, head = self._streams[stream], self.head
        first = head.position(0, stream) - self.keep_behind
        for t in [t for t in record.trunk if t < first]:
            del record.trunk[t]
        for k in range(head.depths - 1):
            below = head.position(k + 1, stream) - self.keep_behind
            for t in [t for t in record.outputs[k] if t < below]:
                del record.outputs[k][t]
        record.outputs[head.depths - 1].clear()


@dataclass
class _StreamRecord:
    depths: int
    rows: int = 0  # trunk rows confirmed (positions 0 .. rows-1)
    tokens: list[int] = field(default_factory=list)  # x_0 .. x_rows (the last once sampled)
    trunk: dict[int, np.ndarray] = field(default_factory=dict)
    outputs: list[dict[int, np.ndarray]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.outputs = [{} for _ in range(self.depths)]

    @property
    def has_sampled(self) -> bool:
        return self.rows > 0 and len(self.tokens) == self.rows + 1

    def set_token(self, position: int, token: int) -> None:
        if position < len(self.tokens):
            self.tokens[position] = token
            del self.tokens[position + 1 :]
        elif position == len(self.tokens):
            self.tokens.append(token)
        else:
            raise ValueError(f"token at position {position} after only {len(self.tokens)} known")
