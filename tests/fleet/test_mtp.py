"""Inkling's MTP head: the engine against a float64 reference, and drafting with it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cascadia.engine.batch import Segment
from cascadia.engine.engine import StageEngine
from cascadia.engine.mtp import MtpDrafter, MtpHead
from cascadia.engine.settings import EngineSettings
from cascadia.engine.speculation import accept_draft
from cascadia.model.checkpoint import CheckpointError, MtpWeights, load_mtp, load_stage
from cascadia.model.synthetic import SyntheticSpec, write_checkpoint
from cascadia.sampling_params import SamplingParams
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


class _Followed:
    """A trunk and an MTP drafter over it, fed greedily: each feed confirms the rows and samples."""

    def __init__(self, model: Path, head: MtpHead) -> None:
        self.trunk = StageEngine(load_stage(model, 0, 5), EngineSettings())
        self.drafter = MtpDrafter(head)

    def open(self, stream: str, ids: list[int]) -> int:
        """Open `stream`, feed `ids` and bring every depth up to date; returns the sampled token."""
        self.trunk.open(stream)
        self.drafter.open(stream)
        token = self.feed(stream, 0, ids)
        self.drafter.propose({stream: DEPTHS})
        return token

    def feed(self, stream: str, start: int, ids: list[int]) -> int:
        step = self.trunk.step([Segment(stream, start, len(ids))], np.asarray(ids))
        self.drafter.confirm(stream, start, step.hidden, ids)
        token = int(step.logits[-1].argmax())
        self.drafter.sampled(stream, token)
        return token

    def close_all(self) -> None:
        for stream in self.drafter.streams:
            self.drafter.close(stream)
            self.trunk.close(stream)


def test_a_stream_taking_over_a_finished_one_drafts_as_the_reference_chain(
    mtp_model: Path, reference: MtpReference, head: MtpHead
):
    """A later prompt that starts with a finished stream's tokens takes over its trunk state and its
    depths, stepped back to where the prompts part: the drafts are the reference chain's on the new
    sequence, as if the new prompt had been fed from its start."""
    followed = _Followed(mtp_model, head)
    old = prompt(5, 20)
    token = followed.open("old", old)
    followed.feed("old", len(old), [token])  # and one decoded row more
    new = [*old[:16], *prompt(6, 5)]
    try:
        followed.trunk.adopt("old", "new", 16)
        followed.drafter.adopt("old", "new", 16)
        assert followed.drafter.streams == ["new"] and all(block.streams == ["new"] for block in head.blocks)
        token = followed.feed("new", 16, new[16:])
        assert followed.drafter.propose({"new": DEPTHS})["new"] == reference.drafts([*new, token], DEPTHS)
    finally:
        followed.close_all()


def test_a_copy_of_a_stream_and_the_stream_itself_each_draft_as_the_reference_chain(
    mtp_model: Path, reference: MtpReference, head: MtpHead
):
    """A prompt that starts as a running stream's did starts as a copy of its trunk state and depths,
    stepped back to where the prompts part: both then draft the reference chain on their own sequences."""
    followed = _Followed(mtp_model, head)
    old = prompt(7, 20)
    token = followed.open("old", old)
    new = [*old[:16], *prompt(8, 5)]
    try:
        followed.trunk.copy("old", "new", 16)
        followed.drafter.copy("old", "new", 16)
        assert sorted(followed.drafter.streams) == ["new", "old"]
        new_token = followed.feed("new", 16, new[16:])
        old_token = followed.feed("old", len(old), [token])  # the source goes on where it was
        drafts = followed.drafter.propose({"new": DEPTHS, "old": DEPTHS})
        assert drafts["new"] == reference.drafts([*new, new_token], DEPTHS)
        assert drafts["old"] == reference.drafts([*old, token, old_token], DEPTHS)
        with pytest.raises(ValueError, match="already open"):
            followed.drafter.copy("old", "new", 3)
    finally:
        followed.close_all()


def test_greedy_ids_are_the_same_with_and_without_mtp(mtp_model: Path, head: MtpHead, tiny: Path):
    from cascadia.engine.generate import generate

    ids = prompt(5, 12)
    tokens, _ = speculate(mtp_model, head, {"s": ids}, rounds=8)
    new = tokens["s"][len(ids) :]
    engine = StageEngine(load_stage(tiny, 0, 5), EngineSettings())
    plain = generate(engine, ids, SamplingParams(max_tokens=len(new))).token_ids
    assert new == plain


# -- the shard's frame checks (pure) ---------------------------------------------------------------


def _frame(opens=(), rows=(), ids=()):
    from cascadia.shard.service import pb

    frame = pb.Frame(frame_id=1, token_ids=list(ids))
    frame.opens.extend(pb.StreamOpen(stream=s, mtp=m) for s, m in opens)
    frame.rows.extend(pb.RowBlock(stream=s, start=0, length=n, wants_token=w, propose=p) for s, n, w, p in rows)
    return frame


def test_the_last_stage_refuses_mtp_requests_it_cannot_serve():
    from cascadia.shard.service import FrameRejected, check_frame

    def check(frame, depths):
        return check_frame(frame, {}, True, 64, 512, mtp_depths=depths)

    good = _frame([("a", True)], [("a", 2, True, 3)], [1, 2])
    assert check(good, 3) == {"a": 2}
    with pytest.raises(FrameRejected, match="no MTP head"):
        check(good, 0)
    with pytest.raises(FrameRejected, match="4 MTP drafts asked of a head with 3 depths"):
        check(_frame([("a", True)], [("a", 2, True, 4)], [1, 2]), 3)
    with pytest.raises(FrameRejected, match="not opened for them"):
        check(_frame([("a", False)], [("a", 2, True, 1)], [1, 2]), 3)
    with pytest.raises(FrameRejected, match="wants no token"):
        check(_frame([("a", True)], [("a", 2, False, 1)], [1, 2]), 3)
    # a middle stage passes the fields on without judging them
    assert check_frame(_frame([("a", True)], [("a", 2, True, 9)], [1, 2]), {}, True, 64, 512) == {"a": 2}


# -- drafting with the MTP head across real shard processes ----------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("shards", [1, 3])
def test_mtp_drafts_across_shard_processes_keep_greedy_ids(mtp_model: Path, tiny: Path, shards: int, tmp_path):
    """The last shard serves the MTP head; the router verifies its drafts: ids equal the engine's alone,
    MTP rounds happen (per-source stats), and every stage frees the streams. Next turns, twins and users
    after a system prompt the first one tells of start from other streams' states, depths included."""
    import asyncio

    import grpc

    from cascadia.engine.generate import generate
    from cascadia.router.local import LocalFleet, free_port
    from cascadia.shard.service import pb, rpc
    from tests.helpers import router_ready

    engine = StageEngine(load_stage(tiny, 0, 5), EngineSettings())
    prompts = {f"r{i}": prompt(20 + i, 6 + 3 * i) for i in range(3)}
    twin = prompt(30, 14)
    system = prompt(40, 40)
    users = {f"user{i}": [*system, *prompt(50 + i, 21)[1:]] for i in range(2)}  # past the slack from 40
    expected = {rid: generate(engine, ids, SamplingParams(max_tokens=16)).token_ids for rid, ids in prompts.items()}
    fleet = LocalFleet(mtp_model, shards, mtp_depths=DEPTHS)
    fleet.start(tmp_path)
    port = free_port()
    fleet.start_router(port, tmp_path / "router.log", max_draft=5, mtp_draft=DEPTHS)

    async def go():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rpc.RouterStub(channel)
            await router_ready(stub)

            async def one(rid, ids):
                message = pb.GenerateRequest(request_id=rid, prompt_ids=ids, max_tokens=16)
                return rid, [e.token async for e in stub.Generate(message, timeout=120)]

            got = dict(await asyncio.gather(*(one(rid, ids) for rid, ids in prompts.items())))
            # a next turn takes over r0's finished stream, the MTP head's depths with it
            message = pb.GenerateRequest(request_id="next", prompt_ids=follow_up(got["r0"]), max_tokens=16)
            events = [e async for e in stub.Generate(message, timeout=120)]
            # one prompt twice at once: the second starts as a copy of the first, the depths with it
            twins = dict(await asyncio.gather(*(one(rid, twin) for rid in ("twin0", "twin1"))))
            # the first user says where the system prompt ends and leaves a copy there; the second starts from it
            told = {}
            for rid, ids in users.items():
                message = pb.GenerateRequest(request_id=rid, prompt_ids=ids, max_tokens=16, shared_prefix=len(system))
                told[rid] = [e async for e in stub.Generate(message, timeout=120)]
            stats = await stub.Stats(pb.StatsRequest(), timeout=5)
            await asyncio.sleep(0.5)  # the close frame travels the chain
            last = rpc.ShardStub(grpc.aio.insecure_channel(fleet.stage_addrs[-1]))
            shard_stats = await last.Stats(pb.StatsRequest(), timeout=5)
            return got, events, twins, told, stats, shard_stats

    def follow_up(answer: list[int]) -> list[int]:
        return [*prompts["r0"], *answer[:-1], 7, 8]

    try:
        got, events, twins, told, stats, shard_stats = asyncio.run(go())
    finally:
        fleet.stop()
    assert got == expected
    nxt = follow_up(got["r0"])
    assert [e.token for e in events] == generate(engine, nxt, SamplingParams(max_tokens=16)).token_ids
    assert events[0].cached_tokens == len(prompts["r0"]) + len(got["r0"]) - 1
    by_source = {s.source: s for s in stats.sources}
    assert "mtp" in by_source and by_source["mtp"].drafted_tokens > 0, stats
    assert twins == dict.fromkeys(twins, generate(engine, twin, SamplingParams(max_tokens=16)).token_ids)
    for rid, ids in users.items():
        assert [e.token for e in told[rid]] == generate(engine, ids, SamplingParams(max_tokens=16)).token_ids
    assert [told[rid][0].cached_tokens for rid in users] == [0, len(system)]
    # the twin's copy: all of the prompt but its last token; the second user's: the system prompt
    assert stats.reused_positions == events[0].cached_tokens + len(twin) - 1 + len(system)
    # r1, r2, "next", the twins, the users and the system prompt's copy are kept
    assert shard_stats.open_streams == stats.kept_streams == 8 and stats.shared_prefixes == 1


