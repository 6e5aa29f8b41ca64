"""How the router reaches a proposer: in-process, or the `cascadia draft` service over gRPC. Both are the
router's `cascadia.router.pipeline.Proposer`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import grpc

from cascadia.draft.proposer import HybridProposer
from cascadia.wire import pb, rpc, tls

log = logging.getLogger("cascadia.router")


class LocalProposer:
    """The hybrid proposer in the router's own process (request-local sources unless given more).

    A draft model or the shared index in Redis runs off the event loop, as in the draft service: a
    model's proposal takes as long as a step of a small model, and meanwhile the router's loop must
    go on taking the pipeline's replies. Proposals and forgets that reach them run one at a time.
    """

    def __init__(self, proposer: HybridProposer | None = None) -> None:
        self.proposer = proposer or HybridProposer()
        self._lock = asyncio.Lock()

    @property
    def _blocking(self) -> bool:
        return self.proposer.model is not None or self.proposer.shared is not None

    async def propose(self, stream: str, context: Sequence[int], k: int) -> tuple[list[int], str]:
        if not self._blocking:
            self.proposer.append(stream, context[self.proposer.known(stream) :])
            return self.proposer.propose(stream, k)
        async with self._lock:
            self.proposer.append(stream, context[self.proposer.known(stream) :])
            return await asyncio.to_thread(self.proposer.propose, stream, k)

    async def observe(self, stream: str, source: str, proposed: int, accepted: int) -> None:
        if self.proposer.shared is None:
            self.proposer.observe(source, proposed, accepted)
        else:
            await asyncio.to_thread(self.proposer.observe, source, proposed, accepted)

    async def forget(self, stream: str, share: bool) -> None:
        if not self._blocking:
            self.proposer.forget(stream, share)
            return
        async with self._lock:
            await asyncio.to_thread(self.proposer.forget, stream, share)

    async def close(self) -> None:
        return None


class DraftClient:
    """The draft service; any failure means no draft this round (speculation is only ever an optimisation)."""

    def __init__(self, address: str, timeout: float = 0.5) -> None:
        self.address = address
        self._channel: grpc.aio.Channel | None = None  # made in the event loop that uses it
        self.timeout = timeout
        self._sent: dict[str, int] = {}
        self._warned = False

    async def propose(self, stream: str, context: Sequence[int], k: int) -> tuple[list[int], str]:
        known = self._sent.get(stream, 0)
        if known > len(context):
            known = 0
        request = pb.ProposeRequest(stream=stream, known=known, tokens=list(context[known:]), k=k)
        try:
            reply = await self.stub.Propose(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            self._sent.pop(stream, None)
            if not self._warned:
                log.warning("draft service unavailable, decoding without drafts: %s", exc.code().name)
                self._warned = True
            return [], ""
        self._warned = False
        if reply.have != len(context):
            self._sent.pop(stream, None)  # resend everything next round
            return [], ""
        self._sent[stream] = reply.have
        return list(reply.tokens), reply.source

    async def observe(self, stream: str, source: str, proposed: int, accepted: int) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.stub.Observe(
                pb.Observation(stream=stream, source=source, proposed=proposed, accepted=accepted), timeout=self.timeout
            )

    async def forget(self, stream: str, share: bool) -> None:
        self._sent.pop(stream, None)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.stub.Forget(pb.ForgetRequest(stream=stream, share=share), timeout=self.timeout)

    @property
    def stub(self):
        if self._channel is None:
            self._channel = tls.channel(self.address)
        return rpc.DraftStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
