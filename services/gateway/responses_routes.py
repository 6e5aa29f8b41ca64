"""`/v1/responses`: create (JSON or SSE events), retrieve, delete and list a stored response's input items."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Query, Request

from cascadia.gateway.auth import Key
from cascadia.gateway.errors import ApiError
from cascadia.gateway.response_store import (
    ConversationLost,
    ResponseStore,
    StoredResponse,
    StoreUnavailable,
    conversation,
)
from cascadia.gateway.responses import (
    OutputBuilder,
    as_response_error,
    chat_request,
    input_items,
    refuse_unsupported,
    status_of,
    turn_starts,
)
from cascadia.gateway.responses_schemas import DeletedResponse, InputItemList, ResponseBody, ResponseRequest
from cascadia.gateway.schemas import error_responses
from cascadia.gateway.tools import AnswerReader
from cascadia.gateway.watch import run_watched, watched_stream

if TYPE_CHECKING:
    from cascadia.gateway.app import Gateway, PreparedChat

log = logging.getLogger("cascadia.gateway")
TOO_LONG = ("prompt_too_long", "context_length_exceeded")  # the codes a shorter conversation may avoid
MAX_LISTED_ITEMS = 100


def _event(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


@contextlib.contextmanager
def _store_answering() -> Iterator[None]:
    """A store that does not answer is a 503 for the request that needed it."""
    try:
        yield
    except StoreUnavailable as exc:
        message = f"Stored responses are unavailable: {exc}"
        raise ApiError(503, message, "server_error", code="store_unavailable") from None


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"No response with id '{response_id}' is stored.", param=param, code="response_not_found")


def _started(body: ResponseRequest, prepared: PreparedChat, model: str, keep: bool) -> ResponseBody:
    """The response as it stands before its first token."""
    shape = body.text.format if body.text is not None and body.text.format is not None else None
    return ResponseBody(
        id=prepared.choices.response_id,
        created_at=int(time.time()),
        status="in_progress",
        model=model,
        output=[],
        instructions=body.instructions,
        previous_response_id=body.previous_response_id,
        max_output_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_logprobs=body.top_logprobs,
        tools=list(body.tools or ()),
        tool_choice=body.tool_choice or "auto",
        parallel_tool_calls=body.parallel_tool_calls is not False,
        text={"format": shape.model_dump(by_alias=True, exclude_none=True) if shape else {"type": "text"}},
        truncation=body.truncation or "disabled",
        store=keep,
        metadata=body.metadata or {},
        user=body.user,
    )


def _finished(started: ResponseBody, prepared: PreparedChat, builder: OutputBuilder) -> ResponseBody:
    generation = prepared.choices.generations[0]
    status, incomplete = status_of(generation.finish_reason)
    usage = prepared.choices.usage()
    return ResponseBody.model_validate(
        started.model_dump()
        | {
            "status": status,
            "incomplete_details": incomplete,
            "completed_at": int(time.time()),
            "output": builder.output,
            "usage": {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": usage.prompt_tokens_details.model_dump(),
                "output_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens,
            },
        }
    )


def _prepared(gateway: Gateway, body: ResponseRequest, items: list[dict[str, Any]]) -> PreparedChat:
    """The response's generation; with truncation "auto", from the first turn on which the conversation fits
    the context (the instructions always stay)."""
    starts = turn_starts(items) if body.truncation == "auto" else [0]
    for start in starts:
        try:
            return gateway.prepare_chat(chat_request(body, items[start:]), "resp")
        except ApiError as exc:
            if exc.code not in TOO_LONG or start == starts[-1]:
                raise as_response_error(exc) from None
    raise AssertionError("the last start returns or raises")


def add_response_routes(app: FastAPI, gateway: Gateway, store: ResponseStore) -> None:
    errors = error_responses(400, 401, 404, 413, 429, 503)
    events = {200: {"content": {"text/event-stream": {}}}}

    @app.post("/v1/responses", response_model=ResponseBody, responses={**errors, **events})
    async def create_response(body: ResponseRequest, request: Request, key: Key) -> Any:
        gateway.check_model(body.model)
        refuse_unsupported(body)
        context: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            with _store_answering():
                previous = await store.get(body.previous_response_id, key)
            if previous is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            try:
                with _store_answering():
                    context = await conversation(store, previous)
            except ConversationLost as lost:
                raise ApiError(
                    404,
                    f"Response '{lost.response_id}', which '{body.previous_response_id}' continues, is no longer "
                    "stored: give the conversation as input instead.",
                    param="previous_response_id",
                    code="response_not_found",
                ) from None
        items = input_items(body)
        prepared = _prepared(gateway, body, context + items)
        keep = body.store is not False
        started = _started(body, prepared, gateway.config.model_name, keep)
        builder = OutputBuilder(wants_logprobs=body.wants_logprobs)

        async def stored(response: ResponseBody) -> ResponseBody:
            """The response, stored when asked: the answer is given even when the store fails to keep it."""
            if keep:
                try:
                    await store.put(StoredResponse(key, response.model_dump(mode="json"), items))
                except StoreUnavailable as exc:
                    gateway.metrics.errors.labels("store_unavailable").inc()
                    log.warning("response %s was not stored: %s", response.id, exc)
            return response

        gateway.limiter.acquire(key)
        if body.stream:
            events = _events(prepared, started, builder, stored)
            failed = functools.partial(_failed, started, builder)
            release = functools.partial(gateway.limiter.release, key)
            return watched_stream(request, prepared.choices, events, failed, release, gateway.metrics)
        await run_watched(request, prepared.choices, functools.partial(gateway.limiter.release, key))
        generation = prepared.choices.generations[0]
        parts, finish = AnswerReader(prepared.tools).parts(generation.text, generation.finish_reason or "stop")
        builder.feed(parts, generation.logprobs)
        builder.finish(finish)
        return await stored(_finished(started, prepared, builder))

    @app.get("/v1/responses/{response_id}", response_model=ResponseBody, responses=error_responses(401, 404, 503))
    async def retrieve_response(response_id: str, key: Key) -> Any:
        with _store_answering():
            stored = await store.get(response_id, key)
        if stored is None:
            raise _not_found(response_id)
        return stored.body

    @app.delete("/v1/responses/{response_id}", response_model=DeletedResponse, responses=error_responses(401, 404, 503))
    async def delete_response(response_id: str, key: Key) -> DeletedResponse:
        with _store_answering():
            deleted = await store.delete(response_id, key)
        if not deleted:
            raise _not_found(response_id)
        return DeletedResponse(id=response_id)

    @app.get(
        "/v1/responses/{response_id}/input_items",
        response_model=InputItemList,
        responses=error_responses(400, 401, 404, 503),
    )
    async def list_input_items(
        response_id: str,
        key: Key,
        limit: int = Query(20, ge=1, le=MAX_LISTED_ITEMS),
        order: str = Query("desc", pattern="^(asc|desc)$"),
        after: str | None = None,
    ) -> InputItemList:
        with _store_answering():
            stored = await store.get(response_id, key)
        if stored is None:
            raise _not_found(response_id)
        items = list(stored.input)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[:limit]
        return InputItemList(
            data=page,
            first_id=page[0]["id"] if page else None,
            last_id=page[-1]["id"] if page else None,
            has_more=len(items) > limit,
        )


def _failed(started: ResponseBody, builder: OutputBuilder, exc: ApiError) -> list[str]:
    """The events of a response the fleet failed after its first events were sent."""
    code = exc.code or exc.type
    failed = started.model_dump() | {"status": "failed", "error": {"code": code, "message": exc.message}}
    return [
        _event(builder.event("error", code=code, message=exc.message, param=exc.param)),
        _event(builder.event("response.failed", response=ResponseBody.model_validate(failed).model_dump(mode="json"))),
    ]


async def _events(
    prepared: PreparedChat,
    started: ResponseBody,
    builder: OutputBuilder,
    stored: Callable[[ResponseBody], Awaitable[ResponseBody]],
) -> AsyncIterator[str]:
    """The response's events: created, its items as they arrive, and completed (or incomplete)."""
    reader = AnswerReader(prepared.tools)
    snapshot = started.model_dump(mode="json")
    yield _event(builder.event("response.created", response=snapshot))
    yield _event(builder.event("response.in_progress", response=snapshot))
    finish: str | None = None
    async for _, delta in prepared.choices.deltas():
        parts, finish = reader.parts(delta.text, delta.finish_reason)
        for event in builder.feed(parts, delta.tokens):
            yield _event(event)
    for event in builder.finish(finish):
        yield _event(event)
    final = await stored(_finished(started, prepared, builder))
    kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
    yield _event(builder.event(kind, response=final.model_dump(mode="json")))
