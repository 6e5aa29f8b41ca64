"""Shared contexts in Redis: finished requests' tokens, indexed by n-gram, with each source's agreement.

Keys (all with a TTL; the server's memory cap and eviction policy bound the rest):
  {prefix}ctx:{id}        the context's tokens, little-endian int32
  {prefix}ng:{n-gram}     context ids whose tokens contain that n-gram, with the end offset
  {prefix}agree:{source}  hash: proposed, accepted
A Redis that is down or slow makes every call here return "nothing found" (and says so once):
drafting carries on from the request-local sources. After a failure the index is left alone for
`retry_after_s` rather than asked again at every call: a hung server costs each call its timeout.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Sequence

import redis

from cascadia.draft_trust import earned

log = logging.getLogger("cascadia.draft")


class RedisContexts:
    def __init__(
        self,
        url: str,
        ngram: int = 4,
        ttl_s: int = 3600,
        trust: float = 0.9,
        warmup: int = 16,
        prefix: str = "cascadia:",
        max_context: int = 8192,
        retry_after_s: float = 1.0,
    ) -> None:
        # an external Redis's password comes from the environment (a Secret), never the command line
        password = os.environ.get("CASCADIA_REDIS_PASSWORD") or None
        self.client = redis.Redis.from_url(url, password=password, socket_timeout=0.2, socket_connect_timeout=0.2)
        self.ngram, self.ttl_s, self.trust, self.warmup = ngram, ttl_s, trust, warmup
        self.prefix, self.max_context = prefix, max_context
        self.retry_after_s = retry_after_s
        self._down = False
        self._failed_at = 0.0

    def _call(self, fn, default):
        if self._down and time.monotonic() - self._failed_at < self.retry_after_s:
            return default
        try:
            out = fn()
        except redis.RedisError as exc:
            if not self._down:
                log.warning("shared-context index unavailable, drafting from local sources only: %s", exc)
            self._down = True
            self._failed_at = time.monotonic()
            return default
        if self._down:
            log.info("shared-context index reachable again")
        self._down = False
        return out

    @property
    def available(self) -> bool:
        return self._call(self.client.ping, False)

    def _ngram_key(self, tokens: Sequence[int]) -> str:
        return f"{self.prefix}ng:" + ",".join(str(int(t)) for t in tokens)

    def publish(self, stream: str, tokens: Sequence[int]) -> None:
        tokens = list(tokens)[-self.max_context :]
        if len(tokens) <= self.ngram:
            return

        def write() -> None:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(f"{self.prefix}ctx:{stream}", struct.pack(f"<{len(tokens)}i", *tokens), ex=self.ttl_s)
            for end in range(self.ngram, len(tokens)):
                key = self._ngram_key(tokens[end - self.ngram : end])
                pipe.hset(key, stream, end)
                pipe.expire(key, self.ttl_s)
            pipe.execute()

        self._call(write, None)

    def lookup(self, suffix: Sequence[int], k: int) -> tuple[str, list[int]] | None:
        def read() -> tuple[str, list[int]] | None:
            hits = self.client.hgetall(self._ngram_key(suffix[-self.ngram :]))
            for context, end in sorted(hits.items()):
                raw = self.client.getrange(f"{self.prefix}ctx:{context.decode()}", 4 * int(end), 4 * (int(end) + k) - 1)
                if raw:
                    return f"shared:{context.decode()}", list(struct.unpack(f"<{len(raw) // 4}i", raw))
            return None

        return self._call(read, None)

    def record(self, source: str, proposed: int, accepted: int) -> None:
        def write() -> None:
            key = f"{self.prefix}agree:{source}"
            pipe = self.client.pipeline(transaction=False)
            pipe.hincrby(key, "proposed", proposed)
            pipe.hincrby(key, "accepted", accepted)
            pipe.expire(key, self.ttl_s)
            pipe.execute()

        self._call(write, None)

    def agreement(self, source: str) -> tuple[int, int]:
        key = f"{self.prefix}agree:{source}"
        raw = self._call(lambda: self.client.hmget(key, "proposed", "accepted"), [None, None])
        return int(raw[0] or 0), int(raw[1] or 0)

    def trusted(self, source: str) -> bool:
        """A source is trusted during its warm-up (so it can earn agreement) and afterwards at >= trust."""
        return earned(*self.agreement(source), self.trust, self.warmup)
