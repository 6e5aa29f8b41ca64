"""Processes a local fleet starts end with the process that started them, even when it is killed.

A fleet's parent stops its children on the way out, but a parent killed outright (SIGKILL, the OOM
killer) leaves shards holding gigabytes and ports. The parent names itself in the child's
environment; the child asks Linux for SIGTERM when that parent dies, and stops like on Ctrl-C.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

ENV = "CASCADIA_PARENT_PID"
PR_SET_PDEATHSIG = 1


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that must not outlive this process."""
    return {**(os.environ if env is None else env), ENV: str(os.getpid())}


def follow_parent() -> None:
    """In a child started with `child_env()`: SIGTERM when the parent dies; exit at once if it already has.

    Linux sends the signal when the thread that started the child exits, so fleets are started from
    the main thread.
    """
    expected = os.environ.pop(ENV, None)  # grandchildren name their own parent
    if expected is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        return
    if os.getppid() != int(expected):  # the parent died before the request above
        raise SystemExit(f"parent process {expected} is gone")
