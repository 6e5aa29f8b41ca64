"""`cascadia gateway`: the app for one model (directory or GGUF file), served by uvicorn."""

from __future__ import annotations

import os
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from cascadia.gateway.app import GatewayConfig, create_app
from cascadia.gateway.auth import KeyRing, load_keys
from cascadia.gateway.response_store import MemoryStore, RedisStore, ResponseStore
from cascadia.gateway.router_client import RouterClient
from cascadia.gateway.text import TextCodec
from cascadia.model.loader import load_shape

REDIS_PASSWORD_ENV = "CASCADIA_REDIS_PASSWORD"  # as the draft service reads it


def model_limits(model: Path) -> tuple[int, int]:
    """(vocabulary size the head produces, positions the model was configured for)."""
    shape = load_shape(model)
    return shape.unpadded_vocab_size, shape.max_position_embeddings


def build_app(
    router_addr: str,
    model_dir: Path,
    served_name: str,
    keys_file: Path | None,
    max_context: int,
    max_prompt_tokens: int,
    max_concurrent_per_key: int,
    max_body_bytes: int = 8 << 20,
    store: ResponseStore | None = None,
) -> FastAPI:
    vocab, positions = model_limits(model_dir)
    config = GatewayConfig(
        model_name=served_name,
        vocab_size=vocab,
        max_context=min(max_context, positions),
        max_prompt_tokens=max_prompt_tokens,
        max_concurrent_per_key=max_concurrent_per_key,
        max_body_bytes=max_body_bytes,
    )
    keys = KeyRing(load_keys(keys_file))
    return create_app(config, RouterClient(router_addr), TextCodec.from_model(model_dir), keys, store)


def response_store(redis_url: str | None, ttl_s: int, capacity: int) -> ResponseStore:
    """Stored responses in the fleet's Redis (shared by every gateway), else in this process."""
    if redis_url:
        return RedisStore(redis_url, ttl_s, password=os.environ.get(REDIS_PASSWORD_ENV) or None)
    return MemoryStore(capacity)


def serve(app: FastAPI, host: str, port: int) -> None:
    uvicorn.run(app, host=host, port=port, log_level="info", access_log=False, timeout_graceful_shutdown=5)
