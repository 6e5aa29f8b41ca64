"""An InklingFleet's spec, defaulted like the API server does and checked beyond what the schema says."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cascadia.operator.crd import SPEC
from cascadia.planner import PlanError, parse_size


class SpecError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"spec.{field}: {message}")
        self.field = field


def with_defaults(value: Any, schema: dict[str, Any] = SPEC) -> Any:
    """Apply the schema's defaults (what a structural CRD does on the server), for specs read elsewhere."""
    if value is None and "default" in schema:
        value = json.loads(json.dumps(schema["default"]))
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for name, sub in schema["properties"].items():
            if name in out or "default" in sub:
                filled = with_defaults(out.get(name), sub)
                if filled is not None:
                    out[name] = filled
        return out
    return value


@dataclass(frozen=True)
class FleetSpec:
    raw: dict[str, Any]
    node_names: tuple[str, ...] | None
    node_selector: dict[str, str] | None
    node_memory: int

    def get(self, *path: str) -> Any:
        node: Any = self.raw
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        return node


def parse_spec(spec: dict[str, Any]) -> FleetSpec:
    """Checks the schema cannot express; raises SpecError naming the field."""
    spec = with_defaults(spec)
    model = spec.get("model") or {}
    if bool(model.get("preset")) == bool(model.get("configMap")):
        raise SpecError("model", "give exactly one of preset and configMap")
    nodes = spec.get("nodes") or {}
    names, selector = nodes.get("names"), nodes.get("selector")
    if (names is None) == (selector is None):
        raise SpecError("nodes", "give exactly one of names and selector")
    if names is not None:
        seen: set[str] = set()
        for i, name in enumerate(names):
            if name in seen:
                raise SpecError(f"nodes.names[{i}]", f"node '{name}' is listed twice")
            seen.add(name)
    try:
        memory = parse_size(str(nodes.get("memory", "")))
    except (PlanError, ValueError) as exc:
        raise SpecError("nodes.memory", str(exc)) from None
    redis = spec.get("redis") or {}
    if not redis.get("managed", True) and not redis.get("url"):
        raise SpecError("redis.url", "an external Redis (managed: false) needs a url")
    if redis.get("managed", True) and redis.get("url"):
        raise SpecError("redis.url", "a url is for an external Redis: set managed to false")
    draft = spec.get("draft") or {}
    if draft.get("model"):
        raise SpecError("draft.model", "a draft language model is not served yet; drafts come from matches")
    rows = (spec.get("serving") or {}).get("rowsPerGroup", 8)
    if draft.get("enabled") and draft.get("maxDraft", 7) >= rows:
        raise SpecError("draft.maxDraft", f"{draft.get('maxDraft')} drafted tokens do not fit rowsPerGroup {rows}")
    return FleetSpec(
        raw=spec,
        node_names=tuple(names) if names is not None else None,
        node_selector=dict(selector["matchLabels"]) if selector is not None else None,
        node_memory=memory,
    )
