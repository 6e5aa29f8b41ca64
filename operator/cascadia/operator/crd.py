"""The InklingFleet CRD: the one source of its schema; the chart's copy is generated from it."""

from __future__ import annotations

from typing import Any

from cascadia import defaults
from cascadia.cpu_isa import AMX_CHOICES
from cascadia.operator import GROUP, KIND, PLURAL, VERSION
from cascadia.planner import PRESET_CONFIGS

PRECISIONS = list(defaults.PRECISIONS)
WEIGHT_FORMATS = ["f32", "f16", "int8", "int4"]
QUANTITY = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
NODE_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


def _s(description: str, **schema: Any) -> dict[str, Any]:
    return {"description": description, **schema}


def _string(description: str, **schema: Any) -> dict[str, Any]:
    return _s(description, type="string", **schema)


def _int(description: str, minimum: int, maximum: int, default: int | None = None) -> dict[str, Any]:
    out = _s(description, type="integer", minimum=minimum, maximum=maximum)
    if default is not None:
        out["default"] = default
    return out


def _object(
    description: str, properties: dict[str, Any], required: list[str] | None = None, default: bool = True
) -> dict[str, Any]:
    out = _s(description, type="object", properties=properties)
    if required:
        out["required"] = required
    if default:
        out["default"] = {}  # so that the defaults inside apply when the block is left out
    return out


