"""The gateway over a live local fleet (`cascadia up`, 2 shard processes), through the real openai client."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest

from cascadia.bench.load import wait_until_ready
from cascadia.gateway.text import TextCodec
from cascadia.gateway.tools import CALL_CLOSE, CALL_OPEN, markup_grammar, split_calls, tool_calls_schema
from cascadia.grammar import cfg_grammar, choice_grammar, json_grammar, regex_grammar
from cascadia.router.local import free_port
from cascadia.router.scheduler import common_prefix
from tests.engine.test_grammar import SCHEMA, conforms
from tests.helpers import next_token_log_probs, with_tokenizer_config
from tests.live_gateway import (
    KEYS,
    MODEL,
    router_active,
    router_stats,
    shard_open_streams,
    wait_until_active,
    wait_until_free,
)

pytestmark = pytest.mark.slow


def expected_text(codec: TextCodec, ids: list[int]) -> str:
    return codec.decode(ids)


def test_models_lists_the_served_model(live):
    client = live.client()
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("other/model")


def test_completion_from_token_ids_is_the_single_process_greedy_output(live, solo):
    prompt = [5, 17, 300, 42, 77]
    ids = solo(prompt, 10)
    out = live.client().completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, logprobs=0)
    choice = out.choices[0]
    assert choice.text == expected_text(live.codec, ids)
    assert out.usage.prompt_tokens == len(prompt)  # used as given: no BOS, no template
    assert out.usage.completion_tokens == len(ids)
    assert choice.finish_reason == ("stop" if ids[-1] in live.codec.stop_token_ids else "length")
    assert choice.logprobs.tokens == [live.codec.token_text(t) for t in ids]
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert out._request_id.startswith("req_")  # the client reads x-request-id, as from OpenAI's API


def test_text_prompts_use_the_checkpoint_tokenizer(live, solo):
    prompt = "The fleet says hello"
    ids = live.codec.encode(prompt)
    out = live.client().completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert out.usage.prompt_tokens == len(ids)
    assert out.choices[0].text == expected_text(live.codec, solo(ids, 6))


def test_chat_streaming_and_not_agree_and_count_the_real_tokens(live, solo):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a shard?"}]
    prompt_ids = live.codec.encode_chat(messages)
    ids = solo(prompt_ids, 12)
    client = live.client()
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == expected_text(live.codec, ids)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt_ids), len(ids))
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)


def _prompt_with_readable_output(live, solo) -> tuple[list[int], str]:
    for seed in range(40):
        prompt = [3 + (seed * 37 + i * 11) % 255 for i in range(6)]
        text = expected_text(live.codec, solo(prompt, 24))
        if len(text.strip("\ufffd")) >= 4:
            return prompt, text
    pytest.fail("no prompt among 40 gives text to cut with a stop string")


def test_stop_strings_end_the_text_before_them_streaming_or_not(live, solo):
    prompt, text = _prompt_with_readable_output(live, solo)
    stop = text[2:4]
    expected = text[: text.index(stop)]
    client = live.client()
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "never!"])
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True
    )
    pieces = list(streamed)
    assert "".join(p.choices[0].text for p in pieces) == expected
    assert pieces[-1].choices[0].finish_reason == "stop"


def test_a_seed_reproduces_sampled_tokens_and_matches_the_engine(live, solo):
    prompt = [9, 8, 7, 6, 5]
    client = live.client()

    def sample(seed: int) -> list[str]:
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, top_p=0.9, seed=seed, logprobs=0
        )
        return out.choices[0].logprobs.tokens

    first = sample(1234)
    assert sample(1234) == first
    ids = solo(prompt, 12, temperature=1.0, top_p=0.9, seed=1234)
    assert first == [live.codec.token_text(t) for t in ids]
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_frequency_penalty_changes_greedy_output_away_from_repeats_as_the_engine_does(live, solo):
    prompt = [40, 41, 42]
    client = live.client()

    def tokens(**extra) -> list[str]:
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=0, **extra)
        return out.choices[0].logprobs.tokens

    plain, penalised = tokens(), tokens(frequency_penalty=2.0)
    assert penalised != plain
    assert penalised == [live.codec.token_text(t) for t in solo(prompt, 24, frequency_penalty=2.0)]
    assert max(collections.Counter(penalised).values()) < max(collections.Counter(plain).values())


def test_logit_bias_forces_and_bans_tokens_as_the_engine_does(live, solo):
    prompt = [5, 17, 300, 42, 77]
    client = live.client()
    forced = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logit_bias={"123": 100}, logprobs=0
    )
    assert forced.choices[0].logprobs.tokens == [live.codec.token_text(123)] * 12
    greedy = solo(prompt, 6)
    ids = solo(prompt, 6, logit_bias=((greedy[0], -100.0),))
    assert ids[0] != greedy[0]
    banned = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logit_bias={str(greedy[0]): -100}
    )
    assert banned.choices[0].text == expected_text(live.codec, ids)


def test_echo_returns_the_prompt_and_each_prompt_tokens_log_prob_as_the_engine_gives_it(live, solo, solo_engine):
    prompt = [5, 17, 300, 42, 77, 9, 11, 12, 13, 14]  # two prefill windows of the router
    expected = next_token_log_probs(solo_engine, prompt)
    client = live.client()
    args = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True}
    out = client.completions.create(logprobs=2, **args)
    choice, completion = out.choices[0], expected_text(live.codec, solo(prompt, 3))
    assert choice.text == live.codec.decode(prompt) + completion
    logprobs = choice.logprobs
    assert logprobs.tokens[: len(prompt)] == [live.codec.token_text(t) for t in prompt]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    scored = expected[np.arange(len(prompt) - 1), prompt[1:]]
    np.testing.assert_allclose(logprobs.token_logprobs[1 : len(prompt)], scored, atol=1e-4)
    for position in range(1, len(prompt)):
        row = expected[position - 1]  # keyed by text, as OpenAI keys them (tokens of the same text collapse)
        best = {live.codec.token_text(int(t)): row[t] for t in np.argsort(-row, kind="stable")[:2]}
        assert logprobs.top_logprobs[position] == pytest.approx(best, abs=1e-4)
    assert len(logprobs.tokens) == len(prompt) + out.usage.completion_tokens
    assert out.usage.prompt_tokens == len(prompt)
    chunks = [c.choices[0] for c in client.completions.create(logprobs=2, stream=True, **args) if c.choices]
    assert "".join(c.text for c in chunks) == choice.text
    assert [lp for c in chunks for lp in c.logprobs.token_logprobs] == logprobs.token_logprobs
    plain = client.completions.create(**args)
    assert plain.choices[0].text == choice.text and plain.choices[0].logprobs is None


def test_a_json_schema_response_format_gives_conforming_json_exactly_as_the_engine_does(live, solo):
    client = live.client()
    shape = {"type": "json_schema", "json_schema": {"name": "inventory", "schema": SCHEMA, "strict": True}}
    for i in range(3):
        messages = [{"role": "user", "content": f"Describe inventory number {i} as JSON."}]
        out = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=120, temperature=0, response_format=shape
        )
        content = out.choices[0].message.content
        assert conforms(json.loads(content)), content
        assert out.choices[0].finish_reason == "stop"
        ids = solo(live.codec.encode_chat(messages), 120, grammar=json_grammar(SCHEMA))
        assert content == expected_text(live.codec, ids)
        assert out.usage.completion_tokens == len(ids)


def test_a_json_object_response_format_streams_the_same_object_as_the_whole_response(live):
    client = live.client()
    body = {"response_format": {"type": "json_object"}}
    whole = client.completions.create(
        model=MODEL, prompt=[7, 8, 9], max_tokens=200, temperature=0.8, seed=5, extra_body=body
    )
    streamed = client.completions.create(
        model=MODEL, prompt=[7, 8, 9], max_tokens=200, temperature=0.8, seed=5, extra_body=body, stream=True
    )
    pieces = list(streamed)
    text = "".join(p.choices[0].text for p in pieces)
    assert text == whole.choices[0].text
    assert whole.choices[0].finish_reason == pieces[-1].choices[0].finish_reason == "stop"
    assert isinstance(json.loads(text), dict)
    plain = client.completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=200, temperature=0.8, seed=5)
    assert plain.choices[0].text != text


def test_structured_outputs_hold_text_to_a_choice_a_regex_or_a_grammar_as_the_engine_does(live, solo):
    client = live.client()
    cases = [
        ({"choice": ["yes", "no", "maybe later"]}, choice_grammar(["yes", "no", "maybe later"]), r"yes|no|maybe later"),
        ({"regex": r"[A-Z]{2}-[0-9]{3}"}, regex_grammar(r"[A-Z]{2}-[0-9]{3}"), r"[A-Z]{2}-[0-9]{3}"),
        ({"grammar": 'start: "id:" NUM\nNUM: /[1-9][0-9]?/'}, None, r"id:[1-9][0-9]?"),
        ({"grammar": 'root ::= "id:" [1-9] [0-9]?'}, None, r"id:[1-9][0-9]?"),  # GBNF
    ]
    for structured, grammar, pattern in cases:
        for prompt in ([5, 6, 7], [300, 12]):
            out = client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=32,
                temperature=0,
                logprobs=5,
                extra_body={"structured_outputs": structured},
            )
            text = out.choices[0].text
            assert re.fullmatch(pattern, text), (structured, text)
            logprobs = out.choices[0].logprobs
            assert "".join(logprobs.tokens) == text + live.codec.eos_token  # the token that ended it is listed
            for top in logprobs.top_logprobs:  # only tokens the grammar allowed, so at times fewer than 5
                assert 1 <= len(top) <= 5 and all(np.isfinite(v) for v in top.values())
            assert out.choices[0].finish_reason == "stop"
            if grammar is not None:
                assert text == expected_text(live.codec, solo(prompt, 32, grammar=grammar))


WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CLOCK_ARGS = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER_ARGS}},
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK_ARGS}},
]


def _calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def _calls_of(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _call_grammar(parallel: bool, prose: bool) -> str:
    """The grammar the gateway holds calls to for TOOLS (the tiny tokenizer holds both tags as tokens)."""
    tools = {"get_weather": WEATHER_ARGS, "get_time": CLOCK_ARGS}
    return cfg_grammar(markup_grammar(tools, parallel, prose, special=[CALL_OPEN, CALL_CLOSE]))


def test_auto_answers_in_text_or_calls_exactly_as_the_engine_does(live, solo):
    client = live.client()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    prompt = live.codec.encode_chat(messages, TOOLS)
    tag = live.codec.tokenizer.token_to_id(CALL_OPEN)
    grammar = _call_grammar(parallel=False, prose=True)

    # auto is the default with tools; left alone, the tiny model answers in text
    text = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, parallel_tool_calls=False, max_tokens=24, temperature=0
    )
    expected = expected_text(live.codec, solo(prompt, 24, grammar=grammar))
    assert CALL_OPEN not in expected
    assert text.choices[0].message.content == expected and text.choices[0].message.tool_calls is None

    pushed = {"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False, "logit_bias": {str(tag): 100}}
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=100, temperature=0, **pushed)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [(name, arguments)] = _calls(choice.message.tool_calls)
    if name == "get_weather":
        assert arguments["city"] in {"Paris", "Rome", "Oslo"} and arguments["unit"] in {"C", "F"}
    else:
        assert name == "get_time" and arguments["zone"] in {"UTC", "CET"}
    ids = solo(prompt, 100, grammar=grammar, logit_bias=((tag, 100.0),))
    prose, expected_calls = split_calls(expected_text(live.codec, ids))
    assert prose == "" and _calls_of(expected_calls) == [(name, arguments)]

    streamed = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=100, temperature=0, stream=True, **pushed
    )
    chunks = [c for c in streamed if c.choices]
    deltas = [call for c in chunks for call in c.choices[0].delta.tool_calls or ()]
    assert [d.index for d in deltas] == [0] and _calls(deltas) == [(name, arguments)]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_tool_calls_are_held_to_the_tools_schemas_exactly_as_the_engine_does(live, solo):
    client = live.client()
    messages = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
    asked = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 150, "temperature": 0}
    out = client.chat.completions.create(model=MODEL, messages=messages, **asked)
    choice = out.choices[0]
    calls = _calls(choice.message.tool_calls)
    assert calls and all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)
    for name, arguments in calls:
        if name == "get_weather":
            assert arguments["city"] in {"Paris", "Rome", "Oslo"} and arguments["unit"] in {"C", "F"}
        else:
            assert name == "get_time" and arguments["zone"] in {"UTC", "CET"}
    ids = solo(live.codec.encode_chat(messages, TOOLS), 150, grammar=_call_grammar(parallel=True, prose=False))
    rest, expected = split_calls(expected_text(live.codec, ids))
    assert calls == _calls_of(expected)
    # the random model may call until max_tokens: the whole calls are calls, a call cut short stays text
    ended = ids[-1] in live.codec.stop_token_ids
    assert choice.finish_reason == ("tool_calls" if ended else "length")
    assert choice.message.content == (rest or None) and (rest == "") == ended

    streamed = client.chat.completions.create(model=MODEL, messages=messages, stream=True, **asked)
    chunks = [c for c in streamed if c.choices]
    deltas = [call for c in chunks for call in c.choices[0].delta.tool_calls or ()]
    assert [d.index for d in deltas] == list(range(len(calls)))
    assert _calls(deltas) == calls
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == rest
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_a_conversations_next_turn_takes_over_the_last_turns_state_and_answers_as_the_engine_does(live, solo):
    client = live.client()
    messages = [{"role": "user", "content": "Say something about the sea, in a few words."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    history = [
        *messages,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And about the sky?"},
    ]
    second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=10, temperature=0)
    before, prompt = live.codec.encode_chat(messages), live.codec.encode_chat(history)
    assert prompt[: len(before)] == before
    assert second.choices[0].message.content == expected_text(live.codec, solo(prompt, 10))
    # the first turn's prompt at least (and as much of its answer as the rendered history spells the same)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert len(before) <= cached < len(prompt) == second.usage.prompt_tokens
    assert router_stats(live).reused_positions >= cached
    metrics = httpx.get(live.base + "/metrics").text
    assert float(re.search(r"cascadia_cached_prompt_tokens_total ([0-9.e+]+)", metrics).group(1)) >= cached


def test_users_sharing_a_system_prompt_start_from_a_kept_copy_of_it_and_answer_as_the_engine_does(live, solo):
    client = live.client()
    system = {"role": "system", "content": "You keep the lighthouse log. " * 4 + "Answer in a few words."}
    questions = ["Where is the lamp?", "Tell me of the storm.", "Name the keeper."]
    prompts, cached = [], []
    for question in questions:
        messages = [system, {"role": "user", "content": question}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
        prompts.append(live.codec.encode_chat(messages))
        assert reply.choices[0].message.content == expected_text(live.codec, solo(prompts[-1], 40))
        cached.append(reply.usage.prompt_tokens_details.cached_tokens)
    shared = common_prefix(prompts[0], prompts[1])
    assert shared == common_prefix(prompts[1], prompts[2]) > 100  # where the questions part
    # the first user's request says where its system message and the next turn's cue end: it leaves a copy
    # there, which every later user starts from (the first answer went past the rewind slack from there)
    cue = [system, {"role": "user", "content": ""}]
    opening = live.codec.encode(live.codec.render_chat(cue, add_generation_prompt=False), add_bos=False)
    assert cached == [0, cached[1], cached[1]] and 100 < cached[1] <= shared
    assert prompts[0][: cached[1]] == opening[: cached[1]] and shared - cached[1] < 3
    assert router_stats(live).shared_prefixes >= 1
    metrics = httpx.get(live.base + "/metrics").text
    assert float(re.search(r"cascadia_router_shared_prefixes ([0-9.e+]+)", metrics).group(1)) >= 1
    assert float(re.search(r"cascadia_router_kept_streams ([0-9.e+]+)", metrics).group(1)) >= 3


def test_a_template_that_writes_calls_its_own_way_gets_a_bare_list_of_calls_as_the_engine_does(
    live, solo, gateway_process, tiny, tmp_path
):
    """The markup is not this model's: auto is refused, and a required call is held to a JSON list."""
    template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}assistant:"
    )
    own = with_tokenizer_config(tiny, tmp_path / "own-template", chat_template=template)
    codec = TextCodec.from_directory(own)
    assert codec.takes_tools and not codec.knows_call_markup
    base, _ = gateway_process(model=own)
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
    with pytest.raises(openai.BadRequestError, match="another way"):
        client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8)
    asked = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 150, "temperature": 0}
    out = client.chat.completions.create(model=MODEL, messages=messages, **asked)
    schema = tool_calls_schema({"get_weather": WEATHER_ARGS, "get_time": CLOCK_ARGS}, parallel=True)
    ids = solo(codec.encode_chat(messages, TOOLS), 150, grammar=json_grammar(schema))
    expected = json.loads(expected_text(codec, ids))
    assert out.choices[0].finish_reason == "tool_calls" and out.choices[0].message.content is None
    assert _calls(out.choices[0].message.tool_calls) == _calls_of_list(expected)
    streamed = [c for c in client.chat.completions.create(model=MODEL, messages=messages, stream=True, **asked)]
    deltas = [call for c in streamed if c.choices for call in c.choices[0].delta.tool_calls or ()]
    assert [d.index for d in deltas] == list(range(len(expected))) and _calls(deltas) == _calls_of_list(expected)
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


