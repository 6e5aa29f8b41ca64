"""The router's scheduling decisions, as a pure state machine (no engine, no gRPC).

A frame is one batch that travels the whole chain of stages: decode rows and prefill windows of
several streams. At most one frame per stage is in flight, so every stage can work at once, and a
stream is in at most one frame (its next row depends on the token the last one returns). Decode
rows go first, prefill windows fill what room is left, so a long prompt never stalls decoding.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from cascadia.engine.sampling import SamplingParams

RequestId = str


class Overloaded(RuntimeError):
    """The admission queue is full."""


@dataclass(frozen=True)
class SchedulerConfig:
    stages: int
    rows_per_group: int = 8
    prefill_window: int = 8
    max_streams: int = 176  # streams holding state on the chain at once
    max_queue: int = 1024  # requests waiting for admission

    def __post_init__(self) -> None:
        for name in ("stages", "rows_per_group", "prefill_window", "max_streams"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")


@dataclass(frozen=True)
class Request:
    id: RequestId
    prompt: tuple[int, ...]
    params: SamplingParams

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.id}: the prompt is empty")


@dataclass(frozen=True)
class Row:
    """Consecutive positions of one stream in a frame."""

    stream: RequestId
    start: int
    tokens: tuple[int, ...]
    wants_token: bool  # the last row's token is sampled and sent back
    opens: bool  # first frame of the stream: stages open its state


@dataclass(frozen=True)
class Frame:
    id: int
    rows: tuple[Row, ...]

    @property
    def size(self) -> int:
        return sum(len(r.tokens) for r in self.rows)


@dataclass(frozen=True)
class Emitted:
    stream: RequestId
    token: int
    finished: Literal["stop", "length"] | None


@dataclass
class _Stream:
    request: Request
    position: int = 0  # positions already sent
    generated: list[int] = field(default_factory=list)
    busy: bool = False
    opened: bool = False

    @property
    def prefilling(self) -> bool:
        return self.position < len(self.request.prompt)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._queue: deque[Request] = deque()
        self._active: dict[RequestId, _Stream] = {}
        self._in_flight: dict[int, Frame] = {}
        self._next_frame = 0
        self._chain_ready = False

    # -- inputs -----------------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        if request.id in self._active or any(r.id == request.id for r in self._queue):
            raise ValueError(f"request {request.id} is already known")
        if len(self._queue) >= self.config.max_queue:
            raise Overloaded(f"overloaded: {len(self._queue)} requests already wait for admission")
        self._queue.append(request)

    def set_chain_ready(self, ready: bool) -> None:
        self._chain_ready = ready

    def cancel(self, request_id: RequestId) -> bool:
        """Forget a request; returns True when stages hold state for it that must be closed."""
        for queued in self._queue:
            if queued.id == request_id:
                self._queue.remove(queued)
                return False
        stream = self._active.pop(request_id, None)
        return stream is not None and stream.opened

    def on_frame_done(self, frame_id: int, tokens: dict[RequestId, int]) -> list[Emitted]:
        """The last stage's sampled tokens for a frame; returns what each stream emitted."""
        frame = self._in_flight.pop(frame_id)
        emitted = []
        for row in frame.rows:
            stream = self._active.get(row.stream)
            if stream is None:  # cancelled while in flight
                continue
            stream.busy = False
            if not row.wants_token:
                continue
            if row.stream not in tokens:
                raise ValueError(f"frame {frame_id}: no token for stream {row.stream}")
            token = tokens[row.stream]
            stream.generated.append(token)
            params = stream.request.params
            finished: Literal["stop", "length"] | None = None
            if token in params.stop_ids:
                finished = "stop"
            elif len(stream.generated) >= params.max_tokens:
                finished = "length"
            if finished:
                del self._active[row.stream]
            emitted.append(Emitted(row.stream, token, finished))
        return emitted

    def on_frame_failed(self, frame_id: int) -> list[RequestId]:
        """A frame lost on the chain: its streams fail (their state on the stages is unknown)."""
        frame = self._in_flight.pop(frame_id, None)
        if frame is None:
            return []
        failed = [row.stream for row in frame.rows if row.stream in self._active]
        for stream in failed:
            del self._active[stream]
        return failed

    # -- decisions --------------------------------------------------------------------------------

    def next_frames(self) -> list[Frame]:
        """Frames to send now: one per free stage slot, each at most `rows_per_group` rows."""
        if not self._chain_ready:
            return []
        self._admit()
        frames = []
        while len(self._in_flight) < self.config.stages:
            frame = self._build_frame()
            if frame is None:
                break
            self._in_flight[frame.id] = frame
            frames.append(frame)
        return frames

    def _admit(self) -> None:
        while self._queue and len(self._active) < self.config.max_streams:
            request = self._queue.popleft()
            self._active[request.id] = _Stream(request)

    def _build_frame(self) -> Frame | None:
        budget = self.config.rows_per_group
        rows: list[Row] = []
        ready = [s for s in self._active.values() if not s.busy]
        for stream in [s for s in ready if not s.prefilling]:  # decode rows first
            if budget == 0:
                break
            rows.append(Row(stream.request.id, stream.position, (stream.generated[-1],), True, False))
            budget -= 1
        for stream in [s for s in ready if s.prefilling]:
            if budget == 0:
                break
            prompt = stream.request.prompt
            n = min(self.config.prefill_window, budget, len(prompt) - stream.position)
            end = stream.position + n
            rows.append(
                Row(
                    stream.request.id,
                    stream.position,
                    prompt[stream.position : end],
                    end == len(prompt),
                    not stream.opened,
                )
            )
            budget -= n
        if not rows:
            return None
        for row in rows:
            stream = self._active[row.stream]
            stream.busy, stream.opened = True, True
            stream.position += len(row.tokens)
        frame = Frame(self._next_frame, tuple(rows))
        self._next_frame += 1
        return frame

    # -- views ------------------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)
