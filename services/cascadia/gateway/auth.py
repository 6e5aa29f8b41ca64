"""API keys (bearer tokens) and per-key concurrency limits."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Header, Request

from cascadia.gateway.errors import ApiError

KEYS_ENV = "CASCADIA_API_KEYS"
ANONYMOUS = "anonymous"


def load_keys(path: Path | None = None, environ: dict[str, str] | None = None) -> list[str]:
    """Keys from a file (one per line, '#' comments; a mounted Secret) and from $CASCADIA_API_KEYS (commas)."""
    keys: list[str] = []
    if path is not None:
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                keys.append(line)
    env = os.environ if environ is None else environ
    keys += [k.strip() for k in env.get(KEYS_ENV, "").split(",") if k.strip()]
    return keys


def key_id(key: str) -> str:
    """A name for a key that is safe to log and to use as a metric label."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


class KeyRing:
    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = {hashlib.sha256(k.encode()).digest(): key_id(k) for k in keys}

    @property
    def open(self) -> bool:
        return not self._digests

    def authenticate(self, authorization: str | None) -> str:
        """The caller's key id, or 401; with no keys configured everyone is 'anonymous'."""
        if self.open:
            return ANONYMOUS
        if not authorization or not authorization.lower().startswith("bearer "):
            raise ApiError(
                401,
                "Missing API key: send 'Authorization: Bearer <key>'.",
                "invalid_request_error",
                code="invalid_api_key",
            )
        digest = hashlib.sha256(authorization[7:].strip().encode()).digest()
        for known, name in self._digests.items():
            if hmac.compare_digest(known, digest):
                return name
        raise ApiError(401, "Incorrect API key provided.", "invalid_request_error", code="invalid_api_key")


class ConcurrencyLimiter:
    """At most `limit` requests in flight per key (0: no limit)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active: Counter[str] = Counter()

    def acquire(self, key: str) -> None:
        if self.limit and self.active[key] >= self.limit:
            raise ApiError(
                429,
                f"Too many concurrent requests for this key: the limit (max_concurrent_requests_per_key) is "
                f"{self.limit}.",
                "rate_limit_error",
                param="max_concurrent_requests_per_key",
                code="concurrency_limit_exceeded",
            )
        self.active[key] += 1

    def release(self, key: str) -> None:
        self.active[key] -= 1
        if self.active[key] <= 0:
            del self.active[key]


def authenticated(
    request: Request, authorization: Annotated[str | None, Header(include_in_schema=False)] = None
) -> str:
    """The caller's key id (401 without a valid key, unless the gateway runs open)."""
    return request.app.state.gateway.keys.authenticate(authorization)


Key = Annotated[str, Depends(authenticated)]