def _calls_of_list(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["name"], c["arguments"]) for c in calls]


def test_a_named_tool_without_parallel_calls_gives_one_call_of_it_and_results_round_trip(live, solo):
    client = live.client()
    messages = [{"role": "user", "content": "Time?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    out = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=named, parallel_tool_calls=False, max_tokens=100
    )
    [(name, arguments)] = _calls(out.choices[0].message.tool_calls)
    assert name == "get_time" and arguments["zone"] in {"UTC", "CET"}
    call = out.choices[0].message.tool_calls[0]
    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0
    )
    rendered = [{**m, "content": m["content"] or ""} for m in history]
    rendered[1]["tool_calls"] = [
        {"id": call.id, "type": "function", "function": {"name": name, "arguments": arguments}}  # arguments parsed
    ]
    expected = solo(live.codec.encode_chat(rendered, TOOLS), 8)  # the calls and the result reach the prompt
    assert answer.choices[0].message.content == expected_text(live.codec, expected)
    assert answer.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice"),  # auto, the default
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}], "tool_choice": "none"}, "tools"),
        ({"messages": [{"role": "tool", "content": "12:00"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "x"}]}, "messages"),
        ({"messages": [{"role": "assistant"}]}, "messages"),
    ],
)
def test_bad_tool_requests_get_a_400_naming_the_parameter(live, extra, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    response = httpx.post(live.base + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)


def test_chat_top_logprobs_are_sorted_and_include_alternatives(live):
    out = live.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for token in content:
        tops = [t.logprob for t in token.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert token.logprob == pytest.approx(tops[0], abs=1e-5)  # greedy: the chosen one is the best


def test_thirty_two_concurrent_streaming_clients_each_get_their_own_greedy_text(live, solo):
    prompts = [[3 + (i * 13 + j * 7) % 250 for j in range(1 + i % 9)] for i in range(32)]
    expected = [solo(p, 8) for p in prompts]

    async def one(client: openai.AsyncOpenAI, prompt: list[int]) -> tuple[str, int]:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage

    async def everyone():
        client = live.async_client()
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()

    results = asyncio.run(everyone())
    for (text, completion_tokens), ids in zip(results, expected, strict=True):
        assert text == expected_text(live.codec, ids)
        assert completion_tokens == len(ids)


def test_a_batch_of_prompts_with_n_choices_each_gives_every_single_requests_output(live, solo):
    prompts = [[5, 17, 300, 42], [9, 8, 7]]
    client = live.client()
    out = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=8, temperature=0)
    ids = [solo(p, 8) for p in prompts]
    greedy = [expected_text(live.codec, i) for i in ids]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [greedy[0], greedy[0], greedy[1], greedy[1]]
    assert out.usage.prompt_tokens == sum(map(len, prompts))  # each prompt once, however many choices it has
    assert out.usage.completion_tokens == 2 * (len(ids[0]) + len(ids[1]))
    text_batch = client.completions.create(model=MODEL, prompt=["The fleet", "says hello"], max_tokens=4, temperature=0)
    for choice, text in zip(text_batch.choices, ["The fleet", "says hello"], strict=True):
        assert choice.text == expected_text(live.codec, solo(live.codec.encode(text), 4))


def test_n_sampled_choices_differ_and_each_is_the_single_request_with_its_seed(live, solo):
    prompt = [9, 8, 7, 6, 5]
    client = live.client()
    sampling = {"max_tokens": 10, "temperature": 1.0, "logprobs": 0}
    out = client.completions.create(model=MODEL, prompt=prompt, n=3, seed=1234, **sampling)
    tokens = [c.logprobs.tokens for c in out.choices]
    assert len({tuple(t) for t in tokens}) == 3
    for j, choice_tokens in enumerate(tokens):
        alone = client.completions.create(model=MODEL, prompt=prompt, seed=1234 + j, **sampling)
        assert alone.choices[0].logprobs.tokens == choice_tokens
    ids = solo(prompt, 10, temperature=1.0, seed=1235)
    assert tokens[1] == [live.codec.token_text(t) for t in ids]


def test_streamed_choices_carry_their_index_and_match_the_whole_response(live):
    messages = [{"role": "user", "content": "What is a shard?"}]
    client = live.client()
    sampling = {"max_tokens": 8, "temperature": 1.0, "seed": 77, "n": 3}
    whole = client.chat.completions.create(model=MODEL, messages=messages, **sampling)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}, **sampling
        )
    )
    assert len({c.id for c in chunks}) == 1
    texts: dict[int, str] = collections.defaultdict(str)
    roles: dict[int, list] = collections.defaultdict(list)
    finishes: dict[int, list] = collections.defaultdict(list)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index].append(choice.delta.role)
        if choice.finish_reason:
            finishes[choice.index].append(choice.finish_reason)
    assert {i: texts[i] for i in range(3)} == {c.index: c.message.content for c in whole.choices}
    assert all(roles[i][0] == "assistant" and set(roles[i][1:]) <= {None} for i in range(3))
    assert {i: f for i, f in finishes.items()} == {c.index: [c.finish_reason] for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens == len(live.codec.encode_chat(messages))


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "hi", "top_k": 2**80}, 400, "top_k"),
        ({"model": MODEL, "prompt": "hi", "n": 17}, 400, "n"),
        ({"model": MODEL, "prompt": ["a", "b", "c"], "n": 6}, 400, "n"),  # 18 choices
        ({"model": MODEL, "prompt": [[1, 2], [3, 600]]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [[5], [5] * 1000], "max_tokens": 100}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "hi", "logit_bias": {"5": 1, "05": 2}}, 400, "logit_bias"),
        ({"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "best_of"),
        ({"model": MODEL, "prompt": "hi", "response_format": {"type": "xml"}}, 400, "response_format"),
        ({"model": MODEL, "prompt": "hi", "structured_outputs": {"regex": "(a"}}, 400, "structured_outputs"),
        ({"model": MODEL, "prompt": "hi", "structured_outputs": {"grammar": "start: x"}}, 400, "structured_outputs"),
        ({"model": MODEL, "prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400, "structured"),
        ({"model": MODEL, "prompt": "hi", "structured_outputs": {}}, 400, "structured_outputs"),
        (
            {
                "model": MODEL,
                "prompt": "hi",
                "structured_outputs": {"choice": ["a"]},
                "response_format": {"type": "json_object"},
            },
            400,
            "structured_outputs",
        ),
        (
            {
                "model": MODEL,
                "prompt": "hi",
                "response_format": {"type": "json_schema", "json_schema": {"name": "a b"}},
            },
            400,
            "response_format",
        ),
        (
            {
                "model": MODEL,
                "prompt": "hi",
                "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "frob"}}},
            },
            400,
            "response_format",
        ),
        ({"model": MODEL, "prompt": [1, 2, 600]}, 400, "prompt"),
        ({"model": MODEL, "prompt": [4.5]}, 400, "prompt.list[int].0"),
        ({"model": MODEL, "prompt": ""}, 400, None),
        ({"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ({"model": MODEL, "prompt": [5] * 1100}, 400, "prompt"),
        ({"model": MODEL, "prompt": [5] * 1000, "max_tokens": 100}, 400, "max_tokens"),
    ],
)
def test_bad_completion_requests_get_4xx_naming_the_problem(live, body, status, param):
    response = httpx.post(live.base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS[0]}"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param.split(".")[0])


def test_bad_json_wrong_shapes_and_auth_failures_are_4xx(live):
    url = live.base + "/v1/chat/completions"
    auth = {"Authorization": f"Bearer {KEYS[0]}", "Content-Type": "application/json"}
    assert httpx.post(url, content=b"{not json", headers=auth).status_code == 400
    assert httpx.post(url, json={"model": MODEL, "messages": "hi"}, headers=auth).status_code == 400
    assert httpx.post(url, json={"model": MODEL, "messages": []}, headers=auth).status_code == 400
    bad_role = {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}
    assert httpx.post(url, json=bad_role, headers=auth).status_code == 400
    top_without = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    response = httpx.post(url, json=top_without, headers=auth)
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_logprobs"
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer sk-wrong-key-123"}, {"Authorization": KEYS[0]}):
        response = httpx.post(url, json=ok, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        live.client(key="sk-wrong-key-123").models.list()
    with pytest.raises(openai.NotFoundError):
        live.client().completions.create(model="other", prompt="x")
    logs = "".join(p.read_text() for p in live.log_dir.glob("*.log"))
    assert not any(k in logs for k in (*KEYS, "sk-wrong-key-123"))


LONG = {"model": MODEL, "prompt": [7, 8], "max_tokens": 600, "temperature": 0}  # runs for seconds


@pytest.mark.parametrize(("stream", "n"), [(True, 1), (False, 1), (True, 3), (False, 3)])
def test_a_client_that_disconnects_frees_its_streams_on_every_stage(live, stream, n):
    wait_until_free(live)
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    body = {**LONG, "n": n}
    with httpx.Client(timeout=30) as client:
        if stream:
            body["stream"] = True
            with client.stream("POST", live.base + "/v1/completions", json=body, headers=headers) as response:
                lines = response.iter_lines()  # kept: dropping the iterator closes the connection
                first = next(lines)
                assert first.startswith('data: {"id"'), first
                wait_until_active(live, n)
                kept = router_stats(live).kept_streams
                deadline = time.monotonic() + 15  # the opens travel down the pipeline with the first frames
                while shard_open_streams(live) != [n + kept] * 2:
                    assert time.monotonic() < deadline, shard_open_streams(live)
                    time.sleep(0.05)
                assert router_active(live) == n
        else:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                call = pool.submit(client.post, live.base + "/v1/completions", json=body, headers=headers, timeout=2.0)
                wait_until_active(live, n)
                with pytest.raises(httpx.ReadTimeout):
                    call.result()
    wait_until_free(live, timeout=5.0)  # well before the 600 tokens would have been generated
    metrics = httpx.get(live.base + "/metrics").text
    assert re.search(r'cascadia_errors_total\{kind="client_disconnected"\} [1-9]', metrics)


def test_metrics_count_requests_tokens_and_latencies(live):
    client = live.client()
    client.completions.create(model=MODEL, prompt=[3, 4], max_tokens=3, temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[3, 4], max_tokens=0)
    text = httpx.get(live.base + "/metrics").text

    def value(pattern: str) -> float:
        match = re.search(pattern + r" ([0-9.e+]+)", text)
        assert match, pattern
        return float(match.group(1))

    assert value(r'cascadia_requests_total\{endpoint="/v1/completions",status="200"\}') >= 1
    assert value(r'cascadia_requests_total\{endpoint="/v1/completions",status="400"\}') >= 1
    assert value(r"cascadia_prompt_tokens_total") >= 2
    assert value(r"cascadia_completion_tokens_total") >= 3
    assert value(r"cascadia_time_to_first_token_seconds_count") >= 1
    assert value(r"cascadia_inter_token_latency_seconds_count") >= 2
    assert "cascadia_router_queue_depth" in text


def test_health_and_readiness_follow_the_router(live, gateway_process):
    assert httpx.get(live.base + "/healthz").json() == {"status": "ok"}
    assert httpx.get(live.base + "/readyz").status_code == 200
    base, _ = gateway_process(router=f"127.0.0.1:{free_port()}", ready=False)  # nothing listens there
    assert httpx.get(base + "/healthz").status_code == 200
    response = httpx.get(base + "/readyz")
    assert response.status_code == 503 and "router" in response.json()["detail"]
    response = httpx.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert response.status_code == 503 and response.json()["error"]["message"]


def test_concurrent_requests_per_key_are_limited(live, gateway_process):
    base, _ = gateway_process("--max-concurrent-per-key", "1", keys=True)
    wait_until_free(live)
    headers = [{"Authorization": f"Bearer {k}"} for k in KEYS]
    short = {"model": MODEL, "prompt": [7, 8], "max_tokens": 2}
    with httpx.Client(timeout=60) as client, concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(client.post, base + "/v1/completions", json=LONG, headers=headers[0])
        wait_until_active(live)
        refused = client.post(base + "/v1/completions", json=short, headers=headers[0])
        assert refused.status_code == 429
        assert "max_concurrent_requests_per_key" in refused.json()["error"]["message"]
        assert client.post(base + "/v1/completions", json=short, headers=headers[1]).status_code == 200
        assert running.result().status_code == 200
        assert client.post(base + "/v1/completions", json=short, headers=headers[0]).status_code == 200


def test_without_keys_the_gateway_is_open_and_says_so(live, gateway_process):
    base, log = gateway_process()
    out = openai.OpenAI(base_url=base + "/v1", api_key="anything", max_retries=0).completions.create(
        model=MODEL, prompt=[3], max_tokens=2, temperature=0
    )
    assert out.usage.completion_tokens >= 1
    assert "no API keys configured" in log.read_text()


def test_schemathesis_finds_no_server_errors_and_responses_conform(live, gateway_process, tmp_path):
    base, _ = gateway_process("--max-context", "24")
    command = [
        sys.executable, "-m", "schemathesis.cli", "run", base + "/openapi.json",
        "--checks", "all", "--exclude-checks", "positive_data_acceptance",
        "--max-examples", "25", "--workers", "1", "--seed", "1", "--no-color",
    ]  # fmt: skip
    # one worker: hypothesis describes the filters of query parameters' wrong-type values from their source,
    # and that cache is not thread-safe (with two workers schemathesis itself crashed in KeyError and a
    # SystemError from ast.parse, while every case it had run passed)
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    wait_until_free(live)


def test_the_gateway_rides_out_a_router_restart(tiny, tmp_path):
    from cascadia.router.local import LocalFleet

    fleet = LocalFleet(tiny, 2)
    fleet.start(tmp_path)
    router_port, port = free_port(), free_port()
    fleet.start_router(router_port, tmp_path / "router.log")
    env = {k: v for k, v in os.environ.items() if k != "CASCADIA_API_KEYS"}
    cmd = [
        sys.executable,
        "-m",
        "cascadia.cli",
        "gateway",
        "--router",
        f"127.0.0.1:{router_port}",
        "--model",
        str(tiny),
        "--port",
        str(port),
    ]
    gateway = subprocess.Popen(cmd, env=env, stdout=(tmp_path / "gateway.log").open("w"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    try:
        wait_until_ready(base, gateway)
        first = httpx.post(base + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
        fleet.router.kill()
        fleet.router.wait()
        deadline = time.monotonic() + 15
        while httpx.get(base + "/readyz").status_code != 503:
            assert time.monotonic() < deadline, "readiness did not follow the router down"
            time.sleep(0.2)
        down = httpx.post(base + "/v1/completions", json=body, timeout=30)
        assert down.status_code == 503 and down.json()["error"]["code"] == "unavailable"
        fleet.start_router(router_port, tmp_path / "router-2.log")
        wait_until_ready(base, gateway, timeout=60)
        again = httpx.post(base + "/v1/completions", json=body, timeout=30)
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == first
        assert gateway.poll() is None
    finally:
        gateway.terminate()
        gateway.wait(15)
        fleet.stop()
