"""Inkling's MTP head: the engine against a float64 reference, and drafting with it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cascadia.engine.batch import Segment
from cascadia.engine.engine import StageEngine
from cascadia.engine.mtp import MtpDrafter, MtpHead
from cascadia.engine.sampling import SamplingParams
from cascadia.engine.settings import EngineSettings
from cascadia.engine.speculation import accept_draft
from cascadia.model.checkpoint import CheckpointError, MtpWeights, load_mtp, load_stage
from cascadia.model.synthetic import SyntheticSpec, write_checkpoint
from tests.mtp_reference import MtpReference, Variant
from tests.oracle import relative_rms

DEPTHS = 3


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> Path:
    # seed 0 like `tiny`: the trunk's weights are drawn first, so both checkpoints share them
    return write_checkpoint(
        tmp_path_factory.mktemp("mtp") / "tiny-mtp", SyntheticSpec(seed=0, layout="published", mtp_layers=DEPTHS)
    )


@pytest.fixture(scope="module")
def reference(mtp_model: Path, tiny: Path) -> MtpReference:
    return MtpReference(mtp_model, tiny)


@pytest.fixture(scope="module")
def head(mtp_model: Path) -> MtpHead:
    return MtpHead(load_mtp(mtp_model), EngineSettings())


def prompt(seed: int, length: int) -> list[int]:
    return [1, *np.random.default_rng(seed).integers(3, 500, length - 1).tolist()]


def trunk_states(model: Path, ids: list[int]) -> np.ndarray:
    trunk = StageEngine(load_stage(model, 0, 5), EngineSettings())
    trunk.open("s")
    return trunk.step([Segment("s", 0, len(ids))], np.asarray(ids)).hidden


def run_chain(head: MtpHead, stream: str, trunk: np.ndarray, ids: list[int], shift: int = 1):
    """Teacher-fed: every depth over every row, as the reference's `chain` does."""
    head.open(stream)
    out, prev = [], trunk
    for k in range(head.depths):
        rows = min(len(trunk), len(ids) - k - 1)
        raw = head.run_depth(k, [Segment(stream, 0, rows)], prev[:rows], np.asarray(ids[k + shift : k + shift + rows]))
        out.append((raw, head.logits(raw)))
        prev = raw
    head.close(stream)
    return out


def test_the_checkpoint_carries_the_head(mtp_model: Path, tiny: Path):
    weights = load_mtp(mtp_model)
    assert len(weights.depths) == DEPTHS and weights.shape.num_layers == DEPTHS
    # like the 975B head: depths 1 and 3 global, the others sliding
    assert [a.kind for a in weights.shape.attention] == ["sliding", "global", "sliding"]
    assert all(d.block.router is None for d in weights.depths)
    assert len(load_mtp(mtp_model, depths=1).depths) == 1
    with pytest.raises(CheckpointError, match="no MTP head"):
        load_mtp(tiny)
    with pytest.raises(CheckpointError, match="asked for 4 MTP depths"):
        load_mtp(mtp_model, depths=4)


def test_every_depth_matches_the_float64_reference(mtp_model: Path, reference: MtpReference, head: MtpHead):
    ids = prompt(1, 41)  # past the sliding window and the relative extent
    n = len(ids) - 1
    ours = run_chain(head, "teacher", trunk_states(mtp_model, ids[:n]), ids)
    theirs = reference.chain(ids, n, DEPTHS)
    for k, ((raw, logits), (ref_raw, ref_logits)) in enumerate(zip(ours, theirs, strict=True)):
        assert raw.shape == tuple(ref_raw.shape)
        assert relative_rms(raw, ref_raw.numpy()) <= 1e-4, f"depth {k}"
        assert relative_rms(logits, ref_logits.numpy()) <= 1e-4, f"depth {k}"
        assert (logits.argmax(-1) == ref_logits.numpy().argmax(-1)).all()


MISTAKES = {
    "embedding before hidden": Variant(embedding_first=True),
    "skipped hidden norm": Variant(skip_hidden_norm=True),
    "w13 split in halves": Variant(w13_halves=True),
    "no short convs": Variant(no_convs=True),
    "no relative bias": Variant(no_relative_bias=True),
    "embedding of x_t": Variant(token_at_t=True),
}


def _engine_with(mtp_model: Path, variant: Variant) -> tuple[MtpHead, int]:
    """The engine given the same mistake through its inputs, where one can be (None otherwise)."""
    import dataclasses

    weights = load_mtp(mtp_model)
    shift = 0 if variant.token_at_t else 1
    if variant.embedding_first:
        shape = dataclasses.replace(weights.shape, mtp_hidden_states_first=False)
        weights = dataclasses.replace(weights, shape=shape)
    depths = []
    for depth in weights.depths:
        block, attention = depth.block, depth.block.attention
        if variant.no_convs:
            attention = dataclasses.replace(
                attention,
                k_conv=0 * attention.k_conv,
                v_conv=0 * attention.v_conv,
                attn_conv=0 * attention.attn_conv,
            )
            block = dataclasses.replace(block, attention=attention, mlp_conv=0 * block.mlp_conv)
        if variant.no_relative_bias:
            attention = dataclasses.replace(attention, rel_proj=0 * attention.rel_proj)
            block = dataclasses.replace(block, attention=attention)
        if variant.w13_halves:
            raw = load_mtp_w13(mtp_model, block.index)
            half = raw.shape[0] // 2
            slices = block.experts.gate.shape[0]
            experts = dataclasses.replace(
                block.experts,
                gate=raw[:half].reshape(slices, -1, raw.shape[1]),
                up=raw[half:].reshape(slices, -1, raw.shape[1]),
            )
            block = dataclasses.replace(block, experts=experts)
        depths.append(dataclasses.replace(depth, block=block))
    weights: MtpWeights = dataclasses.replace(weights, depths=tuple(depths))
    return MtpHead(weights, EngineSettings()), shift


def load_mtp_w13(model: Path, depth: int) -> np.ndarray:
    from safetensors.numpy import load_file

    return load_file(str(model / "model.safetensors"))[f"model.mtp.layers.{depth}.transformer_block.mlp.w13_dn.weight"]


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_detail_has_teeth(mtp_model: Path, tiny: Path, head: MtpHead, mistake: str):
    """A wrong detail moves the reference far from the engine; where the engine can be given the same
    mistake, it moves with it and the two agree again."""
    variant = MISTAKES[mistake]
    ids = prompt(2, 30)
    n = len(ids) - 1
    trunk = trunk_states(mtp_model, ids[:n])
    ours = run_chain(head, "correct", trunk, ids)
    wrong = MtpReference(mtp_model, tiny, variant).chain(ids, n, DEPTHS)
    last = DEPTHS - 1
    assert relative_rms(ours[last][1], wrong[last][1].numpy()) > 1e-2
    if variant.skip_hidden_norm:
        return  # a norm left out is not something the engine can be fed
    wrong_engine, shift = _engine_with(mtp_model, variant)
    theirs = run_chain(wrong_engine, "wrong", trunk, ids, shift)
    for k in range(DEPTHS):
        rows = len(wrong[k][1])
        assert relative_rms(theirs[k][1][:rows], wrong[k][1].numpy()) <= 1e-4, f"depth {k}"
    assert relative_rms(theirs[last][1], ours[last][1]) > 1e-2


def speculate(
    model: Path,
    head: MtpHead,
    prompts: dict[str, list[int]],
    rounds: int,
    reference: MtpReference | None = None,
    truth: dict[str, list[int]] | None = None,
):
    """Greedy decoding with MTP drafts verified by the trunk; returns ids per stream and drafts per round.

    With `truth` (each stream's greedy ids), round r verifies r % 4 true tokens instead of the MTP's
    drafts, so blocks of every acceptance length are confirmed (random MTP weights rarely agree).
    """
    trunk = StageEngine(load_stage(model, 0, 5), EngineSettings())
    drafter = MtpDrafter(head)
    greedy = SamplingParams()
    tokens: dict[str, list[int]] = {}
    for s, ids in prompts.items():
        trunk.open(s)
        drafter.open(s)
        step = trunk.step([Segment(s, 0, len(ids))], np.asarray(ids))
        drafter.confirm(s, 0, step.hidden, ids)
        tokens[s] = [*ids, int(step.logits[-1].argmax())]
        drafter.sampled(s, tokens[s][-1])
    history = []
    for r in range(rounds):
        drafts = drafter.propose(dict.fromkeys(prompts, DEPTHS))
        if reference is not None:
            for s in prompts:
                assert drafts[s] == reference.drafts(tokens[s], DEPTHS), s
        history.append(drafts)
        for s in prompts:
            n = len(tokens[s]) - 1
            verified = drafts[s] if truth is None else truth[s][len(tokens[s]) : len(tokens[s]) + r % 4]
            block = [tokens[s][-1], *verified]
            step = trunk.step([Segment(s, n, len(block))], np.asarray(block))
            accepted = accept_draft(step.logits, verified, greedy, np.random.default_rng(0))
            confirmed = len(accepted)  # the accepted drafts and the trunk's own token
            drafter.confirm(s, n, step.hidden[:confirmed], block[:confirmed])
            trunk.rewind(s, n + confirmed)
            tokens[s].extend(accepted)
            drafter.sampled(s, tokens[s][-1])
    for s in prompts:
        drafter.close(s)
    assert not drafter.streams and not any(block.streams for block in head.blocks)
    return tokens, history


def test_drafts_follow_the_reference_chain_through_rewinds(mtp_model: Path, reference: MtpReference, head: MtpHead):
    """Each round's drafts equal the reference's self-fed chain on the confirmed tokens, while rejected
    rows are rewound on every depth; two streams at different lengths share each depth's batch."""
    prompts = {"a": prompt(3, 14), "b": prompt(4, 9)}
    plain, _ = speculate(mtp_model, head, prompts, rounds=30)
    tokens, history = speculate(mtp_model, head, prompts, rounds=9, reference=reference, truth=plain)
    assert all(len(d) == DEPTHS for round_ in history for d in round_.values())
    grown = {s: len(tokens[s]) - len(prompts[s]) for s in prompts}
    assert all(g > 9 for g in grown.values()), grown  # true tokens were accepted several at a time
    assert tokens["a"] == plain["a"][: len(tokens["a"])] and tokens["b"] == plain["b"][: len(tokens["b"])]


def test_greedy_ids_are_the_same_with_and_without_mtp(mtp_model: Path, head: MtpHead, tiny: Path):
    from cascadia.engine.generate import generate

    ids = prompt(5, 12)
    tokens, _ = speculate(mtp_model, head, {"s": ids}, rounds=8)
    new = tokens["s"][len(ids) :]
    engine = StageEngine(load_stage(tiny, 0, 5), EngineSettings())
    plain = generate(engine, ids, SamplingParams(max_tokens=len(new))).token_ids
    assert new == plain
