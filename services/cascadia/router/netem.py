"""An emulated fleet network on one machine: each shard in its own network namespace, joined to a
bridge by a veth pair, with `tc` shaping what leaves the shard: a token bucket for bandwidth,
netem for latency and loss.

Every hop between machines of the real fleet crosses exactly one shaped link: a shard's egress.
The router and gateway stay in the root namespace, as machine 0 would hold them. Needs root (or
CAP_NET_ADMIN) and iproute2.

Kernels built without netem still shape the rate with the token bucket; latency and loss then
act on the packets entering the shard's namespace instead: iptables drops a random share of them
(the `statistic` match) and sends the rest through a netfilter queue that a `delay_line` process
releases after the delay. Each hop still crosses one shaped link (the one into its receiver).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections.abc import Mapping, Sequence
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

    @property
    def impaired(self) -> bool:
        return bool(self.delay_ms or self.loss_percent)

    def qdisc_args(self, netem: bool = True) -> list[str]:
        """netem when latency or loss is asked and the kernel has it; a token bucket otherwise."""
        if not (netem and self.impaired):
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


DELAY_QUEUE = 0  # netfilter queue numbers are per namespace: every host can use the same one
DELAY_LINE_START_S = 30.0  # a delay line that has not bound its queue by then is not coming


def ingress_impairment_commands(shape: LinkShape) -> list[list[str]]:
    """iptables rules (run inside a host's namespace) for latency and loss without netem."""
    rule = ["iptables", "-t", "mangle", "-A", "PREROUTING", "-i", "eth0"]
    out = []
    if shape.loss_percent:
        out.append([*rule, "-m", "statistic", "--mode", "random", "--probability", f"{shape.loss_percent / 100:.6f}"])
        out[-1] += ["-j", "DROP"]
    if shape.delay_ms:
        out.append([*rule, "-j", "NFQUEUE", "--queue-num", str(DELAY_QUEUE)])
    return out


def link_commands(plan: NetworkPlan, shapes: Sequence[LinkShape], netem: bool) -> list[list[str]]:
    """Shape every host's link: `shapes[i]` for host i. Without netem, latency and loss need the
    delay lines (`EmulatedNetwork` starts them before these rules queue any packet)."""
    out = []
    for host, shape in zip(plan.hosts, shapes, strict=True):
        ns = ["ip", "netns", "exec", host.namespace]
        out.append([*ns, "tc", "qdisc", "add", "dev", "eth0", "root", *shape.qdisc_args(netem)])
        if not netem:
            out += [[*ns, *c] for c in ingress_impairment_commands(shape)]
    return out


def setup_commands(plan: NetworkPlan, shape: LinkShape | Sequence[LinkShape], netem: bool = True) -> list[list[str]]:
    """Namespaces, links and addresses, then the shaping (one shape for all hosts, or one per host)."""
    shapes = [shape] * len(plan.hosts) if isinstance(shape, LinkShape) else list(shape)
    return namespace_commands(plan) + link_commands(plan, shapes, netem)


def namespace_commands(plan: NetworkPlan) -> list[list[str]]:
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
        ]
    return out


def teardown_commands(plan: NetworkPlan) -> list[list[str]]:
    # A namespace's devices go away asynchronously after `netns del`: deleting the veth first (which
    # takes its peer with it) frees the names at once for a network made right after this one.
    links = [["ip", "link", "del", h.outer] for h in plan.hosts]
    return links + [["ip", "netns", "del", h.namespace] for h in plan.hosts] + [["ip", "link", "del", plan.bridge]]


class EmulatedNetwork:
    """Creates the plan's namespaces on entry and removes them on exit (also after a failed setup).

    `links` gives hosts whose link differs from `shape` (e.g. one slow, lossy hop)."""

    def __init__(
        self, hosts: int, shape: LinkShape, tag: str | None = None, links: Mapping[int, LinkShape] | None = None
    ) -> None:
        self.plan = plan_network(tag or format(os.getpid() % 0xFFFFFF, "x"), hosts)
        if links and not all(0 <= i < hosts for i in links):
            raise ValueError(f"links for hosts {sorted(links)}: the network has hosts 0 to {hosts - 1}")
        self.shapes = [dict(links or {}).get(i, shape) for i in range(hosts)]
        self.netem = True
        self._delay_lines: list[subprocess.Popen] = []

    def __enter__(self) -> EmulatedNetwork:
        try:
            for command in namespace_commands(self.plan):
                run(command)
            self.netem = not any(s.impaired for s in self.shapes) or kernel_has_netem(self.prefix(0))
            if not self.netem:
                for i, shape in enumerate(self.shapes):
                    if shape.delay_ms:
                        self._delay_lines.append(self._start_delay_line(i, shape.delay_ms))
            for command in link_commands(self.plan, self.shapes, self.netem):
                run(command)
        except subprocess.CalledProcessError as exc:
            self.__exit__()
            raise RuntimeError(f"emulated network: '{' '.join(exc.cmd)}' failed: {exc.stderr.strip()}") from None
        except (RuntimeError, FileNotFoundError):
            self.__exit__()
            raise
        return self

    def _start_delay_line(self, host: int, delay_ms: float) -> subprocess.Popen:
        cmd = [*self.prefix(host), sys.executable, "-m", "cascadia.router.delay_line"]
        cmd += ["--queue", str(DELAY_QUEUE), "--delay-ms", str(delay_ms)]
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert process.stdout is not None
        answered, _, _ = select.select([process.stdout], [], [], DELAY_LINE_START_S)
        if not answered or process.stdout.readline().strip() != "ready":
            if not answered:
                process.kill()
            error = process.communicate(timeout=10)[1].strip().splitlines()
            raise RuntimeError(
                f"emulated network: the delay line for host {host} did not start "
                f"(latency without netem needs iptables and the NetfilterQueue package): {error[-1] if error else ''}"
            )
        return process

    def __exit__(self, *_: object) -> None:
        for process in self._delay_lines:
            process.terminate()
        for process in self._delay_lines:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        self._delay_lines.clear()
        for command in teardown_commands(self.plan):
            subprocess.run(command, capture_output=True)

    def delay_lines_alive(self) -> bool:
        return all(p.poll() is None for p in self._delay_lines)

    def prefix(self, host: int) -> list[str]:
        """Run a command inside host `host`'s namespace."""
        return ["ip", "netns", "exec", self.plan.hosts[host].namespace]


def run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True, text=True)


def kernel_has_netem(prefix: list[str]) -> bool:
    """Try a netem qdisc on a namespace's loopback (and take it away again)."""
    probe = subprocess.run([*prefix, "tc", "qdisc", "add", "dev", "lo", "root", "netem"], capture_output=True)
    if probe.returncode != 0:
        return False
    subprocess.run([*prefix, "tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    return True
