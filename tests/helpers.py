"""Waiting for real gRPC services in tests (the router's whole chain, any standard health service); their logs;
the single-process engine's scores of a prompt."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cascadia.engine.batch import Segment
from cascadia.engine.sampling import log_softmax
from cascadia.wire import pb


async def router_ready(stub, attempts: int = 300) -> None:
    """Until the router reports every stage serving."""
    for _ in range(attempts):
        try:
            stats = await stub.Stats(pb.StatsRequest(), timeout=1)
            if stats.stage_serving and all(stats.stage_serving):
                return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError("the router's chain never became ready")


async def serving(address: str, timeout: float = 60) -> None:
    """Until the standard health service at `address` says SERVING."""
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(address) as channel:
        while time.monotonic() < deadline:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{address} not serving")


def print_logs(directory: Path, tail: int = 4000) -> None:
    """The end of every process log in `directory`, for pytest to show when the test fails."""
    for log in sorted(directory.glob("*.log")):
        print(f"--- {log.name} ---\n{log.read_text(errors='replace')[-tail:]}")


def next_token_log_probs(engine, prompt: Sequence[int]) -> np.ndarray:
    """[len(prompt) - 1, V]: the log-probs the whole-model `engine` gives after each prompt row but the last,
    so that row i scores prompt token i + 1."""
    engine.open("next-token-log-probs")
    try:
        rows = np.arange(len(prompt))
        logits = engine.step([Segment("next-token-log-probs", 0, len(prompt))], np.array(prompt), rows).logits
    finally:
        engine.close("next-token-log-probs")
    return log_softmax(logits[:-1])


def with_tokenizer_config(model: Path, out: Path, **settings) -> Path:
    """A copy of checkpoint `model` at `out` whose tokenizer_config.json says `settings` (a chat template...)."""
    shutil.copytree(model, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(settings)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out
