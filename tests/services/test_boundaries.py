"""Service boundaries: the import contract in pyproject.toml (checked by import-linter), and at run time
the roles that serve no model load no engine."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIGHT_ROLES = [
    "cascadia.router.service",
    "cascadia.gateway.server",
    "cascadia.draft.service",
    "cascadia.operator.handlers",
]


def _loaded(module: str, prefixes: tuple[str, ...]) -> list[str]:
    """The modules starting with any of `prefixes` that importing `module` in a fresh interpreter loads."""
    probe = (
        f"import sys, json, {module}; print(json.dumps(sorted(m for m in sys.modules if m.startswith({prefixes!r}))))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout)


@pytest.mark.parametrize("module", LIGHT_ROLES)
def test_a_role_that_serves_no_model_loads_no_engine(module):
    assert _loaded(module, ("openvino", "cascadia.engine", "cascadia.shard")) == []


def test_the_shard_does_load_the_engine():
    """The probe above can fail: the shard's entry module brings OpenVINO in."""
    assert "openvino" in _loaded("cascadia.shard.service", ("openvino",))


def _lint_imports(package_parent: Path, config: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(package_parent), "PATH": str(Path(sys.executable).parent)}
    return subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), str(config), "--no-cache"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=package_parent,
    )


def test_the_import_contract_holds_and_catches_a_role_importing_another(tmp_path):
    """The contract passes on the tree, and fails, naming the import, on a copy where the router reaches
    into the shard."""
    config = ROOT / "pyproject.toml"
    assert "importlinter" in tomllib.loads(config.read_text())["tool"]
    copy = tmp_path / "cascadia"
    shutil.copytree(ROOT / "services" / "cascadia", copy, ignore=shutil.ignore_patterns("__pycache__"))
    kept = _lint_imports(tmp_path, config)
    assert kept.returncode == 0, kept.stdout[-3000:]
    with (copy / "router" / "scheduler.py").open("a") as f:
        f.write("\nfrom cascadia.shard import service as _reaching_in  # noqa\n")
    broken = _lint_imports(tmp_path, config)
    assert broken.returncode != 0
    assert "cascadia.router.scheduler -> cascadia.shard.service" in broken.stdout
