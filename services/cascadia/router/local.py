"""A local fleet: every shard as its own process on loopback, placed by the planner."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cascadia.model.loader import load_shape
from cascadia.parent import child_env
from cascadia.planner import GIB, PlanRequest, plan_fleet
from cascadia.role_args import DraftArgs, RouterArgs, ShardArgs
from cascadia.router.netem import EmulatedNetwork
from cascadia.router.scheduler import SchedulerConfig

# one frame on the chain, up to 64 rows, prompts in windows of 16, and drafts only while the streams
# and their drafts fill no more than 16 rows (see `LocalFleet.scheduler_config`)
ONE_MACHINE_SCHEDULE = {"frames_in_flight": 1, "rows_per_group": 64, "prefill_window": 16, "draft_rows": 16}


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nothing listens on now, never one this process handed out before.

    The port is free only until its process binds it, seconds later; meanwhile the kernel may offer the
    same port again, and two roles given it would collide.
    """
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def reserve_port(port: int) -> None:
    """Keep `free_port` from handing out a port chosen elsewhere (a command-line option)."""
    _handed_out.add(port)


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
    router: subprocess.Popen | None = None
    network: EmulatedNetwork | None = None  # shards in their own namespaces behind shaped links
    context: int | None = None  # global-layer positions per stream on every shard (None: the default)
    helpers: list[subprocess.Popen] = field(default_factory=list)  # Redis and the draft service
    kv_precision: str = "f32"
    mtp_depths: int = 0  # the last shard serves this many depths of the model's MTP head
    threads: int = 0  # inference threads per shard (0: the plugin's default)

    @property
    def stage_addrs(self) -> list[str]:
        if self.network is not None:
            return [f"{h.address}:{p}" for h, p in zip(self.network.plan.hosts, self.ports, strict=False)]
        return [f"127.0.0.1:{p}" for p in self.ports]

    def scheduler_config(self, **overrides: Any) -> SchedulerConfig:
        """The router's settings for this chain (`SchedulerConfig` fields in `overrides` win).

        Shards on loopback share this machine's cores, so running every stage at once only splits the
        batch and makes the stages' threads contend: one frame on the chain at a time, carrying every
        ready row (docs/bench/history/benchmarks-log.md, `cascadia bench peer`: the 3-shard fleet at 8 streams went from
        0.34x GenAI to 0.70-0.78x). A lone stream may verify up to 15 drafted tokens: such a frame has no
        other rows to delay, and a long copy gains more from 16-token rounds than the extra rows cost
        (`cascadia bench spec`). Shards behind emulated links stand for separate machines and keep the
        fleet's defaults.
        """
        local = {} if self.network is not None else ONE_MACHINE_SCHEDULE
        return SchedulerConfig(**{"stages": self.shards, **local, **overrides})

    def schedule_options(self) -> dict[str, int]:
        """The `RouterArgs` fields that give `scheduler_config()`."""
        config = self.scheduler_config()
        return {
            "rows_per_group": config.rows_per_group,
            "prefill_window": config.prefill_window,
            "frames_in_flight": config.frames_in_flight,
            "draft_rows": config.draft_rows,
        }

    def router_args(self, port: int, **extra: object) -> RouterArgs:
        """`cascadia router` over this fleet's stages (once started), its API on 127.0.0.1:port, scheduled
        as `schedule_options` says (`extra`: more `RouterArgs` fields, such as a draft service)."""
        fields = {**self.schedule_options(), **extra}
        return RouterArgs(f"127.0.0.1:{port}", tuple(self.stage_addrs), self.reply_addr, **fields)  # type: ignore[arg-type]

    @property
    def reply_addr(self) -> str:
        host = self.network.plan.gateway_address if self.network is not None else "127.0.0.1"
        return f"{host}:{self.reply_port}"

    def start(self, log_dir: Path | None = None) -> None:
        self._ranges = local_ranges(self.model, self.shards)
        self._log_dir = log_dir
        self.ports = [free_port() for _ in self._ranges]
        self.processes = [self._spawn(i) for i in range(len(self._ranges))]

    def _spawn(self, i: int) -> subprocess.Popen:
        start, end = self._ranges[i]
        last = i + 1 == len(self._ranges)
        args = ShardArgs(
            str(self.model),
            (start, end),
            self.stage_addrs[i],
            i,
            self.precision,
            context=self.context,
            next=None if last else self.stage_addrs[i + 1],
            reply_to=self.reply_addr if last else None,
            kv_precision=self.kv_precision if self.kv_precision != "f32" else None,
            mtp_depths=self.mtp_depths if last and self.mtp_depths else None,
            threads=self.threads or None,
        )
        cmd = self.network.prefix(i) if self.network is not None else []
        cmd += [sys.executable, "-m", "cascadia.cli", *args.to_argv()]
        out = open(self._log_dir / f"shard-{i}.log", "a") if self._log_dir else subprocess.DEVNULL  # noqa: SIM115
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env())

    def start_router(self, port: int, log: Path | None = None, **extra: object) -> subprocess.Popen:
        """`cascadia router` as `router_args` gives it."""
        cmd = [sys.executable, "-m", "cascadia.cli", *self.router_args(port, **extra).to_argv()]
        out = open(log, "w") if log else None  # noqa: SIM115 (the process outlives this call)
        self.router = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=child_env())
        return self.router

    def start_draft(self, log_dir: Path | None = None, draft_model: str | None = None) -> str:
        """`cascadia draft` beside the fleet, over a Redis of its own when redis-server exists; its address."""
        redis_url = None
        binary = shutil.which("redis-server")
        if binary is not None:
            port = free_port()
            cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            cmd += ["--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"]
            self.helpers.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            redis_url = f"redis://127.0.0.1:{port}/0"
        address = f"127.0.0.1:{free_port()}"
        args = DraftArgs(address, redis_url, model=draft_model, target=str(self.model) if draft_model else None)
        cmd = [sys.executable, "-m", "cascadia.cli", *args.to_argv()]
        out = open(log_dir / "draft.log", "w") if log_dir else None  # noqa: SIM115 (the process outlives this call)
        draft = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, env=child_env())
        self.helpers.append(draft)
        return address

    def restart(self, stage: int) -> None:
        """Start a stage again on its old address (after it died or was killed)."""
        if self.processes[stage].poll() is None:
            raise RuntimeError(f"stage {stage} is still running")
        self.processes[stage] = self._spawn(stage)

    def dead(self) -> list[tuple[int, int]]:
        """(stage, exit code) of every shard process that has exited."""
        return [(i, p.returncode) for i, p in enumerate(self.processes) if p.poll() is not None]

    def kill(self, stage: int) -> None:
        self.processes[stage].send_signal(signal.SIGKILL)
        self.processes[stage].wait()

    def stop(self, timeout: float = 10.0) -> None:
        everything = [*self.processes, *([self.router] if self.router else []), *self.helpers]
        for p in everything:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in everything:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
