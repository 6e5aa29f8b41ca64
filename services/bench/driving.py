"""Benchmarks that drive a local fleet through one router driver: start, wait, run, stop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rich.console import Console

T = TypeVar("T")


def drive_local_fleet(
    fleet: Any,
    scheduler: Any,
    console: Console,
    run: Callable[[Any], Awaitable[T]],
    proposer: Any = None,
) -> T:
    """`await run(driver)` with a driver of `scheduler` over the started `fleet`, once every shard serves;
    the fleet is stopped afterwards, whatever happens."""
    from cascadia.router.pipeline import PipelineDriver

    async def go() -> T:
        driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, scheduler, 600, proposer)
        await driver.start()
        try:
            with console.status(f"starting {fleet.shards} shards"):
                await driver.wait_ready(timeout=600)
            return await run(driver)
        finally:
            await driver.stop()

    try:
        return asyncio.run(go())
    finally:
        fleet.stop()


@dataclass(frozen=True)
class Answered:
    tokens: list[int]
    cached: int  # prompt positions the stream started with (taken over or copied)
    ttft_s: float  # from submission to the first token


async def answer(driver: Any, request_id: str, prompt: Sequence[int], params: Any) -> Answered:
    """One request through `driver`, timed from its submission to its first token."""
    from cascadia.router.scheduler import Request

    started = time.perf_counter()
    pending = await driver.submit(Request(request_id, tuple(prompt), params))
    await pending.done.wait()
    driver.release(request_id)
    if pending.error:
        raise RuntimeError(f"request {request_id}: {pending.error}")
    first, _ = pending.events.get_nowait()
    return Answered(list(pending.tokens), first.cached, pending.first_token_at - started)
