"""Benchmarks that drive a local fleet through one router driver: start, wait, run, stop."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console

from cascadia.bench.report import pyplot

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


async def answer(driver: Any, request_id: str, prompt: Sequence[int], params: Any, shared_prefix: int = 0) -> Answered:
    """One request through `driver`, timed from its submission to its first token."""
    from cascadia.router.scheduler import Request

    started = time.perf_counter()
    pending = await driver.submit(Request(request_id, tuple(prompt), params, shared_prefix=shared_prefix))
    await pending.done.wait()
    driver.release(request_id)
    if pending.error:
        raise RuntimeError(f"request {request_id}: {pending.error}")
    first, _ = pending.events.get_nowait()
    return Answered(list(pending.tokens), first.cached, pending.first_token_at - started)


def chat_fleet_bench(
    model: Path,
    shards: int,
    out: Path,
    name: str,
    console: Console,
    measure: Callable[[Any, Any], Awaitable[dict[str, Any]]],
    plot: Callable[[dict[str, Any], Path], None],
    **fields: Any,
) -> dict[str, Any]:
    """`await measure(driver, codec)` on the f32 local fleet `cascadia up` gives a chat model, with its
    schedule; the summary (`fields`, the machine and what `measure` returned) goes to NAME.json and its
    plot to NAME.png."""
    from cascadia.bench.machine import machine_summary
    from cascadia.gateway.text import TextCodec
    from cascadia.router.local import LocalFleet

    out.mkdir(parents=True, exist_ok=True)
    codec = TextCodec.from_model(model)
    fleet = LocalFleet(model, shards, "f32")
    scheduler = fleet.scheduler_config()
    fleet.start(log_dir=out)
    results = drive_local_fleet(fleet, scheduler, console, lambda driver: measure(driver, codec))
    summary = {"model": model.name, "shards": shards, **fields, "machine": machine_summary(), **results}
    (out / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary, out / f"{name}.png")
    return summary


@contextmanager
def panels(path: Path, count: int, title: str) -> Iterator[Any]:
    """A row of `count` plot panels to draw on, saved to `path` under `title` once drawn."""
    plt = pyplot()

    fig, axes = plt.subplots(1, count, figsize=(5 * count + 1, 4))
    try:
        yield axes
        fig.suptitle(title)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def plot_reuse(
    axes: Any,
    points: list[dict[str, Any]],
    key: str,
    xlabel: str,
    slow: tuple[str, str],
    fast: tuple[str, str],
    others: Sequence[tuple[str, str]] = (),
) -> None:
    """Two panels for `points` (by `key`): the median time to the first token of each mode (`slow`, `fast`
    and `others`: its summary key and label) and, under each prompt's tokens, the tokens it started with
    in the `fast` mode."""
    x = [p[key] for p in points]
    for field, label in (slow, fast, *others):
        axes[0].plot(x, [p[field] for p in points], marker="o", label=label)
    axes[0].set_xlabel(xlabel)
    axes[0].set_ylabel("time to first token (s, median)")
    axes[0].legend()
    axes[1].bar(x, [p["prompt_tokens"] for p in points], label="prompt tokens", color="lightgrey")
    axes[1].bar(x, [p["cached_tokens"] for p in points], label=f"started with ({fast[1]})", color="tab:orange")
    axes[1].set_xlabel(key)
    axes[1].set_ylabel("tokens")
    axes[1].legend(loc="lower right")
    for ax in axes[:2]:
        ax.set_xticks(x)
