"""The operator against a real API server, installed by the real helm, running as its service account."""

from __future__ import annotations

import copy
import itertools
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tests.kube_env import OPERATOR_NAMESPACE, KubeEnv, find_binaries

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts/cascadia"
EXAMPLE = ROOT / "examples/inklingfleet.yaml"
NODES = [f"pc-{i:02d}" for i in range(1, 12)]
GROUP, VERSION, PLURAL = "cascadia.dev", "v1alpha1", "inklingfleets"


@pytest.fixture(scope="module")
def kube(tmp_path_factory) -> Iterator[KubeEnv]:
    bins = find_binaries()
    if bins is None:
        if os.environ.get("CI"):
            pytest.fail("the Kubernetes test binaries are missing: run .ci/kube-build")
        pytest.skip("no kube-apiserver here: run .ci/kube-build")
    env = KubeEnv(tmp_path_factory.mktemp("kube"), bins)
    try:
        env.start()
        yield env
    finally:
        env.stop()


@pytest.fixture(scope="module")
def api(kube) -> client.ApiClient:
    return config.new_client_from_config(str(kube.admin_config))


@pytest.fixture(scope="module")
def installed(kube) -> None:
    kube.run("helm", "install", "cascadia", str(CHART), "--namespace", OPERATOR_NAMESPACE, "--create-namespace")


@pytest.fixture(scope="module")
def operator(kube, installed) -> Iterator[None]:
    """The operator in this process (kopf's KopfRunner), with the chart's service account identity."""
    from kopf.testing import KopfRunner

    saved = {k: os.environ.get(k) for k in ("KUBECONFIG", "CASCADIA_OPERATOR_INTERVAL")}
    os.environ["KUBECONFIG"] = str(kube.operator_config)
    os.environ["CASCADIA_OPERATOR_INTERVAL"] = "1"
    args = ["run", "--standalone", "--all-namespaces", "--verbose", "-m", "cascadia.operator.handlers"]
    try:
        with KopfRunner(args, timeout=60) as runner:
            time.sleep(2)
            yield
        assert runner.exception is None or isinstance(runner.exception, SystemExit), runner.output[-3000:]
        denied = [line for line in runner.output.splitlines() if "Forbidden" in line or '" 403 ' in line]
        assert not denied, "\n".join(denied[:10])
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def nodes(api, installed) -> list[str]:
    core = client.CoreV1Api(api)
    for name in [*NODES, "spare-1", "spare-2"]:
        labels = {"kubernetes.io/hostname": name, "cascadia.dev/pool": "spare" if name.startswith("spare") else "pc"}
        core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name, labels=labels)))
    return NODES


def wait_for(check: Callable[[], Any], timeout: float = 45, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except ApiException as exc:
            if exc.status != 404:
                raise
            last = None
        if last:
            return last
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}; last seen: {last!r}")


def fleet(api, namespace: str, name: str) -> dict:
    return client.CustomObjectsApi(api).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def condition(body: dict, kind: str) -> dict | None:
    return next((c for c in (body.get("status") or {}).get("conditions", []) if c["type"] == kind), None)


def has_condition(api, namespace: str, name: str, kind: str, status: str, reason: str | None = None):
    def check():
        body = fleet(api, namespace, name)
        found = condition(body, kind)
        if found and found["status"] == status and (reason is None or found["reason"] == reason):
            return body
        return None

    return check


def create_namespace(api, name: str) -> None:
    try:
        client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    except ApiException as exc:
        if exc.status != 409:
            raise


def apply_fleet(
    kube, namespace: str, name: str, spec: dict, check: bool = True, *options: str
) -> subprocess.CompletedProcess:
    doc = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InklingFleet",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }
    return kube.run("kubectl", "apply", *options, "-f", "-", stdin=yaml.safe_dump(doc), check=check)


def example_spec() -> dict:
    docs = list(yaml.safe_load_all(EXAMPLE.read_text()))
    return copy.deepcopy(next(d for d in docs if d["kind"] == "InklingFleet")["spec"])


