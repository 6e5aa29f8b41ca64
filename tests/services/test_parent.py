"""A local fleet's processes end with the process that started them, even one killed outright."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from cascadia import parent

STARTER = """
import json, sys, time
from pathlib import Path
from cascadia.router.local import LocalFleet
fleet = LocalFleet(Path(sys.argv[1]), 2)
fleet.start()
print(json.dumps([p.pid for p in fleet.processes]), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_shards_stop_when_the_process_that_started_them_is_killed(tiny):
    starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tiny)], stdout=subprocess.PIPE, text=True)
    shards = [psutil.Process(pid) for pid in json.loads(starter.stdout.readline())]
    try:
        time.sleep(2)  # the shards are past their start-up
        assert all(s.is_running() and s.status() != psutil.STATUS_ZOMBIE for s in shards)
        starter.send_signal(signal.SIGKILL)  # no chance to stop its fleet
        starter.wait(10)
        _, alive = psutil.wait_procs(shards, timeout=30)
        assert alive == []
    finally:
        for shard in shards:
            if shard.is_running():
                shard.kill()


def test_a_child_whose_parent_is_already_gone_exits():
    env = {**os.environ, parent.ENV: str(os.getpid() + 12345)}  # not the child's parent
    done = subprocess.run(
        [sys.executable, "-m", "cascadia.cli", "--help"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert f"parent process {os.getpid() + 12345} is gone" in done.stderr


def test_a_process_not_started_by_a_fleet_is_left_alone(monkeypatch):
    monkeypatch.delenv(parent.ENV, raising=False)
    parent.follow_parent()
    assert parent.child_env({"A": "1"}) == {"A": "1", parent.ENV: str(os.getpid())}
