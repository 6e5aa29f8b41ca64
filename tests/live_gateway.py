"""A live local fleet behind the gateway (`cascadia up`, 2 shard processes) for tests through the real openai
client, and the single-process engine whose tokens the fleet must reproduce."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from cascadia.bench.load import wait_until_ready
from cascadia.gateway.text import TextCodec
from cascadia.grammar import GrammarVocabulary
from cascadia.model.checkpoint import load_stage
from cascadia.model.config import load_shape
from cascadia.router.local import free_port
from cascadia.sampling_params import SamplingParams
from cascadia.wire import pb, rpc
from tests.helpers import print_logs

KEYS = ("sk-test-alpha-0123456789", "sk-test-beta-9876543210")
MODEL = "tiny"


@dataclass
class Live:
    base: str
    router: str
    shards: list[str]
    log_dir: Path
    codec: TextCodec

    def client(self, key: str = KEYS[0]) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=60)

    def async_client(self, key: str = KEYS[0]) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def live(tiny, tmp_path_factory) -> Iterator[Live]:
    logs = tmp_path_factory.mktemp("up")
    port, router_port = free_port(), free_port()
    env = {**os.environ, "CASCADIA_API_KEYS": ",".join(KEYS)}
    cmd = [sys.executable, "-m", "cascadia.cli", "up", "--model", str(tiny), "--shards", "2", "--port", str(port)]
    cmd += ["--router-port", str(router_port), "--log-dir", str(logs)]
    with open(logs / "up.log", "w") as out:
        process = subprocess.Popen(cmd, env=env, stderr=out, stdout=out)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(base, process, timeout=180)
        shards = re.search(r"shards on (\S+), (\S+);", (logs / "up.log").read_text()).groups()
        yield Live(base, f"127.0.0.1:{router_port}", list(shards), logs, TextCodec.from_directory(tiny))
    finally:
        process.terminate()
        process.wait(30)
        print_logs(logs)


@pytest.fixture
def gateway_process(tiny, live, tmp_path):
    """Start one more `cascadia gateway` over the same router, with other settings; `start.processes` maps each
    one's base URL to its process."""
    started: dict[str, subprocess.Popen] = {}

    def start(
        *options: str, keys: bool = False, router: str | None = None, ready: bool = True, model: Path | None = None
    ):
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "CASCADIA_API_KEYS"}
        if keys:
            env["CASCADIA_API_KEYS"] = ",".join(KEYS)
        cmd = [sys.executable, "-m", "cascadia.cli", "gateway", "--router", router or live.router]
        cmd += ["--model", str(model or tiny), "--served-model-name", MODEL, "--port", str(port), *options]
        log = tmp_path / f"gateway-{port}.log"
        process = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        started[base] = process
        if ready:
            wait_until_ready(base, process, timeout=60)
        else:
            deadline = time.monotonic() + 30
            while True:
                try:
                    httpx.get(base + "/healthz", timeout=1)
                    break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline
                    time.sleep(0.3)
        return base, log

    start.processes = started
    yield start
    for process in started.values():
        process.terminate()
        process.wait(15)


@pytest.fixture(scope="module")
def solo_engine(tiny):
    # the engine is imported here, not at the top: every test session loads this plugin, and the pure
    # tier (tests/unit) must not bring OpenVINO in
    from cascadia.engine.engine import StageEngine
    from cascadia.engine.settings import EngineSettings

    return StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings())


@pytest.fixture(scope="module")
def solo(tiny, solo_engine):
    """Token ids the single-process engine generates: what the fleet must reproduce."""
    from cascadia.engine.generate import generate

    engine = solo_engine
    stops = TextCodec.from_directory(tiny).stop_token_ids
    vocabulary = GrammarVocabulary.from_model(tiny, engine.shape.unpadded_vocab_size)

    def run(prompt: list[int], max_tokens: int, **sampling) -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, stop_ids=stops, **sampling)
        return generate(engine, prompt, params, stream="solo", vocabulary=vocabulary).token_ids

    return run


def shard_open_streams(live) -> list[int]:
    async def ask():
        out = []
        for addr in live.shards:
            async with grpc.aio.insecure_channel(addr) as channel:
                out.append((await rpc.ShardStub(channel).Stats(pb.StatsRequest(), timeout=5)).open_streams)
        return out

    return asyncio.run(ask())


def router_stats(live):
    async def ask():
        async with grpc.aio.insecure_channel(live.router) as channel:
            return await rpc.RouterStub(channel).Stats(pb.StatsRequest(), timeout=5)

    return asyncio.run(ask())


def router_active(live) -> int:
    return router_stats(live).active_streams


def wait_until_free(live, timeout: float = 15.0) -> None:
    """No stream running; the stages hold only the finished streams the router keeps."""
    deadline = time.monotonic() + timeout
    while True:
        router, shards = router_stats(live), shard_open_streams(live)
        if router.active_streams == 0 and shards == [router.kept_streams] * len(shards):
            return
        assert time.monotonic() < deadline, f"router {router}, shards {shards}"
        time.sleep(0.2)


def wait_until_active(live, count: int = 1, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while router_active(live) < count:
        assert time.monotonic() < deadline, f"{count} streams never became active on the router"
        time.sleep(0.05)
