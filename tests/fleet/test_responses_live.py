"""The Responses API over a live local fleet (`cascadia up`, 2 shard processes), through the real openai client:
the engine's tokens, the stream's events, conversations continued from stored responses (in memory and in a
Redis that two gateways share), function calls, and a client that goes away."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from cascadia.gateway.background import HOLD_S
from tests.live_gateway import KEYS, MODEL, router_stats, wait_until_active, wait_until_free

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
BRIEF = "Answer in a few words."
# on the tiny model this seed's answer runs to its 600 tokens, several seconds: time enough to stop it
LONG = {"input": "Tell me about the sea.", "max_output_tokens": 600, "temperature": 1, "extra_body": {"seed": 1}}


def test_a_response_is_the_engines_greedy_answer_streamed_or_not(live, solo):
    client = live.client()
    asked = {"instructions": BRIEF, "input": "What is a shard?", "max_output_tokens": 12, "temperature": 0}
    prompt = live.codec.encode_chat(
        [{"role": "system", "content": BRIEF}, {"role": "user", "content": "What is a shard?"}]
    )
    ids = solo(prompt, 12)
    whole = client.responses.create(model=MODEL, **asked)
    assert whole.output_text == live.codec.decode(ids)
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (len(prompt), len(ids))
    ended = ids[-1] in live.codec.stop_token_ids
    assert whole.status == ("completed" if ended else "incomplete")
    assert (whole.incomplete_details is None) == ended
    assert [item.type for item in whole.output] == ["message"] and whole.output[0].role == "assistant"
    assert whole.id.startswith("resp_") and whole.output[0].id.startswith("msg_")  # OpenAI's id forms
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": BRIEF}, {"role": "user", "content": "What is a shard?"}],
        max_tokens=12, temperature=0,
    )  # fmt: skip
    assert chat.choices[0].message.content == whole.output_text and chat.id.startswith("chatcmpl-")

    events = list(client.responses.create(model=MODEL, stream=True, **asked))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed" if ended else "response.incomplete",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text and events[-1].response.status == whole.status
    assert client.responses.retrieve(events[-1].response.id).output_text == whole.output_text


def test_the_stream_helper_gathers_a_completed_response(live):
    client = live.client()
    asked = {
        "input": "Say yes.",
        "max_output_tokens": 200,
        "temperature": 0,
        "text": {"format": {"type": "json_object"}},
    }
    with client.responses.stream(model=MODEL, **asked) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and isinstance(json.loads(final.output_text), dict)


def test_previous_response_id_continues_the_conversation_on_the_last_turns_state(live, solo):
    client = live.client()
    first = client.responses.create(
        model=MODEL, instructions=BRIEF, input="Say something about the sea.", max_output_tokens=10, temperature=0
    )
    counted = client.responses.input_tokens.count(
        model=MODEL, instructions=BRIEF, input="And about the sky?", previous_response_id=first.id
    )
    second = client.responses.create(
        model=MODEL, instructions=BRIEF, input="And about the sky?", previous_response_id=first.id,
        max_output_tokens=10, temperature=0,
    )  # fmt: skip
    assert counted.input_tokens == second.usage.input_tokens
    history = [
        {"role": "system", "content": BRIEF},
        {"role": "user", "content": "Say something about the sea."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And about the sky?"},
    ]
    prompt, before = live.codec.encode_chat(history), live.codec.encode_chat(history[:2])
    assert second.output_text == live.codec.decode(solo(prompt, 10))
    assert second.usage.input_tokens == len(prompt)
    # the first turn's state is taken over: its prompt at least is not computed again
    assert len(before) <= second.usage.input_tokens_details.cached_tokens < len(prompt)
    assert second.previous_response_id == first.id

    stored = client.responses.retrieve(second.id)
    assert stored.output_text == second.output_text and stored.usage == second.usage
    items = client.responses.input_items.list(second.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "And about the sky?")]
    other = live.client(KEYS[1])
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(second.id)  # a response belongs to the key that made it
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=MODEL, input="Go on.", previous_response_id=second.id, max_output_tokens=2)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match=first.id):  # the turn before is gone
        client.responses.create(model=MODEL, input="Go on.", previous_response_id=second.id, max_output_tokens=2)
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_conversation_gathers_each_responses_input_and_output_and_the_next_continues_it(live, solo):
    client = live.client()
    kept = client.conversations.create(items=[{"role": "user", "content": "Say something about the sea."}])
    first = client.responses.create(
        model=MODEL, instructions=BRIEF, conversation=kept.id, input=[], max_output_tokens=10, temperature=0
    )
    assert first.conversation.id == kept.id
    items = client.conversations.items.list(kept.id, order="asc").data
    assert [(item.type, item.role) for item in items] == [("message", "user"), ("message", "assistant")]
    assert items[1].content[0].text == first.output_text
    counted = client.responses.input_tokens.count(
        model=MODEL, instructions=BRIEF, conversation=kept.id, input="And about the sky?"
    )
    second = client.responses.create(
        model=MODEL, instructions=BRIEF, conversation={"id": kept.id}, input="And about the sky?",
        max_output_tokens=10, temperature=0, store=False,
    )  # fmt: skip
    history = [
        {"role": "system", "content": BRIEF},
        {"role": "user", "content": "Say something about the sea."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And about the sky?"},
    ]
    prompt = live.codec.encode_chat(history)
    assert second.output_text == live.codec.decode(solo(prompt, 10))
    assert second.usage.input_tokens == counted.input_tokens == len(prompt)
    # the first turn's state is taken over, as for previous_response_id
    assert second.usage.input_tokens_details.cached_tokens >= len(live.codec.encode_chat(history[:2]))
    assert len(client.conversations.items.list(kept.id).data) == 4  # store: false adds to it all the same
    later = client.responses.create(
        model=MODEL, conversation=kept.id, input="One more?", max_output_tokens=4, temperature=0, background=True
    )
    assert _polled(client, later.id).conversation.id == kept.id
    newest = client.conversations.items.list(kept.id, limit=2).data  # a background response adds to it as it ends
    assert [item.role for item in newest] == ["assistant", "user"] and newest[1].content[0].text == "One more?"
    client.conversations.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, conversation=kept.id, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):  # a conversation belongs to the key that made it
        live.client(KEYS[1]).conversations.retrieve(client.conversations.create().id)


def test_function_calls_come_as_items_and_their_outputs_continue_the_conversation_as_chat_does(live):
    client = live.client()
    question = "What is the weather in Oslo?"
    asked = {"tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 150, "temperature": 0}
    response = client.responses.create(model=MODEL, input=question, tools=[TOOL], **asked)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], tools=[CHAT_TOOL],
        tool_choice="required", parallel_tool_calls=False, max_tokens=150, temperature=0,
    )  # fmt: skip
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in chat.choices[0].message.tool_calls or ()]
    calls = [item for item in response.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    if not calls:  # the random model ran to max_output_tokens inside its call: the text as written
        assert response.status == "incomplete"
        return
    call = calls[0]
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city", "unit"}

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "-3 C, snow"}
    answer = client.responses.create(
        model=MODEL, previous_response_id=response.id, input=[result], tools=[TOOL], max_output_tokens=12, temperature=0
    )
    chat_history = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}},
        ]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "-3 C, snow"},
    ]  # fmt: skip
    chat_answer = client.chat.completions.create(
        model=MODEL, messages=chat_history, tools=[CHAT_TOOL], max_tokens=12, temperature=0
    )
    message = chat_answer.choices[0].message
    assert answer.output_text == (message.content or "")
    assert answer.usage.input_tokens == chat_answer.usage.prompt_tokens


def test_two_gateways_sharing_a_redis_continue_each_others_conversations(live, gateway_process, redis_server):
    url, _ = redis_server
    first_base, _ = gateway_process("--redis", url, keys=True)
    second_base, _ = gateway_process("--redis", url, keys=True)
    first = openai.OpenAI(base_url=first_base + "/v1", api_key=KEYS[0], max_retries=0, timeout=60)
    second = openai.OpenAI(base_url=second_base + "/v1", api_key=KEYS[0], max_retries=0, timeout=60)
    opened = first.responses.create(
        model=MODEL, instructions=BRIEF, input="Name a sea.", max_output_tokens=8, temperature=0
    )
    assert second.responses.retrieve(opened.id).output_text == opened.output_text
    went_on = second.responses.create(
        model=MODEL, instructions=BRIEF, input="And a river?", previous_response_id=opened.id,
        max_output_tokens=8, temperature=0,
    )  # fmt: skip
    assert went_on.usage.input_tokens_details.cached_tokens > 0
    assert first.responses.retrieve(went_on.id).previous_response_id == opened.id
    kept = first.conversations.create(items=[{"role": "user", "content": "Name a sea."}])
    answered = second.responses.create(
        model=MODEL, instructions=BRIEF, conversation=kept.id, input=[], max_output_tokens=8, temperature=0
    )
    assert answered.output_text == opened.output_text  # the same conversation, kept by the other gateway
    assert [i.role for i in first.conversations.items.list(kept.id, order="asc").data] == ["user", "assistant"]

    # a background response runs on the gateway that took it; any of them follows, polls and cancels it
    streamed = first.responses.create(
        model=MODEL, instructions=BRIEF, input="Name a sea.", max_output_tokens=8, temperature=0,
        background=True, stream=True,
    )  # fmt: skip
    created = next(iter(streamed))
    streamed.close()
    followed = list(second.responses.retrieve(created.response.id, stream=True))
    assert [e.type for e in followed][:2] == ["response.created", "response.in_progress"]
    assert followed[-1].response.output_text == opened.output_text
    wait_until_free(live)
    running = first.responses.create(model=MODEL, background=True, **LONG)
    assert _polled(second, running.id, until=("queued",)).status == "in_progress"
    assert second.responses.cancel(running.id).status == "cancelled"
    wait_until_free(live, timeout=2.0)
    assert first.responses.retrieve(running.id).status == "cancelled"
    # a gateway that stops leaves its runs failed, not in progress forever
    stopped = first.responses.create(model=MODEL, background=True, **LONG)
    wait_until_active(live, 1)
    process = gateway_process.processes[first_base]
    process.terminate()
    process.wait(15)
    failed = second.responses.retrieve(stopped.id)
    assert failed.status == "failed" and failed.error.code == "gateway_stopped"
    wait_until_free(live, timeout=2.0)
    # and one killed outright is found out once it no longer says it holds its runs
    third_base, _ = gateway_process("--redis", url, keys=True)
    third = openai.OpenAI(base_url=third_base + "/v1", api_key=KEYS[0], max_retries=0, timeout=60)
    killed = third.responses.create(model=MODEL, background=True, stream=True, **LONG)
    created = next(iter(killed))
    wait_until_active(live, 1)
    gateway_process.processes[third_base].kill()
    wait_until_free(live, timeout=5.0)  # its streams to the router broke: the router stopped its generation
    assert second.responses.retrieve(created.response.id).status in ("queued", "in_progress")  # not yet known
    lost = _polled(second, created.response.id, timeout=HOLD_S + 5)
    assert lost.status == "failed" and lost.error.code == "gateway_lost"
    followed = list(second.responses.retrieve(created.response.id, stream=True))  # ends, not waits forever
    assert followed and followed[0].type == "response.created"


def _polled(client: openai.OpenAI, response_id: str, timeout: float = 60.0, until=("queued", "in_progress")):
    """The response once its status leaves `until`."""
    deadline = time.monotonic() + timeout
    while (response := client.responses.retrieve(response_id)).status in until:
        assert time.monotonic() < deadline, f"{response_id} still {response.status}"
        time.sleep(0.05)
    return response


def test_a_background_response_is_polled_to_the_engines_answer_and_may_be_cancelled(live, solo):
    client = live.client()
    wait_until_free(live)
    asked = {"model": MODEL, "input": "Tell me about the sea.", "temperature": 0}
    queued = client.responses.create(max_output_tokens=10, background=True, **asked)
    assert queued.status == "queued" and queued.background and queued.output == []
    done = _polled(client, queued.id)
    prompt = live.codec.encode_chat([{"role": "user", "content": "Tell me about the sea."}])
    assert done.output_text == live.codec.decode(solo(prompt, 10)) and done.background
    assert done.status in ("completed", "incomplete") and done.usage.input_tokens == len(prompt)
    assert client.responses.cancel(queued.id).status == done.status  # finished: returned as it is
    went_on = client.responses.create(model=MODEL, input="Go on.", previous_response_id=queued.id, max_output_tokens=2)
    assert went_on.usage.input_tokens_details.cached_tokens >= len(prompt)  # a finished one continues as any
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(went_on.id)

    long = client.responses.create(model=MODEL, background=True, **LONG)
    with pytest.raises(openai.BadRequestError, match="still") as refused:  # not before it has finished
        client.responses.create(model=MODEL, input="More.", previous_response_id=long.id, max_output_tokens=2)
    assert refused.value.body["param"] == "previous_response_id"
    assert _polled(client, long.id, until=("queued",)).status == "in_progress"
    running = re.compile(r"^cascadia_background_responses (\S+)$", re.M)
    assert float(running.search(httpx.get(live.base + "/metrics").text).group(1)) == 1
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.id == long.id
    wait_until_free(live, timeout=2.0)  # stopped on the router well before its 600 tokens
    assert float(running.search(httpx.get(live.base + "/metrics").text).group(1)) == 0
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(long.id).status == "cancelled"

    deleted = client.responses.create(model=MODEL, background=True, **LONG)
    wait_until_active(live, 1)
    client.responses.delete(deleted.id)  # deleting one in progress stops it, and it is not stored again
    wait_until_free(live, timeout=2.0)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(deleted.id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(max_output_tokens=2, background=True, store=False, **asked)
    assert refused.value.body["param"] == "store"


def test_a_background_stream_outlives_its_client_and_is_followed_again_from_where_it_left(live):
    client = live.client()
    wait_until_free(live)
    seen = []
    with client.responses.create(model=MODEL, background=True, stream=True, **LONG) as stream:
        for event in stream:
            seen.append(event)
            if sum(e.type == "response.output_text.delta" for e in seen) == 5:
                break
    created = seen[0]
    assert created.type == "response.created" and created.response.status == "queued" and created.response.background
    time.sleep(0.3)
    assert router_stats(live).active_streams == 1  # its client left: the run goes on
    rest = list(client.responses.retrieve(created.response.id, stream=True, starting_after=seen[-1].sequence_number))
    assert [e.sequence_number for e in seen + rest] == list(range(len(seen) + len(rest)))
    text = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
    final = client.responses.retrieve(created.response.id)
    assert rest[-1].type == "response.incomplete" and final.status == "incomplete"
    assert final.output_text == text == rest[-1].response.output_text and final.usage.output_tokens == 600
    again = list(client.responses.retrieve(created.response.id, stream=True))  # from the first event, all of it
    assert [e.sequence_number for e in again] == list(range(len(again))) and again[-1].type == "response.incomplete"
    polled_only = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, background=True)
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    for response_id in (polled_only.id, plain.id):  # only a background stream's events are kept
        with pytest.raises(openai.BadRequestError, match="stream"):
            client.responses.retrieve(response_id, stream=True)
    _polled(client, polled_only.id)


def test_a_client_that_leaves_a_streamed_response_frees_its_stream(live):
    wait_until_free(live)
    body = {"model": MODEL, "input": [{"role": "user", "content": "Go on and on."}], "stream": True}
    body |= {"max_output_tokens": 600, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", live.base + "/v1/responses", json=body, headers=headers) as response,
    ):
        lines = response.iter_lines()  # kept: dropping the iterator closes the connection
        assert next(lines) == "event: response.created"
        wait_until_active(live, 1)
    wait_until_free(live, timeout=5.0)  # well before 600 tokens
    deadline = time.monotonic() + 5
    while not re.search(
        r'cascadia_errors_total\{kind="client_disconnected"\} [1-9]', httpx.get(live.base + "/metrics").text
    ):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert router_stats(live).active_streams == 0


def test_a_store_that_does_not_answer_still_gets_the_answer_and_reads_get_a_503(live, gateway_process):
    from cascadia.router.local import free_port

    base, log = gateway_process("--redis", f"redis://127.0.0.1:{free_port()}/0", keys=True)
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEYS[0], max_retries=0, timeout=60)
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, temperature=0)
    assert response.output and response.usage.output_tokens >= 1  # answered, though not stored
    with pytest.raises(openai.InternalServerError) as refused:
        client.responses.retrieve(response.id)
    assert refused.value.status_code == 503 and "unavailable" in str(refused.value)
    with pytest.raises(openai.InternalServerError):
        client.responses.create(model=MODEL, input="Go on.", previous_response_id=response.id, max_output_tokens=2)
    assert re.search(r'cascadia_errors_total\{kind="store_unavailable"\} [1-9]', httpx.get(base + "/metrics").text)
    assert "was not stored" in log.read_text()


def test_truncation_auto_leaves_the_oldest_turns_out_of_a_conversation_over_the_context(live, gateway_process):
    base, _ = gateway_process("--max-context", "160", keys=True)
    client = openai.OpenAI(base_url=base + "/v1", api_key=KEYS[0], max_retries=0, timeout=60)
    asked = {"model": MODEL, "instructions": "Be brief.", "max_output_tokens": 6, "temperature": 0}
    said = ["Tell me of the harbour.", "And of the market?", "And of the lamps?", "And of the gulls?"]
    previous, turns = None, []
    for text in said:
        response = client.responses.create(input=text, previous_response_id=previous, truncation="auto", **asked)
        previous = response.id
        turns.append((text, response.output_text, response.usage.input_tokens))
    with pytest.raises(openai.BadRequestError) as refused:  # whole, the conversation no longer fits
        client.responses.create(input="And the baker?", previous_response_id=previous, **asked)
    assert refused.value.body["param"] in ("input", "max_output_tokens")
    last = client.responses.create(input="And the baker?", previous_response_id=previous, truncation="auto", **asked)
    assert last.truncation == "auto" and last.status in ("completed", "incomplete")
    # the prompt is the conversation from some later user turn on, as chat renders that part of it
    history = [
        m
        for text, answer, _ in turns
        for m in ({"role": "user", "content": text}, {"role": "assistant", "content": answer})
    ]
    history.append({"role": "user", "content": "And the baker?"})
    for start in range(0, len(history), 2):
        messages = [{"role": "system", "content": "Be brief."}, *history[start:]]
        if len(live.codec.encode_chat(messages)) == last.usage.input_tokens:
            break
    else:
        raise AssertionError(f"no cut of the conversation renders to {last.usage.input_tokens} tokens")
    assert start > 0
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == last.output_text
