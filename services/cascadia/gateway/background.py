"""Background responses (`background: true`): generated apart from the request that asked for them.

The response is stored queued and answered at once; its run moves it to in_progress at its first output
and to its last state when it ends. Every state goes through the store, so any gateway sharing it
answers a poll, a cancel or a delete: the run looks at its stored state every `poll_s` seconds and stops
its generation on the router once the response was cancelled or deleted. The run also says in the store,
every few seconds, that it holds the response: a gateway killed or cut off says nothing more, and the
first reader after `HOLD_S` finds its response failed (`gateway_lost`) rather than in progress forever.

A background response asked with `stream: true` keeps its stream's events in the store as well, and its
stream is followed from there: by the request that created it (whose leaving stops nothing) and by any
client that follows it again from a sequence number, on any gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from cascadia.gateway.errors import ApiError
from cascadia.gateway.metrics import GatewayMetrics
from cascadia.gateway.response_store import ResponseStore, StoredResponse, StoreUnavailable

log = logging.getLogger("cascadia.gateway")

POLL_S = 0.25
HOLD_S = 10.0  # a run says it holds its response for this long, again every quarter of it
LAST_EVENTS = ("response.completed", "response.incomplete", "response.failed")
STOPPED = ApiError(503, "The gateway stopped before the response finished.", "server_error", code="gateway_stopped")


@dataclass
class BackgroundRun:
    events: AsyncIterator[dict[str, Any]]  # the response's events, to its completed or incomplete one
    in_progress: StoredResponse  # as stored once the first output arrives
    finished: Callable[[dict[str, Any]], StoredResponse]  # the last event's response as stored
    failed: Callable[[ApiError], StoredResponse]  # as stored when the run fails
    release: Callable[[], None]  # gives back the key's concurrency place
    failed_events: Callable[[ApiError], list[dict[str, Any]]] | None = None  # set: its events are kept

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
    _added: dict[str, asyncio.Event] = field(default_factory=dict)  # set when a local run adds an event

    async def hold(self, response_id: str) -> None:
        """Say that this gateway runs the response (before it is first stored: no reader finds it unheld)."""
        await self.store.hold(response_id, HOLD_S)

    async def settled(self, stored: StoredResponse) -> StoredResponse:
        """`stored` as it stands: an unfinished background response that no gateway holds any more is failed."""
        if not stored.unfinished or stored.id in self._tasks or await self.store.held(stored.id):
            return stored
        lost = {"code": "gateway_lost", "message": "The gateway running this response stopped answering."}
        failed = dataclasses.replace(stored, body=stored.body | {"status": "failed", "error": lost})
        if await self.store.replace_unfinished(failed):
            self.metrics.errors.labels("gateway_lost").inc()
            return failed
        return await self.store.get(stored.id, stored.owner) or stored

    def start(self, run: BackgroundRun) -> None:
        if run.failed_events is not None:
            self._added[run.id] = asyncio.Event()
        self._tasks[run.id] = asyncio.ensure_future(self._run(run))
        self.metrics.background_runs.inc()

    async def follow(self, response_id: str, owner: str, after: int = -1) -> AsyncIterator[dict[str, Any]]:
        """A background response's kept events after sequence number `after`, then each as it is added,
        to its last (or until the response is cancelled, deleted or fails without one)."""
        while True:
            added = self._added.get(response_id)  # taken before reading: an event added after wakes us
            events = await self.store.events_after(response_id, after)
            for event in events:
                yield event
                after = event["sequence_number"]
                if event["type"] in LAST_EVENTS:
                    return
            if not events:
                stored = await self.store.get(response_id, owner)
                if stored is not None:
                    stored = await self.settled(stored)
                if stored is None or not stored.unfinished:
                    for event in await self.store.events_after(response_id, after):
                        yield event  # added between the two reads
                    return
            if added is None:  # run by another gateway: only the store tells
                await asyncio.sleep(self.poll_s)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(added.wait(), self.poll_s)

    def _tell_followers(self, response_id: str, last: bool = False) -> None:
        added = self._added.pop(response_id, None)
        if added is not None:
            added.set()
            if not last:
                self._added[response_id] = asyncio.Event()

    async def _add_events(self, run: BackgroundRun, events: list[dict[str, Any]]) -> None:
        try:
            for event in events:
                await self.store.add_event(run.id, event)
        except StoreUnavailable as exc:
            self.metrics.errors.labels("store_unavailable").inc()
            log.warning("background response %s: an event could not be stored: %s", run.id, exc)
        self._tell_followers(run.id)

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
            # an event is kept before the state it leads to: a follower that finds the response finished
            # finds its last event too
            if run.failed_events is not None:
                await self._add_events(run, [event])
            if event["type"] in LAST_EVENTS:
                await self.keep(run.finished(event["response"]))

    async def _fail(self, run: BackgroundRun, error: ApiError) -> None:
        if run.failed_events is not None and await self._wanted(run):
            await self._add_events(run, run.failed_events(error))
        await self.keep(run.failed(error))

    async def _run(self, run: BackgroundRun) -> None:
        consume = asyncio.ensure_future(self._consume(run))
        held_at = time.monotonic()
        try:
            while not consume.done():
                await asyncio.wait({consume}, timeout=self.poll_s)
                if time.monotonic() - held_at > HOLD_S / 4:
                    held_at = time.monotonic()
                    with contextlib.suppress(StoreUnavailable):
                        await self.store.hold(run.id, HOLD_S)
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
                await self._fail(run, error)
        except asyncio.CancelledError:
            consume.cancel()
            await asyncio.gather(consume, return_exceptions=True)
            await self._fail(run, STOPPED)
            raise
        finally:
            run.release()
            self._tasks.pop(run.id, None)
            self.metrics.background_runs.dec()
            self._tell_followers(run.id, last=True)
