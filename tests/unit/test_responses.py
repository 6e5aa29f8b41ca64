"""The Responses API's pieces without a fleet: input items to chat messages, the output builder's items and
events, the stores (in memory and in a real Redis), and what the app refuses before the router."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from cascadia.gateway.app import GatewayConfig, create_app
from cascadia.gateway.auth import KeyRing
from cascadia.gateway.background import BackgroundRun, BackgroundRuns
from cascadia.gateway.errors import ApiError
from cascadia.gateway.generation import TokenLogprob
from cascadia.gateway.metrics import GatewayMetrics
from cascadia.gateway.response_store import (
    EVENT_LOGS,
    ConversationLost,
    MemoryStore,
    RedisStore,
    StoredConversation,
    StoredResponse,
    StoreUnavailable,
    conversation,
)
from cascadia.gateway.responses import OutputBuilder, chat_messages, chat_request, input_items, turn_starts
from cascadia.gateway.responses_routes import render_response
from cascadia.gateway.responses_schemas import ResponseRequest
from cascadia.gateway.router_client import RouterClient
from cascadia.gateway.text import TextCodec
from cascadia.gateway.tools import AnswerReader, ToolAnswer
from cascadia.router.local import free_port

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
IMAGE = {"type": "input_image", "image_url": "https://example.com/a.png"}
BAD_SCHEMA = {"type": "json_schema", "name": "s", "schema": {"type": "frob"}}
MARKUP = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def request(**fields) -> ResponseRequest:
    return ResponseRequest.model_validate({"model": "tiny", **fields})


def test_input_items_become_chat_messages_with_calls_joining_the_assistant_turn_before_them():
    body = request(
        instructions="Be brief.",
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
            {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "-3 C"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
            {"role": "developer", "content": [{"type": "input_text", "text": t} for t in ("Now ", "sum up.")]},
        ],
    )  # fmt: skip
    messages = chat_messages(body.instructions, input_items(body))
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool", "developer"]
    assert messages[0]["content"] == "Be brief." and messages[-1]["content"] == "Now sum up."
    assert messages[2]["content"] == "Checking."
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["call_1", "call_2"]
    assert (messages[3]["tool_call_id"], messages[3]["content"]) == ("call_1", "-3 C")
    assert messages[4]["content"] == "noon"
    # a call with no assistant text before it is an assistant turn of its own
    alone = chat_messages(None, [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}])
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert alone == [{"role": "assistant", "content": None, "tool_calls": [call]}]


def test_text_input_is_one_user_message_and_the_chat_request_carries_every_setting():
    body = request(
        input="Hi",
        max_output_tokens=7,
        temperature=0.5,
        top_p=0.9,
        seed=3,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
        tools=[{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        tool_choice={"type": "function", "name": "get_weather"},
        parallel_tool_calls=False,
    )
    [item] = input_items(body)
    assert item["id"].startswith("msg_") and item["status"] == "completed"
    assert (item["type"], item["role"], item["content"]) == ("message", "user", [{"type": "input_text", "text": "Hi"}])
    chat = chat_request(body, input_items(body))
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.seed) == (7, 0.5, 0.9, 3)
    assert chat.logprobs is True and chat.top_logprobs == 2
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.parameters == {"type": "object"}
    assert chat.tool_choice.function.name == "get_weather" and chat.parallel_tool_calls is False
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for shape in ({"type": "json_schema", "name": "s", "schema": schema}, {"type": "json_object"}):
        body = request(input="x", text={"format": shape})
        shaped = chat_request(body, input_items(body)).response_format
        assert shaped.type == shape["type"]
        assert shape["type"] == "json_object" or shaped.json_schema.json_schema == schema


def test_a_conversation_may_be_cut_only_where_a_user_turn_starts():
    items = [
        {"type": "message", "role": "user", "content": "a"},
        {"type": "message", "role": "assistant", "content": "b"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "d"},
        {"role": "user", "content": "e"},
        {"type": "message", "role": "developer", "content": "f"},
        {"type": "message", "role": "user", "content": "g"},
    ]
    assert turn_starts(items) == [0, 4, 6]
    assert turn_starts(items[1:4]) == [0]


class _Fits:
    """A stand-in for the gateway's rendering: a conversation fits when it has at most `fits` messages."""

    def __init__(self, fits: int, refusal: str = "context_length_exceeded") -> None:
        self.fits, self.refusal, self.rendered = fits, refusal, []

    def render_chat(self, request):
        self.rendered.append(len(request.messages))
        if len(request.messages) > self.fits:
            raise ApiError(400, f"{len(request.messages)} messages", param="max_tokens", code=self.refusal)
        return len(request.messages)


