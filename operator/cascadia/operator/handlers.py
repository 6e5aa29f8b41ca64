"""kopf handlers: create, update, resume and a timer all run one level-based reconcile."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from datetime import UTC, datetime
from typing import Any

import kopf
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic import DynamicClient

from cascadia.model.config import ConfigError
from cascadia.operator import GROUP, PLURAL, VERSION
from cascadia.operator.planning import fleet_plan, select_nodes
from cascadia.operator.render import COMPONENT_LABEL, FLEET_LABEL, STAGE_LABEL, Fleet, plan_status, render
from cascadia.operator.spec import SpecError, parse_spec
from cascadia.operator.status import (
    Condition,
    Observed,
    ShardState,
    merge_conditions,
    not_planned,
    serving_conditions,
    status_changed,
)
from cascadia.planner import FleetPlan, PlanError

FIELD_MANAGER = "cascadia-operator"
INTERVAL = float(os.environ.get("CASCADIA_OPERATOR_INTERVAL", "10"))
CHILD_KINDS = (
    ("v1", "ConfigMap"),
    ("v1", "Service"),
    ("apps/v1", "StatefulSet"),
    ("apps/v1", "Deployment"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
)
log = logging.getLogger("cascadia.operator")


def _time(value: Any) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    return datetime.fromisoformat(str(value).replace("Z", "+00:00"))


def _pod_ready(pod: Any) -> bool:
    status = pod.status
    if status is None or status.phase != "Running":
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])


class KubeApi:
    """The operator's only contact with the API server."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)
        self.dynamic = DynamicClient(api_client)

    def nodes(self) -> dict[str, dict[str, str]]:
        """Every node's name and labels (one list call serves both the selector and the presence check)."""
        return {n.metadata.name: dict(n.metadata.labels or {}) for n in self.core.list_node().items}

    def model_config(self, namespace: str, name: str) -> dict[str, Any]:
        try:
            cm = self.core.read_namespaced_config_map(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                raise kopf.TemporaryError(f"spec.model.configMap: ConfigMap '{name}' not found", delay=15) from None
            raise
        text = (cm.data or {}).get("config.json")
        if text is None:
            raise SpecError("model.configMap", f"ConfigMap '{name}' has no key config.json")
        return json.loads(text)

    def apply(self, manifest: dict[str, Any]) -> None:
        resource = self.dynamic.resources.get(api_version=manifest["apiVersion"], kind=manifest["kind"])
        self.dynamic.server_side_apply(
            resource, body=manifest, namespace=manifest["metadata"]["namespace"], field_manager=FIELD_MANAGER,
            force_conflicts=True,
        )  # fmt: skip

    def prune(self, fleet: Fleet, keep: list[dict[str, Any]]) -> list[str]:
        """Delete children of this fleet that the current render no longer has (e.g. a node taken out)."""
        wanted = {(m["kind"], m["metadata"]["name"]) for m in keep}
        deleted = []
        for api_version, kind in CHILD_KINDS:
            resource = self.dynamic.resources.get(api_version=api_version, kind=kind)
            found = resource.get(namespace=fleet.namespace, label_selector=f"{FLEET_LABEL}={fleet.name}")
            for item in found.items:
                owners = item.metadata.get("ownerReferences") or []
                if (kind, item.metadata.name) in wanted or not any(o.get("uid") == fleet.uid for o in owners):
                    continue
                resource.delete(
                    name=item.metadata.name, namespace=fleet.namespace, body={"propagationPolicy": "Background"}
                )
                deleted.append(f"{kind}/{item.metadata.name}")
        return deleted

    def pods(self, fleet: Fleet) -> list[Any]:
        return self.core.list_namespaced_pod(fleet.namespace, label_selector=f"{FLEET_LABEL}={fleet.name}").items

    def statefulset_created(self, fleet: Fleet) -> dict[str, datetime]:
        resource = self.dynamic.resources.get(api_version="apps/v1", kind="StatefulSet")
        found = resource.get(namespace=fleet.namespace, label_selector=f"{FLEET_LABEL}={fleet.name}")
        return {i.metadata.name: _time(i.metadata.creationTimestamp) for i in found.items}

    def write_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, {"status": status})