def statefulsets(api, namespace: str, fleet_name: str) -> dict[str, Any]:
    items = (
        client.AppsV1Api(api)
        .list_namespaced_stateful_set(
            namespace, label_selector=f"cascadia.dev/fleet={fleet_name},app.kubernetes.io/component=shard"
        )
        .items
    )
    return {s.metadata.name: s for s in items}


def make_pods_ready(api, namespace: str, fleet_name: str, skip: set[str] = frozenset()) -> int:
    """Play the kubelet: mark the fleet's pods running and ready."""
    core = client.CoreV1Api(api)
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    count = 0
    for pod in core.list_namespaced_pod(namespace, label_selector=f"cascadia.dev/fleet={fleet_name}").items:
        if pod.metadata.name in skip:
            continue
        status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}]}
        core.patch_namespaced_pod_status(pod.metadata.name, namespace, {"status": status})
        count += 1
    return count


def test_chart_lints_strictly_and_renders_valid_manifests(kube):
    kube.run("helm", "lint", "--strict", str(CHART), "--set", "exampleFleet.enabled=true")
    rendered = kube.run("helm", "template", "cascadia", str(CHART), "--namespace", OPERATOR_NAMESPACE).stdout
    validate = subprocess.run(
        ["kubernetes-validate", "-k", "1.33.0", "--strict", "-"], input=rendered, capture_output=True, text=True
    )
    assert validate.returncode == 0, validate.stdout + validate.stderr
    # the server checks every object (the example fleet needs the CRD first, so it is left out here)
    dry = kube.run("helm", "install", "dry", str(CHART), "--namespace", "default", "--dry-run=server")
    assert "ClusterRole" in dry.stdout


def test_eleven_node_example_yields_eleven_pinned_statefulsets_and_a_plan(kube, api, operator, nodes):
    kube.run("kubectl", "apply", "-f", str(EXAMPLE))
    sets = wait_for(
        lambda: (s := statefulsets(api, "serving", "inkling")) and len(s) == 11 and s, what="11 shard StatefulSets"
    )
    seen_nodes = set()
    for i in range(11):
        sts = sets[f"inkling-shard-{i}"]
        pod = sts.spec.template.spec
        term = pod.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms[0]
        node = term.match_expressions[0].values[0]
        seen_nodes.add(node)
        container = pod.containers[0]
        assert container.args[container.args.index("--layers") + 1] == f"{6 * i}:{6 * i + 6}"
        assert container.resources.limits["gpu.intel.com/xe"] == "1"
        assert sts.spec.replicas == 1
    assert seen_nodes == set(NODES)
    body = wait_for(
        lambda: (b := fleet(api, "serving", "inkling")).get("status", {}).get("plan") and b, what="status.plan"
    )
    assert body["status"]["plan"][0] | {"memoryBytes": 0} == {
        "node": "pc-01",
        "startLayer": 0,
        "endLayer": 6,
        "memoryBytes": 0,
    }
    assert [(p["node"], p["startLayer"], p["endLayer"]) for p in body["status"]["plan"]] == [
        (n, 6 * i, 6 * i + 6) for i, n in enumerate(NODES)
    ]
    assert body["status"]["totalShards"] == 11
    # the example drafts: a draft Deployment beside the router, which is told where it is
    apps = client.AppsV1Api(api)
    draft = wait_for(
        lambda: next(
            (d for d in apps.list_namespaced_deployment("serving").items if d.metadata.name == "inkling-draft"), None
        ),
        what="the draft Deployment",
    )
    assert draft.spec.template.spec.containers[0].args[0] == "draft"
    router = apps.read_namespaced_deployment("inkling-router", "serving").spec.template.spec.containers[0].args
    assert router[router.index("--draft") + 1] == "inkling-draft.serving.svc:7100"
    assert condition(body, "Planned")["status"] == "True"
    assert condition(body, "Ready")["status"] == "False"
    for kind, name in (
        ("deployment", "inkling-router"),
        ("deployment", "inkling-gateway"),
        ("configmap", "inkling-plan"),
        ("service", "inkling-shard-0"),
        ("statefulset", "inkling-redis"),
    ):
        kube.run("kubectl", "get", "-n", "serving", kind, name)
    printed = kube.run("kubectl", "get", "ifleet", "-n", "serving").stdout
    assert "READY" in printed and "SHARDS" in printed and "AGE" in printed