@pytest.mark.parametrize("turns", [1, 2, 7, 40])
def test_truncation_auto_starts_at_the_earliest_turn_that_fits_in_a_few_renders(turns):
    items = [{"role": role, "content": f"{role} {i}"} for i in range(turns) for role in ("user", "assistant")]
    items.append({"role": "user", "content": "last"})
    body = request(input=items, instructions="Be brief.", truncation="auto")
    for fits in range(2, 2 * turns + 3):  # the instructions and the last user turn always fit
        stand_in = _Fits(fits)
        rendered, chat = render_response(stand_in, body, input_items(body))
        # the instructions, then as many of the latest turns as fit: the earliest start a user turn begins at
        assert rendered == 1 + min(2 * turns + 1, (fits - 2) // 2 * 2 + 1) == len(chat.messages)
        assert len(stand_in.rendered) <= 2 + math.ceil(math.log2(turns + 1))
    whole = _Fits(2 * turns + 2)
    render_response(whole, body, input_items(body))
    assert whole.rendered == [2 * turns + 2]  # a conversation that fits is rendered once
    with pytest.raises(ApiError) as refused:
        render_response(_Fits(1), body, input_items(body))
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "max_output_tokens"
    other = _Fits(1, refusal="invalid_value")  # not a length: no shorter conversation is tried
    with pytest.raises(ApiError):
        render_response(other, body, input_items(body))
    assert len(other.rendered) == 1
    disabled = _Fits(2 * turns)  # one message short of the whole conversation
    with pytest.raises(ApiError):
        render_response(disabled, request(input=items, truncation="disabled"), input_items(body))
    assert len(disabled.rendered) == 1


def _replay(events: list[dict]) -> list[dict]:
    """The output items a client rebuilds from the events alone."""
    items: dict[int, dict] = {}
    for event in events:
        if event["type"] == "response.output_item.added":
            items[event["output_index"]] = {**event["item"], "text": "", "arguments": ""}
        elif event["type"] == "response.output_text.delta":
            items[event["output_index"]]["text"] += event["delta"]
        elif event["type"] == "response.function_call_arguments.delta":
            items[event["output_index"]]["arguments"] += event["delta"]
        elif event["type"] == "response.output_item.done":
            done = event["item"]
            rebuilt = items[event["output_index"]]
            if done["type"] == "message":
                assert done["content"][0]["text"] == rebuilt["text"]
            else:
                assert done["arguments"] == rebuilt["arguments"]
            items[event["output_index"]] = done
    return [items[i] for i in sorted(items)]


@pytest.mark.parametrize(
    ("text", "finish", "kinds"),
    [
        ("Plain words.", "stop", ["message"]),
        ("", "stop", ["message"]),
        ("\n" + MARKUP, "stop", ["function_call"]),  # a blank line before a call is no message
        ("Let me look. " + MARKUP + "\n" + MARKUP, "stop", ["message", "function_call", "function_call"]),
        (MARKUP + '\n<tool_call>\n{"name": "get_w', "length", ["function_call", "message"]),  # cut short
    ],
)
def test_the_output_streamed_in_pieces_is_the_output_built_whole(text, finish, kinds):
    tools = ToolAnswer("", markup=True)
    whole = OutputBuilder()
    parts, whole_finish = AnswerReader(tools).parts(text, finish)
    whole.feed(parts, [])
    whole.finish(whole_finish)

    streamed, reader, events = OutputBuilder(), AnswerReader(tools), []
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)] or [""]
    for n, piece in enumerate(pieces):
        parts, streamed_finish = reader.parts(piece, finish if n == len(pieces) - 1 else None)
        events += streamed.feed(parts, [])
    events += streamed.finish(streamed_finish)

    assert [item["type"] for item in whole.output] == [item["type"] for item in streamed.output] == kinds
    strip = lambda items: [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]  # noqa: E731
    assert strip(whole.output) == strip(streamed.output) == strip(_replay(events))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    if kinds[-1] == "message":
        assert streamed.output[-1]["status"] == ("incomplete" if finish == "length" else "completed")
    calls = [item for item in whole.output if item["type"] == "function_call"]
    assert all(c["name"] == "get_weather" and json.loads(c["arguments"]) == {"city": "Oslo"} for c in calls)


