"""Serving defaults that several roles, the planner and the operator's resource schema share, defined once."""

from __future__ import annotations

PLANNED_STREAMS = 88  # streams a stage's state is sized for (`cascadia shard --streams`, `plan --streams`)
MAX_STREAMS = 176  # streams the router keeps state for on the chain at once
ROWS_PER_GROUP = 8  # rows a pipeline group carries
PREFILL_WINDOW = 8  # prompt rows a prefill window carries
MAX_QUEUE = 1024  # requests waiting for admission before the router answers overloaded
# the precision modes a shard takes (`cascadia.engine.settings.preset` defines each)
PRECISIONS = ("f32", "bf16", "f16", "int8", "int4", "w8a8", "w4a8")
