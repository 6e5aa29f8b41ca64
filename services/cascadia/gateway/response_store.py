"""Stored responses (what `GET /v1/responses/{id}` returns and what `previous_response_id` continues) and
conversations (`/v1/conversations`: items that responses naming one read and add to).

A gateway alone keeps them in memory (the most recently used `capacity`); gateways that share a Redis
(an InklingFleet's replicas) keep them there, each until `ttl_s` seconds after it was last read, so
that a conversation may go on through any of them. Each response holds its own input and output and
names the response it continued, so a long conversation is stored once, not once per turn. A response
belongs to the API key that created it: another key finds nothing. Conversations are kept alike.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any, Protocol

DEFAULT_CAPACITY = 1024
EVENT_LOGS = 64  # background streams whose events a gateway alone keeps
DEFAULT_TTL_S = 24 * 3600  # after its last read; a fleet's Redis is memory, not an archive
KEY_PREFIX = "cascadia:response:"
EVENTS_PREFIX = "cascadia:response-events:"
HELD_PREFIX = "cascadia:response-held:"
CONVERSATION_PREFIX = "cascadia:conversation:"
ITEMS_PREFIX = "cascadia:conversation-items:"
# replace a stored response only while its status is one of ARGV[3:], in one step on the server
FINISH_SCRIPT = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local status = cjson.decode(raw)['body']['status']
for i = 3, #ARGV do
  if status == ARGV[i] then
    redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
    return 1
  end
end
return 0
"""


MAX_TURNS = 4096  # responses one conversation may chain (each turn adds at least a token to the context)
UNFINISHED = ("queued", "in_progress")  # a background response's states before its last


class StoreUnavailable(RuntimeError):
    """The store did not answer (Redis down or unreachable)."""


class ConversationLost(LookupError):
    """A response that a stored one continues is no longer stored."""

    def __init__(self, response_id: str) -> None:
        super().__init__(response_id)
        self.response_id = response_id


@dataclass(frozen=True)
class StoredResponse:
    owner: str  # the key id that created it
    body: dict[str, Any]  # the response as it was returned
    input: list[dict[str, Any]]  # the input items it was given
    streamed: bool = False  # a background response whose stream's events are kept

    @property
    def id(self) -> str:
        return self.body["id"]

    @property
    def previous(self) -> str | None:
        return self.body.get("previous_response_id")

    @property
    def unfinished(self) -> bool:
        return self.body.get("status") in UNFINISHED

    def turn(self) -> list[dict[str, Any]]:
        """This response's own items: its input, then its output as a later request gives it back."""
        return [*self.input, *(output_as_input(item) for item in self.body["output"])]


@dataclass(frozen=True)
class StoredConversation:
    owner: str  # the key id that created it
    id: str
    created_at: int
    metadata: dict[str, str]

    def body(self) -> dict[str, Any]:
        return {"id": self.id, "object": "conversation", "created_at": self.created_at, "metadata": self.metadata}


