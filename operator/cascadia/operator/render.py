"""The children of an InklingFleet as manifests: pure functions of the fleet, its spec and its plan."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kubernetes.utils import parse_quantity

from cascadia.cpu_isa import AMX_VARIABLE
from cascadia.operator import GROUP, KIND, VERSION
from cascadia.operator.spec import FleetSpec
from cascadia.planner import FleetPlan, StagePlan
from cascadia.role_args import ConvertArgs, DraftArgs, GatewayArgs, RouterArgs, ShardArgs

SHARD_PORT = 7000
ROUTER_PORT = 50051
COLLECT_PORT = 50052
REDIS_PORT = 6379
DRAFT_PORT = 7100
KEYS_MOUNT = "/etc/cascadia/keys"
FLEET_LABEL = "cascadia.dev/fleet"
STAGE_LABEL = "cascadia.dev/stage"
COMPONENT_LABEL = "app.kubernetes.io/component"
RUN_AS = 10001


@dataclass(frozen=True)
class Fleet:
    name: str
    namespace: str
    uid: str
    spec: FleetSpec


def labels(fleet: Fleet, component: str, **extra: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "cascadia",
        "app.kubernetes.io/instance": fleet.name,
        "app.kubernetes.io/managed-by": "cascadia-operator",
        COMPONENT_LABEL: component,
        FLEET_LABEL: fleet.name,
        **extra,
    }


def selector(fleet: Fleet, component: str, **extra: str) -> dict[str, str]:
    return {FLEET_LABEL: fleet.name, COMPONENT_LABEL: component, **extra}


def _metadata(fleet: Fleet, name: str, component: str, **extra: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": fleet.namespace,
        "labels": labels(fleet, component, **extra),
        "ownerReferences": [
            {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": KIND,
                "name": fleet.name,
                "uid": fleet.uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ],
    }


def shard_name(fleet: Fleet, stage: int) -> str:
    return f"{fleet.name}-shard-{stage}"


def shard_address(fleet: Fleet, stage: int) -> str:
    name = shard_name(fleet, stage)
    return f"{name}-0.{name}.{fleet.namespace}.svc:{SHARD_PORT}"


def _security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _pod_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _probe(port: int) -> dict[str, Any]:
    # an exec probe through the image's own CLI works on every Kubernetes version (grpc probes need 1.24+)
    return {
        "exec": {"command": ["cascadia", "probe", "--address", f"127.0.0.1:{port}"]},
        "periodSeconds": 10,
        "timeoutSeconds": 5,
        "failureThreshold": 3,
    }


def _model_volume(spec: FleetSpec) -> dict[str, Any]:
    claim = spec.get("model", "persistentVolumeClaim")
    if claim:
        return {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    return {"name": "model", "hostPath": {"path": spec.get("model", "path"), "type": "Directory"}}


def _resources(
    spec: FleetSpec, component: str, requests: dict[str, Any] | None = None, limits: dict[str, Any] | None = None
) -> dict[str, Any]:
    extra = spec.get("resources", component) or {}
    out = {
        "requests": {**(requests or {}), **(extra.get("requests") or {})},
        "limits": {**(limits or {}), **(extra.get("limits") or {})},
    }
    # quantities travel as strings: server-side apply types them strictly
    return {k: {name: str(q) for name, q in v.items()} for k, v in out.items() if v}


def _node_affinity(nodes: list[str]) -> dict[str, Any]:
    term = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": nodes}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def _container(name: str, image: str, args: list[str], spec: FleetSpec, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "image": image,
        "imagePullPolicy": spec.get("images", "pullPolicy"),
        "args": args,
        "securityContext": _security(),
        **extra,
    }


def _workload_pod(
    fleet: Fleet,
    component: str,
    containers: list[dict],
    volumes: list[dict] | None = None,
    affinity: dict | None = None,
    **extra_labels: str,
) -> dict[str, Any]:
    pod: dict[str, Any] = {"securityContext": _pod_security(), "containers": containers, "enableServiceLinks": False}
    if volumes:
        pod["volumes"] = volumes
    if affinity:
        pod["affinity"] = affinity
    return {"metadata": {"labels": labels(fleet, component, **extra_labels)}, "spec": pod}


# where a shard writes each compiled graph's weights to read them back through a file mapping (the root
# filesystem is read-only); on the node's disk, not in memory, or the mapping would save nothing
WEIGHTS_CACHE = "/var/cache/cascadia"
# the graphs' text and the small constants the plan does not count, beyond the stage's planned weights
WEIGHTS_CACHE_SLACK = 256 * 1024 * 1024


def weights_cache_bytes(placed: StagePlan) -> int:
    """Disk a shard's scratch volume holds: the weight files are removed once read, but their blocks stay
    allocated for as long as the shard maps them, so the whole stage's weights are there while it serves."""
    return placed.weight_bytes + WEIGHTS_CACHE_SLACK


