"""The fleet's status from what was planned and observed: pure functions, `now` passed in."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True", "False" or "Unknown"
    reason: str
    message: str


@dataclass(frozen=True)
class ShardState:
    stage: int
    name: str  # the StatefulSet
    node: str
    ready: bool
    unready_since: datetime | None  # when it last stopped being ready (or was created)


@dataclass(frozen=True)
class Observed:
    shards: tuple[ShardState, ...]
    missing_nodes: tuple[str, ...]  # planned nodes the cluster does not have
    services_ready: dict[str, bool]  # router, gateway: at least one ready pod


def _list(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def serving_conditions(observed: Observed, now: datetime, grace_seconds: int, plan_note: str) -> list[Condition]:
    shards = observed.shards
    ready = [s for s in shards if s.ready]
    waiting = [s for s in shards if not s.ready]
    out = [Condition("Planned", "True", "Planned", plan_note)]
    if waiting:
        names = [f"{s.name} on {s.node}" for s in waiting]
        out.append(
            Condition(
                "ShardsReady",
                "False",
                "ShardsNotReady",
                f"{len(ready)}/{len(shards)} shards ready; waiting for {_list(names)}",
            )
        )
    else:
        out.append(Condition("ShardsReady", "True", "AllShardsReady", f"{len(shards)}/{len(shards)} shards ready"))
    down = sorted(name for name, ok in observed.services_ready.items() if not ok)
    if waiting or down:
        parts = [f"{len(waiting)} shard(s) not ready"] if waiting else []
        parts += [f"{name} not ready" for name in down]
        out.append(Condition("Ready", "False", "NotReady", "; ".join(parts)))
    else:
        out.append(Condition("Ready", "True", "Serving", "every shard, the router and the gateway are ready"))
    out.append(degraded(observed, now, grace_seconds))
    return out


def degraded(observed: Observed, now: datetime, grace_seconds: int) -> Condition:
    if observed.missing_nodes:
        by_node = {s.node: s for s in observed.shards}
        named = [f"{n} (stage {by_node[n].stage})" if n in by_node else n for n in observed.missing_nodes]
        return Condition("Degraded", "True", "NodeMissing", f"planned node(s) not in the cluster: {_list(named)}")
    stuck = [
        s for s in observed.shards
        if not s.ready and s.unready_since is not None
        and (now - s.unready_since).total_seconds() >= grace_seconds
    ]  # fmt: skip
    if stuck:
        named = [f"{s.name} on {s.node} for {int((now - s.unready_since).total_seconds())} s" for s in stuck]
        return Condition("Degraded", "True", "ShardUnready", f"shard(s) unready past {grace_seconds} s: {_list(named)}")
    return Condition("Degraded", "False", "AsExpected", "no missing node, no shard stuck unready")


def not_planned(reason: str, message: str) -> list[Condition]:
    return [
        Condition("Planned", "False", reason, message),
        Condition("Ready", "False", reason, message),
    ]


def merge_conditions(
    previous: list[dict[str, Any]], current: list[Condition], now: datetime, generation: int
) -> list[dict[str, Any]]:
    """Conditions as stored: a condition keeps its lastTransitionTime while its status stays the same."""
    before = {c.get("type"): c for c in previous or []}
    out = []
    for c in current:
        old = before.get(c.type)
        since = old.get("lastTransitionTime") if old and old.get("status") == c.status else None
        out.append({
            "type": c.type, "status": c.status, "reason": c.reason, "message": c.message,
            "lastTransitionTime": since or now.strftime("%Y-%m-%dT%H:%M:%SZ"), "observedGeneration": generation,
        })  # fmt: skip
    return out


def status_changed(previous: dict[str, Any], new: dict[str, Any]) -> bool:
    return any(previous.get(key) != value for key, value in new.items())
