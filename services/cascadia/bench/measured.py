"""A child process measured as Kubernetes sees it: its anonymous and resident memory sampled while it runs,
optionally inside a memory cgroup with a limit, as a container's memory limit is enforced.

Anonymous memory is what the kernel cannot reclaim without swap: a process over its cgroup's limit in
anonymous memory is killed. File pages (the mapped weights, the page cache of files read and written)
count against the limit too, but the kernel drops them under pressure instead of killing.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")


def smaps(pid: int) -> dict[str, int]:
    """The process's resident set in bytes by kind (smaps_rollup: Rss, Anonymous, ...)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                parts = line.split()
                if len(parts) == 3 and parts[2] == "kB":
                    out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


class MemoryCgroup:
    """A memory cgroup of its own (v1 where mounted, else v2) with `limit` bytes and no swap."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        name = f"cascadia-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.v1 = (CGROUP_V1_MEMORY / "memory.limit_in_bytes").is_file()
        self.path = (CGROUP_V1_MEMORY if self.v1 else CGROUP_V2) / name
        self.path.mkdir()
        if self.v1:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            swap = self.path / "memory.memsw.limit_in_bytes"
            if swap.is_file():
                swap.write_text(str(limit))
        else:
            (self.path / "memory.max").write_text(str(limit))
            if (self.path / "memory.swap.max").is_file():
                (self.path / "memory.swap.max").write_text("0")

    @staticmethod
    def available() -> bool:
        """Whether this process may make memory cgroups (root, a writable memory hierarchy)."""
        if (CGROUP_V1_MEMORY / "memory.limit_in_bytes").is_file():
            return os.access(CGROUP_V1_MEMORY, os.W_OK)
        controllers = CGROUP_V2 / "cgroup.controllers"
        return controllers.is_file() and "memory" in controllers.read_text().split() and os.access(CGROUP_V2, os.W_OK)

    def join_self(self) -> None:
        """Move the calling process in (run in the child between fork and exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def stats(self) -> dict[str, int]:
        if self.v1:
            oom = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
            return {
                "max_usage_bytes": int((self.path / "memory.max_usage_in_bytes").read_text()),
                "failcnt": int((self.path / "memory.failcnt").read_text()),
                "oom_kills": int(oom.get("oom_kill", 0)),
            }
        events = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
        peak = self.path / "memory.peak"
        return {
            "max_usage_bytes": int(peak.read_text()) if peak.is_file() else -1,
            "failcnt": int(events.get("max", 0)),
            "oom_kills": int(events.get("oom_kill", 0)),
        }

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)  # the last task is still leaving


@dataclass
class Measured:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    peak_anon_bytes: int = 0
    peak_rss_bytes: int = 0
    cgroup: dict[str, int] = field(default_factory=dict)

    @property
    def killed_by_oom(self) -> bool:
        return self.cgroup.get("oom_kills", 0) > 0


def run_measured(argv: list[str], limit: int | None = None, timeout: float = 3600, sample_s: float = 0.1) -> Measured:
    """Run `argv`, sampling its memory until it exits; inside a fresh memory cgroup of `limit` bytes if given.

    Reading smaps_rollup walks every mapping of the process: at a stage's tens of gigabytes of mappings a
    sample costs milliseconds, so they are a tenth of a second apart."""
    group = MemoryCgroup(limit) if limit is not None else None
    peak = {"anon": 0, "rss": 0}
    began = time.monotonic()
    try:
        process = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=group.join_self if group is not None else None,
        )
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                now = smaps(process.pid)
                peak["anon"] = max(peak["anon"], now.get("Anonymous", 0))
                peak["rss"] = max(peak["rss"], now.get("Rss", 0))
                done.wait(sample_s)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        finally:
            done.set()
            sampler.join()
        stats = group.stats() if group is not None else {}
    finally:
        if group is not None:
            group.remove()
    return Measured(process.returncode, stdout, stderr, time.monotonic() - began, peak["anon"], peak["rss"], stats)