def output_as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as a later request gives it back (without its text's log-probs)."""
    if item["type"] != "message":
        return item
    content = [{k: v for k, v in part.items() if k != "logprobs"} for part in item["content"]]
    return {**item, "content": content}


class ResponseStore(Protocol):
    async def get(self, response_id: str, owner: str) -> StoredResponse | None: ...

    async def put(self, stored: StoredResponse) -> None: ...

    async def replace_unfinished(self, stored: StoredResponse) -> bool:
        """Replace an unfinished background response with `stored`, unless it finished or was deleted first.

        Its run and a cancel (from any gateway) both move a response on this way: whichever finishes it
        first gives its last state, and a deleted response is not stored again."""
        ...

    async def delete(self, response_id: str, owner: str) -> bool: ...

    async def add_event(self, response_id: str, event: dict[str, Any]) -> None:
        """Keep a background response's next stream event (its sequence number is its place), so that a
        client may follow the stream again from any gateway."""
        ...

    async def events_after(self, response_id: str, after: int) -> list[dict[str, Any]]:
        """A background response's events whose sequence numbers come after `after`, in order."""
        ...

    async def hold(self, response_id: str, seconds: float) -> None:
        """Say that a gateway is running this background response, for `seconds` from now."""
        ...

    async def held(self, response_id: str) -> bool:
        """Whether a gateway said, within the time it gave, that it runs this response."""
        ...

    async def put_conversation(self, stored: StoredConversation, items: list[dict[str, Any]]) -> None:
        """Store a conversation (a new one, or one whose metadata changed) and add `items` to its end."""
        ...

    async def get_conversation(self, conversation_id: str, owner: str) -> StoredConversation | None: ...

    async def delete_conversation(self, conversation_id: str, owner: str) -> bool: ...

    async def add_items(self, conversation_id: str, owner: str, items: list[dict[str, Any]]) -> bool:
        """Add items to a conversation's end (False if it is not stored)."""
        ...

    async def items(self, conversation_id: str, owner: str) -> list[dict[str, Any]] | None:
        """A conversation's items, oldest first (None if it is not stored)."""
        ...

    async def delete_item(self, conversation_id: str, owner: str, item_id: str) -> bool: ...

    async def close(self) -> None: ...


async def conversation(store: ResponseStore, last: StoredResponse) -> list[dict[str, Any]]:
    """The items of every turn up to `last`, oldest first (ConversationLost if one is gone)."""
    turns = [last]
    while turns[-1].previous is not None and len(turns) < MAX_TURNS:
        earlier = await store.get(turns[-1].previous, last.owner)
        if earlier is None:
            raise ConversationLost(turns[-1].previous)
        turns.append(earlier)
    return [item for stored in reversed(turns) for item in stored.turn()]


class MemoryStore:
    """The most recent `capacity` responses, in this process."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        # background streams' events, of the most recently started EVENT_LOGS only: a long answer's events
        # take far more memory than its response
        self._events: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._held_until: dict[str, float] = {}
        self._conversations: OrderedDict[str, tuple[StoredConversation, list[dict[str, Any]]]] = OrderedDict()

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
            evicted, _ = self._responses.popitem(last=False)
            self._events.pop(evicted, None)

    async def replace_unfinished(self, stored: StoredResponse) -> bool:
        current = self._responses.get(stored.id)
        if current is None or not current.unfinished:
            return False
        self._responses[stored.id] = stored
        return True

    async def delete(self, response_id: str, owner: str) -> bool:
        stored = self._responses.get(response_id)
        if stored is None or stored.owner != owner:
            return False
        del self._responses[response_id]
        self._events.pop(response_id, None)
        return True

    async def add_event(self, response_id: str, event: dict[str, Any]) -> None:
        if response_id not in self._responses:
            return
        if response_id not in self._events:
            self._events[response_id] = []
            while len(self._events) > EVENT_LOGS:
                self._events.popitem(last=False)
        self._events[response_id].append(event)

    async def events_after(self, response_id: str, after: int) -> list[dict[str, Any]]:
        log = self._events.get(response_id, [])
        return log[bisect.bisect_right(log, after, key=lambda event: event["sequence_number"]) :]

    async def hold(self, response_id: str, seconds: float) -> None:
        now = time.monotonic()
        self._held_until = {k: v for k, v in self._held_until.items() if v > now}
        self._held_until[response_id] = now + seconds

    async def held(self, response_id: str) -> bool:
        return self._held_until.get(response_id, 0.0) > time.monotonic()

    async def put_conversation(self, stored: StoredConversation, items: list[dict[str, Any]]) -> None:
        earlier = self._conversations.get(stored.id)
        self._conversations[stored.id] = (stored, [*(earlier[1] if earlier else ()), *items])
        self._conversations.move_to_end(stored.id)
        while len(self._conversations) > self.capacity:
            self._conversations.popitem(last=False)

    def _conversation(self, conversation_id: str, owner: str) -> tuple[StoredConversation, list[dict[str, Any]]] | None:
        found = self._conversations.get(conversation_id)
        if found is None or found[0].owner != owner:
            return None
        self._conversations.move_to_end(conversation_id)
        return found

    async def get_conversation(self, conversation_id: str, owner: str) -> StoredConversation | None:
        found = self._conversation(conversation_id, owner)
        return found[0] if found else None

    async def delete_conversation(self, conversation_id: str, owner: str) -> bool:
        if self._conversation(conversation_id, owner) is None:
            return False
        del self._conversations[conversation_id]
        return True

    async def add_items(self, conversation_id: str, owner: str, items: list[dict[str, Any]]) -> bool:
        found = self._conversation(conversation_id, owner)
        if found is not None:
            found[1].extend(items)
        return found is not None

    async def items(self, conversation_id: str, owner: str) -> list[dict[str, Any]] | None:
        found = self._conversation(conversation_id, owner)
        return list(found[1]) if found else None

    async def delete_item(self, conversation_id: str, owner: str, item_id: str) -> bool:
        found = self._conversation(conversation_id, owner)
        kept = [item for item in found[1] if item["id"] != item_id] if found else []
        if found is None or len(kept) == len(found[1]):
            return False
        found[1][:] = kept
        return True

    async def close(self) -> None:
        self._responses.clear()
        self._events.clear()
        self._conversations.clear()


class RedisStore:
    """Responses in a Redis that every gateway of a fleet reaches, each expiring `ttl_s` after its last read.

    A Redis that does not answer raises StoreUnavailable, within a second, rather than hold the request.
    """

    def __init__(self, url: str, ttl_s: int = DEFAULT_TTL_S, password: str | None = None) -> None:
        import redis.asyncio as redis

        if ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1, got {ttl_s}")
        self.ttl_s = ttl_s
        self._redis = redis.Redis.from_url(
            url, password=password, decode_responses=True, socket_timeout=1.0, socket_connect_timeout=1.0
        )

    async def get(self, response_id: str, owner: str) -> StoredResponse | None:
        with _answering():
            raw = await self._redis.getex(KEY_PREFIX + response_id, ex=self.ttl_s)  # read: kept ttl_s longer
        if raw is None:
            return None
        stored = StoredResponse(**json.loads(raw))
        return stored if stored.owner == owner else None

    async def put(self, stored: StoredResponse) -> None:
        raw = json.dumps(asdict(stored), separators=(",", ":"))
        with _answering():
            await self._redis.set(KEY_PREFIX + stored.id, raw, ex=self.ttl_s)

    async def replace_unfinished(self, stored: StoredResponse) -> bool:
        raw = json.dumps(asdict(stored), separators=(",", ":"))
        with _answering():
            done = await self._redis.eval(FINISH_SCRIPT, 1, KEY_PREFIX + stored.id, raw, self.ttl_s, *UNFINISHED)
        return bool(done)

    async def delete(self, response_id: str, owner: str) -> bool:
        if await self.get(response_id, owner) is None:
            return False
        with _answering():
            return bool(await self._redis.delete(KEY_PREFIX + response_id, EVENTS_PREFIX + response_id))

    async def add_event(self, response_id: str, event: dict[str, Any]) -> None:
        key = EVENTS_PREFIX + response_id
        with _answering():
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.rpush(key, json.dumps(event, separators=(",", ":")))
                pipe.expire(key, self.ttl_s)
                await pipe.execute()

    async def events_after(self, response_id: str, after: int) -> list[dict[str, Any]]:
        key = EVENTS_PREFIX + response_id
        with _answering():
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.lrange(key, max(after + 1, 0), -1)
                pipe.expire(key, self.ttl_s)  # read: kept as long as the response
                raw, _ = await pipe.execute()
        return [json.loads(event) for event in raw]

    async def hold(self, response_id: str, seconds: float) -> None:
        with _answering():
            await self._redis.set(HELD_PREFIX + response_id, "1", px=max(1, int(seconds * 1000)))

    async def held(self, response_id: str) -> bool:
        with _answering():
            return bool(await self._redis.exists(HELD_PREFIX + response_id))

    async def put_conversation(self, stored: StoredConversation, items: list[dict[str, Any]]) -> None:
        key = CONVERSATION_PREFIX + stored.id
        with _answering():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.set(key, json.dumps(asdict(stored), separators=(",", ":")), ex=self.ttl_s)
                if items:
                    pipe.rpush(ITEMS_PREFIX + stored.id, *(json.dumps(item, separators=(",", ":")) for item in items))
                    pipe.expire(ITEMS_PREFIX + stored.id, self.ttl_s)
                await pipe.execute()

    async def get_conversation(self, conversation_id: str, owner: str) -> StoredConversation | None:
        with _answering():
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.getex(CONVERSATION_PREFIX + conversation_id, ex=self.ttl_s)  # read: both kept ttl_s longer
                pipe.expire(ITEMS_PREFIX + conversation_id, self.ttl_s)
                raw, _ = await pipe.execute()
        if raw is None:
            return None
        stored = StoredConversation(**json.loads(raw))
        return stored if stored.owner == owner else None

    async def delete_conversation(self, conversation_id: str, owner: str) -> bool:
        if await self.get_conversation(conversation_id, owner) is None:
            return False
        with _answering():
            return bool(await self._redis.delete(CONVERSATION_PREFIX + conversation_id, ITEMS_PREFIX + conversation_id))

    async def add_items(self, conversation_id: str, owner: str, items: list[dict[str, Any]]) -> bool:
        if await self.get_conversation(conversation_id, owner) is None:
            return False
        key = ITEMS_PREFIX + conversation_id
        with _answering():
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.rpush(key, *(json.dumps(item, separators=(",", ":")) for item in items))
                pipe.expire(key, self.ttl_s)
                await pipe.execute()
        return True

    async def items(self, conversation_id: str, owner: str) -> list[dict[str, Any]] | None:
        if await self.get_conversation(conversation_id, owner) is None:
            return None
        with _answering():
            raw = await self._redis.lrange(ITEMS_PREFIX + conversation_id, 0, -1)
        return [json.loads(item) for item in raw]

    async def delete_item(self, conversation_id: str, owner: str, item_id: str) -> bool:
        if await self.get_conversation(conversation_id, owner) is None:
            return False
        key = ITEMS_PREFIX + conversation_id
        with _answering():
            for raw in await self._redis.lrange(key, 0, -1):
                if json.loads(raw)["id"] == item_id:
                    return bool(await self._redis.lrem(key, 1, raw))
        return False

    async def close(self) -> None:
        await self._redis.aclose()


@contextlib.contextmanager
def _answering() -> Iterator[None]:
    import redis

    try:
        yield
    except (redis.RedisError, OSError) as exc:
        raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc
