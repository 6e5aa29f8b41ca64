"""Grammars hold generated text to a JSON schema, a regular expression or a list of choices: in the
masks themselves, in single-process generation, and across a fleet of shard processes with drafts."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import numpy as np
import pytest

from cascadia.draft.client import LocalProposer
from cascadia.engine.engine import StageEngine
from cascadia.engine.generate import generate
from cascadia.engine.settings import EngineSettings
from cascadia.engine.speculation import verified_tokens
from cascadia.gateway.text import TextCodec
from cascadia.grammar import (
    GrammarError,
    GrammarVocabulary,
    choice_grammar,
    json_grammar,
    regex_grammar,
)
from cascadia.model.checkpoint import load_stage
from cascadia.model.config import load_shape
from cascadia.router.local import LocalFleet
from cascadia.router.pipeline import PipelineDriver
from cascadia.router.scheduler import Request, SchedulerConfig
from cascadia.sampling_params import SamplingParams
from cascadia.shard.service import pb, rpc

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 5},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "colors", "count"],
    "additionalProperties": False,
}
CODE = r"[A-Z]{2}-[0-9]{3}"
CHOICES = ["yes", "no", "maybe later"]


def conforms(value) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"ok", "colors", "count"}
        and isinstance(value["ok"], bool)
        and 1 <= len(value["colors"]) <= 5
        and set(value["colors"]) <= {"red", "green", "blue"}
        and type(value["count"]) is int
        and 0 <= value["count"] <= 99
    )


def holds(text: str, grammar_kind: str) -> bool:
    if grammar_kind == "json":
        return conforms(json.loads(text))
    if grammar_kind == "regex":
        return re.fullmatch(CODE, text) is not None
    return text in CHOICES


GRAMMARS = {"json": json_grammar(SCHEMA), "regex": regex_grammar(CODE), "choice": choice_grammar(CHOICES)}


@pytest.fixture(scope="module")
def codec(tiny_codec: TextCodec) -> TextCodec:
    return tiny_codec


@pytest.fixture(scope="module")
def vocabulary(tiny_vocabulary: GrammarVocabulary) -> GrammarVocabulary:
    return tiny_vocabulary


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_masks_hold_any_logits_to_the_grammar_and_let_a_stop_token_through_only_at_a_whole_match(
    kind, codec, vocabulary
):
    stops = sorted(codec.stop_token_ids)
    for seed in range(12):
        rng = np.random.default_rng(seed)
        constraint = vocabulary.constraint(GRAMMARS[kind], stops)
        tokens: list[int] = []
        for _ in range(300):
            allowed = constraint.allowed()
            assert allowed[stops].all() == constraint.matcher.is_accepting() or constraint.matcher.is_stopped()
            row = rng.normal(size=vocabulary.sampled_vocab).astype(np.float32) * 4
            row[stops] -= 2.0  # the text runs on for a while where the grammar allows it
            token = int(np.argmax(constraint.mask(row)))
            assert allowed[token]
            constraint.advance(token)
            if token in stops:
                break
            tokens.append(token)
        else:
            pytest.fail("no stop token in 300 tokens")
        assert holds(codec.decode(tokens), kind), codec.decode(tokens)


def test_ids_past_the_tokenizer_and_its_own_end_token_are_never_allowed(codec):
    own = codec.tokenizer.get_vocab_size(with_added_tokens=True)
    wider = GrammarVocabulary(codec.tokenizer.to_str(), own + 12)  # a head padded past the tokenizer
    constraint = wider.constraint(json_grammar(None), [2])
    for token in codec.encode('{"a": [1, "b"]}'):
        allowed = constraint.allowed()
        assert allowed.shape == (own + 12,) and allowed[token]
        assert not allowed[own:].any() and not allowed[2]  # 2 is its own end token too: only a whole match ends
        constraint.advance(token)
    assert constraint.allowed()[2] and constraint.matcher.is_accepting()


def test_a_draft_that_leaves_the_grammar_is_refused_and_verification_equals_masked_decoding(codec, vocabulary):
    stops = sorted(codec.stop_token_ids)
    rng = np.random.default_rng(3)
    rows = rng.normal(size=(6, vocabulary.sampled_vocab)).astype(np.float32)
    sequential = vocabulary.constraint(GRAMMARS["json"], stops)
    path, allowed_at = [], []
    for row in rows:
        allowed_at.append(sequential.allowed())
        path.append(int(np.argmax(sequential.mask(row))))
        sequential.advance(path[-1])
    refused = int(np.flatnonzero(~allowed_at[3])[0])
    greedy = SamplingParams()
    verifying = vocabulary.constraint(GRAMMARS["json"], stops)
    draft = [*path[:3], refused, path[4]]
    assert [t for _, t in verified_tokens(rows, draft, greedy, rng, verifying)] == path[:4]
    replay = vocabulary.constraint(GRAMMARS["json"], stops)
    for token in path[:4]:
        replay.advance(token)
    assert (verifying.allowed() == replay.allowed()).all()  # the matcher moved by the emitted tokens only
    sampled = SamplingParams(temperature=1.0)
    for _ in range(30):  # sampled verification gives a refused draft no chance either
        c = vocabulary.constraint(GRAMMARS["json"], stops)
        emitted = [t for _, t in verified_tokens(rows, draft, sampled, rng, c)]
        assert len(emitted) <= 4 and (len(emitted) < 4 or emitted[3] != refused)


def test_bad_grammars_and_grammars_without_an_end_are_refused_with_the_reason(vocabulary):
    with pytest.raises(GrammarError, match="stop token"):
        vocabulary.constraint(GRAMMARS["json"], [])
    with pytest.raises(GrammarError, match="Invalid type"):
        vocabulary.constraint(json_grammar({"type": "frob"}), [2])
    with pytest.raises(GrammarError):
        vocabulary.constraint(regex_grammar("(unclosed"), [2])


@pytest.fixture(scope="module")
def solo_engine(tiny):
    return StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings())


def requests(codec: TextCodec) -> list[Request]:
    stops = codec.stop_token_ids
    out = []
    for i, kind in enumerate(["json", "json", "regex", "choice"]):
        prompt = tuple(int(t) for t in np.random.default_rng(i).integers(3, 250, size=5 + i))
        params = SamplingParams(max_tokens=120, stop_ids=stops, grammar=GRAMMARS[kind])
        out.append(Request(f"{kind}-{i}", prompt, params))
    sampled = SamplingParams(max_tokens=120, stop_ids=stops, grammar=GRAMMARS["json"], temperature=1.0, seed=7)
    out.append(Request("json-sampled", (40, 41, 42), sampled))
    out.append(Request("plain", (40, 41, 42), SamplingParams(max_tokens=20, stop_ids=stops)))
    return out


def test_single_process_generation_holds_to_the_grammar_and_ends_on_a_stop_token(codec, vocabulary, solo_engine):
    for request in requests(codec)[:-1]:
        ids = generate(solo_engine, request.prompt, request.params, vocabulary=vocabulary).token_ids
        assert ids[-1] in codec.stop_token_ids, request.id
        assert holds(codec.decode(ids[:-1]), request.id.split("-")[0]), (request.id, codec.decode(ids))
    with pytest.raises(ValueError, match="needs the model's vocabulary"):
        generate(solo_engine, [5], requests(codec)[0].params)


@pytest.mark.slow
def test_a_fleet_with_drafts_gives_the_single_process_ids_under_grammars_and_refuses_bad_ones(
    tiny, tmp_path, codec, vocabulary, solo_engine
):
    """Two shard processes and speculative rounds: drafts (the proposer's, and what each grammar forces,
    sent by the last stage) are verified under each stream's grammar, so every request gets exactly the
    ids of single-process generation; a grammar that does not parse is refused at the router, and one
    that reaches a stage is refused by the stage, both while others run."""
    batch = requests(codec)
    expected = [generate(solo_engine, r.prompt, r.params, vocabulary=vocabulary).token_ids for r in batch]
    fleet = LocalFleet(tiny, 2)
    fleet.start(log_dir=tmp_path)
    config = SchedulerConfig(stages=2).speculating(max_draft=4)

    async def go():
        driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, config, proposer=LocalProposer())
        await driver.start()
        try:
            await driver.wait_ready(timeout=120)
            running = [asyncio.ensure_future(driver.generate(r)) for r in batch]
            bad = SamplingParams(stop_ids=codec.stop_token_ids, grammar=regex_grammar("(unclosed"))
            with pytest.raises(ValueError) as refused:
                await driver.submit(Request("bad", (5, 6), bad))
            frame = pb.Frame(
                frame_id=10**6,
                opens=[pb.StreamOpen(stream="g", sampling=pb.Sampling(grammar=bad.grammar, stop_ids=[2]))],
            )
            async with grpc.aio.insecure_channel(fleet.stage_addrs[-1]) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as stage_refused:
                    await rpc.ShardStub(channel).Submit(frame, timeout=5)
                stats = await rpc.ShardStub(channel).Stats(pb.StatsRequest(), timeout=5)
            results = await asyncio.gather(*running)
            return results, str(refused.value), stage_refused.value, stats, dict(driver.spec_by_source)
        finally:
            await driver.stop()

    try:
        results, refusal, stage_refusal, stats, spec = asyncio.run(go())
    finally:
        fleet.stop()
    assert [r.tokens for r in results] == expected
    for request, ids in zip(batch[:-1], expected, strict=False):
        assert holds(codec.decode(ids[:-1]), request.id.split("-")[0])
    proposed, accepted = spec["grammar"]  # a key's name and its quotes are drafted from the grammar alone
    assert proposed >= accepted > 0, spec
    assert refusal
    assert stage_refusal.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stream 'g': grammar" in stage_refusal.details()
    assert stats.grammars


def test_forced_tokens_are_the_text_the_grammar_allows_alone(codec, vocabulary):
    constraint = vocabulary.constraint(GRAMMARS["json"], sorted(codec.stop_token_ids))
    assert codec.decode(constraint.forced()) == '{"ok": '
    for token in codec.encode('{"ok": true'):
        constraint.advance(token)
    assert codec.decode(constraint.forced()) == ', "colors": ["'
    for token in codec.encode(', "colors": ["red"], "count": 7}'):
        constraint.advance(token)
    assert constraint.forced() == [] and constraint.matcher.is_accepting()