# -- capture on an MTP fleet and offline draft evaluation -------------------------------------------


@pytest.mark.slow
def test_eval_draft_scores_every_source_on_a_captured_fleet(
    mtp_model: Path, reference: MtpReference, redis_server, tmp_path
):
    """Capture two shards drafting with the MTP head, then score the sources offline. The teacher-fed
    depth-0 scores equal the float64 reference's on the same sequences, and depth 0 reads only true
    tokens in both protocols, so the self-fed chain's depth-0 score must equal the teacher-fed one."""
    import asyncio
    import json
    import subprocess
    import sys

    from cascadia.router.local import LocalFleet, free_port
    from cascadia.shard.capture import confirmed_streams, read_capture
    from tests.fleet.test_capture import _run_requests

    url, _ = redis_server
    fleet = LocalFleet(mtp_model, 2, mtp_depths=DEPTHS)
    fleet.start(tmp_path)
    port = free_port()
    fleet.start_router(port, tmp_path / "router.log", max_draft=5, mtp_draft=DEPTHS)
    motif = prompt(30, 7)[1:]
    requests = {"a": [1, *motif, *motif[:3]], "b": prompt(31, 12), "c": [1, *motif, 9, *motif[:4]]}

    def cli(*args):
        run = subprocess.run([sys.executable, "-m", "cascadia.cli", *args], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        return run

    try:
        asyncio.run(_run_requests(port, {"warm": requests["b"]}, 2))
        cli("capture", "--router", f"127.0.0.1:{port}", "--dir", str(tmp_path / "cap"))
        asyncio.run(_run_requests(port, requests, 14))
        cli("capture", "--router", f"127.0.0.1:{port}", "--off")
    finally:
        fleet.stop()
    out = tmp_path / "eval"
    cli(
        "eval-draft",
        str(tmp_path / "cap"),
        "--depths",
        str(DEPTHS),
        "--vocab-prefix",
        "256",
        "--redis",
        url,
        "--out",
        str(out),
    )
    summary = json.loads((out / "eval-draft.json").read_text())
    assert (out / "eval-draft.png").stat().st_size > 0
    sources = summary["sources"]
    expected = {"suffix", "shared", "mtp teacher-fed", "mtp self-fed"}
    expected |= {f"{name} (first 256 ids)" for name in ("mtp teacher-fed", "mtp self-fed")}
    assert set(sources) == expected
    streams = confirmed_streams(read_capture(tmp_path / "cap")[1])
    generated = sum(len(s.tokens) - s.prompt_length for s in streams.values())
    assert summary["streams"] == 3 and summary["generated_tokens"] == generated
    teacher, self_fed = sources["mtp teacher-fed"], sources["mtp self-fed"]
    assert teacher["attempts_per_depth"][0] == self_fed["attempts_per_depth"][0] > 0
    assert teacher["agreement_per_depth"][0] == self_fed["agreement_per_depth"][0]
    # the float64 reference, teacher-fed on the same confirmed sequences
    right = attempts = 0
    for stream in streams.values():
        n = len(stream.tokens) - 1
        _, logits = reference.chain(stream.tokens, n, 1)[0]
        for t in range(len(logits)):
            if stream.prompt_length < t + 2 <= n:
                attempts += 1
                right += int(logits[t].argmax()) == stream.tokens[t + 2]
    assert attempts == teacher["attempts_per_depth"][0]
    assert right / attempts == pytest.approx(teacher["agreement_per_depth"][0])
    for score in sources.values():
        assert all(v is None or 0.0 <= v <= 1.0 for v in score["agreement_per_depth"])


def test_bench_mtp_reports_cost_and_agreement(mtp_model: Path, tmp_path):
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "cascadia.cli", "bench", "mtp", "--model", str(mtp_model), "--out", str(tmp_path)]
    cmd += ["--rounds", "2", "--sequences", "1", "--new-tokens", "8", "--streams", "1,2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads((tmp_path / "mtp.json").read_text())
    assert [c["streams"] for c in summary["cost"]] == [1, 2]
    assert all(c["last_stage_step_ms"] > 0 and c["mtp_chain_ms"] > 0 for c in summary["cost"])
    teacher, self_fed = summary["agreement"]["teacher-fed"], summary["agreement"]["self-fed"]
    assert teacher["attempts_per_depth"][0] == self_fed["attempts_per_depth"][0] == 7
    assert summary["teacher_minus_self_fed"][0] == 0.0
    assert (tmp_path / "mtp.png").stat().st_size > 0


def test_streams_that_draft_nothing_keep_their_depths_within_reach(head: MtpHead):
    """A stream whose rounds ask for no draft (a busy fleet) still has its depths catch up, so the rows
    held for them stay bounded instead of growing with the stream."""
    drafter = MtpDrafter(head)
    rng = np.random.default_rng(9)
    drafter.open("busy")
    drafter.confirm("busy", 0, rng.standard_normal((4, 64)).astype(np.float32), [1, 5, 6, 7])
    drafter.sampled("busy", 8)
    for n in range(4, 4 + 3 * MtpDrafter.CATCH_UP):
        assert drafter.propose({"busy": 0}) == {"busy": []}
        drafter.confirm("busy", n, rng.standard_normal((1, 64)).astype(np.float32), [int(rng.integers(3, 500))])
        drafter.sampled("busy", int(rng.integers(3, 500)))
    record = drafter._streams["busy"]
    assert len(record.trunk) <= MtpDrafter.CATCH_UP + 1
    # each depth waits until it is more than CATCH_UP behind the one before: bounded, not growing
    assert all(record.rows - head.position(k, "busy") <= 2 * MtpDrafter.CATCH_UP + k + 1 for k in range(DEPTHS))
    assert all(len(outputs) <= 2 * MtpDrafter.CATCH_UP + DEPTHS for outputs in record.outputs)
    drafter.close("busy")


def test_a_long_prompt_catches_up_in_windows_and_drafts_the_same(
    mtp_model: Path, reference: MtpReference, head: MtpHead, monkeypatch
):
    """With tiny catch-up windows, a prompt far longer than them is taken a window at a time per depth,
    and the drafts still equal the reference chain's, round after round."""
    monkeypatch.setattr(MtpDrafter, "CATCH_UP", 3)
    monkeypatch.setattr(MtpDrafter, "WINDOW", 5)
    runs: list[int] = []
    original = MtpHead.run_depth

    def counted(self, depth, segments, prev, ahead):
        runs.append(sum(s.length for s in segments))
        return original(self, depth, segments, prev, ahead)

    monkeypatch.setattr(MtpHead, "run_depth", counted)
    prompts = {"long": prompt(40, 33)}
    plain, _ = speculate(mtp_model, head, prompts, rounds=12)
    runs.clear()
    speculate(mtp_model, head, prompts, rounds=5, reference=reference, truth=plain)
    assert max(runs) <= 5 + DEPTHS  # no step over the whole prompt