def test_log_probs_ride_on_the_text_deltas_that_carry_their_tokens():
    builder = OutputBuilder(wants_logprobs=True)
    first = builder.feed(["He"], [TokenLogprob(1, "He", -0.5, (("He", -0.5),))])
    second = builder.feed(["llo"], [TokenLogprob(2, "llo", -1.0, (("llo", -1.0), ("p", -2.0)))])
    done = builder.finish("stop")
    deltas = [e for e in first + second if e["type"] == "response.output_text.delta"]
    assert [[lp["token"] for lp in d["logprobs"]] for d in deltas] == [["He"], ["llo"]]
    assert [t["token"] for t in deltas[1]["logprobs"][0]["top_logprobs"]] == ["llo", "p"]
    text_done = next(e for e in done if e["type"] == "response.output_text.done")
    assert text_done["text"] == "Hello" and [lp["logprob"] for lp in text_done["logprobs"]] == [-0.5, -1.0]


def _stored(response_id: str, previous: str | None, said: str, owner: str = "alice") -> StoredResponse:
    text = {"type": "output_text", "text": f"re: {said}", "annotations": [], "logprobs": [{"token": "x"}]}
    answer = {"id": f"msg_{response_id}", "type": "message", "role": "assistant", "status": "completed"}
    answer["content"] = [text]
    body = {"id": response_id, "previous_response_id": previous, "output": [answer]}
    return StoredResponse(owner, body, [{"type": "message", "role": "user", "content": said}])


async def _conversation_checks(store) -> None:
    for n, previous in enumerate([None, "r0", "r1"]):
        await store.put(_stored(f"r{n}", previous, f"turn {n}"))
    last = await store.get("r2", "alice")
    items = await conversation(store, last)
    assert [i["content"] if i["role"] == "user" else i["content"][0]["text"] for i in items] == [
        "turn 0", "re: turn 0", "turn 1", "re: turn 1", "turn 2", "re: turn 2",
    ]  # fmt: skip
    assert all("logprobs" not in part for i in items if i["role"] == "assistant" for part in i["content"])
    assert await store.get("r2", "mallory") is None  # another key finds nothing
    assert not await store.delete("r1", "mallory") and await store.delete("r1", "alice")
    with pytest.raises(ConversationLost) as lost:
        await conversation(store, last)
    assert lost.value.response_id == "r1"


def _background(status: str) -> StoredResponse:
    return StoredResponse("alice", {"id": "b1", "status": status, "background": True, "output": []}, [])


async def _unfinished_checks(store) -> None:
    assert not await store.replace_unfinished(_background("in_progress"))  # nothing to replace: nothing stored
    assert await store.get("b1", "alice") is None
    await store.put(_background("queued"))
    assert await store.replace_unfinished(_background("in_progress"))
    assert await store.replace_unfinished(_background("cancelled"))
    assert not await store.replace_unfinished(_background("completed"))  # the cancel came first
    assert (await store.get("b1", "alice")).body["status"] == "cancelled"
    await store.put(_background("queued"))
    assert await store.delete("b1", "alice")
    assert not await store.replace_unfinished(_background("completed"))  # deleted: not stored again
    assert await store.get("b1", "alice") is None


async def _event_checks(store) -> None:
    await store.put(_background("queued"))
    for n in range(5):
        await store.add_event("b1", {"type": "response.output_text.delta", "sequence_number": n})
    assert [e["sequence_number"] for e in await store.events_after("b1", -1)] == [0, 1, 2, 3, 4]
    assert [e["sequence_number"] for e in await store.events_after("b1", 2)] == [3, 4]
    assert await store.events_after("b1", 4) == []
    assert await store.delete("b1", "alice")
    assert await store.events_after("b1", -1) == []  # deleted with its response


