"""The fleet's plan: the same pure planner as `cascadia plan`, fed from the spec."""

from __future__ import annotations

from typing import Any

from cascadia.model.config import shape_from_config
from cascadia.operator.spec import FleetSpec
from cascadia.planner import FleetPlan, PlanRequest, plan_fleet, preset_shape


def fleet_plan(spec: FleetSpec, nodes: list[str], model_config: dict[str, Any] | None) -> FleetPlan:
    shape = preset_shape(spec.get("model", "preset")) if model_config is None else shape_from_config(model_config)
    precision = spec.get("precision")
    serving = spec.get("serving")
    request = PlanRequest(
        nodes=tuple(nodes),
        node_memory=spec.node_memory,
        expert_weights=precision["experts"],
        attention_weights=precision["attention"],
        head_weights=precision["head"],
        layers_per_node=spec.get("layersPerNode"),
        streams=serving["maxStreams"],
        streams_per_step=serving["rowsPerGroup"],
        context=serving["contextBudget"],
        device=spec.get("device"),
    )
    return plan_fleet(shape, request)


def select_nodes(cluster: dict[str, dict[str, str]], match_labels: dict[str, str]) -> list[str]:
    """Nodes carrying every label, in name order (the pipeline order of a selected fleet)."""
    return sorted(name for name, labels in cluster.items() if all(labels.get(k) == v for k, v in match_labels.items()))
