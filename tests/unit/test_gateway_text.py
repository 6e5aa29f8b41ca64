"""Text handling of the gateway: tokenizer, chat templates, incremental detokenising, stop strings, keys."""

from __future__ import annotations

import pytest

from cascadia.gateway.auth import ConcurrencyLimiter, KeyRing, key_id, load_keys
from cascadia.gateway.errors import ApiError
from cascadia.gateway.text import PLAIN_CHAT_TEMPLATE, IncrementalDetokenizer, StopMatcher, TextCodec
from tests.helpers import with_tokenizer_config


@pytest.fixture(scope="module")
def codec(tiny) -> TextCodec:
    return TextCodec.from_directory(tiny)


def test_multibyte_characters_split_across_tokens_are_released_whole(codec):
    text = "añ€😀b"
    ids = codec.encode(text)
    assert len(ids) == len(text.encode())  # byte-level: one token per byte
    detok = IncrementalDetokenizer(codec)
    pieces = [detok.push(t) for t in ids]
    assert "".join(pieces) + detok.flush() == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[:3] == ["a", "", "ñ"]  # the first byte of ñ alone is held back


def test_a_sequence_cut_inside_a_character_flushes_a_replacement_not_bytes(codec):
    ids = codec.encode("é")
    detok = IncrementalDetokenizer(codec)
    assert detok.push(ids[0]) == ""
    assert detok.flush() == "\ufffd"


def test_special_tokens_leave_no_text(codec):
    eos = codec.tokenizer.token_to_id("<|eos|>")
    assert eos in codec.stop_token_ids
    detok = IncrementalDetokenizer(codec)
    assert [detok.push(t) for t in [*codec.encode("hi"), eos]] == ["h", "i", ""]


@pytest.mark.parametrize(
    ("stops", "pieces", "released", "stopped"),
    [
        (["END"], ["abc", "E", "N", "D", "tail"], "abc", True),
        (["END"], ["abE", "Nx", "END"], "abENx", True),
        (["\n\n", "##"], ["one\n", "\ntwo"], "one", True),
        (["xyz"], ["xy", "q"], "xyq", False),
        (["aab"], ["aa", "ab"], "a", True),
    ],
)
def test_stop_strings_are_found_across_piece_boundaries(stops, pieces, released, stopped):
    matcher = StopMatcher(stops)
    out = "".join(matcher.push(p) for p in pieces)
    out += matcher.flush()
    assert out == released
    assert matcher.stopped is stopped


def test_text_that_may_start_a_stop_string_is_held_until_known(codec):
    matcher = StopMatcher(["STOP"])
    assert matcher.push("go ST") == "go "
    assert matcher.push("x") == "STx"


def test_the_plain_template_when_the_checkpoint_has_none(codec):
    assert not codec.has_own_template
    assert codec.chat_template == PLAIN_CHAT_TEMPLATE
    text = codec.render_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert text == "system: be brief\nuser: hi\nassistant:"


