"""The operator's pure parts: spec checks, the plan, rendered children, status conditions, the CRD's copies."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from cascadia.operator.crd import crd
from cascadia.operator.planning import fleet_plan, select_nodes
from cascadia.operator.render import Fleet, render
from cascadia.operator.spec import SpecError, parse_spec, with_defaults
from cascadia.operator.status import Observed, ShardState, degraded, merge_conditions, serving_conditions
from cascadia.planner import PlanError

ROOT = Path(__file__).resolve().parents[2]
NODES = [f"pc-{i:02d}" for i in range(1, 12)]


def example_spec() -> dict:
    docs = list(yaml.safe_load_all((ROOT / "examples/inklingfleet.yaml").read_text()))
    return next(d for d in docs if d["kind"] == "InklingFleet")["spec"]


def rendered(spec: dict | None = None):
    parsed = parse_spec(spec or example_spec())
    plan = fleet_plan(parsed, list(parsed.node_names), None)
    return plan, render(Fleet("inkling", "serving", "uid-1", parsed), plan)


def test_the_chart_ships_the_crd_generated_from_its_source():
    shipped = yaml.safe_load((ROOT / "charts/cascadia/crds/inklingfleets.cascadia.dev.yaml").read_text())
    assert shipped == crd()


def test_defaults_come_from_the_schema():
    spec = {"model": {"preset": "inkling-975b", "path": "/m"}, "nodes": {"names": ["a"], "memory": "8Gi"}}
    spec = with_defaults(spec)
    assert spec["serving"]["rowsPerGroup"] == 8
    assert spec["precision"] == {"experts": "int4", "attention": "int8", "head": "int8", "mode": "int4"}
    assert spec["nodes"]["deviceResource"] == "gpu.intel.com/xe"
    assert spec["draft"]["minSharedAgreement"] == 0.9
    assert "layersPerNode" not in spec


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda s: s["model"].update(configMap="cfg"), "model"),
        (lambda s: s["model"].pop("preset"), "model"),
        (lambda s: s["nodes"].update(selector={"matchLabels": {"a": "b"}}), "nodes"),
        (lambda s: s["nodes"]["names"].append("pc-03"), "nodes.names[11]"),
        (lambda s: s["nodes"].update(memory="lots"), "nodes.memory"),
        (lambda s: s.update(redis={"managed": False}), "redis.url"),
        (lambda s: s.update(draft={"enabled": True, "model": "/models/small"}), "draft.model"),
        (lambda s: s.update(draft={"enabled": True, "maxDraft": 8}), "draft.maxDraft"),
    ],
)
def test_spec_errors_name_the_field(change, field):
    spec = example_spec()
    change(spec)
    with pytest.raises(SpecError) as caught:
        parse_spec(spec)
    assert caught.value.field == field
    assert str(caught.value).startswith(f"spec.{field}:")


def test_eleven_nodes_get_six_layers_each_pinned_with_a_device_and_a_chained_next_hop():
    plan, children = rendered()
    assert [(s.node, s.start_layer, s.end_layer) for s in plan.stages] == [
        (n, 6 * i, 6 * i + 6) for i, n in enumerate(NODES)
    ]
    shards = {
        c["metadata"]["name"]: c for c in children if c["kind"] == "StatefulSet" and "shard" in c["metadata"]["name"]
    }
    assert len(shards) == 11
    for i, node in enumerate(NODES):
        sts = shards[f"inkling-shard-{i}"]
        pod = sts["spec"]["template"]["spec"]
        assert sts["spec"]["replicas"] == 1
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms == [{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}]
        container = pod["containers"][0]
        assert container["resources"]["limits"]["gpu.intel.com/xe"] == "1"
        args = container["args"]
        assert args[0] == "shard" and args[args.index("--layers") + 1] == f"{6 * i}:{6 * i + 6}"
        if i < 10:
            assert args[args.index("--next") + 1].startswith(f"inkling-shard-{i + 1}-0.inkling-shard-{i + 1}.serving")
        else:
            assert args[args.index("--reply-to") + 1].startswith("inkling-router.serving.svc:")
        assert container["volumeMounts"][0]["mountPath"] == "/models/inkling"
        # compiled weights are mapped from a disk-backed scratch volume: the root filesystem is read-only
        cache = next(m for m in container["volumeMounts"] if m["name"] == "weights-cache")
        assert {"name": "CASCADIA_CACHE_DIR", "value": cache["mountPath"]} in container["env"]
        # the shard's command takes its AMX choice from the environment the spec gives it (auto by default)
        assert {"name": "CASCADIA_CPU_AMX", "value": "auto"} in container["env"]
        # the scratch volume is sized for the stage's weights, and the pod asks the node for that much disk
        scratch = next(v for v in pod["volumes"] if v["name"] == "weights-cache")["emptyDir"]["sizeLimit"]
        assert container["resources"]["requests"]["ephemeral-storage"] == scratch
        assert plan.stages[i].weight_bytes < int(scratch) <= plan.stages[i].weight_bytes + 2**30
        assert container["readinessProbe"]["exec"]["command"][:2] == ["cascadia", "probe"]
    kinds = sorted({(c["kind"], c["metadata"]["name"]) for c in children} - {("StatefulSet", n) for n in shards})
    assert ("Deployment", "inkling-router") in kinds and ("Deployment", "inkling-gateway") in kinds
    assert ("ConfigMap", "inkling-plan") in kinds and ("StatefulSet", "inkling-redis") in kinds
    for child in children:
        assert child["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_each_node_converts_its_stage_before_its_shard_starts_within_the_planned_memory():
    spec = example_spec()
    spec["model"]["nodeCachePath"] = "/srv/cascadia"
    plan, children = rendered(spec)
    shards = [c for c in children if c["kind"] == "StatefulSet" and "shard" in c["metadata"]["name"]]
    assert len(shards) == len(plan.stages)
    in_order = sorted(shards, key=lambda c: int(c["metadata"]["name"].split("-")[-1]))
    for sts, placed in zip(in_order, plan.stages, strict=True):
        pod = sts["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        shard = pod["containers"][0]
        layers = f"{placed.start_layer}:{placed.end_layer}"
        args = init["args"]
        assert args[0] == "convert" and args[args.index("--layers") + 1] == layers
        assert args[args.index("--model") + 1] == "/models/inkling"
        assert args[args.index("--precision") + 1] == shard["args"][shard["args"].index("--precision") + 1]
        assert args[args.index("--device") + 1] == "GPU"
        # the shard serves what the conversion wrote, on the node's own disk
        converted = args[args.index("--out") + 1]
        assert shard["args"][shard["args"].index("--model") + 1] == converted
        cache = next(v for v in pod["volumes"] if v["name"] == "node-cache")["hostPath"]
        assert cache == {"path": "/srv/cascadia", "type": "DirectoryOrCreate"}
        mount = next(m for m in init["volumeMounts"] if m["name"] == "node-cache")["mountPath"]
        assert converted.startswith(mount + "/") and layers.replace(":", "-") in converted
        assert {"name": "CASCADIA_COMPILE_CACHE_DIR", "value": f"{mount}/compile-cache"} in shard["env"]
        # requested and enforced at the plan's total, the conversion inside the same bound
        for container in (init, shard):
            memory = container["resources"]
            assert memory["requests"]["memory"] == memory["limits"]["memory"] == str(placed.total_bytes)
    assert with_defaults(example_spec())["model"]["nodeCachePath"] == "/var/lib/cascadia"


def test_the_spec_s_amx_choice_reaches_every_shard():
    spec = example_spec()
    spec.update(device="CPU", cpuAmx="on")
    _, children = rendered(spec)
    shards = [c for c in children if c["kind"] == "StatefulSet" and "shard" in c["metadata"]["name"]]
    for sts in shards:
        container = sts["spec"]["template"]["spec"]["containers"][0]
        assert {"name": "CASCADIA_CPU_AMX", "value": "on"} in container["env"]
        assert container["args"][container["args"].index("--device") + 1] == "CPU"


def test_the_router_keeps_as_many_finished_streams_and_shared_prefixes_as_the_spec_says():
    def router_args(spec: dict) -> list[str]:
        _, children = rendered(spec)
        router = next(c for c in children if c["metadata"]["name"] == "inkling-router" and c["kind"] == "Deployment")
        return router["spec"]["template"]["spec"]["containers"][0]["args"]

    args = router_args(example_spec())
    assert (args[args.index("--keep-finished") + 1], args[args.index("--min-shared-prefix") + 1]) == ("8", "32")
    spec = example_spec()
    spec["serving"].update(keepFinished=0, minSharedPrefix=256)
    args = router_args(spec)
    assert (args[args.index("--keep-finished") + 1], args[args.index("--min-shared-prefix") + 1]) == ("0", "256")


def test_draft_service_is_rendered_and_the_router_drafts_through_it():
    spec = example_spec()
    spec["draft"] = {"enabled": True, "replicas": 2, "maxDraft": 5, "minSharedAgreement": 0.95}
    _, children = rendered(spec)
    by_name = {(c["kind"], c["metadata"]["name"]): c for c in children}
    draft = by_name[("Deployment", "inkling-draft")]
    assert draft["spec"]["replicas"] == 2
    args = draft["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "draft" and args[args.index("--redis") + 1] == "redis://inkling-redis.serving.svc:6379/0"
    assert args[args.index("--trust") + 1] == "0.95"
    assert by_name[("Service", "inkling-draft")]["spec"]["ports"][0]["port"] == 7100
    router = by_name[("Deployment", "inkling-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert router[router.index("--max-draft") + 1] == "5"
    assert router[router.index("--draft") + 1] == "inkling-draft.serving.svc:7100"
    policy = by_name[("NetworkPolicy", "inkling-draft")]["spec"]["ingress"][0]
    assert [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in policy["from"]] == ["router"]
    # without the draft service the router never drafts
    spec = example_spec()
    spec["draft"] = {"enabled": False}
    _, children = rendered(spec)
    router = next(c for c in children if c["metadata"]["name"] == "inkling-router" and c["kind"] == "Deployment")
    assert "--max-draft" not in router["spec"]["template"]["spec"]["containers"][0]["args"]


def test_gateways_keep_stored_responses_in_the_fleets_redis():
    _, children = rendered()
    by_name = {(c["kind"], c["metadata"]["name"]): c for c in children}
    gateway = by_name[("Deployment", "inkling-gateway")]["spec"]["template"]["spec"]["containers"][0]
    assert gateway["args"][gateway["args"].index("--redis") + 1] == "redis://inkling-redis.serving.svc:6379/0"
    assert gateway["args"][gateway["args"].index("--response-ttl") + 1] == "86400"  # the default: a day
    assert "env" not in gateway  # the managed Redis has no password
    policy = by_name[("NetworkPolicy", "inkling-redis")]["spec"]["ingress"][0]
    admitted = sorted(p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in policy["from"])
    assert admitted == ["draft", "gateway", "router"]
    redis = by_name[("StatefulSet", "inkling-redis")]["spec"]["template"]["spec"]["containers"][0]
    assert "--maxmemory" not in redis["args"]  # no memory limit: nothing to keep under
    spec = example_spec()
    spec["resources"] = {"redis": {"limits": {"memory": "512Mi"}}}
    _, children = rendered(spec)
    redis = next(c for c in children if c["kind"] == "StatefulSet" and c["metadata"]["name"] == "inkling-redis")
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--maxmemory") + 1] == str(384 << 20)
    assert args[args.index("--maxmemory-policy") + 1] == "volatile-lru"
    # an external Redis: its password reaches the draft service and the gateways from the Secret, never
    # their arguments
    spec = example_spec()
    spec["draft"] = {"enabled": True}
    spec["gateway"] = {"storedResponseTtlSeconds": 3600}
    secret = {"name": "r", "key": "p"}
    spec["redis"] = {"managed": False, "url": "rediss://cache.example:6380/0", "passwordSecret": secret}
    _, children = rendered(spec)
    for name in ("inkling-draft", "inkling-gateway"):
        deployment = next(c for c in children if c["metadata"]["name"] == name and c["kind"] == "Deployment")
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert container["args"][container["args"].index("--redis") + 1] == "rediss://cache.example:6380/0"
        assert container["env"] == [{"name": "CASCADIA_REDIS_PASSWORD", "valueFrom": {"secretKeyRef": secret}}]
    assert container["args"][container["args"].index("--response-ttl") + 1] == "3600"  # the gateway's, last


def test_network_policies_let_only_the_router_and_previous_stage_reach_shards():
    _, children = rendered()
    policies = {c["metadata"]["name"]: c["spec"] for c in children if c["kind"] == "NetworkPolicy"}
    shard = policies["inkling-shard"]
    sources = [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in shard["ingress"][0]["from"]]
    assert shard["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "shard"
    assert sorted(sources) == ["router", "shard"] and shard["ingress"][0]["ports"][0]["port"] == 7000
    router = policies["inkling-router"]["ingress"]
    assert [r["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for r in router] == [
        "gateway",
        "shard",
    ]
    assert "inkling-gateway" not in policies
    spec = example_spec()
    spec["networkPolicies"] = False
    assert not [c for c in rendered(spec)[1] if c["kind"] == "NetworkPolicy"]


def test_a_selector_picks_labelled_nodes_in_name_order():
    cluster = {"pc-02": {"pool": "pc"}, "pc-01": {"pool": "pc", "x": "1"}, "spare": {"pool": "spare"}}
    assert select_nodes(cluster, {"pool": "pc"}) == ["pc-01", "pc-02"]
    assert select_nodes(cluster, {"pool": "pc", "x": "1"}) == ["pc-01"]
    assert select_nodes(cluster, {"pool": "none"}) == []


def test_shards_are_applied_from_the_last_stage_to_the_first():
    _, children = rendered()
    order = [c["metadata"]["name"] for c in children if c["kind"] == "StatefulSet" and "shard" in c["metadata"]["name"]]
    assert order == [f"inkling-shard-{i}" for i in reversed(range(11))]


def test_rendered_children_are_valid_against_current_kubernetes_schemas():
    _, children = rendered()
    for child in children:
        kubernetes_validate.validate(child, "1.33.0", strict=True)


def test_a_fleet_that_cannot_fit_says_why():
    spec = example_spec()
    spec["nodes"]["memory"] = "16Gi"
    parsed = parse_spec(spec)
    with pytest.raises(PlanError, match="GiB"):
        fleet_plan(parsed, list(parsed.node_names), None)


NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def _shards(ready: list[bool], since: datetime = NOW - timedelta(seconds=10)) -> tuple[ShardState, ...]:
    return tuple(ShardState(i, f"f-shard-{i}", f"pc-{i}", r, None if r else since) for i, r in enumerate(ready))


def test_all_ready_is_ready_and_not_degraded():
    observed = Observed(_shards([True] * 3), (), {"router": True, "gateway": True})
    by_type = {c.type: c for c in serving_conditions(observed, NOW, 60, "plan")}
    assert by_type["Ready"].status == "True" and by_type["ShardsReady"].status == "True"
    assert by_type["Degraded"].status == "False"


def test_a_shard_unready_past_the_grace_period_degrades_the_fleet_naming_it():
    shards = _shards([True, False, True], NOW - timedelta(seconds=120))
    observed = Observed(shards, (), {"router": True, "gateway": True})
    assert degraded(observed, NOW, 300).status == "False"  # still within grace
    condition = degraded(observed, NOW, 60)
    assert (condition.status, condition.reason) == ("True", "ShardUnready")
    assert "f-shard-1 on pc-1" in condition.message
    by_type = {c.type: c for c in serving_conditions(observed, NOW, 60, "plan")}
    assert by_type["Ready"].status == "False" and "1 shard(s) not ready" in by_type["Ready"].message


def test_a_missing_node_degrades_the_fleet_naming_it_and_its_stage():
    observed = Observed(_shards([True, True]), ("pc-1",), {"router": True, "gateway": True})
    condition = degraded(observed, NOW, 60)
    assert condition.reason == "NodeMissing" and "pc-1 (stage 1)" in condition.message


def test_conditions_keep_their_transition_time_until_their_status_flips():
    observed = Observed(_shards([False]), (), {"router": True, "gateway": True})
    first = merge_conditions([], serving_conditions(observed, NOW, 600, "p"), NOW, 1)
    later = NOW + timedelta(seconds=30)
    same = merge_conditions(first, serving_conditions(observed, later, 600, "p"), later, 1)
    assert [c["lastTransitionTime"] for c in same] == [c["lastTransitionTime"] for c in first]
    ready = Observed(_shards([True]), (), {"router": True, "gateway": True})
    flipped = {c["type"]: c for c in merge_conditions(same, serving_conditions(ready, later, 600, "p"), later, 2)}
    assert flipped["Ready"]["lastTransitionTime"] == "2026-12-02T12:00:30Z"
    assert flipped["Planned"]["lastTransitionTime"] == "2026-12-02T12:00:00Z"
