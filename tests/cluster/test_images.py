"""Images cannot be built here (no Docker engine): lint them, and check every command they and the
manifests run parses against the real `cascadia` command line."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from cascadia.cli import app
from cascadia.operator.planning import fleet_plan
from cascadia.operator.render import Fleet, render
from cascadia.operator.spec import parse_spec
from tests.kube_env import find_binaries

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "images").glob("*.Dockerfile"))


def parse_cascadia(args: list[str]) -> None:
    """Parse (not run) `cascadia ARGS` the way the installed entry point would; UsageError if it is wrong."""
    group = typer.main.get_command(app)
    command = group.get_command(group.make_context("cascadia", [args[0]]), args[0])
    assert command is not None, f"no subcommand '{args[0]}'"
    command.make_context(args[0], list(args[1:]))


def instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    return [(m.group(1).upper(), m.group(2)) for m in re.finditer(r"^(\w+)\s+(.*)$", text, re.MULTILINE)]


def test_there_is_an_image_per_role_that_exists():
    assert {p.name.split(".")[0] for p in DOCKERFILES} >= {"shard", "router", "draft", "gateway", "operator"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_multi_stage_pinned_non_root_and_runs_a_real_subcommand(dockerfile):
    steps = instructions(dockerfile)
    bases = [arg.split()[0] for op, arg in steps if op == "FROM"]
    assert len(bases) >= 2, "multi-stage: build and runtime"
    for base in bases:
        assert re.match(r"^[\w./-]+:\d[\w.-]*$", base), f"{base} is not pinned to a version"
    user = [arg for op, arg in steps if op == "USER"][-1]
    assert user.split(":")[0] not in ("0", "root")
    entry = json.loads(next(arg for op, arg in steps if op == "ENTRYPOINT"))
    cmd = json.loads(next(arg for op, arg in steps if op == "CMD"))
    assert entry == ["cascadia"]
    assert cmd == [dockerfile.name.split(".")[0], "--help"]
    shown = CliRunner().invoke(app, cmd)
    assert shown.exit_code == 0 and "Usage" in shown.output


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint is installed by the test extras")
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile):
    result = subprocess.run(["hadolint", str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_each_image_installs_its_role_extra_from_a_wheel_that_carries_the_grpc_modules(dockerfile):
    """setup.py generates the gRPC modules when the wheel is built, so the build stage must have it; the
    runtime installs only the role's extra (tests/services/test_role_dependencies.py installs each one alone)."""
    steps = instructions(dockerfile)
    role = dockerfile.name.split(".")[0]
    copied = " ".join(arg for op, arg in steps if op == "COPY")
    assert "setup.py" in copied and "protos" in copied
    runs = [arg for op, arg in steps if op == "RUN"]
    assert any("pip wheel" in run and "--no-deps" in run for run in runs)
    assert any(f'"cascadia[{role}]==' in run for run in runs), f"{role} image does not install cascadia[{role}]"


def test_every_command_the_operator_renders_parses():
    docs = yaml.safe_load_all((ROOT / "examples/inklingfleet.yaml").read_text())
    spec = parse_spec(next(d for d in docs if d["kind"] == "InklingFleet")["spec"])
    plan = fleet_plan(spec, list(spec.node_names), None)
    commands = []
    for child in render(Fleet("inkling", "serving", "uid", spec), plan):
        pod = child.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []):
            if container["image"].startswith("ghcr.io/cascadia/"):
                commands.append(container["args"])
                probe = container.get("readinessProbe", {}).get("exec")
                if probe:
                    commands.append(probe["command"][1:])
    assert {c[0] for c in commands} == {"shard", "router", "draft", "gateway", "probe"}
    for args in commands:
        parse_cascadia(args)


@pytest.mark.skipif(find_binaries() is None, reason="helm comes with .ci/kube-build")
def test_the_chart_runs_a_command_that_parses():
    helm = find_binaries()["helm"]
    rendered = subprocess.run(
        [helm, "template", "t", str(ROOT / "charts/cascadia"), "--set", "operator.watchNamespaces={serving,batch}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    deployment = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:5] == ["operator", "--namespace", "serving", "--namespace", "batch"]
    parse_cascadia(args)


def test_a_wrong_command_does_not_parse():
    with pytest.raises(Exception, match="no-such-flag"):
        parse_cascadia(["shard", "--model", "/m", "--layers", "0:6", "--listen", "x", "--no-such-flag"])
