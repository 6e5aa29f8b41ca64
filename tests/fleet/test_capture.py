"""Capture on a fleet of real shard processes, replay of what it recorded, and the capture budget."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cascadia.engine.engine import StageEngine
from cascadia.engine.generate import generate
from cascadia.engine.settings import EngineSettings
from cascadia.model.loader import load_stage
from cascadia.router.local import LocalFleet, free_port
from cascadia.sampling_params import SamplingParams
from cascadia.shard.capture import CaptureError, confirmed_streams, read_capture
from tests.helpers import router_ready


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cascadia.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def prompts(n: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(7)
    return {f"r{i}": [1, *rng.integers(3, 500, size=5 + 4 * i).tolist()] for i in range(n)}


async def _run_requests(port: int, requests: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    import grpc

    from cascadia.shard.service import pb, rpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = rpc.RouterStub(channel)
        await router_ready(stub)

        async def one(rid, ids):
            message = pb.GenerateRequest(request_id=rid, prompt_ids=ids, max_tokens=max_tokens)
            return rid, [e.token async for e in stub.Generate(message, timeout=120)]

        return dict(await asyncio.gather(*(one(r, ids) for r, ids in requests.items())))


@pytest.fixture(scope="module")
def captured(tiny: Path, tmp_path_factory: pytest.TempPathFactory):
    """Three requests through 2 shards with speculation (rewinds happen), every layer captured."""
    root = tmp_path_factory.mktemp("capture")
    fleet = LocalFleet(tiny, 2)
    fleet.start(root)
    port = free_port()
    fleet.start_router(port, root / "router.log", max_draft=3)
    requests = prompts(3)
    try:
        asyncio.run(_run_requests(port, {"warm": requests["r0"]}, 2))  # the chain is ready before capture
        on = cli("capture", "--router", f"127.0.0.1:{port}", "--dir", str(root / "cap"), "--every-layer")
        assert on.returncode == 0, on.stderr
        got = asyncio.run(_run_requests(port, requests, 12))
        off = cli("capture", "--router", f"127.0.0.1:{port}", "--off")
        assert off.returncode == 0, off.stderr
        assert "stage 0: off" in off.stderr and "stage 1: off" in off.stderr
        assert " 0 files" not in off.stderr  # the stopped capture reports what it wrote
    finally:
        fleet.stop()
    return root / "cap", requests, got, fleet


def test_capture_records_every_stage_and_the_confirmed_tokens(captured, tiny: Path):
    directory, requests, got, _ = captured
    stages = read_capture(directory)
    assert sorted(stages) == [0, 1]
    first, last = stages[0], stages[1]
    assert first.info.start_layer == 0 and last.info.end_layer == 5
    assert first.frames[0].inputs.ndim == 1 and last.frames[0].inputs.ndim == 2
    streams = confirmed_streams(last)
    assert set(streams) == set(requests)
    engine = StageEngine(load_stage(tiny, 0, 5), EngineSettings())
    for rid, ids in requests.items():
        s = streams[rid]
        assert s.tokens[: len(ids)] == ids and s.prompt_length == len(ids)
        # the confirmed sequence is the prompt and what the router emitted (less the last token's row)
        assert s.tokens[len(ids) :] == got[rid][: len(s.tokens) - len(ids)]
        assert s.final_states.shape == (len(s.tokens) - 1, 64)
        expected = generate(engine, ids, SamplingParams(max_tokens=12)).token_ids
        assert got[rid] == expected


@pytest.mark.parametrize("layers", ["0:5", "0:2", "2:5", "1:4"])
def test_replay_in_the_same_precision_reproduces_the_capture_exactly(captured, layers: str):
    directory = captured[0]
    run = cli("replay", str(directory), "--layers", layers, "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    start, end = (int(x) for x in layers.split(":"))
    assert sorted(int(k) for k in report["per_layer"]) == list(range(start, end))
    for layer, d in report["per_layer"].items():
        assert d["rows"] > 0 and d["relative_rms"] == 0.0 and d["relative_max"] == 0.0, (layer, d)
    if end == 5:
        assert report["argmax_agreement"] == 1.0


@pytest.mark.parametrize("layer", [1, 3, 4])
def test_replay_in_another_precision_reports_a_bounded_deviation(captured, layer: int):
    """int8 weights against the f32 fleet, one layer from its captured input: a nonzero deviation of the
    size int8 weights give on these random 64-wide layers (0.5% dense, about 2% in the 32-wide experts)."""
    run = cli("replay", str(captured[0]), "--layers", f"{layer}:{layer + 1}", "--precision", "int8", "--json")
    assert run.returncode == 0, run.stderr
    (deviation,) = json.loads(run.stdout)["per_layer"].values()
    assert 0.0 < deviation["relative_rms"] <= 0.05, deviation


def test_replay_refuses_what_was_not_captured(captured, tmp_path):
    stages = read_capture(captured[0])
    assert stages  # a readable capture
    bad = cli("replay", str(tmp_path), "--layers", "0:5")
    assert bad.returncode == 2 and "no capture files" in bad.stderr
    with pytest.raises(CaptureError, match="no capture files"):
        read_capture(tmp_path)


def test_a_full_capture_budget_stops_capture_and_never_disturbs_serving(tiny: Path, tmp_path):
    fleet = LocalFleet(tiny, 2)
    fleet.start(tmp_path)
    port = free_port()
    fleet.start_router(port, tmp_path / "router.log")
    requests = prompts(4)
    router = f"127.0.0.1:{port}"
    try:
        asyncio.run(_run_requests(port, {"warm": requests["r0"]}, 2))
        bad = cli("capture", "--router", router, "--dir", str(tmp_path / "cap"), "--budget", "0")
        assert bad.returncode == 2 and "--budget '0'" in bad.stderr
        blocked = tmp_path / "file"
        blocked.write_text("")
        refused = cli("capture", "--router", router, "--dir", str(blocked / "cap"))
        assert refused.returncode == 2 and "stage 0: capture directory" in refused.stderr
        on = cli("capture", "--router", router, "--dir", str(tmp_path / "cap"), "--budget", "24Ki")
        assert on.returncode == 0, on.stderr
        got = asyncio.run(_run_requests(port, requests, 10))
        status = cli("capture", "--router", router, "--status")
        assert status.returncode == 0
        assert "stage 1: full (stopped)" in status.stderr, status.stderr
        more = asyncio.run(_run_requests(port, {"after": requests["r1"]}, 10))
    finally:
        fleet.stop()
    engine = StageEngine(load_stage(tiny, 0, 5), EngineSettings())
    for rid, ids in requests.items():
        assert got[rid] == generate(engine, ids, SamplingParams(max_tokens=10)).token_ids
    assert more["after"] == got["r1"]
    stages = read_capture(tmp_path / "cap")  # what was written before the budget ran out stays readable
    assert stages and all(len(s.frames) > 0 for s in stages.values())