def test_ready_pods_drive_the_fleet_to_ready_and_status_is_not_rewritten(kube, api, operator, nodes):
    wait_for(lambda: len(client.CoreV1Api(api).list_namespaced_pod(
        "serving", label_selector="cascadia.dev/fleet=inkling").items) >= 13, what="pods created")  # fmt: skip
    ready = has_condition(api, "serving", "inkling", "Ready", "True")

    def marked_and_ready():
        make_pods_ready(api, "serving", "inkling")  # pods the controllers create later are ready too
        return ready()

    body = wait_for(marked_and_ready, what="Ready=True")
    assert body["status"]["readyShards"] == 11
    assert condition(body, "Degraded")["status"] == "False"
    version = body["metadata"]["resourceVersion"]
    time.sleep(3)  # three timer reconciles with nothing new to say
    assert fleet(api, "serving", "inkling")["metadata"]["resourceVersion"] == version


def test_a_node_that_disappears_marks_the_fleet_degraded_naming_it(kube, api, operator, nodes):
    client.CoreV1Api(api).delete_node("pc-05")
    body = wait_for(has_condition(api, "serving", "inkling", "Degraded", "True", "NodeMissing"), what="Degraded")
    assert "pc-05 (stage 4)" in condition(body, "Degraded")["message"]
    labels = {"kubernetes.io/hostname": "pc-05", "cascadia.dev/pool": "pc"}
    client.CoreV1Api(api).create_node(client.V1Node(metadata=client.V1ObjectMeta(name="pc-05", labels=labels)))
    wait_for(has_condition(api, "serving", "inkling", "Degraded", "False"), what="Degraded cleared")


def test_a_shard_that_stays_unready_marks_the_fleet_degraded(kube, api, operator, nodes):
    create_namespace(api, "unready")
    spec = {
        "model": {"preset": "inkling-975b", "path": "/models/inkling"},
        "nodes": {"selector": {"matchLabels": {"cascadia.dev/pool": "pc"}}, "memory": "61Gi"},
        "layersPerNode": 6,
        "serving": {"shardUnreadyGraceSeconds": 2},
    }
    apply_fleet(kube, "unready", "slow", spec)
    wait_for(lambda: len(client.CoreV1Api(api).list_namespaced_pod(
        "unready", label_selector="cascadia.dev/fleet=slow").items) >= 13, what="pods created")  # fmt: skip
    unready = has_condition(api, "unready", "slow", "Degraded", "True", "ShardUnready")

    def marked_and_degraded():
        make_pods_ready(api, "unready", "slow", skip={"slow-shard-3-0"})
        return unready()

    body = wait_for(marked_and_degraded, what="ShardUnready")
    assert "slow-shard-3 on pc-04" in condition(body, "Degraded")["message"]
    assert body["status"]["readyShards"] == 10