def test_the_memory_store_chains_turns_and_gives_up_the_least_recently_used():
    async def run():
        await _conversation_checks(MemoryStore(8))
        await _unfinished_checks(MemoryStore(8))
        await _event_checks(MemoryStore(8))
        many = MemoryStore(EVENT_LOGS + 8)  # a gateway alone keeps the events of its latest streams only
        for n in range(EVENT_LOGS + 2):
            await many.put(StoredResponse("alice", {"id": f"m{n}", "status": "queued", "output": []}, []))
            await many.add_event(f"m{n}", {"type": "response.created", "sequence_number": 0})
        assert [len(await many.events_after(f"m{n}", -1)) for n in (0, 1, 2, EVENT_LOGS + 1)] == [0, 0, 1, 1]
        store = MemoryStore(2)
        for n in range(2):
            await store.put(_stored(f"s{n}", None, "x"))
        assert await store.get("s0", "alice") is not None  # read: s1 is now the least recently used
        await store.put(_stored("s2", None, "x"))
        assert await store.get("s1", "alice") is None and await store.get("s0", "alice") is not None

    asyncio.run(run())


def test_the_redis_store_chains_turns_expires_them_and_says_when_redis_is_gone(redis_server):
    url, process = redis_server

    async def run():
        store = RedisStore(url, ttl_s=60)
        await _conversation_checks(store)
        await _unfinished_checks(store)
        await _event_checks(store)
        await store.hold("b1", 0.2)
        assert await store.held("b1")
        await asyncio.sleep(0.3)
        assert not await store.held("b1")
        import redis.asyncio as redis

        raw = redis.Redis.from_url(url)
        assert 0 < await raw.ttl("cascadia:response:r2") <= 60
        await raw.expire("cascadia:response:r2", 5)
        await store.get("r2", "alice")  # a read keeps it ttl_s longer
        assert await raw.ttl("cascadia:response:r2") > 5
        await raw.aclose()
        await store.close()

    asyncio.run(run())
    process.terminate()
    process.wait(10)

    async def gone():
        store = RedisStore(url, ttl_s=60)
        with pytest.raises(StoreUnavailable):
            await store.get("r2", "alice")
        with pytest.raises(StoreUnavailable):
            await store.put(_stored("r9", None, "x"))
        with pytest.raises(StoreUnavailable):
            await store.replace_unfinished(_background("completed"))
        with pytest.raises(StoreUnavailable):
            await store.held("b1")
        await store.close()

    asyncio.run(gone())