# where a shard pod mounts its node's cache directory (`spec.model.nodeCachePath`)
NODE_CACHE = "/var/lib/cascadia"
COMPILE_CACHE_VARIABLE = "CASCADIA_COMPILE_CACHE_DIR"


def converted_stage_path(fleet: Fleet, placed: StagePlan) -> str:
    """Where a node's converted stage lives in the pod: named by fleet and layer range, so a re-plan that
    moves layers converts anew instead of finding another range."""
    return f"{NODE_CACHE}/converted/{fleet.namespace}-{fleet.name}-{placed.start_layer}-{placed.end_layer}"


def shard_statefulset(fleet: Fleet, plan: FleetPlan, stage: int) -> dict[str, Any]:
    spec = fleet.spec
    placed = plan.stages[stage]
    last = stage + 1 == len(plan.stages)
    model_path = spec.get("model", "path")
    converted = converted_stage_path(fleet, placed)
    layers = (placed.start_layer, placed.end_layer)
    precision, device = spec.get("precision", "mode"), spec.get("device")
    convert_args = ConvertArgs(model_path, converted, layers, precision, device).to_argv()
    args = ShardArgs(
        converted, layers, f"0.0.0.0:{SHARD_PORT}", stage, precision, device,
        context=spec.get("serving", "contextBudget"), streams=spec.get("serving", "maxStreams"),
        next=None if last else shard_address(fleet, stage + 1),
        reply_to=f"{fleet.name}-router.{fleet.namespace}.svc:{COLLECT_PORT}" if last else None,
    ).to_argv()  # fmt: skip
    device = spec.get("nodes", "deviceResource")
    # the plan's total is what the shard holds: requested and enforced, as a memory cgroup enforces it
    memory = str(placed.total_bytes)
    scratch = str(weights_cache_bytes(placed))
    mounts = [
        {"name": "model", "mountPath": model_path, "readOnly": True},
        {"name": "node-cache", "mountPath": NODE_CACHE},
    ]
    # the conversion runs within the shard's own memory: it peaks below what the stage then holds
    conversion = _container(
        "convert", spec.get("images", "shard"), convert_args, spec,
        resources=_resources(spec, "shard", requests={"memory": memory}, limits={"memory": memory}),
        volumeMounts=mounts,
    )  # fmt: skip
    container = _container(
        "shard", spec.get("images", "shard"), args, spec,
        ports=[{"name": "grpc", "containerPort": SHARD_PORT, "protocol": "TCP"}],
        readinessProbe=_probe(SHARD_PORT),
        resources=_resources(
            spec, "shard", requests={"memory": memory, "ephemeral-storage": scratch, device: 1},
            limits={"memory": memory, device: 1},
        ),
        volumeMounts=[*mounts, {"name": "weights-cache", "mountPath": WEIGHTS_CACHE}],
        env=[{"name": "CASCADIA_STAGE", "value": str(stage)}, {"name": "CASCADIA_ROLE", "value": "last" if last else (
            "first" if stage == 0 else "middle")}, {"name": "CASCADIA_CACHE_DIR", "value": WEIGHTS_CACHE},
            {"name": COMPILE_CACHE_VARIABLE, "value": f"{NODE_CACHE}/compile-cache"},
            {"name": AMX_VARIABLE, "value": spec.get("cpuAmx")}],
    )  # fmt: skip
    name = shard_name(fleet, stage)
    stage_labels = {STAGE_LABEL: str(stage)}
    node_cache = {
        "name": "node-cache",
        "hostPath": {"path": spec.get("model", "nodeCachePath"), "type": "DirectoryOrCreate"},
    }
    volumes = [_model_volume(spec), node_cache, {"name": "weights-cache", "emptyDir": {"sizeLimit": scratch}}]
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(fleet, name, "shard", **stage_labels),
        "spec": {
            "replicas": 1,
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector(fleet, "shard", **stage_labels)},
            "template": _with_init(
                _workload_pod(fleet, "shard", [container], volumes, _node_affinity([placed.node]), **stage_labels),
                [conversion],
            ),
        },
    }


