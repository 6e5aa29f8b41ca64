"""Frames to the next hop, in order, over one long-lived gRPC stream (`Shard.Push`, `Collector.DeliverAll`).

A unary call per frame makes the sender wait a full round trip before it can send the next one; on
a link with latency that wait, not the wire, sets the pace of the chain. Over a stream the frames
keep their order, the sender goes on at once, and the receiver's receipts come back on their own:
a receipt with an error (a refused frame), or the stream breaking (the peer died), reports every
frame it covers to `on_failed`. The next frame after a break opens a new stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

log = logging.getLogger(__name__)

OnFailed = Callable[[int, str], None]


@dataclass
class _Stream:
    call: Any  # grpc.aio.StreamStreamCall
    unanswered: deque[int] = field(default_factory=deque)
    broken: bool = False
    reader: asyncio.Task | None = None


class FrameStream:
    def __init__(self, open_call: Callable[[], Any], on_failed: OnFailed, peer: str) -> None:
        self._open_call = open_call
        self._on_failed = on_failed
        self.peer = peer
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._stream: _Stream | None = None
        self._writer: asyncio.Task | None = None

    def send(self, message: Any) -> None:
        """Queue a message (anything with a `frame_id`); it is written after those queued before it."""
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_all())
        self._outbox.put_nowait(message)

    @property
    def in_flight(self) -> int:
        """Messages queued or written whose receipt has not come back."""
        held = len(self._stream.unanswered) if self._stream and not self._stream.broken else 0
        return self._outbox.qsize() + held

    async def _write_all(self) -> None:
        while True:
            message = await self._outbox.get()
            stream = self._stream
            if stream is None or stream.broken:
                stream = self._stream = _Stream(self._open_call())
                stream.reader = asyncio.get_running_loop().create_task(self._read_receipts(stream))
            stream.unanswered.append(message.frame_id)
            try:
                await stream.call.write(message)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                self._break(stream, _details(exc))

    async def _read_receipts(self, stream: _Stream) -> None:
        try:
            while True:
                receipt = await stream.call.read()
                if receipt is grpc.aio.EOF:
                    self._break(stream, "stream ended")
                    return
                if stream.unanswered and stream.unanswered[0] == receipt.frame_id:
                    stream.unanswered.popleft()
                if receipt.error:
                    self._on_failed(receipt.frame_id, receipt.error)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
            self._break(stream, _details(exc))

    def _break(self, stream: _Stream, reason: str) -> None:
        if stream.broken:
            return
        stream.broken = True
        stream.call.cancel()
        if stream.unanswered:
            log.error("%d frame(s) to %s lost: %s", len(stream.unanswered), self.peer, reason)
        while stream.unanswered:
            self._on_failed(stream.unanswered.popleft(), f"{self.peer}: {reason}")

    async def close(self, timeout: float = 2.0) -> None:
        """Let what is queued go out (up to `timeout`), then end the stream."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.in_flight and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        if self._writer is not None:
            self._writer.cancel()
        stream = self._stream
        if stream is not None and not stream.broken:
            stream.broken = True
            stream.call.cancel()


def _details(exc: Exception) -> str:
    return exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc) or type(exc).__name__
