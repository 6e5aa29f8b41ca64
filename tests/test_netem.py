"""The emulated fleet network: planned names and commands, and real shards behind shaped links."""

from __future__ import annotations

import asyncio
import os
import shutil
import time

import numpy as np
import pytest

from cascadia.engine.engine import StageEngine
from cascadia.engine.generate import generate
from cascadia.engine.sampling import SamplingParams
from cascadia.engine.settings import EngineSettings
from cascadia.model.checkpoint import load_stage
from cascadia.model.config import load_shape
from cascadia.router.local import LocalFleet
from cascadia.router.netem import EmulatedNetwork, LinkShape, plan_network, setup_commands, teardown_commands
from cascadia.router.pipeline import PipelineDriver
from cascadia.router.scheduler import Request, SchedulerConfig


def test_names_fit_linux_interface_limits_and_addresses_are_distinct():
    plan = plan_network("a1b2c3", 12)
    names = [plan.bridge, *(h.outer for h in plan.hosts)]
    assert all(len(n) <= 15 for n in names)
    assert len({h.address for h in plan.hosts}) == 12 and plan.gateway_address not in {h.address for h in plan.hosts}
    with pytest.raises(ValueError):
        plan_network("bad-tag!", 2)


def test_each_shard_shapes_its_own_egress_once_and_teardown_undoes_setup():
    plan = plan_network("t", 2)
    shape = LinkShape("1gbit", 20.0, 5.0)
    commands = setup_commands(plan, shape)
    shaping = [c for c in commands if "tc" in c]
    assert len(shaping) == 2
    assert shaping[0][-8:] == ["root", "netem", "rate", "1gbit", "delay", "20.0ms", "loss", "5.0%"]
    assert LinkShape("100mbit").qdisc_args()[:3] == ["tbf", "rate", "100mbit"]
    assert all(c[:5] == ["ip", "netns", "exec", plan.hosts[i].namespace, "tc"] for i, c in enumerate(shaping))
    created = {c[3] for c in commands if c[:3] == ["ip", "netns", "add"]}
    removed = {c[3] for c in teardown_commands(plan) if c[:3] == ["ip", "netns", "del"]}
    assert created == removed == {h.namespace for h in plan.hosts}
    with pytest.raises(ValueError):
        LinkShape(delay_ms=-1)


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")
def test_shards_behind_shaped_links_give_the_same_ids_and_pay_for_the_link(tiny, tmp_path):
    # A rate alone (not every kernel here has netem for latency). The prompt's prefill crosses the
    # shaped link between the shards as 64 KiB of FP32 rows: at 512 kbit/s that is about a second
    # more to the first token than the same fleet takes on loopback.
    prompt = tuple(int(t) for t in np.random.default_rng(0).integers(3, 500, size=256))
    engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings())
    expected = generate(engine, prompt, SamplingParams(max_tokens=4), stream="solo").token_ids

    async def run(fleet: LocalFleet):
        driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, SchedulerConfig(stages=2), frame_timeout=60)
        await driver.start()
        try:
            await driver.wait_ready(timeout=120)
            started = time.perf_counter()
            result = await driver.generate(Request("r", prompt, SamplingParams(max_tokens=4)))
            return result, result.first_token_at - started
        finally:
            await driver.stop()

    def first_token_time(network: EmulatedNetwork | None) -> float:
        fleet = LocalFleet(tiny, 2, network=network)
        fleet.start(tmp_path)
        try:
            result, ttft = asyncio.run(run(fleet))
        finally:
            fleet.stop()
        assert result.tokens == expected
        return ttft

    loopback = first_token_time(None)
    network = EmulatedNetwork(2, LinkShape("512kbit", burst="2kb"))
    try:
        network.__enter__()
    except RuntimeError as exc:
        if "not permitted" in str(exc).lower():
            pytest.skip(f"this sandbox cannot make network namespaces: {exc}")
        raise
    try:
        shaped = first_token_time(network)
    finally:
        network.__exit__()
    wire = 256 * 64 * 4 / (512e3 / 8)
    assert shaped >= loopback + 0.5 * wire, f"first token {shaped:.2f} s shaped vs {loopback:.2f} s on loopback"