def test_a_background_run_stores_each_state_and_why_it_stopped():
    stopped_early = []

    async def events(outcome, gate: asyncio.Event):
        yield {"type": "response.created", "sequence_number": 0}
        await gate.wait()
        yield {"type": "response.output_item.added", "sequence_number": 1}
        if isinstance(outcome, Exception):
            raise outcome
        if outcome == "completed":
            yield {"type": "response.completed", "sequence_number": 2, "response": _background("completed").body}
            return
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:  # where a generation stops its request on the router
            stopped_early.append(True)
            raise

    def failed_events(exc):
        return [{"type": "error", "sequence_number": 2}, {"type": "response.failed", "sequence_number": 3}]

    async def run(outcome, poll_s: float = 0.01, keep_events: bool = False, store=None, started=None):
        store, released = store or MemoryStore(), []
        stopped_early.clear()  # each case counts its own run's stop
        runs = BackgroundRuns(store, GatewayMetrics(), poll_s=poll_s)
        queued = _background("queued")
        await store.put(queued)
        gate = asyncio.Event()
        body = queued.body
        runs.start(
            BackgroundRun(
                events(outcome, gate),
                StoredResponse("alice", body | {"status": "in_progress"}, []),
                lambda finished: StoredResponse("alice", finished, []),
                lambda exc: StoredResponse("alice", body | {"status": "failed", "error": exc.code}, []),
                lambda: released.append(True),
                failed_events if keep_events else None,
            )
        )
        if started is not None:
            await started(runs)
        await asyncio.sleep(0.05)
        assert (await store.get("b1", "alice")).body["status"] == "queued"  # no output yet
        gate.set()
        await asyncio.sleep(0.05)
        return store, runs, released

    async def failing():
        store, _, released = await run(ApiError(503, "The fleet is gone.", code="router_unavailable"))
        assert (await store.get("b1", "alice")).body == {**_background("failed").body, "error": "router_unavailable"}
        assert released == [True]

    async def cancelled():
        store, _, released = await run("forever")
        assert (await store.get("b1", "alice")).body["status"] == "in_progress" and not released
        await store.replace_unfinished(_background("cancelled"))
        await asyncio.sleep(0.05)
        assert released == [True] and stopped_early == [True]
        assert (await store.get("b1", "alice")).body["status"] == "cancelled"

    async def stopped():
        store, runs, released = await run("forever", poll_s=3600)
        await runs.stop()
        assert (await store.get("b1", "alice")).body["error"] == "gateway_stopped" and released == [True]
        assert stopped_early == [True]

    async def followed():
        followers = []

        async def gathered(runs, after):
            return [event async for event in runs.follow("b1", "alice", after)]

        async def start_following(runs):  # from the first event, and from the second, while the run goes on
            followers.extend(asyncio.ensure_future(gathered(runs, after)) for after in (-1, 0))

        store, runs, _ = await run(
            ApiError(503, "gone", code="router_unavailable"), keep_events=True, started=start_following
        )
        first, second = await asyncio.gather(*followers)
        assert [e["sequence_number"] for e in first] == [0, 1, 2, 3] and first[-1]["type"] == "response.failed"
        assert [e["sequence_number"] for e in second] == [1, 2, 3]
        assert await gathered(runs, 3) == []  # after its last: nothing more
        await store.delete("b1", "alice")
        assert await store.events_after("b1", -1) == []  # deleted with its response

    async def completing():
        store, _, released = await run("completed", keep_events=True)
        assert (await store.get("b1", "alice")).body["status"] == "completed" and released == [True]
        kept = await store.events_after("b1", -1)
        assert [e["type"] for e in kept] == ["response.created", "response.output_item.added", "response.completed"]

    async def lost():
        store = MemoryStore()
        runs = BackgroundRuns(store, GatewayMetrics())
        await store.hold("b1", 0.05)
        await store.put(_background("in_progress"))
        assert (await runs.settled(await store.get("b1", "alice"))).body["status"] == "in_progress"  # held
        await asyncio.sleep(0.1)  # its gateway said nothing more
        lost = await runs.settled(await store.get("b1", "alice"))
        assert lost.body["status"] == "failed" and lost.body["error"]["code"] == "gateway_lost"
        assert (await store.get("b1", "alice")).body == lost.body
        assert [e async for e in runs.follow("b1", "alice")] == []  # nothing more will come
        finished = _background("completed")
        assert await runs.settled(finished) is finished  # a finished one needs no holder

    for case in (failing, cancelled, stopped, followed, completing, lost):
        asyncio.run(case())