def observe(api: KubeApi, fleet: Fleet, plan: FleetPlan, cluster_nodes: set[str]) -> Observed:
    pods = api.pods(fleet)
    created = api.statefulset_created(fleet)
    shard_pods = {
        p.metadata.labels.get(STAGE_LABEL): p for p in pods if p.metadata.labels.get(COMPONENT_LABEL) == "shard"
    }
    shards = []
    for stage, placed in enumerate(plan.stages):
        name = f"{fleet.name}-shard-{stage}"
        pod = shard_pods.get(str(stage))
        if pod is None:
            shards.append(ShardState(stage, name, placed.node, False, created.get(name)))
            continue
        ready = _pod_ready(pod)
        since = _time(pod.metadata.creation_timestamp)
        for c in (pod.status.conditions or []) if pod.status else []:
            if c.type == "Ready" and c.last_transition_time:
                since = _time(c.last_transition_time)
        shards.append(ShardState(stage, name, placed.node, ready, None if ready else since))
    services = {
        component: any(_pod_ready(p) for p in pods if p.metadata.labels.get(COMPONENT_LABEL) == component)
        for component in ("router", "gateway")
    }
    missing = tuple(s.node for s in plan.stages if s.node not in cluster_nodes)
    return Observed(tuple(shards), missing, services)


def _store(api: KubeApi, body: Any, conditions: list[Condition], extra: dict[str, Any], now: datetime) -> None:
    previous = dict(body.get("status") or {})
    generation = body["metadata"].get("generation", 0)
    status = {
        **extra,
        "conditions": merge_conditions(previous.get("conditions") or [], conditions, now, generation),
        "observedGeneration": generation,
    }
    if status_changed(previous, status):  # an unchanged status is not written again
        api.write_status(body["metadata"]["namespace"], body["metadata"]["name"], status)


def reconcile(api: KubeApi, body: Any, now: datetime | None = None) -> None:
    """Observe, plan, apply and write status, from whatever state the fleet and its children are in."""
    now = now or datetime.now(UTC)
    meta = body["metadata"]
    try:
        spec = parse_spec(dict(body.get("spec") or {}))
    except SpecError as exc:
        _store(api, body, not_planned("InvalidSpec", str(exc)), {"totalShards": 0, "readyShards": 0}, now)
        raise kopf.PermanentError(str(exc)) from None
    fleet = Fleet(meta["name"], meta["namespace"], meta["uid"], spec)
    cluster = api.nodes()
    cluster_nodes = set(cluster)
    nodes = list(spec.node_names) if spec.node_names is not None else select_nodes(cluster, spec.node_selector or {})
    try:
        config_name = spec.get("model", "configMap")
        model_config = api.model_config(fleet.namespace, config_name) if config_name else None
        plan = fleet_plan(spec, nodes, model_config)
    except (PlanError, ConfigError) as exc:
        reason = "DoesNotFit" if isinstance(exc, PlanError) else "BadModelConfig"
        _store(api, body, not_planned(reason, str(exc)), {"plan": [], "totalShards": 0, "readyShards": 0}, now)
        return
    except SpecError as exc:
        _store(api, body, not_planned("InvalidSpec", str(exc)), {"totalShards": 0, "readyShards": 0}, now)
        raise kopf.PermanentError(str(exc)) from None
    children = render(fleet, plan)
    for child in children:
        api.apply(child)
    for gone in api.prune(fleet, children):
        log.info("fleet %s/%s: deleted %s", fleet.namespace, fleet.name, gone)
    observed = observe(api, fleet, plan, cluster_nodes)
    grace = spec.get("serving", "shardUnreadyGraceSeconds")
    extra = {
        "plan": plan_status(plan),
        "totalShards": len(plan.stages),
        "readyShards": sum(s.ready for s in observed.shards),
    }
    _store(api, body, serving_conditions(observed, now, grace, plan.note), extra, now)


_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock(uid: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(uid, threading.Lock())


def _api() -> KubeApi:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        # read $KUBECONFIG now: the client library's default is fixed when it is first imported
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
    return KubeApi(client.ApiClient())


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod, the service account; elsewhere $KUBECONFIG (as the handlers' own client does)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.posting.level = logging.WARNING
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="cascadia.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="cascadia.dev")
    settings.persistence.finalizer = "cascadia.dev/operator"
    settings.watching.server_timeout = 60
    memo.api = _api()


@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
@kopf.on.resume(GROUP, VERSION, PLURAL)
def on_change(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    with _lock(body["metadata"]["uid"]):
        reconcile(memo.api, body)


@kopf.timer(GROUP, VERSION, PLURAL, interval=INTERVAL, initial_delay=INTERVAL)
def on_timer(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    # a permanent error is in the status already; it is retried once the spec changes
    with _lock(body["metadata"]["uid"]), contextlib.suppress(kopf.PermanentError):
        reconcile(memo.api, body)
