"""Each role's image installs the package with that role's extra (pyproject.toml). Here each extra is
installed alone into a fresh virtual environment, from the wheel the images build: the role's modules
import and its command starts there, the light roles carry no OpenVINO, and only the operator carries
kopf."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

# what each role's command imports on its way to serving, and the command
ROLES = {
    "shard": (["cascadia.shard.service", "cascadia.shard.capture", "cascadia.engine.mtp", "cascadia.grammar",
               "cascadia.model.checkpoint", "cascadia.model.loader"], "shard"),
    "router": (["cascadia.router.service", "cascadia.router.pipeline", "cascadia.planner"], "router"),
    "gateway": (["cascadia.gateway.server", "cascadia.model.loader"], "gateway"),
    "draft": (["cascadia.draft.service", "cascadia.draft.model", "cascadia.draft.shared", "cascadia.gateway.text"],
              "draft"),
    "operator": (["cascadia.operator.handlers", "cascadia.operator.crd", "grpc_health.v1.health_pb2"], "operator"),
}  # fmt: skip


def _declared(extra: str) -> set[str]:
    """The distributions the package with `extra` asks for by name (its own extras followed)."""
    names: set[str] = set()
    pending = [*PROJECT["dependencies"], *PROJECT["optional-dependencies"][extra]]
    while pending:
        req = Requirement(pending.pop())
        if canonicalize_name(req.name) == "cascadia":
            for nested in req.extras:
                pending.extend(PROJECT["optional-dependencies"][nested])
        else:
            names.add(canonicalize_name(req.name))
    return names


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    return next(out.glob("cascadia-*.whl"))


def _venv_with(wheel: Path, extra: str, where: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=300)
    python = where / "bin" / "python"
    install = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", f"{wheel}[{extra}]"]
    done = subprocess.run(install, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return python


@pytest.mark.parametrize("role", sorted(ROLES))
def test_a_role_runs_from_its_extra_alone(role, wheel, tmp_path):
    modules, command = ROLES[role]
    python = _venv_with(wheel, role, tmp_path / "venv")
    probe = (
        "import importlib, importlib.metadata as md, json\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(d.metadata['Name'].lower() for d in md.distributions())))"
    )
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    installed = set(json.loads(done.stdout))
    assert ("openvino" in installed) == (role in ("shard", "draft"))
    assert ("kopf" in installed) == (role == "operator")
    cli = [str(python.parent / "cascadia"), command, "--help"]
    helped = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0 and "Usage" in helped.stdout, helped.stderr[-3000:]


def test_what_the_extras_declare_keeps_the_model_out_of_the_light_roles():
    for role in ("router", "gateway", "operator"):
        assert "openvino" not in _declared(role), role
    for role in ("shard", "router", "gateway", "draft"):
        assert "kopf" not in _declared(role), role
    assert "openvino" in _declared("shard") and "kopf" in _declared("operator")
