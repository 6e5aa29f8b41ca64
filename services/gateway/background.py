"""Background responses (`background: true`): generated apart from the request that asked for them.

The response is stored queued and answered at once; its run moves it to in_progress at its first output
and to its last state when it ends. Every state goes through the store, so any gateway sharing it
answers a poll, a cancel or a delete: the run looks at its stored state every `poll_s` seconds and stops
its generation on the router once the response was cancelled or deleted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from cascadia.gateway.errors import ApiError
from cascadia.gateway.metrics import GatewayMetrics
from cascadia.gateway.response_store import ResponseStore, StoredResponse, StoreUnavailable

log = logging.getLogger("cascadia.gateway")

POLL_S = 0.25
STOPPED = ApiError(503, "The gateway stopped before the response finished.", "server_error", code="gateway_stopped")


@dataclass
class BackgroundRun:
    events: AsyncIterator[dict[str, Any]]  # the response's events; the last one's producer stores it
    in_progress: StoredResponse  # as stored once the first output arrives
    failed: Callable[[ApiError], StoredResponse]  # as stored when the run fails
    release: Callable[[], None]  # gives back the key's concurrency place

    @property
    def id(self) -> str:
        return self.in_progress.id


@dataclass
class BackgroundRuns:
    """The background responses this gateway is generating."""

    store: ResponseStore
    metrics: GatewayMetrics
    poll_s: float = POLL_S
    _tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    def start(self, run: BackgroundRun) -> None:
        self._tasks[run.id] = asyncio.ensure_future(self._run(run))

    async def keep(self, stored: StoredResponse) -> bool:
        """Store a background response's next state (False if it had finished or was deleted first)."""
        try:
            return await self.store.replace_unfinished(stored)
        except StoreUnavailable as exc:
            self.metrics.errors.labels("store_unavailable").inc()
            log.warning("background response %s could not be stored as %s: %s", stored.id, stored.body["status"], exc)
            return False

    async def stop(self) -> None:
        """Stop every run (the gateway is stopping): each response is stored as failed, not left in progress."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _wanted(self, run: BackgroundRun) -> bool:
        try:
            stored = await self.store.get(run.id, run.in_progress.owner)
        except StoreUnavailable:
            return True  # a store that does not answer now cancels nothing
        return stored is not None and stored.unfinished

    async def _consume(self, run: BackgroundRun) -> None:
        announced = False
        async for event in run.events:
            if not announced and event["type"] == "response.output_item.added":
                announced = True
                await self.keep(run.in_progress)

    async def _run(self, run: BackgroundRun) -> None:
        consume = asyncio.ensure_future(self._consume(run))
        try:
            while not consume.done():
                await asyncio.wait({consume}, timeout=self.poll_s)
                if not consume.done() and not await self._wanted(run):
                    consume.cancel()  # cancelled or deleted: its generation stops on the router
                    await asyncio.gather(consume, return_exceptions=True)
                    return
            error = consume.exception()
            if error is not None:
                if not isinstance(error, ApiError):
                    log.error("background response %s failed", run.id, exc_info=error)
                    error = ApiError(500, f"{type(error).__name__}: {error}", "server_error", code="server_error")
                self.metrics.errors.labels(error.code or error.type).inc()
                await self.keep(run.failed(error))
        except asyncio.CancelledError:
            consume.cancel()
            await asyncio.gather(consume, return_exceptions=True)
            await self.keep(run.failed(STOPPED))
            raise
        finally:
            run.release()
            self._tasks.pop(run.id, None)