def _with_init(pod: dict[str, Any], init: list[dict[str, Any]]) -> dict[str, Any]:
    pod["spec"]["initContainers"] = init
    return pod


def _tcp(ports: list[dict]) -> list[dict]:
    # server-side apply on older API servers needs the protocol spelled out: it keys the port lists
    return [{"protocol": "TCP", **p} for p in ports]


def headless_service(fleet: Fleet, name: str, component: str, ports: list[dict], **extra: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(fleet, name, component, **extra),
        "spec": {
            "clusterIP": "None",
            "selector": selector(fleet, component, **extra),
            "ports": _tcp(ports),
            "publishNotReadyAddresses": True,
        },
    }


def service(fleet: Fleet, name: str, component: str, ports: list[dict], service_type: str = "ClusterIP") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(fleet, name, component),
        "spec": {"type": service_type, "selector": selector(fleet, component), "ports": _tcp(ports)},
    }


def _deployment(
    fleet: Fleet, name: str, component: str, replicas: int, pod: dict[str, Any], strategy: str = "RollingUpdate"
) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(fleet, name, component),
        "spec": {
            "replicas": replicas,
            "strategy": {"type": strategy},
            "selector": {"matchLabels": selector(fleet, component)},
            "template": pod,
        },
    }


def router_children(fleet: Fleet, plan: FleetPlan) -> list[dict[str, Any]]:
    spec = fleet.spec
    serving = spec.get("serving")
    name = f"{fleet.name}-router"
    draft = spec.get("draft")
    drafting = draft.get("enabled")
    args = RouterArgs(
        f"0.0.0.0:{ROUTER_PORT}", tuple(shard_address(fleet, i) for i in range(len(plan.stages))),
        f"0.0.0.0:{COLLECT_PORT}", rows_per_group=serving["rowsPerGroup"], prefill_window=serving["prefillWindow"],
        max_streams=serving["maxStreams"], max_queue=serving["maxQueue"], keep_finished=serving["keepFinished"],
        min_shared_prefix=serving["minSharedPrefix"], max_draft=draft["maxDraft"] if drafting else None,
        draft=f"{fleet.name}-draft.{fleet.namespace}.svc:{DRAFT_PORT}" if drafting else None,
    ).to_argv()  # fmt: skip
    container = _container(
        "router", spec.get("images", "router"), args, spec,
        ports=_tcp([{"name": "api", "containerPort": ROUTER_PORT}, {"name": "collect", "containerPort": COLLECT_PORT}]),
        readinessProbe=_probe(ROUTER_PORT), resources=_resources(spec, "router"),
    )  # fmt: skip
    # one router owns the streams: a second one during a rollout would split them
    deployment = _deployment(fleet, name, "router", 1, _workload_pod(fleet, "router", [container]), "Recreate")
    ports = [
        {"name": "api", "port": ROUTER_PORT, "targetPort": "api"},
        {"name": "collect", "port": COLLECT_PORT, "targetPort": "collect"},
    ]
    return [deployment, service(fleet, name, "router", ports)]


