"""`/v1/responses`: create (JSON or SSE events), retrieve, delete and list a stored response's input items."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import StreamingResponse
from starlette.convertors import StringConvertor, register_url_convertor

from cascadia.gateway.auth import Key
from cascadia.gateway.background import BackgroundRun, BackgroundRuns
from cascadia.gateway.errors import ApiError, bad_request
from cascadia.gateway.response_store import (
    ConversationLost,
    ResponseStore,
    StoredResponse,
    StoreUnavailable,
    conversation,
    output_as_input,
)
from cascadia.gateway.responses import (
    OutputBuilder,
    as_response_error,
    chat_request,
    input_items,
    page_of,
    refuse_unsupported,
    status_of,
    turn_starts,
)
from cascadia.gateway.responses_schemas import (
    DeletedResponse,
    InputItemList,
    InputTokenCount,
    InputTokensRequest,
    ResponseBody,
    ResponseInput,
    ResponseRequest,
)
from cascadia.gateway.schemas import error_responses
from cascadia.gateway.tools import AnswerReader
from cascadia.gateway.watch import SSE_HEADERS, run_watched, watched_stream

if TYPE_CHECKING:
    from cascadia.gateway.app import Gateway, PreparedChat, RenderedChat
    from cascadia.gateway.schemas import ChatCompletionRequest

log = logging.getLogger("cascadia.gateway")


class ResponseIdConvertor(StringConvertor):
    """A path segment naming a stored response: any but `input_tokens`, the counting endpoint's own path, so
    that a GET or DELETE there is a 405 naming POST rather than a search for a response of that id."""

    regex = "(?!input_tokens(?:/|$))[^/]+"


register_url_convertor("response_id", ResponseIdConvertor())
TOO_LONG = ("prompt_too_long", "context_length_exceeded")  # the codes a shorter conversation may avoid
MAX_LISTED_ITEMS = 100


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


@contextlib.contextmanager
def store_answering() -> Iterator[None]:
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
        background=bool(body.background),
        conversation={"id": conversation_id(body)} if body.conversation is not None else None,
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


def render_response(
    gateway: Gateway, body: ResponseRequest, items: list[dict[str, Any]]
) -> tuple[RenderedChat, ChatCompletionRequest]:
    """The response's prompt and the chat request it renders; with truncation "auto", from the earliest turn
    on which the conversation fits the context (the instructions always stay).

    The whole conversation is tried first, as it usually fits. Past that the turns are searched by halves,
    since a later start never renders longer: a conversation far over the context costs a few renders, not
    one per turn it leaves out.
    """
    starts = turn_starts(items) if body.truncation == "auto" else [0]
    low, high = 0, len(starts) - 1  # the earliest start that fits, if any, lies in starts[low..high]
    found: tuple[RenderedChat, ChatCompletionRequest] | None = None
    too_long: ApiError | None = None
    while low <= high:
        middle = low if found is None and too_long is None else (low + high) // 2
        request = chat_request(body, items[starts[middle] :])
        try:
            found = gateway.render_chat(request), request
            high = middle - 1
        except ApiError as exc:
            if exc.code not in TOO_LONG:
                raise as_response_error(exc) from None
            too_long, low = exc, middle + 1
    if found is None:
        assert too_long is not None
        raise as_response_error(too_long)
    return found


@dataclass(frozen=True)
class ItemPageQuery:
    """Which page of a list of items a request asks for: how many, newest or oldest first, after which."""

    limit: int
    order: str
    after: str | None

    def of(self, items: list[dict[str, Any]]) -> InputItemList:
        return page_of(items, self.limit, self.order, self.after)


def _item_page(
    limit: int = Query(20, ge=1, le=MAX_LISTED_ITEMS),
    order: str = Query("desc", pattern="^(asc|desc)$"),
    after: str | None = None,
) -> ItemPageQuery:
    return ItemPageQuery(limit, order, after)


ItemPage = Annotated[ItemPageQuery, Depends(_item_page)]


def conversation_not_found(conversation_id: str, param: str | None = None) -> ApiError:
    message = f"No conversation with id '{conversation_id}' is stored."
    return ApiError(404, message, param=param, code="conversation_not_found")


def conversation_id(body: ResponseInput) -> str | None:
    given = body.conversation
    return given if isinstance(given, str) or given is None else given.id


async def _earlier_turns(runs: BackgroundRuns, body: ResponseInput, key: str) -> list[dict[str, Any]]:
    """The items before this input: the conversation named, or the stored responses `previous_response_id`
    continues (404 when it is not, or no longer, whole)."""
    store = runs.store
    named = conversation_id(body)
    if named is not None:
        with store_answering():
            items = await store.items(named, key)
        if items is None:
            raise conversation_not_found(named, "conversation")
        return [output_as_input(item) for item in items]
    if body.previous_response_id is None:
        return []
    with store_answering():
        previous = await store.get(body.previous_response_id, key)
        if previous is not None:
            previous = await runs.settled(previous)
    if previous is None:
        raise _not_found(body.previous_response_id, "previous_response_id")
    if previous.unfinished:
        raise bad_request(
            f"Response '{previous.id}' is still {previous.body['status']}: continue it once it has finished.",
            "previous_response_id",
            "response_unfinished",
        )
    try:
        with store_answering():
            return await conversation(store, previous)
    except ConversationLost as lost:
        raise ApiError(
            404,
            f"Response '{lost.response_id}', which '{body.previous_response_id}' continues, is no longer "
            "stored: give the conversation as input instead.",
            param="previous_response_id",
            code="response_not_found",
        ) from None


def add_response_routes(app: FastAPI, gateway: Gateway, store: ResponseStore) -> BackgroundRuns:
    """The Responses API's routes; what they return runs the background responses (stop it on shutdown)."""
    errors = error_responses(400, 401, 404, 413, 429, 503)
    events = {200: {"content": {"text/event-stream": {}}}}
    runs = BackgroundRuns(store, gateway.metrics)

    @app.post("/v1/responses", response_model=ResponseBody, responses={**errors, **events})
    async def create_response(body: ResponseRequest, request: Request, key: Key) -> Any:
        gateway.check_model(body.model)
        refuse_unsupported(body)
        if body.background and body.store is False:
            raise bad_request("A background response is stored, to be polled: it cannot have store: false.", "store")
        context = await _earlier_turns(runs, body, key)
        items = input_items(body)
        prepared = gateway.start_chat(*render_response(gateway, body, context + items), "resp_")
        keep = body.store is not False
        started = _started(body, prepared, gateway.config.model_name, keep)
        builder = OutputBuilder(wants_logprobs=body.wants_logprobs)

        def as_stored(response: ResponseBody) -> StoredResponse:
            return StoredResponse(key, response.model_dump(mode="json"), items, bool(body.background and body.stream))

        async def added_to_conversation(response: ResponseBody) -> ResponseBody:
            """The response, its input and output added to the conversation it names, if it does."""
            named = conversation_id(body)
            if named is not None:
                said = items + [output_as_input(item) for item in response.model_dump(mode="json")["output"]]
                try:
                    if not await store.add_items(named, key, said):
                        log.warning("conversation %s was deleted before response %s was added", named, response.id)
                except StoreUnavailable as exc:
                    gateway.metrics.errors.labels("store_unavailable").inc()
                    log.warning("response %s was not added to conversation %s: %s", response.id, named, exc)
            return response

        async def stored(response: ResponseBody) -> ResponseBody:
            """The response, stored when asked: the answer is given even when the store fails to keep it."""
            await added_to_conversation(response)
            if keep:
                try:
                    await store.put(as_stored(response))
                except StoreUnavailable as exc:
                    gateway.metrics.errors.labels("store_unavailable").inc()
                    log.warning("response %s was not stored: %s", response.id, exc)
            return response

        gateway.limiter.acquire(key)
        release = functools.partial(gateway.limiter.release, key)
        if body.background:
            queued = started.model_copy(update={"status": "queued"})
            try:
                with store_answering():
                    await runs.hold(queued.id)
                    await store.put(as_stored(queued))
            except ApiError:
                release()
                raise

            runs.start(
                BackgroundRun(
                    _events(prepared, started, builder, added_to_conversation, created=queued),
                    as_stored(started),
                    lambda body: as_stored(ResponseBody.model_validate(body)),
                    lambda exc: as_stored(_failed_body(started, exc)),
                    release,
                    functools.partial(_failed_events, started, builder) if body.stream else None,
                )
            )
            if body.stream:  # followed from the store: a client that leaves stops nothing
                return _followed(runs.follow(started.id, key), gateway)
            return queued
        if body.stream:
            sse = (_sse(event) async for event in _events(prepared, started, builder, stored))
            failed = functools.partial(_failed, started, builder)
            return watched_stream(request, prepared.choices, sse, failed, release, gateway.metrics)
        await run_watched(request, prepared.choices, release)
        generation = prepared.choices.generations[0]
        parts, finish = AnswerReader(prepared.tools).parts(generation.text, generation.finish_reason or "stop")
        builder.feed(parts, generation.logprobs)
        builder.finish(finish)
        return await stored(_finished(started, prepared, builder))

    @app.post(
        "/v1/responses/{response_id:response_id}/cancel",
        response_model=ResponseBody,
        responses=error_responses(400, 401, 404, 503),
    )
    async def cancel_response(response_id: str, key: Key) -> Any:
        """Stop a background response that is queued or in progress; a finished one is returned as it is."""
        with store_answering():
            stored = await store.get(response_id, key)
            if stored is None:
                raise _not_found(response_id)
            stored = await runs.settled(stored)
            if not stored.body.get("background"):
                raise bad_request(f"Response '{response_id}' was not created with background: true.", None)
            if stored.unfinished:
                cancelled = dataclasses.replace(stored, body=stored.body | {"status": "cancelled"})
                if await store.replace_unfinished(cancelled):
                    return cancelled.body
                stored = await store.get(response_id, key)  # its run finished it first
                if stored is None:
                    raise _not_found(response_id)
        return stored.body

    @app.post(
        "/v1/responses/input_tokens", response_model=InputTokenCount, responses=error_responses(400, 401, 404, 503)
    )
    async def count_input_tokens(body: InputTokensRequest, key: Key) -> InputTokenCount:
        """The tokens a response to this input would read, counted as `POST /v1/responses` renders them.

        Over the context, with truncation disabled, the whole conversation is still counted (a response
        would be refused), so that a client learns by how much; with truncation auto, the turns a
        response would keep, or the latest user turn's on when not even that fits.
        """
        given = {name: getattr(body, name) for name in body.model_fields_set}
        asked = ResponseRequest(**given | {"model": body.model or gateway.config.model_name})
        gateway.check_model(asked.model)
        refuse_unsupported(asked)
        items = await _earlier_turns(runs, asked, key) + input_items(asked)
        try:
            rendered, _ = render_response(gateway, asked, items)
            return InputTokenCount(input_tokens=len(rendered.ids))
        except ApiError as exc:
            if exc.code not in TOO_LONG:
                raise
        start = turn_starts(items)[-1] if asked.truncation == "auto" else 0
        prompt = gateway.chat_prompt(chat_request(asked, items[start:]))
        return InputTokenCount(input_tokens=len(prompt.ids))

    @app.get(
        "/v1/responses/{response_id:response_id}",
        response_model=ResponseBody,
        responses={**error_responses(400, 401, 404, 503), **events},
    )
    async def retrieve_response(
        response_id: str,
        key: Key,
        stream: bool = Query(False, description="Follow a background response's stream (created with stream)."),
        starting_after: int = Query(
            -1, ge=-1, description="With stream: the events after this sequence number (-1: from the first)."
        ),
    ) -> Any:
        with store_answering():
            stored = await store.get(response_id, key)
            if stored is not None:
                stored = await runs.settled(stored)
        if stored is None:
            raise _not_found(response_id)
        if not stream:
            return stored.body
        if not stored.streamed:
            raise bad_request(
                f"Response '{response_id}' was not created with background: true and stream: true.", "stream"
            )
        return _followed(runs.follow(response_id, key, starting_after), gateway)

    @app.delete(
        "/v1/responses/{response_id:response_id}",
        response_model=DeletedResponse,
        responses=error_responses(401, 404, 503),
    )
    async def delete_response(response_id: str, key: Key) -> DeletedResponse:
        with store_answering():
            deleted = await store.delete(response_id, key)
        if not deleted:
            raise _not_found(response_id)
        return DeletedResponse(id=response_id)

    @app.get(
        "/v1/responses/{response_id:response_id}/input_items",
        response_model=InputItemList,
        responses=error_responses(400, 401, 404, 503),
    )
    async def list_input_items(response_id: str, key: Key, page: ItemPage) -> InputItemList:
        with store_answering():
            stored = await store.get(response_id, key)
        if stored is None:
            raise _not_found(response_id)
        return page.of(stored.input)

    return runs