def test_an_invalid_spec_is_rejected_by_kubectl_naming_the_field(kube, api, installed):
    create_namespace(api, "invalid")
    bad = [
        (lambda s: s.update(layersPerNode=0), "spec.layersPerNode"),
        (lambda s: s["nodes"].update(names=[]), "spec.nodes.names"),
        (lambda s: s["nodes"].update(memory="sixty-four gigs"), "spec.nodes.memory"),
        (lambda s: s["precision"].update(experts="int3"), "spec.precision.experts"),
        (lambda s: s.update(cpuAmx="sometimes"), "spec.cpuAmx"),
        (lambda s: s["serving"].update(keepFinished=-1), "spec.serving.keepFinished"),
        (lambda s: s.pop("nodes"), "spec.nodes"),
    ]
    for change, field in bad:
        spec = example_spec()
        change(spec)
        # the API server's own check of the CRD schema (kubectl's client-side pass words it differently)
        result = apply_fleet(kube, "invalid", "bad", spec, False, "--validate=false")
        assert result.returncode != 0, f"{field} accepted"
        assert field in result.stderr, result.stderr
        client_side = apply_fleet(kube, "invalid", "bad", spec, False)
        assert client_side.returncode != 0 and field.rsplit(".", 1)[-1] in client_side.stderr


def test_a_spec_the_schema_allows_but_the_operator_refuses_gets_a_condition_naming_the_field(
    kube, api, operator, nodes
):
    create_namespace(api, "refused")
    spec = example_spec()
    spec["model"]["configMap"] = "also-a-config"
    apply_fleet(kube, "refused", "both", spec)
    body = wait_for(has_condition(api, "refused", "both", "Planned", "False", "InvalidSpec"), what="InvalidSpec")
    assert condition(body, "Planned")["message"].startswith("spec.model:")
    assert not statefulsets(api, "refused", "both")


def test_a_fleet_that_cannot_fit_gets_a_false_condition_with_the_reason(kube, api, operator, nodes):
    create_namespace(api, "small")
    spec = example_spec()
    spec["nodes"]["memory"] = "16Gi"
    apply_fleet(kube, "small", "tiny-pcs", spec)
    body = wait_for(has_condition(api, "small", "tiny-pcs", "Planned", "False", "DoesNotFit"), what="DoesNotFit")
    assert "GiB" in condition(body, "Planned")["message"]
    assert not statefulsets(api, "small", "tiny-pcs")


def test_a_spec_change_replans_and_prunes_shards_no_longer_in_the_plan(kube, api, operator, nodes):
    create_namespace(api, "replan")
    spec = example_spec()
    apply_fleet(kube, "replan", "moving", spec)
    wait_for(lambda: len(statefulsets(api, "replan", "moving")) == 11, what="11 shards")
    spec["nodes"]["names"] = NODES[:10]
    spec["nodes"]["memory"] = "96Gi"  # 66 layers on 10 nodes: some hold 7
    spec.pop("layersPerNode")
    apply_fleet(kube, "replan", "moving", spec)

    def replanned():
        sets = statefulsets(api, "replan", "moving")
        body = fleet(api, "replan", "moving")
        return len(sets) == 10 and len(body["status"].get("plan", [])) == 10 and (sets, body)

    sets, body = wait_for(replanned, what="10 shards")
    ranges = [(p["startLayer"], p["endLayer"]) for p in body["status"]["plan"]]
    assert ranges[0][0] == 0 and ranges[-1][1] == 66
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    args = sets["moving-shard-9"].spec.template.spec.containers[0].args
    assert args[args.index("--layers") + 1] == f"{ranges[9][0]}:{ranges[9][1]}"
    assert "--reply-to" in args
    assert body["status"]["observedGeneration"] == body["metadata"]["generation"]


def test_deleting_the_fleet_garbage_collects_its_children(kube, api, operator, nodes):
    create_namespace(api, "doomed")
    apply_fleet(kube, "doomed", "short-lived", example_spec())
    wait_for(lambda: len(statefulsets(api, "doomed", "short-lived")) == 11, what="11 shards")
    kube.run("kubectl", "delete", "ifleet", "-n", "doomed", "short-lived", "--wait=true")
    apps = client.AppsV1Api(api)
    wait_for(
        lambda: (
            not statefulsets(api, "doomed", "short-lived")
            and not apps.list_namespaced_deployment("doomed").items
            and not client.CoreV1Api(api).list_namespaced_service("doomed").items
        ),
        what="children collected",
    )