def gateway_children(fleet: Fleet, plan: FleetPlan) -> list[dict[str, Any]]:
    spec = fleet.spec
    gateway = spec.get("gateway")
    name = f"{fleet.name}-gateway"
    model_path = spec.get("model", "path")
    volumes = [_model_volume(spec)]
    mounts = [{"name": "model", "mountPath": model_path, "readOnly": True}]
    keys = gateway.get("apiKeySecret")
    if keys:
        volumes.append({"name": "api-keys", "secret": {"secretName": keys}})
        mounts.append({"name": "api-keys", "mountPath": KEYS_MOUNT, "readOnly": True})
    # stored responses (/v1/responses) in the fleet's Redis, so that any replica continues a conversation
    store = redis_url(fleet)
    args = GatewayArgs(
        f"{fleet.name}-router.{fleet.namespace}.svc:{ROUTER_PORT}", model_path, host="0.0.0.0", port=8000,
        max_context=spec.get("serving", "contextBudget"), max_concurrent_per_key=gateway["maxConcurrentPerKey"],
        api_keys_file=f"{KEYS_MOUNT}/keys" if keys else None, redis=store,
        response_ttl=gateway["storedResponseTtlSeconds"] if store else None,
    ).to_argv()  # fmt: skip
    env = redis_env(fleet)
    probe = {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 10, "timeoutSeconds": 5}
    container = _container(
        "gateway", spec.get("images", "gateway"), args, spec,
        ports=[{"name": "http", "containerPort": 8000, "protocol": "TCP"}], readinessProbe=probe,
        livenessProbe={"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 20},
        resources=_resources(spec, "gateway"), volumeMounts=mounts, **({"env": env} if env else {}),
    )  # fmt: skip
    # the tokenizer lives in the checkpoint, which only the fleet's nodes hold
    affinity = _node_affinity(sorted({s.node for s in plan.stages}))
    pod = _workload_pod(fleet, "gateway", [container], volumes, affinity)
    deployment = _deployment(fleet, name, "gateway", gateway["replicas"], pod)
    ports = [{"name": "http", "port": gateway["port"], "targetPort": "http"}]
    return [deployment, service(fleet, name, "gateway", ports, gateway["serviceType"])]


def redis_url(fleet: Fleet) -> str | None:
    if fleet.spec.get("redis", "managed"):
        return f"redis://{fleet.name}-redis.{fleet.namespace}.svc:{REDIS_PORT}/0"
    return fleet.spec.get("redis", "url")


def redis_env(fleet: Fleet) -> list[dict[str, Any]]:
    """The external Redis's password, for the containers that reach it."""
    secret = fleet.spec.get("redis", "passwordSecret")
    if secret and not fleet.spec.get("redis", "managed"):
        return [{"name": "CASCADIA_REDIS_PASSWORD", "valueFrom": {"secretKeyRef": secret}}]
    return []


def draft_children(fleet: Fleet) -> list[dict[str, Any]]:
    """The draft service: request-local matches, and shared contexts in the fleet's Redis."""
    spec = fleet.spec
    draft = spec.get("draft")
    name = f"{fleet.name}-draft"
    args = DraftArgs(f"0.0.0.0:{DRAFT_PORT}", redis_url(fleet), draft["minSharedAgreement"]).to_argv()
    env = redis_env(fleet)
    container = _container(
        "draft", spec.get("images", "draft"), args, spec,
        ports=_tcp([{"name": "grpc", "containerPort": DRAFT_PORT}]),
        readinessProbe=_probe(DRAFT_PORT), resources=_resources(spec, "draft"), **({"env": env} if env else {}),
    )  # fmt: skip
    deployment = _deployment(fleet, name, "draft", draft["replicas"], _workload_pod(fleet, "draft", [container]))
    return [deployment, service(fleet, name, "draft", [{"name": "grpc", "port": DRAFT_PORT, "targetPort": "grpc"}])]


def redis_memory_args(resources: dict[str, Any]) -> list[str]:
    """Under a memory limit, Redis evicts the least recently used of its expiring keys (every draft context and
    stored response expires) at three quarters of it, rather than grow into the limit and be killed."""
    limit = resources.get("limits", {}).get("memory")
    if limit is None:
        return []
    try:
        cap = int(parse_quantity(limit) * 3 // 4)
    except ValueError:  # the API server refuses the quantity itself, naming it
        return []
    return ["--maxmemory", str(cap), "--maxmemory-policy", "volatile-lru"]


def redis_children(fleet: Fleet) -> list[dict[str, Any]]:
    spec = fleet.spec
    name = f"{fleet.name}-redis"
    resources = _resources(spec, "redis")
    args = ["--save", "", "--appendonly", "no", *redis_memory_args(resources)]
    container = _container(
        "redis", spec.get("images", "redis"), args, spec,
        ports=[{"name": "redis", "containerPort": REDIS_PORT, "protocol": "TCP"}],
        readinessProbe={"exec": {"command": ["redis-cli", "ping"]}, "periodSeconds": 10},
        resources=resources, volumeMounts=[{"name": "data", "mountPath": "/data"}],
    )  # fmt: skip
    pod = _workload_pod(fleet, "redis", [container], [{"name": "data", "emptyDir": {}}])
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _metadata(fleet, name, "redis"),
        "spec": {
            "replicas": 1,
            "serviceName": name,
            "selector": {"matchLabels": selector(fleet, "redis")},
            "template": pod,
        },
    }
    return [statefulset, headless_service(fleet, name, "redis", [{"name": "redis", "port": REDIS_PORT}])]


def _peers(fleet: Fleet, *components: str) -> list[dict[str, Any]]:
    return [{"podSelector": {"matchLabels": selector(fleet, c)}} for c in components]


def _policy(fleet: Fleet, component: str, rules: list[tuple[list[str], int]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(fleet, f"{fleet.name}-{component}", "network-policy"),
        "spec": {
            "podSelector": {"matchLabels": selector(fleet, component)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": _peers(fleet, *sources), "ports": [{"protocol": "TCP", "port": port}]}
                for sources, port in rules
            ],
        },
    }


def network_policies(fleet: Fleet) -> list[dict[str, Any]]:
    """Only the router and the stage before reach a shard; only the gateway reaches the router's API,
    and only the last stage its collector. The gateway is the fleet's public face and stays open."""
    policies = [
        _policy(fleet, "shard", [(["router", "shard"], SHARD_PORT)]),
        _policy(fleet, "router", [(["gateway"], ROUTER_PORT), (["shard"], COLLECT_PORT)]),
    ]
    if fleet.spec.get("redis", "managed"):
        policies.append(_policy(fleet, "redis", [(["draft", "router", "gateway"], REDIS_PORT)]))
    if fleet.spec.get("draft", "enabled"):
        policies.append(_policy(fleet, "draft", [(["router"], DRAFT_PORT)]))
    return policies


def plan_configmap(fleet: Fleet, plan: FleetPlan) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(fleet, f"{fleet.name}-plan", "plan"),
        "data": {"plan.json": json.dumps(plan_status(plan), indent=2), "mode": plan.mode, "note": plan.note},
    }


def plan_status(plan: FleetPlan) -> list[dict[str, Any]]:
    return [
        {
            "node": s.node,
            "startLayer": s.start_layer,
            "endLayer": s.end_layer,
            "memoryBytes": s.total_bytes,
        }
        for s in plan.stages
    ]


def render(fleet: Fleet, plan: FleetPlan) -> list[dict[str, Any]]:
    """Every child, in the order they are applied.

    The plan first; shards from the last stage to the first, so each stage's next hop exists before
    a stage starts pointing at it; then the router that admits requests and the gateway in front.
    """
    children = [plan_configmap(fleet, plan)]
    if fleet.spec.get("networkPolicies"):
        children += network_policies(fleet)
    for stage in reversed(range(len(plan.stages))):
        name = shard_name(fleet, stage)
        ports = [{"name": "grpc", "port": SHARD_PORT, "targetPort": "grpc"}]
        children.append(headless_service(fleet, name, "shard", ports, **{STAGE_LABEL: str(stage)}))
        children.append(shard_statefulset(fleet, plan, stage))
    if fleet.spec.get("redis", "managed"):
        children += redis_children(fleet)
    if fleet.spec.get("draft", "enabled"):
        children += draft_children(fleet)
    children += router_children(fleet, plan)
    children += gateway_children(fleet, plan)
    return children