def _failed_body(started: ResponseBody, exc: ApiError) -> ResponseBody:
    code = exc.code or exc.type
    return ResponseBody.model_validate(
        started.model_dump() | {"status": "failed", "error": {"code": code, "message": exc.message}}
    )


def _failed_events(started: ResponseBody, builder: OutputBuilder, exc: ApiError) -> list[dict[str, Any]]:
    """The events of a response the fleet failed after its first events were sent."""
    failed = _failed_body(started, exc).model_dump(mode="json")
    return [
        builder.event("error", code=exc.code or exc.type, message=exc.message, param=exc.param),
        builder.event("response.failed", response=failed),
    ]


def _failed(started: ResponseBody, builder: OutputBuilder, exc: ApiError) -> list[str]:
    return [_sse(event) for event in _failed_events(started, builder, exc)]


def _followed(events: AsyncIterator[dict[str, Any]], gateway: Gateway) -> StreamingResponse:
    """A background response's events as a stream; a store that stops answering ends it."""

    async def stream() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield _sse(event)
        except StoreUnavailable as exc:
            gateway.metrics.errors.labels("store_unavailable").inc()
            log.warning("a background response's stream ended: %s", exc)

    return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)


async def _events(
    prepared: PreparedChat,
    started: ResponseBody,
    builder: OutputBuilder,
    stored: Callable[[ResponseBody], Awaitable[ResponseBody]],
    created: ResponseBody | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """The response's events: `created` (default: as started), its items as they arrive, and completed (or
    incomplete)."""
    reader = AnswerReader(prepared.tools)
    snapshot = started.model_dump(mode="json")
    yield builder.event("response.created", response=(created or started).model_dump(mode="json"))
    yield builder.event("response.in_progress", response=snapshot)
    finish: str | None = None
    async for _, delta in prepared.choices.deltas():
        parts, finish = reader.parts(delta.text, delta.finish_reason)
        for event in builder.feed(parts, delta.tokens):
            yield event
    for event in builder.finish(finish):
        yield event
    final = await stored(_finished(started, prepared, builder))
    kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
    yield builder.event(kind, response=final.model_dump(mode="json"))
