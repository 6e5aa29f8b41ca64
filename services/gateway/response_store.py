"""Stored responses: what `GET /v1/responses/{id}` returns and what `previous_response_id` continues.

A gateway alone keeps them in memory (the most recent `capacity`); gateways that share a Redis (an
InklingFleet's replicas) keep them there, each for `ttl` seconds, so that a conversation may go on
through any of them. A response belongs to the API key that created it: another key finds nothing.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, Protocol

DEFAULT_CAPACITY = 1024
DEFAULT_TTL_S = 30 * 24 * 3600  # as long as OpenAI keeps a stored response
KEY_PREFIX = "cascadia:response:"


@dataclass(frozen=True)
class StoredResponse:
    owner: str  # the key id that created it
    body: dict[str, Any]  # the response as it was returned
    input: list[dict[str, Any]]  # the input items it was given
    context: list[dict[str, Any]]  # the items of the responses it continues, before its input

    @property
    def id(self) -> str:
        return self.body["id"]

    def conversation(self) -> list[dict[str, Any]]:
        """The items a response continuing this one starts with: its context, its input, its output."""
        return [*self.context, *self.input, *(output_as_input(item) for item in self.body["output"])]


def output_as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as a later request gives it back (without its text's log-probs)."""
    if item["type"] != "message":
        return item
    content = [{k: v for k, v in part.items() if k != "logprobs"} for part in item["content"]]
    return {**item, "content": content}


class ResponseStore(Protocol):
    async def get(self, response_id: str, owner: str) -> StoredResponse | None: ...

    async def put(self, stored: StoredResponse) -> None: ...

    async def delete(self, response_id: str, owner: str) -> bool: ...

    async def close(self) -> None: ...


class MemoryStore:
    """The most recent `capacity` responses, in this process."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is None or stored.owner != owner:
            return None
        self._responses.move_to_end(response_id)
        return stored

    async def put(self, stored: StoredResponse) -> None:
        self._responses[stored.id] = stored
        self._responses.move_to_end(stored.id)
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    async def delete(self, response_id: str, owner: str) -> bool:
        stored = self._responses.get(response_id)
        if stored is None or stored.owner != owner:
            return False
        del self._responses[response_id]
        return True

    async def close(self) -> None:
        self._responses.clear()


class RedisStore:
    """Responses in a Redis that every gateway of a fleet reaches, each expiring `ttl_s` after it was stored."""

    def __init__(self, url: str, ttl_s: int = DEFAULT_TTL_S, password: str | None = None) -> None:
        import redis.asyncio as redis

        if ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1, got {ttl_s}")
        self.ttl_s = ttl_s
        self._redis = redis.Redis.from_url(url, password=password, decode_responses=True)

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        raw = await self._redis.get(KEY_PREFIX + response_id)
        if raw is None:
            return None
        stored = StoredResponse(**json.loads(raw))
        return stored if stored.owner == owner else None

    async def put(self, stored: StoredResponse) -> None:
        await self._redis.set(KEY_PREFIX + stored.id, json.dumps(asdict(stored), separators=(",", ":")), ex=self.ttl_s)

    async def delete(self, response_id: str, owner: str) -> bool:
        if await self.get(response_id, owner) is None:
            return False
        return bool(await self._redis.delete(KEY_PREFIX + response_id))

    async def close(self) -> None:
        await self._redis.aclose()
