"""Benchmarks that drive a local fleet through one router driver: start, wait, run, stop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
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
