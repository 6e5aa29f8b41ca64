"""One request's tokens from the router, turned into text pieces that respect stop strings."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from cascadia.gateway.errors import ApiError
from cascadia.gateway.metrics import GatewayMetrics
from cascadia.gateway.router_client import RouterClient
from cascadia.gateway.text import IncrementalDetokenizer, StopMatcher, TextCodec
from cascadia.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    text: str
    logprob: float | None  # None: a prompt's first token, which nothing precedes
    top: tuple[tuple[str, float], ...] | None


@dataclass
class Delta:
    text: str
    tokens: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class Generation:
    router: RouterClient
    codec: TextCodec
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stops: list[str]
    metrics: GatewayMetrics
    wants_logprobs: bool = False
    speculation: bool = True
    score_prompt: bool = False  # each prompt token's log-prob given the ones before it, from the first event
    shared_prefix: int = 0  # the prompt's first tokens other requests are likely to start with (0: not known)
    arrived: float = field(default_factory=time.perf_counter)
    completion_tokens: int = 0
    cached_tokens: int = 0  # the prompt's first tokens the fleet took over or copied from another stream
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1, 2, ... (score_prompt)
    _call: object | None = None
    _tasks: set = field(default_factory=set)

    def abort(self) -> None:
        """Stop this request on the router (the client went away); frees its state on every stage."""
        if self.finish_reason is not None:
            return
        if self._call is not None:
            self._call.cancel()
        task = asyncio.get_running_loop().create_task(self.router.cancel(self.request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def deltas(self) -> AsyncIterator[Delta]:
        detokenizer = IncrementalDetokenizer(self.codec)
        matcher = StopMatcher(self.stops)
        self._call = self.router.generate(
            self.request_id, self.prompt, self.params, self.speculation, self.score_prompt, self.shared_prefix
        )
        last = None
        try:
            async for event in self.router.events(self._call):
                now = time.perf_counter()
                if last is None:
                    self.metrics.ttft.observe(now - self.arrived)
                    self.cached_tokens = event.cached_tokens
                    self.metrics.cached_prompt_tokens.inc(event.cached_tokens)
                    self.prompt_logprobs = [
                        self._token_logprob(token, scored.logprob, scored.top)
                        for token, scored in zip(self.prompt[1:], event.prompt, strict=False)
                    ]
                else:
                    self.metrics.itl.observe(now - last)
                last = now
                self.completion_tokens += 1
                self.metrics.completion_tokens.inc()
                info = self._logprob(event)
                ends_on_stop_id = event.finish_reason == "stop" and event.token in self.params.stop_ids
                text = matcher.push("" if ends_on_stop_id else detokenizer.push(event.token))
                finish = event.finish_reason or None
                if finish and not matcher.stopped:
                    text += matcher.push(detokenizer.flush())
                    text += matcher.flush()
                if matcher.stopped:
                    finish = "stop"
                self.text += text
                if info:
                    self.logprobs.append(info)
                if finish:
                    if event.finish_reason:  # the router ended it and freed the stream itself
                        self.finish_reason = finish
                    else:
                        self.abort()
                        self.finish_reason = finish
                    yield Delta(text, [info] if info else [], finish)
                    return
                yield Delta(text, [info] if info else [])
            raise ApiError(503, "The request was cancelled by the fleet.", "server_error", code="cancelled")
        finally:
            if self.finish_reason is None:
                self.abort()

    def _logprob(self, event) -> TokenLogprob | None:
        if not self.wants_logprobs:
            return None
        return self._token_logprob(event.token, event.logprob, event.top)

    def _token_logprob(self, token: int, logprob: float, top) -> TokenLogprob:
        best = tuple((self.codec.token_text(t.token), t.logprob) for t in top)
        return TokenLogprob(token, self.codec.token_text(token), logprob, best)

    async def run(self) -> None:
        async for _ in self.deltas():
            pass