@pytest.fixture
def call(tiny):
    # nothing listens on the router's port: a request that got past the gateway's checks would be a 503
    config = GatewayConfig("tiny", 500, max_context=64)
    app = create_app(config, RouterClient(f"127.0.0.1:{free_port()}"), TextCodec.from_directory(tiny), KeyRing(["k"]))

    def run(method: str, path: str, **kwargs) -> httpx.Response:
        async def go():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
                return await client.request(method, path, headers={"Authorization": "Bearer k"}, **kwargs)

        return asyncio.run(go())

    return run


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            400,
            "input[0].content[0]",
            "input_image",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input[0]", "reasoning"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0]", "web_search"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, 400, "reasoning", "reason"),
        ({"input": "hi", "max_output_tokens": 1000}, 400, "max_output_tokens", "max_context"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "frob"}}}},
            400,
            "text.format",
            "text.format",
        ),
        ({"input": "hi", "tool_choice": "required"}, 400, "tool_choice", "tools"),
        ({"input": []}, 400, "input", "no input"),
        ({"input": "hi", "truncation": "middle"}, 400, "truncation", ""),
        ({"input": "hi", "background": True, "store": False}, 400, "store", "background"),
        ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "previous_response_id", "resp_unknown"),
        ({"input": "hi", "model": "other"}, 404, "model", "other"),
        ({"input": "hi"}, 503, None, "unavailable"),  # past every check: the router is not there
    ],
)
def test_bad_response_requests_are_refused_naming_the_parameter(call, body, status, param, words):
    response = call("POST", "/v1/responses", json={"model": "tiny", **body})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_unknown_stored_responses_are_404s(call):
    for method, path in [("GET", "/v1/responses/resp_x"), ("DELETE", "/v1/responses/resp_x"),
                         ("GET", "/v1/responses/resp_x/input_items")]:  # fmt: skip
        response = call(method, path)
        assert response.status_code == 404 and "resp_x" in response.json()["error"]["message"]


