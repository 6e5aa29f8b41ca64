"""An emulated fleet network on one machine: each shard in its own network namespace, joined to a
bridge by a veth pair, with `tc` shaping what leaves the shard: a token bucket for bandwidth,
netem for latency and loss.

Every hop between machines of the real fleet crosses exactly one shaped link: a shard's egress.
The router and gateway stay in the root namespace, as machine 0 would hold them. Needs root (or
CAP_NET_ADMIN) and iproute2.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkShape:
    rate: str = "1gbit"
    delay_ms: float = 0.0
    loss_percent: float = 0.0
    burst: str = "64kb"  # bytes a rate-only link lets through at once

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or not 0 <= self.loss_percent < 100:
            raise ValueError(f"link delay {self.delay_ms} ms / loss {self.loss_percent}% out of range")

    def qdisc_args(self) -> list[str]:
        """netem when latency or loss is asked (the kernel needs sch_netem); a token bucket otherwise."""
        if not (self.delay_ms or self.loss_percent):
            return ["tbf", "rate", self.rate, "burst", self.burst, "latency", "1s"]
        args = ["netem", "rate", self.rate]
        if self.delay_ms:
            args += ["delay", f"{self.delay_ms}ms"]
        if self.loss_percent:
            args += ["loss", f"{self.loss_percent}%"]
        return args


@dataclass(frozen=True)
class Host:
    namespace: str
    outer: str  # veth end on the bridge, root namespace
    address: str


@dataclass(frozen=True)
class NetworkPlan:
    bridge: str
    gateway_address: str  # the bridge's address: where the root namespace's servers listen
    prefix_length: int
    hosts: tuple[Host, ...]


def plan_network(tag: str, hosts: int, subnet: int = 77) -> NetworkPlan:
    """Names (interface names fit Linux's 15 characters) and addresses for `hosts` shards."""
    if not 1 <= hosts <= 200:
        raise ValueError(f"{hosts} hosts: between 1 and 200")
    if not tag.isalnum() or len(tag) > 6:
        raise ValueError(f"network tag '{tag}' must be up to 6 letters or digits")
    base = f"10.{subnet}.0"
    return NetworkPlan(
        bridge=f"csbr{tag}",
        gateway_address=f"{base}.1",
        prefix_length=24,
        hosts=tuple(Host(f"cs{tag}-{i}", f"csv{tag}{i}", f"{base}.{10 + i}") for i in range(hosts)),
    )


def setup_commands(plan: NetworkPlan, shape: LinkShape) -> list[list[str]]:
    cidr = f"/{plan.prefix_length}"
    out = [
        ["ip", "link", "add", plan.bridge, "type", "bridge"],
        ["ip", "addr", "add", plan.gateway_address + cidr, "dev", plan.bridge],
        ["ip", "link", "set", plan.bridge, "up"],
    ]
    for host in plan.hosts:
        ns = ["ip", "netns", "exec", host.namespace]
        out += [
            ["ip", "netns", "add", host.namespace],
            ["ip", "link", "add", host.outer, "type", "veth", "peer", "name", "eth0", "netns", host.namespace],
            ["ip", "link", "set", host.outer, "master", plan.bridge],
            ["ip", "link", "set", host.outer, "up"],
            [*ns, "ip", "addr", "add", host.address + cidr, "dev", "eth0"],
            [*ns, "ip", "link", "set", "eth0", "up"],
            [*ns, "ip", "link", "set", "lo", "up"],
            [*ns, "ip", "route", "add", "default", "via", plan.gateway_address],
            [*ns, "tc", "qdisc", "add", "dev", "eth0", "root", *shape.qdisc_args()],
        ]
    return out


def teardown_commands(plan: NetworkPlan) -> list[list[str]]:
    # deleting a namespace deletes its veth end, and with it the peer on the bridge
    return [["ip", "netns", "del", h.namespace] for h in plan.hosts] + [["ip", "link", "del", plan.bridge]]


class EmulatedNetwork:
    """Creates the plan's namespaces on entry and removes them on exit (also after a failed setup)."""

    def __init__(self, hosts: int, shape: LinkShape, tag: str | None = None) -> None:
        self.plan = plan_network(tag or format(os.getpid() % 0xFFFFFF, "x"), hosts)
        self.shape = shape

    def __enter__(self) -> EmulatedNetwork:
        try:
            for command in setup_commands(self.plan, self.shape):
                subprocess.run(command, check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError as exc:
            self.__exit__()
            hint = ""
            if "qdisc kind is unknown" in exc.stderr and "netem" in exc.cmd:
                hint = " (this kernel has no netem: latency and loss cannot be emulated; a rate alone can)"
            raise RuntimeError(f"emulated network: '{' '.join(exc.cmd)}' failed: {exc.stderr.strip()}{hint}") from None
        return self

    def __exit__(self, *_: object) -> None:
        for command in teardown_commands(self.plan):
            subprocess.run(command, capture_output=True)

    def prefix(self, host: int) -> list[str]:
        """Run a command inside host `host`'s namespace."""
        return ["ip", "netns", "exec", self.plan.hosts[host].namespace]
