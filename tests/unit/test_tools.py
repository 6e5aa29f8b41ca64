"""Tool calls in the `<tool_call>` markup: the grammars that hold them, the reader that takes them out of
streamed text, and the prompt a template without tools receives."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from cascadia.gateway.text import TextCodec
from cascadia.gateway.tools import (
    CALL_CLOSE,
    CALL_OPEN,
    CallReader,
    ListReader,
    markup_grammar,
    read_calls,
    split_calls,
    tool_calls,
    tool_calls_schema,
    with_tools_in_text,
)
from cascadia.grammar import GrammarVocabulary, cfg_grammar, json_grammar
from cascadia.model.config import load_shape

SPECIAL = (CALL_OPEN, CALL_CLOSE)  # the synthetic tokenizer holds both as tokens
CLOSED = {"type": "object", "additionalProperties": False}
TOOLS = {
    "get_time": {**CLOSED, "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]},
    "ping": {**CLOSED, "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]},
}


def block(name: str, arguments: dict) -> str:
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CALL_CLOSE}"


def test_the_reader_gives_prose_and_calls_whatever_the_pieces_the_text_arrives_in():
    text = "Let me see < that. " + block("ping", {"n": 3}) + "\n" + block("get_time", {"zone": "a </tool_call> b"})
    for size in (1, 2, 5, len(text)):
        reader = CallReader()
        parts = [p for i in range(0, len(text), size) for p in reader.feed(text[i : i + size])] + reader.close()
        prose = "".join(p for p in parts if isinstance(p, str))
        calls = [(p["function"]["name"], json.loads(p["function"]["arguments"])) for p in parts if isinstance(p, dict)]
        assert prose == "Let me see < that. "
        assert calls == [("ping", {"n": 3}), ("get_time", {"zone": "a </tool_call> b"})]
        assert reader.calls == 2
    assert split_calls(text)[0] == "Let me see < that. "


@pytest.mark.parametrize(
    "text",
    [
        "no calls here, though <tool is a prefix",
        'cut short: <tool_call>\n{"name": "ping", "arguments": {"n"',
        f"{CALL_OPEN}\n[1, 2]\n{CALL_CLOSE}",  # not a call: stays text
    ],
)
def test_text_that_holds_no_whole_call_comes_back_as_it_was_written(text):
    reader = CallReader()
    parts = [p for ch in text for p in reader.feed(ch)] + reader.close()
    assert all(isinstance(p, str) for p in parts) and "".join(parts) == text
    assert split_calls(text) == (text, [])


def test_a_bare_list_of_calls_is_settled_when_the_answer_ends():
    whole = json.dumps([{"name": "ping", "arguments": {"n": 3}}, {"name": "get_time", "arguments": {"zone": "UTC"}}])
    reader = ListReader()
    assert [p for i in range(0, len(whole), 7) for p in reader.feed(whole[i : i + 7])] == []
    calls = reader.close()
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("ping", {"n": 3}),
        ("get_time", {"zone": "UTC"}),
    ]
    assert reader.calls == 2
    cut = whole[:-9]  # max_tokens ended it: the text as written
    assert read_calls(ListReader(), cut) == (cut, [])


def test_text_that_could_still_open_a_call_is_held_back_until_it_cannot():
    reader = CallReader()
    assert reader.feed("a <tool_") == ["a "]
    assert reader.feed("c") == []
    assert reader.feed("up") == ["<tool_cup"]


def _accepts(vocabulary: GrammarVocabulary, codec: TextCodec, grammar: str, text: str) -> bool:
    constraint = vocabulary.constraint(grammar, sorted(codec.stop_token_ids))
    for token in codec.encode(text, add_bos=False):
        if not constraint.mask(np.zeros(vocabulary.sampled_vocab, np.float32))[token] > -np.inf:
            return False
        constraint.advance(token)
    return constraint.matcher.is_accepting()


@pytest.fixture(scope="module")
def spelling(tiny) -> tuple[TextCodec, GrammarVocabulary]:
    """The tiny model's tokenizer without the tags as tokens: text spells them out, byte by byte."""
    document = json.loads((tiny / "tokenizer.json").read_text())
    for added in document["added_tokens"]:
        if added["content"] in SPECIAL:
            added["content"], added["special"] = f"<|unused_{added['id']}|>", True
    text = json.dumps(document)
    codec = TextCodec(tokenizer=Tokenizer.from_str(text), stop_token_ids=frozenset({2}))
    return codec, GrammarVocabulary(text, load_shape(tiny).unpadded_vocab_size)


@pytest.mark.parametrize("tags", ["tokens", "spelled"])
def test_auto_allows_prose_or_calls_and_holds_whatever_follows_an_opening_tag(
    tiny_codec, tiny_vocabulary, spelling, tags
):
    codec, vocabulary = spelling if tags == "spelled" else (tiny_codec, tiny_vocabulary)
    special = [tag for tag in SPECIAL if vocabulary.is_special(tag)]
    assert special == ([] if tags == "spelled" else list(SPECIAL))
    assert len(codec.encode(CALL_OPEN)) == (1 if special else len(CALL_OPEN))

    def grammar(parallel: bool, prose: bool) -> str:
        return cfg_grammar(markup_grammar(TOOLS, parallel=parallel, prose=prose, special=special))

    auto = grammar(parallel=True, prose=True)
    assert _accepts(vocabulary, codec, auto, "Nothing to call.")
    assert _accepts(vocabulary, codec, auto, "Checking. " + block("ping", {"n": 4}))
    assert _accepts(vocabulary, codec, auto, block("ping", {"n": 4}) + "\n" + block("get_time", {"zone": "CET"}))
    assert not _accepts(vocabulary, codec, auto, "Checking. <tool_call> and more prose")
    assert not _accepts(vocabulary, codec, auto, block("ping", {"n": 12}))  # above its maximum
    assert not _accepts(vocabulary, codec, auto, block("nope", {}))
    single = grammar(parallel=False, prose=True)
    assert not _accepts(vocabulary, codec, single, block("ping", {"n": 4}) + "\n" + block("ping", {"n": 5}))
    required = grammar(parallel=True, prose=False)
    assert not _accepts(vocabulary, codec, required, "Checking. " + block("ping", {"n": 4}))
    assert _accepts(vocabulary, codec, required, block("get_time", {"zone": "UTC"}))