def test_the_checkpoint_template_and_bos_come_from_tokenizer_config(tiny, tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    model = with_tokenizer_config(tiny, tmp_path / "with-template", chat_template=template, add_bos_token=True)
    codec = TextCodec.from_directory(model)
    bos = codec.tokenizer.token_to_id("<|bos|>")
    eos = codec.tokenizer.token_to_id("<|eos|>")
    ids = codec.encode_chat([{"role": "user", "content": "hi"}])
    assert ids == [bos, *codec.encode("<user>hi", add_bos=False), eos, *codec.encode("<assistant>", add_bos=False)]
    assert codec.encode("hi")[0] == bos  # completions text gets BOS; chat gets exactly one
    assert ids.count(bos) == 1


def test_a_template_that_raises_is_reported(tiny, tmp_path):
    template = "{{ raise_exception('roles must alternate') }}"
    model = with_tokenizer_config(tiny, tmp_path / "raising", chat_template=template)
    with pytest.raises(ValueError, match="roles must alternate"):
        TextCodec.from_directory(model).render_chat([{"role": "user", "content": "x"}])


def test_keys_from_file_and_environment(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# operators\nsk-one\n\nsk-two  # ci\n")
    assert load_keys(path, {"CASCADIA_API_KEYS": "sk-three, sk-four"}) == ["sk-one", "sk-two", "sk-three", "sk-four"]
    assert load_keys(None, {}) == []


def test_bearer_keys_are_checked_and_never_echoed():
    ring = KeyRing(["sk-secret"])
    assert ring.authenticate("Bearer sk-secret") == key_id("sk-secret")
    assert "sk-secret" not in key_id("sk-secret")
    for header in (None, "sk-secret", "Bearer sk-wrong", "Basic abc"):
        with pytest.raises(ApiError) as caught:
            ring.authenticate(header)
        assert caught.value.status == 401
        assert "sk-secret" not in caught.value.message
    assert KeyRing([]).authenticate(None) == "anonymous"


def test_concurrency_limit_per_key():
    limiter = ConcurrencyLimiter(2)
    limiter.acquire("a")
    limiter.acquire("a")
    limiter.acquire("b")
    with pytest.raises(ApiError) as caught:
        limiter.acquire("a")
    assert caught.value.status == 429 and "max_concurrent_requests_per_key" in caught.value.message
    limiter.release("a")
    limiter.acquire("a")
    assert ConcurrencyLimiter(0).acquire("a") is None  # 0: no limit


def test_the_instructions_length_covers_the_leading_system_messages_the_tools_and_the_next_turns_cue(codec):
    system = [{"role": "system", "content": "be brief"}, {"role": "developer", "content": "no lists"}]
    messages = [*system, {"role": "user", "content": "hi"}, {"role": "system", "content": "later"}]
    ids = codec.encode_chat(messages)
    n = codec.instructions_length(messages, None, ids)
    assert codec.decode(ids[:n]) == "system: be brief\ndeveloper: no lists\nuser: "
    assert codec.instructions_length(messages[2:], None, codec.encode_chat(messages[2:])) == 0  # none lead
    alone = messages[:2]  # instructions and no turn after them
    assert codec.decode(ids[: codec.instructions_length(alone, None, codec.encode_chat(alone))]).endswith("lists\n")
    # a template without a place for tools gets them in the system message: they are instructions too
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    with_tools = codec.encode_chat(messages, tools)
    assert codec.decode(with_tools[codec.instructions_length(messages, tools, with_tools) :]).startswith("hi\n")
    assert codec.instructions_length(messages, tools, with_tools) > n + 20


@pytest.mark.parametrize(
    ("template", "opening"),
    [
        # insists on a user's last turn: the empty cue satisfies it
        (
            "{% if messages[-1]['role'] != 'user' %}{{ raise_exception('the last turn must be a user') }}{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
            "system: " + "be brief " * 8 + "\nuser: ",
        ),
        # insists on a user's turn with words in it: the system message alone
        (
            "{% if not messages[-1]['content'] %}{{ raise_exception('empty turn') }}{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
            "system: " + "be brief " * 8 + "\n",
        ),
        # folds the system message into the user's turn: only what both renders start with
        ("{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}{% endif %}{% endfor %}", ""),
    ],
    ids=["user-last", "no-empty-turn", "folding"],
)
def test_the_instructions_length_is_what_the_templates_opening_and_the_prompt_share(tiny, tmp_path, template, opening):
    codec = TextCodec.from_directory(with_tokenizer_config(tiny, tmp_path / "template", chat_template=template))
    messages = [{"role": "system", "content": "be brief " * 8}, {"role": "user", "content": "hi"}]
    ids = codec.encode_chat(messages)
    shared = codec.decode(ids[: codec.instructions_length(messages, None, ids)])
    assert shared == opening or (not opening and "[INST] ".startswith(shared))
