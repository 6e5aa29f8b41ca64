"""A local fleet: every shard as its own process on loopback, placed by the planner."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from cascadia.model.config import load_shape
from cascadia.planner import GIB, PlanRequest, plan_fleet


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_ranges(model: Path, shards: int) -> list[tuple[int, int]]:
    shape = load_shape(model)
    if not 1 <= shards <= shape.num_layers:
        raise ValueError(f"--shards {shards}: the model has {shape.num_layers} layers (1 to {shape.num_layers} shards)")
    # one machine shares its memory among the shards: plan on an ample budget, balanced by bytes
    request = PlanRequest(tuple(f"shard-{i}" for i in range(shards)), 1024 * GIB, "f32", "f32", "f32", streams=1)
    plan = plan_fleet(shape, request)
    ranges = plan.ranges
    if len(ranges) != shards:
        raise ValueError(f"--shards {shards}: could only place {len(ranges)} shards")
    return ranges


@dataclass
class LocalFleet:
    model: Path
    shards: int
    precision: str = "f32"
    reply_port: int = field(default_factory=free_port)
    ports: list[int] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def stage_addrs(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    @property
    def reply_addr(self) -> str:
        return f"127.0.0.1:{self.reply_port}"

    def start(self, log_dir: Path | None = None) -> None:
        ranges = local_ranges(self.model, self.shards)
        self.ports = [free_port() for _ in ranges]
        for i, (start, end) in enumerate(ranges):
            hop = ["--next", self.stage_addrs[i + 1]] if i + 1 < len(ranges) else ["--reply-to", self.reply_addr]
            cmd = [
                sys.executable,
                "-m",
                "cascadia.cli",
                "shard",
                "--model",
                str(self.model),
                "--layers",
                f"{start}:{end}",
                "--listen",
                self.stage_addrs[i],
                "--stage",
                str(i),
                "--precision",
                self.precision,
                *hop,
            ]
            out = open(log_dir / f"shard-{i}.log", "w") if log_dir else subprocess.DEVNULL  # noqa: SIM115
            self.processes.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))

    def dead(self) -> list[tuple[int, int]]:
        """(stage, exit code) of every shard process that has exited."""
        return [(i, p.returncode) for i, p in enumerate(self.processes) if p.poll() is not None]

    def kill(self, stage: int) -> None:
        self.processes[stage].send_signal(signal.SIGKILL)
        self.processes[stage].wait()

    def stop(self, timeout: float = 10.0) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.processes:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
