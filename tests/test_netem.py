"""The emulated fleet network: planned names and commands, and real shards behind shaped links."""

from __future__ import annotations

import asyncio
import os
import shutil

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
    # a slow link (a rate alone: not every kernel here has netem for latency) makes each decode
    # frame, about 500 bytes on the wire, take ~16 ms per hop
    prompt = (5, 9, 200, 31)
    engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings())
    expected = generate(engine, prompt, SamplingParams(max_tokens=6), stream="solo").token_ids

    async def run(fleet: LocalFleet):
        driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, SchedulerConfig(stages=2), frame_timeout=60)
        await driver.start()
        try:
            await driver.wait_ready(timeout=120)
            return await driver.generate(Request("r", prompt, SamplingParams(max_tokens=6)))
        finally:
            await driver.stop()

    network = EmulatedNetwork(2, LinkShape("256kbit", burst="2kb"))
    try:
        network.__enter__()
    except RuntimeError as exc:
        if "not permitted" in str(exc).lower():
            pytest.skip(f"this sandbox cannot make network namespaces: {exc}")
        raise
    try:
        fleet = LocalFleet(tiny, 2, network=network)
        fleet.start(tmp_path)
        try:
            result = asyncio.run(run(fleet))
        finally:
            fleet.stop()
    finally:
        network.__exit__()
    assert result.tokens == expected
    gaps = sorted(b - a for a, b in zip(result.token_times, result.token_times[1:], strict=False))
    # each token crosses two shaped egresses, shard 0 -> shard 1 and shard 1 -> the router; on
    # loopback a tiny token takes about 8 ms
    assert gaps[len(gaps) // 2] >= 0.020
    plan = network.plan
    assert not [h for h in plan.hosts if os.path.exists(f"/run/netns/{h.namespace}")]
