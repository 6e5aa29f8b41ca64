"""Each role's command line as one typed, frozen, checked object: built by the operator's render, the local
fleet and `cascadia up`, and checked by `cascadia shard` and `cascadia router` on the flags they were
given, so a flag is spelled, ordered and checked in one place.

`to_argv()` gives the arguments after `cascadia`; a field left None is not passed (the command's own
default holds). A bad combination is a ValueError whose message names the flags. This module imports no
role, so the operator and the router can build any role's line.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from cascadia.defaults import PRECISIONS


def _flag_value(value: object) -> str:
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return f"{value[0]}:{value[1]}"  # a layer range
    if isinstance(value, tuple | list):
        return ",".join(str(v) for v in value)
    return str(value)


class _RoleArgs:
    command: ClassVar[str]

    def to_argv(self) -> list[str]:
        argv = [self.command]
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if value is not None:
                argv += ["--" + f.name.replace("_", "-"), _flag_value(value)]
        return argv


def _check_precision(precision: str | None) -> None:
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"--precision '{precision}' is not one of {', '.join(PRECISIONS)}")


def _check_layers(layers: tuple[int, int]) -> None:
    if not 0 <= layers[0] < layers[1]:
        raise ValueError(f"--layers {layers[0]}:{layers[1]}: expected 0 <= A < B")


@dataclass(frozen=True)
class ShardArgs(_RoleArgs):
    """`cascadia shard`: one layer range, sending its rows to the next stage or, the last, to the router."""

    command: ClassVar[str] = "shard"
    model: str
    layers: tuple[int, int]
    listen: str
    stage: int
    precision: str
    device: str | None = None
    context: int | None = None
    streams: int | None = None
    next: str | None = None
    reply_to: str | None = None
    kv_precision: str | None = None
    mtp_depths: int | None = None
    threads: int | None = None

    def __post_init__(self) -> None:
        if (self.next is None) == (self.reply_to is None):
            raise ValueError("give exactly one of --next and --reply-to")
        _check_precision(self.precision)
        _check_layers(self.layers)
        if self.mtp_depths and self.reply_to is None:
            raise ValueError("--mtp-depths is for the last stage (the one with --reply-to)")


@dataclass(frozen=True)
class ConvertArgs(_RoleArgs):
    """`cascadia convert`: a stage's deployment form, written once before its shard starts."""

    command: ClassVar[str] = "convert"
    model: str
    out: str
    layers: tuple[int, int]
    precision: str
    device: str | None = None

    def __post_init__(self) -> None:
        _check_layers(self.layers)
        _check_precision(self.precision)


@dataclass(frozen=True)
class RouterArgs(_RoleArgs):
    """`cascadia router`: admission, pipeline groups and sampling over the chain of `stages`."""

    command: ClassVar[str] = "router"
    listen: str
    stages: tuple[str, ...]
    collect: str
    rows_per_group: int | None = None
    prefill_window: int | None = None
    max_streams: int | None = None
    max_queue: int | None = None
    keep_finished: int | None = None
    min_shared_prefix: int | None = None
    frames_in_flight: int | None = None
    draft_rows: int | None = None
    max_draft: int | None = None
    draft: str | None = None
    mtp_draft: int | None = None

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("--stages is empty")
        if self.max_draft is not None and self.rows_per_group is not None and self.max_draft >= self.rows_per_group:
            raise ValueError(f"--max-draft {self.max_draft} must be below --rows-per-group {self.rows_per_group}")
        if self.mtp_draft and not self.max_draft:
            raise ValueError(f"--mtp-draft {self.mtp_draft} drafts for speculative rounds: give --max-draft too")


@dataclass(frozen=True)
class GatewayArgs(_RoleArgs):
    """`cascadia gateway`: the OpenAI API in front of the router."""

    command: ClassVar[str] = "gateway"
    router: str
    model: str
    host: str | None = None
    port: int | None = None
    max_context: int | None = None
    max_concurrent_per_key: int | None = None
    api_keys_file: str | None = None
    redis: str | None = None
    response_ttl: int | None = None


@dataclass(frozen=True)
class DraftArgs(_RoleArgs):
    """`cascadia draft`: the proposer service, with shared contexts in Redis and an optional draft model."""

    command: ClassVar[str] = "draft"
    listen: str
    redis: str | None = None
    trust: float | None = None
    model: str | None = None
    target: str | None = None

    def __post_init__(self) -> None:
        if (self.model is None) != (self.target is None):
            raise ValueError("--model needs --target: the draft model's text is re-encoded with the target's tokenizer")
