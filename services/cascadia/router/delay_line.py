"""Latency for an emulated link on kernels without netem.

Packets entering a host's namespace are sent by netfilter to a queue (`iptables ... -j NFQUEUE`);
this process, run inside that namespace, holds each one for the link's delay and then lets it
through. The packets are real: TCP sees the longer round trip, and drops made by the kernel's
`statistic` match before the queue are retransmitted as on a lossy wire.

The delay is applied where packets arrive, not where they leave: a packet held on its sender's
egress would still be charged to the sending socket, and TCP's small-queue limit would then allow
only a couple of packets on the wire per delay.

    ip netns exec NS python -m cascadia.router.delay_line --queue 0 --delay-ms 200
"""

from __future__ import annotations

import argparse
import select
import signal
import sys
import time
from collections import deque
from typing import Generic, TypeVar

Item = TypeVar("Item")


class DelayLine(Generic[Item]):
    """Items leave in arrival order, each `delay_s` after it came in (one delay: FIFO is enough)."""

    def __init__(self, delay_s: float) -> None:
        if delay_s < 0:
            raise ValueError(f"delay {delay_s} s is negative")
        self.delay_s = delay_s
        self._held: deque[tuple[float, Item]] = deque()

    def __len__(self) -> int:
        return len(self._held)

    def push(self, item: Item, now: float) -> None:
        self._held.append((now + self.delay_s, item))

    def pop_due(self, now: float) -> list[Item]:
        due = []
        while self._held and self._held[0][0] <= now:
            due.append(self._held.popleft()[1])
        return due

    def wait_s(self, now: float, idle_s: float = 1.0) -> float:
        """How long to wait for the next release (or `idle_s` when nothing is held)."""
        return max(0.0, self._held[0][0] - now) if self._held else idle_s


def serve(queue: int, delay_ms: float) -> None:
    from netfilterqueue import NetfilterQueue

    line: DelayLine = DelayLine(delay_ms / 1000)
    nfqueue = NetfilterQueue()
    # Only the verdict matters: copy no more of each packet than its first bytes.
    nfqueue.bind(queue, lambda packet: line.push(packet, time.monotonic()), max_len=65536, range=64)
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    fd = nfqueue.get_fd()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    try:
        while not stopping:
            try:
                readable, _, _ = select.select([fd], [], [], line.wait_s(time.monotonic(), idle_s=0.5))
            except InterruptedError:
                continue
            if readable:
                nfqueue.run(block=False)
            for packet in line.pop_due(time.monotonic()):
                packet.accept()
    finally:
        for packet in line.pop_due(float("inf")):
            packet.accept()
        nfqueue.unbind()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queue", type=int, required=True, help="netfilter queue number in this namespace")
    parser.add_argument("--delay-ms", type=float, required=True, help="how long each packet is held")
    args = parser.parse_args(argv)
    if args.delay_ms < 0:
        parser.error(f"--delay-ms {args.delay_ms}: must be 0 or more")
    serve(args.queue, args.delay_ms)


if __name__ == "__main__":
    main()