def test_a_method_a_path_does_not_serve_names_every_method_it_does(call):
    response = call("PUT", "/v1/responses/resp_x")
    assert response.status_code == 405 and response.headers["allow"] == "DELETE, GET"
    for method in ("GET", "DELETE"):  # the counting endpoint's path is no response's id
        response = call(method, "/v1/responses/input_tokens")
        assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert call("GET", "/v1/responses/input_tokens/input_items").status_code == 404
    response = call("GET", "/v1/responses/resp_x/input_items", params={"order": "sideways"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "query.order"


def test_input_tokens_are_counted_as_a_response_renders_them(call, tiny):
    codec = TextCodec.from_directory(tiny)

    def count(**body) -> httpx.Response:
        return call("POST", "/v1/responses/input_tokens", json=body)

    counted = count(input="How are you?", instructions="Be brief.")
    assert counted.status_code == 200, counted.text
    whole = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How are you?"}]
    assert counted.json() == {"object": "response.input_tokens", "input_tokens": len(codec.encode_chat(whole))}
    turns = [
        {"role": "user", "content": "Tell me a long story about the sea. " * 3},
        {"role": "assistant", "content": "No."},
    ]
    turns.append({"role": "user", "content": "Why?"})
    over = count(model="tiny", input=turns)  # over the 64-token context: still counted whole
    assert over.json()["input_tokens"] == len(codec.encode_chat(turns)) > 64
    cut = count(input=turns, truncation="auto")  # the turns a response would keep
    assert cut.json()["input_tokens"] == len(codec.encode_chat(turns[2:]))
    for body, status, param in [
        ({"input": "hi", "reasoning": {"effort": "high"}}, 400, "reasoning"),
        ({"input": [{"role": "user", "content": [IMAGE]}]}, 400, "input[0].content[0]"),
        ({"input": "hi", "conversation": "conv_1"}, 404, "conversation"),
        ({"input": "hi", "model": "other"}, 404, "model"),
        ({"input": "hi", "previous_response_id": "resp_gone"}, 404, "previous_response_id"),
    ]:
        refused = count(**body)
        assert refused.status_code == status and refused.json()["error"]["param"] == param, refused.text


async def _conversation_store_checks(store) -> None:
    said = [{"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    await store.put_conversation(StoredConversation("alice", "conv_1", 7, {"topic": "sea"}), said)
    assert (await store.get_conversation("conv_1", "alice")).metadata == {"topic": "sea"}
    assert await store.get_conversation("conv_1", "mallory") is None  # another key finds nothing
    assert await store.items("conv_1", "mallory") is None and not await store.add_items("conv_1", "mallory", said)
    answer = {"id": "msg_2", "type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yo"}]}
    assert await store.add_items("conv_1", "alice", [answer, {**answer, "id": "msg_3"}])
    assert [item["id"] for item in await store.items("conv_1", "alice")] == ["msg_1", "msg_2", "msg_3"]
    await store.put_conversation(StoredConversation("alice", "conv_1", 7, {"topic": "sky"}), [])  # metadata only
    assert (await store.get_conversation("conv_1", "alice")).metadata == {"topic": "sky"}
    assert len(await store.items("conv_1", "alice")) == 3
    assert not await store.delete_item("conv_1", "alice", "msg_9") and await store.delete_item(
        "conv_1", "alice", "msg_2"
    )
    assert [item["id"] for item in await store.items("conv_1", "alice")] == ["msg_1", "msg_3"]
    assert not await store.delete_conversation("conv_1", "mallory") and await store.delete_conversation(
        "conv_1", "alice"
    )
    assert await store.items("conv_1", "alice") is None and not await store.add_items("conv_1", "alice", said)


def test_conversations_are_kept_in_memory_and_in_redis_for_their_key_only(redis_server):
    url, _ = redis_server

    async def run():
        await _conversation_store_checks(MemoryStore(8))
        store = RedisStore(url, ttl_s=60)
        await _conversation_store_checks(store)
        await store.close()

    asyncio.run(run())


def test_the_conversations_api_keeps_items_in_order_and_refuses_what_it_cannot_serve(call):
    created = call(
        "POST", "/v1/conversations", json={"items": [{"role": "user", "content": "Hello"}], "metadata": {"a": "b"}}
    )
    assert created.status_code == 200, created.text
    conversation = created.json()
    assert conversation["id"].startswith("conv_") and conversation["object"] == "conversation"
    assert conversation["metadata"] == {"a": "b"}
    path = f"/v1/conversations/{conversation['id']}"
    assert call("GET", path).json() == conversation
    added = call("POST", path + "/items", json={"items": [{"role": "assistant", "content": f"r{n}"} for n in range(3)]})
    assert [item["content"][0] for item in added.json()["data"]] == [
        {"type": "output_text", "text": f"r{n}"} for n in range(3)
    ]
    first = call("GET", path + "/items", params={"order": "asc"}).json()
    assert [item["role"] for item in first["data"]] == ["user", "assistant", "assistant", "assistant"]
    assert first["data"][0]["content"] == [{"type": "input_text", "text": "Hello"}]
    newest = call("GET", path + "/items", params={"limit": 2}).json()
    assert [i["content"][0]["text"] for i in newest["data"]] == ["r2", "r1"] and newest["has_more"]
    rest = call("GET", path + "/items", params={"limit": 2, "after": newest["last_id"]}).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["r0", "Hello"] and not rest["has_more"]
    item = first["data"][1]
    assert call("GET", f"{path}/items/{item['id']}").json() == item
    assert call("DELETE", f"{path}/items/{item['id']}").json()["id"] == conversation["id"]
    assert call("GET", f"{path}/items/{item['id']}").status_code == 404
    updated = call("POST", path, json={"metadata": {"c": "d"}}).json()
    assert updated["metadata"] == {"c": "d"} and len(call("GET", path + "/items").json()["data"]) == 3
    for method, url, body, status, param in [
        ("POST", "/v1/conversations", {"items": [{"role": "user", "content": [IMAGE]}]}, 400, "items[0].content[0]"),
        ("POST", path + "/items", {"items": []}, 400, "items"),
        ("POST", "/v1/responses", {"model": "tiny", "input": "hi", "conversation": "conv_gone"}, 404, "conversation"),
        ("POST", "/v1/responses", {"model": "tiny", "input": "hi", "conversation": conversation["id"],
                                   "previous_response_id": "resp_1"}, 400, "conversation"),
        ("POST", "/v1/responses/input_tokens", {"input": "hi", "conversation": {"id": "conv_gone"}}, 404,
         "conversation"),
    ]:  # fmt: skip
        refused = call(method, url, json=body)
        assert refused.status_code == status and refused.json()["error"]["param"] == param, refused.text
    counted = call("POST", "/v1/responses/input_tokens", json={"input": "hi", "conversation": conversation["id"]})
    alone = call("POST", "/v1/responses/input_tokens", json={"input": "hi"})
    assert counted.json()["input_tokens"] > alone.json()["input_tokens"]  # the conversation's items come first
    assert call("DELETE", path).json() == {"id": conversation["id"], "object": "conversation.deleted", "deleted": True}
    assert call("GET", path).status_code == 404 and call("GET", path + "/items").status_code == 404