def _resources(description: str) -> dict[str, Any]:
    quantities = _s(
        "Resource name to quantity.",
        type="object",
        additionalProperties={"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]},
    )
    return _object(description, {"requests": quantities, "limits": quantities}, default=False)


def _secret_ref(description: str) -> dict[str, Any]:
    return _object(
        description,
        {
            "name": _string("Secret name.", pattern=DNS_LABEL, maxLength=253),
            "key": _string("Key inside the Secret.", minLength=1, maxLength=253),
        },
        required=["name", "key"],
        default=False,
    )


SPEC = _object(
    "What to serve, where, and how.",
    {
        "model": _object(
            "The checkpoint and its shape.",
            {
                "preset": _string("A known model shape the planner sizes the fleet for.", enum=sorted(PRESET_CONFIGS)),
                "configMap": _string(
                    "Name of a ConfigMap whose key config.json holds the model's config (instead of a preset).",
                    pattern=DNS_LABEL,
                    maxLength=253,
                ),
                "path": _string(
                    "Where every node holds the checkpoint; mounted read-only into the shards.",
                    pattern=r"^/.*",
                    minLength=2,
                    maxLength=4096,
                ),
                "persistentVolumeClaim": _string(
                    "Mount this PVC at path instead of the node's directory.", pattern=DNS_LABEL, maxLength=253
                ),
                "nodeCachePath": _string(
                    "A directory on each node's disk where an init container converts the node's stage once "
                    "(cascadia convert: weights quantised and laid out as the shard runs them, reused while the "
                    "checkpoint, precision and layers are unchanged) and the iGPU plugin keeps compiled kernels.",
                    pattern=r"^/.*",
                    minLength=2,
                    maxLength=4096,
                    default="/var/lib/cascadia",
                ),
            },
            required=["path"],
            default=False,
        ),
        "nodes": _object(
            "The machines, one shard each, in pipeline order.",
            {
                "names": _s(
                    "Node names (kubernetes.io/hostname), first stage first.",
                    type="array",
                    minItems=1,
                    maxItems=256,
                    items=_string("A node name.", pattern=NODE_NAME, maxLength=253),
                ),
                "selector": _s(
                    "Instead of names: every node with these labels, in name order.",
                    type="object",
                    properties={
                        "matchLabels": _s(
                            "Labels a node must carry.",
                            type="object",
                            minProperties=1,
                            additionalProperties={"type": "string"},
                        )
                    },
                    required=["matchLabels"],
                ),
                "memory": _string("Usable memory per node, a quantity such as 64Gi.", pattern=QUANTITY),
                "deviceResource": _string(
                    "The iGPU device-plugin resource each shard requests.",
                    default="gpu.intel.com/xe",
                    pattern=r"^[a-z0-9.-]+/[a-z0-9.-]+$",
                ),
            },
            required=["memory"],
            default=False,
        ),
        "layersPerNode": _int("Consecutive layers per node; absent: the planner balances memory.", 1, 1024),
        "precision": _object(
            "Weight format per tensor class (the planner sizes memory with them).",
            {
                "experts": _string("Routed and shared experts.", enum=WEIGHT_FORMATS, default="int4"),
                "attention": _string("Attention, router and convolution weights.", enum=WEIGHT_FORMATS, default="int8"),
                "head": _string("Embedding and output head.", enum=WEIGHT_FORMATS, default="int8"),
                "mode": _string("The shards' engine precision mode.", enum=PRECISIONS, default="int4"),
            },
        ),
        "device": _string("OpenVINO device the shards run on.", enum=["GPU", "CPU"], default="GPU"),
        "cpuAmx": _string(
            "Whether the shards' CPU kernels may use AMX tiles: auto keeps them out on CPUs that have them "
            "(bf16 decode at few streams runs faster without), on, off.",
            enum=list(AMX_CHOICES),
            default="auto",
        ),
        "networkPolicies": _s(
            "Render NetworkPolicies: only the router and the previous stage reach a shard, only "
            "the gateway the router.",
            type="boolean",
            default=True,
        ),
        "serving": _object(
            "Scheduling and memory budget.",
            {
                "rowsPerGroup": _int("Rows per pipeline group.", 1, 256, defaults.ROWS_PER_GROUP),
                "prefillWindow": _int("Prompt rows per prefill window.", 1, 1024, defaults.PREFILL_WINDOW),
                "maxStreams": _int(
                    "Concurrent streams (the KV budget is sized for them).", 1, 4096, defaults.PLANNED_STREAMS
                ),
                "contextBudget": _int("Global-layer positions per stream.", 64, 524288, 1024),
                "maxQueue": _int(
                    "Requests waiting beyond which the router answers overloaded.", 0, 100000, defaults.MAX_QUEUE
                ),
                "keepFinished": _int(
                    "Finished streams the shards keep (within maxStreams), so that a prompt that starts with "
                    "one's tokens, such as a conversation's next turn, computes only the rest.",
                    0,
                    4096,
                    8,
                ),
                "minSharedPrefix": _int(
                    "Tokens a prompt must share with a finished or recent one, and go on differently (one system "
                    "prompt, other questions), to start as a copy of the finished stream or leave a kept copy of "
                    "its own where they part; 0: none.",
                    0,
                    524288,
                    32,
                ),
                "shardUnreadyGraceSeconds": _int("A shard unready this long marks the fleet Degraded.", 0, 86400, 300),
            },
        ),
        "draft": _object(
            "Speculative decoding proposer.",
            {
                "enabled": _s(
                    "Run the draft service and let the router verify drafted tokens in speculative rounds.",
                    type="boolean",
                    default=False,
                ),
                "replicas": _int("Draft service replicas (they share the Redis index).", 1, 16, 1),
                "maxDraft": _int("Drafted tokens per speculative round; below serving.rowsPerGroup.", 1, 31, 7),
                "model": _string("Path of a small CPU draft model (not served yet: leave unset)."),
                "minSharedAgreement": _s(
                    "Shared-context matches are used only where their measured agreement is at least this.",
                    type="number",
                    minimum=0,
                    maximum=1,
                    default=0.9,
                ),
            },
        ),
        "redis": _object(
            "The shared-context index, and the gateways' stored responses.",
            {
                "managed": _s("Run a Redis StatefulSet for the fleet.", type="boolean", default=True),
                "url": _string("An external Redis (redis:// or rediss://) when not managed.", pattern=r"^rediss?://.+"),
                "passwordSecret": _secret_ref("Password of the external Redis."),
            },
        ),
        "gateway": _object(
            "The OpenAI-compatible API.",
            {
                "replicas": _int("Gateway replicas.", 1, 64, 1),
                "serviceType": _string(
                    "Service type of the API.", enum=["ClusterIP", "NodePort", "LoadBalancer"], default="ClusterIP"
                ),
                "port": _int("Service port of the API.", 1, 65535, 8000),
                "apiKeySecret": _string(
                    "Secret holding the API keys (key 'keys', one per line); absent: open.",
                    pattern=DNS_LABEL,
                    maxLength=253,
                ),
                "maxConcurrentPerKey": _int("Requests in flight per API key (0: no limit).", 0, 100000, 64),
                "storedResponseTtlSeconds": _int(
                    "Seconds a stored /v1/responses response stays in the fleet's Redis after it was last read.",
                    60,
                    365 * 24 * 3600,
                    24 * 3600,
                ),
            },
        ),
        "images": _object(
            "Container images.",
            {
                "shard": _string("Shard image.", default="ghcr.io/cascadia/shard:0.1.0"),
                "router": _string("Router image.", default="ghcr.io/cascadia/router:0.1.0"),
                "draft": _string("Draft image.", default="ghcr.io/cascadia/draft:0.1.0"),
                "gateway": _string("Gateway image.", default="ghcr.io/cascadia/gateway:0.1.0"),
                "redis": _string("Redis image.", default="redis:7.4-alpine"),
                "pullPolicy": _string(
                    "Image pull policy.", enum=["Always", "IfNotPresent", "Never"], default="IfNotPresent"
                ),
            },
        ),
        "resources": _object(
            "Extra resource requests and limits per component (the shard's device request "
            "and memory come from the plan).",
            {
                "shard": _resources("Shard container."),
                "router": _resources("Router container."),
                "draft": _resources("Draft container."),
                "gateway": _resources("Gateway container."),
                "redis": _resources("Redis container."),
            },
        ),
    },
    required=["model", "nodes"],
    default=False,
)

CONDITION = _object(
    "A condition of the fleet.",
    {
        "type": _string("Planned, ShardsReady, Ready or Degraded."),
        "status": _string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
        "reason": _string("CamelCase reason."),
        "message": _string("What a person needs to know."),
        "lastTransitionTime": _string("When the status last changed.", format="date-time"),
        "observedGeneration": _s("The generation this condition was computed for.", type="integer"),
    },
    required=["type", "status"],
    default=False,
)

STATUS = _object(
    "What the operator planned and observed.",
    {
        "plan": _s(
            "Layers per node, first stage first; half-open ranges.",
            type="array",
            items=_object(
                "A stage.",
                {
                    "node": _string("Node name."),
                    "startLayer": _s("First layer.", type="integer"),
                    "endLayer": _s("One past the last layer.", type="integer"),
                    "memoryBytes": _s("Planned resident bytes (weights, KV budget, runtime).", type="integer"),
                },
                default=False,
            ),
        ),
        "conditions": _s("Planned, ShardsReady, Ready, Degraded.", type="array", items=CONDITION),
        "readyShards": _s("Shards whose pod is ready.", type="integer"),
        "totalShards": _s("Shards in the plan.", type="integer"),
        "observedGeneration": _s("The spec generation last reconciled.", type="integer"),
    },
    default=False,
)


def _condition_column(kind: str) -> dict[str, Any]:
    return {"name": kind, "type": "string", "jsonPath": f'.status.conditions[?(@.type=="{kind}")].status'}


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "plural": PLURAL,
                "singular": "inklingfleet",
                "shortNames": ["ifleet"],
                "listKind": KIND + "List",
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        _condition_column("Ready"),
                        {
                            "name": "Shards",
                            "type": "string",
                            "jsonPath": ".status.readyShards",
                            "description": "Ready shards",
                        },
                        {"name": "Total", "type": "integer", "jsonPath": ".status.totalShards", "priority": 1},
                        _condition_column("Degraded") | {"priority": 1},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "description": "Client machines serving one sparse MoE model, a layer range each.",
                            "type": "object",
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": SPEC,
                                "status": STATUS,
                            },
                            "required": ["spec"],
                        }
                    },
                }
            ],
        },
    }
