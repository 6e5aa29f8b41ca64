"""The generations one request asks for: `n` choices for each of its prompts, run side by side."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from cascadia.gateway.generation import Delta, Generation
from cascadia.gateway.schemas import PromptTokensDetails, Usage
from cascadia.sampling_params import SamplingParams

_ENDED = object()


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """Sampling of a prompt's choice `j`: a seed moves by the choice's place, so the choices differ from each
    other while the first is what the same request with n=1 gives, and each is reproducible."""
    return params if params.seed is None or j == 0 else replace(params, seed=params.seed + j)


@dataclass
class Choices:
    """Choice `i * n + j` is prompt `i`'s `j`-th, numbered as OpenAI numbers them."""

    response_id: str
    prompts: list[list[int]]
    generations: list[Generation]

    def usage(self) -> Usage:
        """Each prompt counts once, however many choices it had (and its cached tokens as its best choice's);
        every generated token counts."""
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(g.completion_tokens for g in self.generations)
        n = len(self.generations) // len(self.prompts)
        cached = sum(
            max(g.cached_tokens for g in self.generations[i * n : (i + 1) * n]) for i in range(len(self.prompts))
        )
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def abort(self) -> None:
        for generation in self.generations:
            generation.abort()

    async def run(self) -> None:
        """Every generation to its end; if one fails, the others are stopped and the failure raised."""
        tasks = [asyncio.ensure_future(g.run()) for g in self.generations]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def deltas(self) -> AsyncIterator[tuple[int, Delta]]:
        """Each generation's deltas with its choice index, in the order they arrive."""
        queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

        async def pump(index: int, generation: Generation) -> None:
            try:
                async for delta in generation.deltas():
                    queue.put_nowait((index, delta))
                queue.put_nowait((index, _ENDED))
            except Exception as exc:  # handed to the reader, which raises it
                queue.put_nowait((index, exc))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(self.generations)]
        running = len(tasks)
        try:
            while running:
                index, item = await queue.get()
                if item is _ENDED:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    assert isinstance(item, Delta)
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()  # a generation cancelled before its end stops its request on the router
            await asyncio.gather(*tasks, return_exceptions=True)
