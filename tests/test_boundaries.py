"""Service boundaries that hold at run time: the roles that serve no model load no engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

LIGHT_ROLES = ["cascadia.router.service", "cascadia.gateway.server", "cascadia.draft.service"]
ENGINE_MODULES = ("openvino", "cascadia.engine.engine", "cascadia.shard.service")


@pytest.mark.parametrize("module", LIGHT_ROLES)
def test_a_role_that_serves_no_model_loads_no_engine(module):
    probe = f"import sys, json, {module}; print(json.dumps([m for m in {ENGINE_MODULES!r} if m in sys.modules]))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout) == []


def test_the_shard_does_load_the_engine():
    """The probe above can fail: the shard's entry module brings OpenVINO in."""
    probe = "import sys, cascadia.shard.service; print('openvino' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "True"
