"""The emulated fleet network: planned names and commands, and real shards behind shaped links."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time

import grpc
import numpy as np
import pytest

from cascadia.engine.engine import StageEngine
from cascadia.engine.generate import generate
from cascadia.engine.settings import EngineSettings
from cascadia.model.checkpoint import load_stage
from cascadia.model.config import load_shape
from cascadia.router.delay_line import DelayLine
from cascadia.router.local import LocalFleet
from cascadia.router.netem import (
    EmulatedNetwork,
    LinkShape,
    link_commands,
    plan_network,
    setup_commands,
    teardown_commands,
)
from cascadia.router.pipeline import PipelineDriver
from cascadia.router.scheduler import Request, SchedulerConfig
from cascadia.sampling_params import SamplingParams
from cascadia.shard.service import pb, rpc


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


def test_without_netem_the_rate_stays_a_token_bucket_and_latency_and_loss_act_on_arriving_packets():
    plan = plan_network("t", 3)
    plain, slow = LinkShape("1gbit"), LinkShape("1gbit", 200.0, 5.0)
    commands = link_commands(plan, [plain, slow, LinkShape("1gbit", loss_percent=1.0)], netem=False)
    per_host = [[c[4:] for c in commands if c[3] == h.namespace] for h in plan.hosts]
    assert all(cmds[0][:6] == ["tc", "qdisc", "add", "dev", "eth0", "root"] and "tbf" in cmds[0] for cmds in per_host)
    assert len(per_host[0]) == 1  # an unimpaired link gets no rules
    drop, queue = per_host[1][1], per_host[1][2]
    assert drop[:7] == ["iptables", "-t", "mangle", "-A", "PREROUTING", "-i", "eth0"]
    assert drop[drop.index("--probability") + 1] == "0.050000" and drop[-2:] == ["-j", "DROP"]
    assert queue[-4:] == ["-j", "NFQUEUE", "--queue-num", "0"]  # loss is ruled before the queue
    assert [c[-1] for c in per_host[2][1:]] == ["DROP"]  # loss alone needs no delay line
    with_netem = link_commands(plan, [plain, slow, plain], netem=True)
    assert all(c[4] == "tc" for c in with_netem) and "netem" in with_netem[1]
    with pytest.raises(ValueError, match="hosts 0 to 1"):
        EmulatedNetwork(2, plain, links={2: slow})


def test_delay_line_releases_in_arrival_order_after_the_delay():
    line: DelayLine[str] = DelayLine(0.2)
    assert line.wait_s(10.0, idle_s=0.5) == 0.5
    line.push("a", 10.0)
    line.push("b", 10.05)
    assert line.pop_due(10.19) == [] and line.wait_s(10.1) == pytest.approx(0.1)
    assert line.pop_due(10.2) == ["a"] and len(line) == 1
    assert line.pop_due(11.0) == ["b"] and line.wait_s(11.0, idle_s=1.0) == 1.0
    with pytest.raises(ValueError):
        DelayLine(-0.1)


needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")


def enter_or_skip(network: EmulatedNetwork) -> EmulatedNetwork:
    try:
        return network.__enter__()
    except RuntimeError as exc:
        if "not permitted" in str(exc).lower():
            pytest.skip(f"this sandbox cannot make network namespaces: {exc}")
        raise


async def timed_generate(fleet: LocalFleet, prompts: list[tuple[int, ...]], max_tokens: int, warm_up: bool = False):
    # every request computes its prompt and every stream is closed at its end: what crosses the links is timed
    config = SchedulerConfig(stages=2, keep_finished=0)
    driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, config, frame_timeout=60)
    await driver.start()
    try:
        await driver.wait_ready(timeout=120)
        if warm_up:  # the stages' first steps at each shape compile; time the steady state
            await driver.generate(Request("warm-up", prompts[0], SamplingParams(max_tokens=max_tokens)))
        started = time.perf_counter()
        requests = [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*(driver.generate(r) for r in requests))
        await streams_closed(fleet.stage_addrs)
        return results, started
    finally:
        await driver.stop()


async def streams_closed(stages: list[str], timeout: float = 30.0) -> None:
    """Until every stage holds no stream and no state bytes (closes also cross the shaped links)."""
    deadline = time.monotonic() + timeout
    while True:
        held = []
        for address in stages:
            async with grpc.aio.insecure_channel(address) as channel:
                stats = await rpc.ShardStub(channel).Stats(pb.StatsRequest(), timeout=5)
            held.append((stats.open_streams, stats.state_bytes))
        if not any(a or b for a, b in held):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"stages still hold (streams, bytes) {held}")
        await asyncio.sleep(0.2)


@pytest.mark.slow
@needs_root
def test_shards_behind_shaped_links_give_the_same_ids_and_pay_for_the_link(tiny, tmp_path):
    # A rate alone (not every kernel here has netem for latency). The prompt's prefill crosses the
    # shaped link between the shards as 64 KiB of FP32 rows: at 512 kbit/s that is about a second
    # more to the first token than the same fleet takes on loopback.
    prompt = tuple(int(t) for t in np.random.default_rng(0).integers(3, 500, size=256))
    engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings())
    expected = generate(engine, prompt, SamplingParams(max_tokens=4), stream="solo").token_ids

    def first_token_time(network: EmulatedNetwork | None) -> float:
        fleet = LocalFleet(tiny, 2, network=network)
        fleet.start(tmp_path)
        try:
            [result], started = asyncio.run(timed_generate(fleet, [prompt], 4, warm_up=True))
        finally:
            fleet.stop()
        assert result.tokens == expected
        return result.first_token_at - started

    loopback = first_token_time(None)
    network = enter_or_skip(EmulatedNetwork(2, LinkShape("512kbit", burst="2kb")))
    try:
        shaped = first_token_time(network)
    finally:
        network.__exit__()
    wire = 256 * 64 * 4 / (512e3 / 8)
    assert shaped >= loopback + 0.5 * wire, f"first token {shaped:.2f} s shaped vs {loopback:.2f} s on loopback"


def dropped_packets(network: EmulatedNetwork, host: int) -> int:
    listing = subprocess.run(
        [*network.prefix(host), "iptables", "-t", "mangle", "-L", "PREROUTING", "-v", "-n", "-x"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum(int(line.split()[0]) for line in listing.splitlines() if " DROP " in f" {line} ")


@pytest.mark.slow
@needs_root
def test_one_hop_with_200ms_latency_and_5_percent_loss_serves_every_request_with_the_same_ids(tiny, tmp_path):
    # The fault-matrix row: one hop (into the second shard) gets 200 ms and 5% loss, the other stays a
    # clean gigabit link. Every token crosses that hop once, so each costs at least the delay; the
    # kernel really drops packets (TCP retransmits them), no request fails and no stage keeps state.
    rng = np.random.default_rng(1)
    prompts = [tuple(int(t) for t in rng.integers(3, 500, size=n)) for n in (200, 120, 40)]
    engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings())
    expected = [
        generate(engine, p, SamplingParams(max_tokens=12), stream=f"s{i}").token_ids for i, p in enumerate(prompts)
    ]
    bad_hop = LinkShape("1gbit", delay_ms=200.0, loss_percent=5.0)
    network = enter_or_skip(EmulatedNetwork(2, LinkShape("1gbit"), links={1: bad_hop}))
    try:
        fleet = LocalFleet(tiny, 2, network=network)
        fleet.start(tmp_path)
        try:
            results, started = asyncio.run(timed_generate(fleet, prompts, 12))
        finally:
            fleet.stop()
        assert network.delay_lines_alive() or network.netem
        drops = dropped_packets(network, 1) if not network.netem else None
    finally:
        network.__exit__()
    assert [r.tokens for r in results] == expected
    for r in results:
        gaps = np.diff(r.token_times)
        assert r.first_token_at - started >= 0.2
        assert np.median(gaps) >= 0.2, f"inter-token gaps {np.round(gaps, 3)} s on a 200 ms hop"
    if drops is not None:
        assert drops > 0, "5% loss dropped no packet"