def answer_from_random_logits(
    vocabulary: GrammarVocabulary, grammar: str, stops: list[int], seed: int, push
) -> list[int]:
    """Tokens chosen greedily from random rows under the grammar; `push(row, tokens)` leans each row first."""
    rng = np.random.default_rng(seed)
    constraint = vocabulary.constraint(grammar, stops)
    tokens: list[int] = []
    while len(tokens) < 400:
        row = rng.normal(size=vocabulary.sampled_vocab).astype(np.float32) * 3
        push(row, tokens)
        token = int(np.argmax(constraint.mask(row)))
        constraint.advance(token)
        if token in stops:
            break
        tokens.append(token)
    return tokens


def check_call(call: dict) -> None:
    arguments = json.loads(call["function"]["arguments"])
    assert call["type"] == "function" and call["id"].startswith("call_")
    if call["function"]["name"] == "get_time":
        assert arguments["zone"] in {"UTC", "CET"}
    else:
        assert call["function"]["name"] == "ping" and 0 <= arguments["n"] <= 9


@pytest.mark.parametrize("prose", [True, False])
def test_answers_from_any_logits_split_into_prose_and_calls_of_the_given_tools(tiny_codec, tiny_vocabulary, prose):
    grammar = cfg_grammar(markup_grammar(TOOLS, parallel=True, prose=prose, special=SPECIAL))
    stops = sorted(tiny_codec.stop_token_ids)
    tag = tiny_codec.tokenizer.token_to_id(CALL_OPEN)
    assert tag is not None  # the synthetic tokenizer holds the tags as text tokens, as chat models' do
    seen = {"prose": 0, "calls": 0}
    for seed in range(12):

        def push(row: np.ndarray, tokens: list[int], seed: int = seed) -> None:
            row[stops] += 2.0 + len(tokens) / 10  # end soon once the grammar allows
            row[tag] += 6.0 if seed % 2 else -50.0  # half of the answers are pushed to call

        text = tiny_codec.decode(answer_from_random_logits(tiny_vocabulary, grammar, stops, seed, push))
        content, calls = split_calls(text)
        if not calls:
            assert prose and CALL_OPEN not in text and content == text
            seen["prose"] += 1
            continue
        seen["calls"] += 1
        assert prose or content == ""
        for call in calls:
            check_call(call)
    assert seen["calls"] and (seen["prose"] or not prose)


@pytest.mark.parametrize("parallel", [False, True])
def test_bare_lists_of_calls_from_any_logits_are_calls_of_the_given_tools(tiny_codec, tiny_vocabulary, parallel):
    """What a model whose template writes calls its own way is held to under tool_choice required."""
    grammar = json_grammar(tool_calls_schema(TOOLS, parallel))
    stops = sorted(tiny_codec.stop_token_ids)
    counts = set()
    for seed in range(8):

        def push(row: np.ndarray, tokens: list[int]) -> None:
            row[stops] += 4.0  # end as soon as the grammar allows

        calls = tool_calls(tiny_codec.decode(answer_from_random_logits(tiny_vocabulary, grammar, stops, seed, push)))
        counts.add(len(calls))
        for call in calls:
            check_call(call)
    assert counts == {1} if not parallel else min(counts) >= 1


def test_a_template_without_tools_gets_them_and_the_calls_and_results_as_text(tiny_codec):
    codec = tiny_codec
    assert not codec.takes_tools and codec.knows_call_markup
    tools = [{"type": "function", "function": {"name": "ping", "parameters": TOOLS["ping"]}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "ping", "arguments": {"n": 2}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Ping twice."},
        {"role": "assistant", "content": None, "tool_calls": [call, call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "pong"},
        {"role": "tool", "tool_call_id": "call_1", "content": "pong again"},
    ]
    rewritten = with_tools_in_text(messages, tools)
    assert [m["role"] for m in rewritten] == ["system", "user", "assistant", "user"]
    assert rewritten[0]["content"].endswith("Be brief.") and '"name": "ping"' in rewritten[0]["content"]
    assert split_calls(rewritten[2]["content"])[1][1]["function"]["arguments"] == '{"n": 2}'
    assert rewritten[3]["content"].count("<tool_response>") == 2 and "pong again" in rewritten[3]["content"]
    prompt = codec.render_chat(messages, tools)
    assert prompt.startswith("system: You can call functions") and prompt.endswith("assistant:")
    assert block("ping", {"n": 2}) in prompt
    assert codec.render_chat(messages[:2]) == "system: Be brief.\nuser: Ping twice.\nassistant:"


def test_a_template_that_writes_tools_its_own_way_is_left_to_it(tiny):
    own = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    own += "{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}"
    codec = TextCodec.from_directory(tiny)
    codec.chat_template, codec.has_own_template = own, True
    assert codec.takes_tools and not codec.knows_call_markup
    tools = [{"type": "function", "function": {"name": "ping"}}]
    assert codec.render_chat([{"role": "user", "content": "hi"}], tools) == "hi[ping]"
    hermes = TextCodec.from_directory(tiny)
    hermes.chat_template = own + "{{ '<tool_call>' if tools }}"
    assert hermes.takes_tools and hermes.knows_call_markup
