"""The router's scheduling decisions, as a pure state machine (no engine, no gRPC).

A frame is one batch that travels the whole chain of stages: decode rows and prefill windows of
several streams. At most one frame per stage is in flight, so every stage can work at once, and a
stream is in at most one frame (its next row depends on the token the last one returns). Decode
rows go first, prefill windows fill what room is left, so a long prompt never stalls decoding.

Speculation: a decoding stream may carry drafted tokens after its last token; the whole block is
verified on the last stage, which returns the accepted drafts and one token of its own. Positions
past the accepted ones are rewound on every stage by the stream's next frame.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from cascadia import defaults
from cascadia.draft_trust import agreement_score, earned
from cascadia.sampling_params import SamplingParams
from cascadia.tokens import common_prefix

RequestId = str


class Overloaded(RuntimeError):
    """The admission queue is full."""


@dataclass(frozen=True)
class SchedulerConfig:
    stages: int
    rows_per_group: int = defaults.ROWS_PER_GROUP
    prefill_window: int = defaults.PREFILL_WINDOW
    max_streams: int = defaults.MAX_STREAMS  # streams holding state on the chain at once
    max_queue: int = defaults.MAX_QUEUE  # requests waiting for admission
    max_draft: int = 0  # drafted tokens per verify block (0: no speculation); within the stages' rewind slack
    mtp_draft: int = 0  # tokens the last stage's MTP head drafts after each token (0: the chain has no head)
    # frames on the chain at once (0: one per stage, so every stage works at once). Stages that share
    # their cores (a fleet on one machine) gain nothing from working at once and lose the batch: 1.
    frames_in_flight: int = 0
    # rows a frame's streams and their drafts may share before speculation stops (0: a group). A chain
    # on one machine takes large groups for throughput, yet a verify block is near free only in a
    # batch as small as a pipeline group's default
    draft_rows: int = 0
    # finished streams whose state the stages keep, so that a prompt starting with one's tokens (the
    # next turn of a conversation) takes over its positions instead of computing them again; they
    # count against max_streams and give way, oldest first, to new streams (0: close at once)
    keep_finished: int = 8
    # prompts that start with this many tokens or more of a recent prompt, and go on differently (one
    # system prompt, other questions), leave a copy of their state where the two part: a kept stream
    # that later prompts starting alike begin as copies of. Such prefixes are kept as finished streams
    # are, within keep_finished; a prompt that starts with this many tokens of a finished stream's and
    # parts from its prompt starts as a copy of it too (0: neither)
    min_shared_prefix: int = 32

    @property
    def in_flight(self) -> int:
        return self.frames_in_flight or self.stages

    @property
    def draft_room(self) -> int:
        return min(self.draft_rows or self.rows_per_group, self.rows_per_group)

    @property
    def longest_draft(self) -> int:
        """Drafted tokens a lone stream's verify block has room for: the draft length to speculate with."""
        return self.draft_room - 1

    def speculating(self, max_draft: int | None = None, mtp_draft: int = 0) -> SchedulerConfig:
        """This schedule drafting `max_draft` tokens per round (default: `longest_draft`), `mtp_draft` of
        them from the last stage's MTP head."""
        drafted = self.longest_draft if max_draft is None else max_draft
        return replace(self, max_draft=drafted, mtp_draft=mtp_draft)

    def __post_init__(self) -> None:
        for name in ("stages", "rows_per_group", "prefill_window", "max_streams"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        for name in ("frames_in_flight", "draft_rows", "keep_finished", "min_shared_prefix"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.max_draft < self.rows_per_group:
            raise ValueError(f"max_draft must be in [0, {self.rows_per_group}), got {self.max_draft}")
        if self.mtp_draft < 0 or (self.mtp_draft and not self.max_draft):
            raise ValueError(f"mtp_draft {self.mtp_draft} needs speculation (max_draft > 0) and must be >= 0")


@dataclass(frozen=True)
class Request:
    id: RequestId
    prompt: tuple[int, ...]
    params: SamplingParams
    speculate: bool = True  # drafts may be verified for this request (when the router speculates)
    score_prompt: bool = False  # the last stage scores each prompt token given the ones before it
    # the prompt's first tokens that other prompts are likely to start with (a chat's system message): the
    # request may leave a kept copy there before any other prompt has shared them (0: not known)
    shared_prefix: int = 0

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.id}: the prompt is empty")
        if not 0 <= self.shared_prefix <= len(self.prompt):
            raise ValueError(
                f"request {self.id}: shared_prefix {self.shared_prefix} must be in [0, {len(self.prompt)}], "
                "the prompt's length"
            )


@dataclass(frozen=True)
class Row:
    """Consecutive positions of one stream in a frame."""

    stream: RequestId
    start: int
    tokens: tuple[int, ...]
    wants_token: bool  # the last row's token is sampled and sent back
    opens: bool  # first frame of the stream: stages open its state
    draft: tuple[int, ...] = ()  # drafted tokens: the last len(draft) of `tokens`, verified on the last stage
    mtp: bool = False  # with `opens`: the last stage's MTP head follows this stream
    propose: int = 0  # MTP tokens the last stage drafts after this row's token
    resume_from: RequestId = ""  # with `opens`: the finished stream whose state the stream takes over at `start`
    copy_from: RequestId = ""  # with `opens`: the open stream whose first `start` positions it starts from
    prefix: bool = False  # a shared prefix's row: no request of its own, its state is kept for copies


@dataclass(frozen=True)
class Frame:
    id: int
    rows: tuple[Row, ...]
    rewinds: tuple[tuple[RequestId, int], ...] = ()  # (stream, position) applied before the rows

    @property
    def size(self) -> int:
        return sum(len(r.tokens) for r in self.rows)


@dataclass(frozen=True)
class Emitted:
    stream: RequestId
    token: int
    finished: Literal["stop", "length"] | None
    cached: int = 0  # on a stream's first token: the prompt positions it took over or copied


# at most one in this many kept places holds a copy of a shared prefix that no stream has started from
UNUSED_COPY_SHARE = 4
RECENT_PROMPTS = 64  # admitted prompts a new one is compared with for a shared prefix
PROBE_EVERY = 16  # tokens a stream whose drafts do not pay generates between one-token probes
PROPOSAL_SMOOTHING = 0.5  # weight of the newest proposal's time per token


@dataclass
class _Stream:
    request: Request
    position: int = 0  # positions already sent
    generated: list[int] = field(default_factory=list)
    frames: int = 0  # frames in flight that carry rows of this stream
    opened: bool = False
    draft: tuple[int, ...] = ()  # proposed continuation for the next decode row
    draft_source: str = ""
    rewind_to: int | None = None  # positions from here on were rejected drafts
    accepted_ema: float = 1.0  # accepted drafts per verify round, smoothed
    proposal_s_per_token: float | None = None  # what asking for its drafts takes, per token asked, smoothed
    # tokens generated when the stream last had a draft to verify; a new stream may probe at once
    drafted_at: int = -PROBE_EVERY
    mtp: bool = False  # the last stage's MTP head follows the stream
    stage_drafts: tuple[tuple[str, tuple[int, ...]], ...] = ()  # the last stage's continuations by source
    reached: int = 0  # the furthest position sent (rejected drafts' rows included)
    resume_from: RequestId = ""  # the finished stream whose state it takes over when it opens
    copy_of: RequestId = ""  # the running stream or kept prefix whose first positions it starts as a copy of
    reused: int = 0  # the prompt positions that state holds
    shares: int = 0  # a prefix of the prompt to leave a kept copy of once sent (0: none)

    @property
    def prefilling(self) -> bool:
        return self.position < len(self.request.prompt)

    @property
    def busy(self) -> bool:
        return self.frames > 0


@dataclass(frozen=True)
class DraftWanted:
    stream: RequestId
    context: tuple[int, ...]  # prompt and generated tokens so far
    k: int  # drafted tokens the next decode row has room for
    # drafts the last stage sent with the stream's last token, by source (its MTP head, its grammar)
    stage: tuple[tuple[str, tuple[int, ...]], ...] = ()


@dataclass(frozen=True)
class Verified:
    stream: RequestId
    source: str
    proposed: int
    accepted: int


def decode_rows_per_frame(decoding: int, in_flight: int, rows_per_group: int) -> int:
    """Decode rows one frame carries: the decoding streams spread over the frames in flight (one per
    stage by default, so that every stage has work: 8 streams on 3 stages go as 3, 3 and 2), and never
    more than a group."""
    return max(1, min(rows_per_group, -(-decoding // in_flight)))


def choose_draft(
    candidates: Sequence[tuple[Sequence[int], str]],
    agreement: dict[str, Sequence[int]],
    floor: float = 0.1,
    warmup: int = 32,
) -> tuple[list[int], str]:
    """The candidate whose source has agreed best so far: (accepted + 1) / (proposed + 2) over its rounds.

    Unmeasured sources start at one half; on a tie the earlier candidate wins (callers list the
    confident sources first). A source that agreed on less than `floor` of its first `warmup` or
    more drafted tokens is not used: verifying its drafts costs rows and gains nothing.
    """
    best: tuple[list[int], str] = ([], "")
    best_score = -1.0
    for tokens, source in candidates:
        if not tokens:
            continue
        proposed, accepted = agreement.get(source, (0, 0))
        if not earned(proposed, accepted, floor, warmup):
            continue
        score = agreement_score(proposed, accepted)
        if score > best_score:
            best, best_score = (list(tokens), source), score
    return best


def speculable(request: Request) -> bool:
    """Penalties depend on every sampled token and a seed promises the same sample path on every run:
    neither survives verifying drafts, so those requests decode one token at a time."""
    params = request.params
    seeded_sampling = params.temperature > 0 and params.seed is not None
    return request.speculate and not params.penalised and not seeded_sampling


def smoothed(previous: float | None, newest: float, weight: float) -> float:
    """An exponential moving average that starts at its first measurement."""
    return newest if previous is None else previous + weight * (newest - previous)


@dataclass(frozen=True)
class Kept:
    """A finished stream whose state the stages keep."""

    tokens: tuple[int, ...]  # what its positions hold, in order
    reached: int  # the furthest position it was fed, which a rewind may go back at most the slack from
    mtp: bool = False  # the last stage's MTP head follows it: only such a stream takes it over
    prefix: bool = False  # a prefix prompts share: later prompts start as copies of it, none takes it over
    # its request's prompt tokens: a prompt holding all of them continues it (a next turn, the same
    # question again) and takes it over; one that parts sooner (another user) starts as a copy of it
    prompt: int = 0
    copies: int = 0  # streams that started as copies of it


def next_to_give_way(kept: Mapping[RequestId, Kept], unused_places: int) -> RequestId:
    """The kept stream that gives way when a place is wanted (`kept` least recently used first): the oldest
    of all, unless more than `unused_places` of them are shared prefixes no stream has started from yet,
    and then the oldest of those.

    A prefix's copy is left on a guess (a prompt said others would start alike, or two prompts did); a
    finished stream is a conversation whose next turn may come. Where system prompts differ from request
    to request (a user's name or the date in them), every request leaves a copy nobody starts from, and
    by age alone those would push the conversations out. A copy that is started from gives way by its use.
    """
    unused = [name for name, held in kept.items() if held.prefix and not held.copies]
    return unused[0] if len(unused) > unused_places else next(iter(kept))


def reusable(
    kept: dict[RequestId, Kept], prompt: Sequence[int], slack: int, mtp: bool = False
) -> tuple[RequestId, int] | None:
    """The kept stream `prompt` continues whose positions serve most of it, and how many: a prompt's last
    token is always fed again (its row gives the first token). `prompt` must hold the kept stream's own
    prompt whole. A stream can be stepped back at most `slack` positions behind the furthest it was fed
    (one less where the MTP head follows it: its depths step back a row further); on a tie the one kept
    last wins. `mtp`: whether the MTP head is to follow the new stream, as it must have followed the
    kept one."""
    best: tuple[RequestId, int] | None = None
    for stream, held in kept.items():
        if held.mtp != mtp or held.prefix:
            continue
        shared = common_prefix(held.tokens, prompt)
        if shared < held.prompt:
            continue  # it parts from the kept stream's prompt: a copy serves it, and the stream stays
        positions = min(shared, len(prompt) - 1)
        reach = slack - 1 if mtp else slack
        if positions > 0 and held.reached - positions <= reach and (best is None or positions >= best[1]):
            best = (stream, positions)
    return best


def copy_source(running: dict[RequestId, tuple[int, ...]], prompt: Sequence[int]) -> tuple[RequestId, int] | None:
    """A running stream (id -> its prompt) whose prompt the new one starts with, all but its last token
    or more (a request's `n` choices, the same question asked twice at once), and how many positions a
    copy of it would start with: the new prompt's last token is always fed (its row gives the first
    token). Only such a stream is copied, as it reaches those positions and before it has gone far
    past them."""
    best: tuple[RequestId, int] | None = None
    for stream, theirs in running.items():
        shared = common_prefix(theirs, prompt)
        positions = min(shared, len(prompt) - 1)
        if positions > 0 and shared >= len(theirs) - 1 and (best is None or positions > best[1]):
            best = (stream, positions)
    return best


def kept_source(
    kept: dict[RequestId, Kept], prompt: Sequence[int], slack: int, mtp: bool = False, shortest: int = 1
) -> tuple[RequestId, int] | None:
    """The kept stream (a shared prefix, or a finished stream) that serves most of `prompt` as a copy, at
    least `shortest` positions, and how many the copy would start with (never the prompt's last token,
    which is always fed): within `slack` of the furthest it was fed (one less where the MTP head follows
    it), since a copy steps its state back to where the prompts part. On a tie a shared prefix wins,
    then the one kept last. `mtp`: whether the MTP head is to follow the copy, as it must follow the kept
    stream."""
    best: tuple[RequestId, int, bool] | None = None
    reach = slack - 1 if mtp else slack
    for stream, held in kept.items():
        if held.mtp != mtp:
            continue
        positions = min(common_prefix(held.tokens, prompt), len(prompt) - 1)
        better = best is None or (positions, held.prefix) >= best[1:]
        if positions >= max(shortest, 1) and held.reached - positions <= reach and better:
            best = (stream, positions, held.prefix)
    return None if best is None else best[:2]


def shared_prefix(recent: Sequence[Sequence[int]], prompt: Sequence[int], copied: int, shortest: int) -> int:
    """Where `prompt` and a recent prompt part, when a kept copy of what they share is worth it: at least
    `shortest` tokens, past the `copied` positions the prompt starts with as a copy (0: not worth it).

    Only prompts that go on differently count: one that holds the other whole (a conversation's next
    turn, the same question again) has the finished stream to take over.
    """
    if not shortest:
        return 0
    parts = (common_prefix(other, prompt) for other in recent)
    shared = max((n for n, other in zip(parts, recent, strict=True) if n < min(len(other), len(prompt))), default=0)
    return shared if shared >= max(copied + shortest, 1) else 0


def announced_prefix(
    kept: dict[RequestId, Kept], request: Request, copied: int, shortest: int, slack: int, mtp: bool = False
) -> int:
    """Where to leave a kept copy of the prefix `request` says other prompts will start with
    (`shared_prefix`): there, when that is at least `shortest` tokens past the `copied` positions the
    prompt starts with and short of its last token (always fed), unless a kept stream (or a copy on its
    way) would already serve a prompt starting with it (0: none)."""
    prompt, announced = request.prompt, request.shared_prefix
    if not shortest or announced < max(copied + shortest, 1) or announced >= len(prompt):
        return 0
    served = kept_source(kept, prompt[: announced + 1], slack, mtp, shortest=announced)
    return 0 if served is not None else announced


def smoothed_acceptance(previous: float, accepted: int) -> float:
    """Accepted drafts per round, smoothed; a round that accepted none starts again from zero.

    A long run of accepted drafts (a copy of the prompt) ends with the copy; the reply then goes on in
    words of its own, and halving the estimate round by round would keep verifying long drafts that
    miss (a 16-row block costs about three one-row steps here) for several more rounds.
    """
    return 0.0 if accepted == 0 else 0.5 * previous + 0.5 * accepted


def draft_length(streams: int, rows_per_group: int, max_draft: int, accepted_ema: float) -> int:
    """Drafted tokens for one stream's next row: none once other streams' rows fill the groups, fewer after misses.

    Speculation pays for lone streams and light load: a verify block of k + 1 rows must share its
    group with the rows of the other `streams` (decoding, prefilling or waiting to be admitted), so
    with n of them only rows_per_group // n - 1 fit.
    """
    if max_draft == 0 or streams == 0:
        return 0
    room = rows_per_group // streams - 1
    adaptive = int(2 * accepted_ema) + 1
    return max(0, min(max_draft, room, adaptive))


@dataclass
class RoundCosts:
    """Measured seconds of a frame by its rows, smoothed: what the chain charges for rows on this device."""

    seconds: dict[int, float] = field(default_factory=dict)
    smoothing: float = 0.25  # weight of the newest measurement

    def observe(self, rows: int, seconds: float) -> None:
        was = self.seconds.get(rows)
        self.seconds[rows] = smoothed(was, seconds, self.smoothing)

    def widest_at_cost(self, rows: int, limit: int, tolerance: float = 0.1) -> int:
        """The most rows, up to `limit`, of a frame measured at no more than `tolerance` above the
        widest measured frame of at most `rows` (a frame of `rows` costs no less, as rows only add
        work); `rows` itself when nothing qualifies."""
        narrower = [r for r in self.seconds if r <= rows]
        if not narrower:
            return rows
        ceiling = self.seconds[max(narrower)] * (1 + tolerance)
        cheap = [r for r, s in self.seconds.items() if rows < r <= limit and s <= ceiling]
        return max(cheap, default=rows)


def grown_draft(k: int, cap: int, other_rows: int, costs: RoundCosts) -> int:
    """`k` drafted tokens, or up to `cap` when a frame with them was measured (nearly) as fast.

    On a CPU a step's time rises in steps with its rows, not per row (the kernels work on tiles of
    rows), so once a verify block has paid for a tile the rest of it verifies almost free
    (`cascadia bench spec` reports the step time by rows). Drafting starts from the acceptance-based
    `k`, so a stream whose drafts miss is never grown.
    """
    if k <= 0 or cap <= k:
        return k
    return costs.widest_at_cost(other_rows + k + 1, other_rows + cap + 1) - other_rows - 1


def paying_draft(k: int, rows: int, expected: float, costs: RoundCosts, proposal_s_per_token: float = 0.0) -> int:
    """Up to `k` drafted tokens for one of `rows` streams sharing a frame, as many as pay; 0 when none do.

    The frame advances each stream by a token. With d drafted rows more it costs `costs[rows + d]`
    instead of `costs[rows]`, plus the wait for the proposal (`proposal_s_per_token` per token asked:
    the frame waits for its proposals, and a draft model may take about as long as the chain, on one
    machine on the same cores), and yields the drafts the stream accepts on top (`expected`, its
    smoothed count per round). The d with the most tokens per second is kept if that beats the frame
    without it. Frame sizes not yet measured with drafts are drafted, which measures them. When
    proposals cost nothing, a lone stream is left to its acceptance (drafting is how its estimate
    grows); when they cost time, a frame of `rows` never measured goes once without drafts, which
    measures it (a stream that always drafts would never learn what a frame without them costs).
    """
    asking = proposal_s_per_token > 0
    if k <= 0 or (rows <= 1 and not asking):
        return k
    base = costs.seconds.get(rows)
    if base is None:
        return 0 if asking else k
    measured = [d for d in range(1, k + 1) if rows + d in costs.seconds]
    if not measured:
        return k

    def rate(d: int) -> float:
        return (rows + min(expected, d)) / (d * proposal_s_per_token + costs.seconds[rows + d])

    best = max(measured, key=rate)
    return best if rate(best) > rows / base else 0


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.round_costs = RoundCosts()
        self._queue: deque[Request] = deque()
        self._active: dict[RequestId, _Stream] = {}
        self._in_flight: dict[int, Frame] = {}
        self._next_frame = 0
        self._chain_ready = False
        self.verified: list[Verified] = []  # the last on_frame_done's verify outcomes, for the proposer
        self._kept: dict[RequestId, Kept] = {}  # finished streams the stages keep, oldest first
        self._dropped: list[RequestId] = []  # kept streams given up, for the stages to close
        self._sharing: dict[RequestId, Kept] = {}  # shared prefixes whose copies are on their way
        self._recent: deque[tuple[int, ...]] = deque(maxlen=RECENT_PROMPTS)
        self._prefixes = 0  # shared prefixes named so far
        self.rewind_slack = 0  # as the stages report it
        self.context = 0  # positions of a stream every stage holds, as the stages report it (0: not known)
        # off while the stages capture: a capture holds each stream's rows from its first position on
        self.taking_over = True
        self.reused_positions = 0  # prompt positions taken over or copied so far

    # -- inputs -----------------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        known = request.id in self._active or request.id in self._kept or request.id in self._sharing
        if known or any(r.id == request.id for r in self._queue):
            raise ValueError(f"request {request.id} is already known")
        if len(self._queue) >= self.config.max_queue:
            raise Overloaded(f"overloaded: {len(self._queue)} requests already wait for admission")
        self._queue.append(request)

    def waiting(self) -> tuple[Request, ...]:
        """Requests waiting for admission, first come first."""
        return tuple(self._queue)

    def set_chain_ready(self, ready: bool) -> None:
        self._chain_ready = ready

    def cancel(self, request_id: RequestId) -> bool:
        """Forget a request; returns True when stages hold state for it that must be closed."""
        for queued in self._queue:
            if queued.id == request_id:
                self._queue.remove(queued)
                return False
        stream = self._active.pop(request_id, None)
        if stream is not None and not stream.opened and stream.resume_from:
            self._dropped.append(stream.resume_from)  # the stages still hold it under its old name
        return stream is not None and stream.opened

    def on_frame_done(
        self,
        frame_id: int,
        tokens: dict[RequestId, int | Sequence[int]],
        stage_drafts: dict[RequestId, dict[str, Sequence[int]]] | None = None,
        seconds: float | None = None,
    ) -> list[Emitted]:
        """The last stage's tokens for a frame (several for a verified block); returns what each stream emitted.

        `stage_drafts` holds the last stage's continuations after each stream's last token, by source (its
        MTP head, the tokens its grammar allows alone); `seconds`, the frame's time on the chain, teaches
        the draft lengths what rows cost.
        """
        frame = self._in_flight.pop(frame_id)
        if seconds is not None:
            self.round_costs.observe(frame.size, seconds)
        emitted = []
        self.verified = []
        for row in frame.rows:
            if row.prefix:
                self._kept_prefix(row.stream)
                continue
            stream = self._active.get(row.stream)
            if stream is None:  # cancelled while in flight
                continue
            stream.frames -= 1
            if not row.wants_token:
                continue
            if row.stream not in tokens:
                raise ValueError(f"frame {frame_id}: no token for stream {row.stream}")
            got = tokens[row.stream]
            got = [got] if isinstance(got, int) else list(got)
            if not 1 <= len(got) <= len(row.draft) + 1 or got[:-1] != list(row.draft[: len(got) - 1]):
                raise ValueError(f"frame {frame_id}: stream {row.stream} returned {got} for draft {row.draft}")
            if row.draft:
                accepted = len(got) - 1
                self.verified.append(Verified(row.stream, stream.draft_source, len(row.draft), accepted))
                stream.accepted_ema = smoothed_acceptance(stream.accepted_ema, accepted)
                if accepted < len(row.draft):  # the stages hold the rejected drafts' positions too
                    stream.position = row.start + accepted + 1
                    stream.rewind_to = stream.position
            drafts = (stage_drafts or {}).get(row.stream, {})
            stream.stage_drafts = tuple((source, tuple(map(int, t))) for source, t in drafts.items() if t)
            params = stream.request.params
            for token in got:
                stream.generated.append(token)
                finished: Literal["stop", "length"] | None = None
                if token in params.stop_ids:
                    finished = "stop"
                elif len(stream.generated) >= params.max_tokens:
                    finished = "length"
                emitted.append(Emitted(row.stream, token, finished, stream.reused if len(stream.generated) == 1 else 0))
                if finished:
                    del self._active[row.stream]
                    self._keep(stream)
                    break
        return emitted

    def on_frame_failed(self, frame_id: int) -> list[RequestId]:
        """A frame lost on the chain: its streams fail (their state on the stages is unknown), and the kept
        streams are given up (a stage that failed may have lost them)."""
        frame = self._in_flight.pop(frame_id, None)
        if frame is None:
            return []
        self.drop_all_kept()
        # a stream that was to take over a kept one's state: the stages that never saw the frame hold it still
        self._dropped.extend(row.resume_from for row in frame.rows if row.resume_from)
        self._dropped.extend(row.stream for row in frame.rows if row.prefix)  # as the stages that saw it do
        failed = [row.stream for row in frame.rows if row.stream in self._active]
        for stream in failed:
            del self._active[stream]
        return failed

    def kept(self, stream_id: RequestId) -> bool:
        """Whether a finished stream's state stays on the stages (it must not be closed)."""
        return stream_id in self._kept

    def drop_kept(self, stream_id: RequestId) -> None:
        """Give up a kept stream (its name is wanted again)."""
        if self._kept.pop(stream_id, None) is not None:
            self._dropped.append(stream_id)

    def drop_all_kept(self) -> None:
        """Give up every kept stream, and the shared prefixes on their way (closed once they are there)."""
        self._dropped.extend([*self._kept, *self._sharing])
        self._kept.clear()
        self._sharing.clear()

    def take_dropped(self) -> list[RequestId]:
        """Kept streams given up since the last call: the stages should close them."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def _keep(self, stream: _Stream) -> None:
        """Keep a finished stream's state for a later prompt: every position but the last token's, which
        was sampled and never fed."""
        if not self.config.keep_finished:
            return
        request = stream.request
        fed = len(request.prompt) + len(stream.generated) - 1
        tokens = (request.prompt + tuple(stream.generated))[:fed]
        self._kept[request.id] = Kept(tokens, stream.reached, stream.mtp, prompt=len(request.prompt))
        while len(self._kept) > self.config.keep_finished:
            self._give_way()

    def _kept_prefix(self, name: RequestId) -> None:
        """A shared prefix's copy is there: keep it, within keep_finished (unless given up on the way)."""
        held = self._sharing.pop(name, None)
        if held is None:
            return
        self._kept[name] = held
        while len(self._kept) > self.config.keep_finished:
            self._give_way()

    def _prefix_name(self) -> RequestId:
        while True:
            self._prefixes += 1
            name = f"prefix-{self._prefixes}"
            if name not in self._active and name not in self._kept and all(r.id != name for r in self._queue):
                return name

    def _give_way(self) -> None:
        name = next_to_give_way(self._kept, max(1, self.config.keep_finished // UNUSED_COPY_SHARE))
        del self._kept[name]
        self._dropped.append(name)

    # -- drafts -----------------------------------------------------------------------------------

    def drafts_wanted(self) -> list[DraftWanted]:
        """Decoding streams that are free and would carry a draft in their next row, with its length."""
        if self.config.max_draft == 0:
            return []
        decoding = [s for s in self._active.values() if s.opened and not s.prefilling and s.generated]
        wanted = []
        for stream in decoding:
            if stream.busy or stream.draft or not speculable(stream.request):
                continue
            left = stream.request.params.max_tokens - len(stream.generated)
            load = self._load()
            cap = min(self.config.max_draft, self.config.draft_room // load - 1, left - 1)
            k = min(draft_length(load, self.config.draft_room, self.config.max_draft, stream.accepted_ema), left - 1)
            k = grown_draft(k, cap, load - 1, self.round_costs)
            paid = paying_draft(k, load, stream.accepted_ema, self.round_costs, stream.proposal_s_per_token or 0.0)
            # a stream whose drafts stopped paying still tries one now and then: its estimate only
            # changes in rounds that verify drafts, and what it generates may turn into a copy
            if paid == 0 < k and len(stream.generated) - stream.drafted_at >= PROBE_EVERY:
                paid = 1
            k = paid
            if k > 0:
                context = stream.request.prompt + tuple(stream.generated)
                stage = tuple((source, t[:k]) for source, t in stream.stage_drafts)
                wanted.append(DraftWanted(stream.request.id, context, k, stage))
            stream.stage_drafts = ()
        return wanted

    def observe_proposal(self, stream_id: RequestId, asked: int, seconds: float) -> None:
        """How long asking for `asked` drafted tokens took (whatever the draft turned out to be)."""
        stream = self._active.get(stream_id)
        if stream is not None and asked > 0:
            stream.proposal_s_per_token = smoothed(stream.proposal_s_per_token, seconds / asked, PROPOSAL_SMOOTHING)

    def set_draft(self, stream_id: RequestId, tokens: Sequence[int], source: str = "") -> None:
        stream = self._active.get(stream_id)
        if stream is not None and not stream.busy:
            stream.draft, stream.draft_source = tuple(int(t) for t in tokens), source
            if stream.draft:  # a probe counts once it verifies something; an empty proposal costs nothing
                stream.drafted_at = len(stream.generated)

    # -- decisions --------------------------------------------------------------------------------

    def next_frames(self) -> list[Frame]:
        """Frames to send now: one per free stage slot, each at most `rows_per_group` rows."""
        if not self._chain_ready:
            return []
        self._admit()
        frames = []
        while len(self._in_flight) < self.config.in_flight:
            frame = self._build_frame()
            if frame is None:
                break
            self._in_flight[frame.id] = frame
            frames.append(frame)
        return frames

    def _admit(self) -> None:
        while self._queue:
            request = self._queue[0]
            stream = _Stream(request)
            found = self._reusable(request)
            copied = self._copyable(request)
            # a kept stream this prompt continues becomes this one, unless a copy serves more
            if found is not None and (copied is None or found[1] >= copied[1]):
                source, positions = found
                held = self._kept.pop(source)
                stream.position, stream.reached, stream.resume_from = positions, held.reached, source
                stream.reused = positions
                self.reused_positions += positions
            else:
                if copied is not None:  # opens once the source has been fed that far
                    stream.copy_of, stream.position = copied
                    source = copied[0]
                    if source in self._kept:  # the kept stream last copied gives way last
                        held = self._kept.pop(source)
                        self._kept[source] = replace(held, copies=held.copies + 1)
                    elif source in self._sharing:
                        held = self._sharing[source]
                        self._sharing[source] = replace(held, copies=held.copies + 1)
                if len(self._active) + len(self._sharing) >= self.config.max_streams:
                    return  # giving kept streams up would not make room
                while self._kept and self._held_streams() >= self.config.max_streams:
                    self._give_way()
            self._queue.popleft()
            self._active[request.id] = stream
            if self._shares_prefixes(request):
                # a stream taken over is gone for the next prompt: only a copy's source stays
                copied = stream.position if stream.copy_of else 0
                shortest = self.config.min_shared_prefix
                stream.shares = shared_prefix(self._recent, request.prompt, copied, shortest)
                if not stream.shares and request.shared_prefix:
                    held, mtp = self._kept | self._sharing, self._follows_mtp(request)
                    stream.shares = announced_prefix(held, request, copied, shortest, self.rewind_slack, mtp)
            self._recent.append(request.prompt)

    @property
    def holds_every_row(self) -> bool:
        """Whether the stages can step a stream back to any position (a Llama stage holds every row): then
        a stream serves prompts that start as it did itself, running, finished and kept, or taken over by
        its next turn, and a kept copy of its first positions would only take a place."""
        return 0 < self.context <= self.rewind_slack

    def _held_streams(self) -> int:
        """Streams whose state the stages hold or are about to: running, kept, shared prefixes on their way."""
        return len(self._active) + len(self._kept) + len(self._sharing)

    def _shares_prefixes(self, request: Request) -> bool:
        """Whether this request may leave a copy of a prefix it shares with a recent prompt or says others
        will share: the stages keep streams and can step a copy back (it starts one position short), yet
        do not hold every row (then every stream serves such prompts itself), and no capture is running."""
        keeps = self.config.keep_finished > 0 and self.rewind_slack >= 1 and not self.holds_every_row
        return keeps and self.taking_over and not request.score_prompt

    def _reusable(self, request: Request) -> tuple[RequestId, int] | None:
        """A kept stream this request may take over: not for a scored prompt (every prompt row is scored)."""
        if not self._kept or not self.taking_over or request.score_prompt:
            return None
        return reusable(self._kept, request.prompt, self.rewind_slack, self._follows_mtp(request))

    def _copyable(self, request: Request) -> tuple[RequestId, int] | None:
        """A running stream, or a kept one (a shared prefix, a finished stream it parts from), this request
        may start as a copy of, and how many positions: not for a scored prompt or a capture. A copy steps
        its source's state back at least one position (its last prompt token is fed again), and the MTP
        head's depths one more, so without that rewind slack there is none."""
        mtp = self._follows_mtp(request)
        if self.rewind_slack < 1 + mtp or not self.taking_over or request.score_prompt:
            return None
        # the MTP head follows a copy only of a stream it follows, and only such a stream is copied for it; a
        # copy that has not opened has been sent nothing yet
        running = {
            i: s.request.prompt for i, s in self._active.items() if self._mtp(s) == mtp and (s.opened or not s.copy_of)
        }
        found = [copy_source(running, request.prompt)]
        if self.config.min_shared_prefix:  # a kept stream is copied as far as a shared prefix is worth it
            shortest = self.config.min_shared_prefix
            found.append(kept_source(self._kept, request.prompt, self.rewind_slack, mtp, shortest))
        return max((f for f in found if f is not None), key=lambda f: f[1], default=None)

    def _mtp(self, stream: _Stream) -> bool:
        """Whether the MTP head follows `stream`, or will once it opens."""
        return stream.mtp if stream.opened else self._follows_mtp(stream.request)

    def _follows_mtp(self, request: Request) -> bool:
        return self.config.mtp_draft > 0 and speculable(request)

    def _build_frame(self) -> Frame | None:
        budget = self.config.rows_per_group
        rows: list[Row] = self._prefix_rows(budget)
        budget -= len(rows)
        rewinds: list[tuple[RequestId, int]] = []
        decoding = sum(1 for s in self._active.values() if not s.prefilling)
        decode_cap = decode_rows_per_frame(decoding, self.config.in_flight, self.config.rows_per_group)
        ready = [s for s in self._active.values() if not s.prefilling and not s.busy]
        for stream in ready[:decode_cap]:  # decode rows first
            if budget == 0:
                break
            draft = stream.draft[: budget - 1]
            stream.draft = ()
            tokens = (stream.generated[-1], *draft)
            rows.append(
                Row(stream.request.id, stream.position, tokens, True, False, draft, propose=self._propose(stream))
            )
            if stream.rewind_to is not None:
                rewinds.append((stream.request.id, stream.rewind_to))
                stream.rewind_to = None
            budget -= 1 + len(draft)
        # A prompt's windows follow each other down the chain without waiting for the one before
        # to come back (stages run frames in order), so a long prompt fills the pipeline; prompts
        # with fewer windows in flight go first, so a long one never holds a short one back.
        prefilling = sorted((s for s in self._active.values() if s.prefilling), key=lambda s: s.frames)
        for stream in prefilling:
            if budget == 0:
                break
            if stream.copy_of and not stream.opened and not self._copy_ready(stream):
                continue
            prompt = stream.request.prompt
            n = min(self.config.prefill_window, budget, len(prompt) - stream.position)
            if stream.shares - 1 > stream.position:  # the window stops where the shared prefix's copy starts
                n = min(n, stream.shares - 1 - stream.position)
            end = stream.position + n
            if not stream.opened:
                stream.mtp = self._follows_mtp(stream.request)
            rows.append(
                Row(
                    stream.request.id,
                    stream.position,
                    prompt[stream.position : end],
                    end == len(prompt),
                    not stream.opened,
                    mtp=stream.mtp and not stream.opened,
                    propose=self._propose(stream) if end == len(prompt) else 0,
                    resume_from="" if stream.opened else stream.resume_from,
                    copy_from="" if stream.opened else stream.copy_of,
                )
            )
            if stream.copy_of and not stream.opened:
                stream.reused = stream.position
                self.reused_positions += stream.position
            budget -= n
        if not rows:
            return None
        for row in rows:
            if row.prefix:
                continue
            stream = self._active[row.stream]
            stream.frames += 1
            stream.opened = True
            stream.position += len(row.tokens)
            stream.reached = max(stream.reached, stream.position)
        frame = Frame(self._next_frame, tuple(rows), tuple(rewinds))
        self._next_frame += 1
        return frame

    def _prefix_rows(self, budget: int) -> list[Row]:
        """One-row copies of streams that have been sent a prefix they share with a recent prompt (stages run
        frames in order, so this frame sees those positions): each feeds the prefix's last token again and
        is then kept for later prompts to start as copies of. A stream that went on past the rewind slack
        first leaves none, as does one the stages have no room beside."""
        rows: list[Row] = []
        for stream in self._active.values():
            end = stream.shares
            if not end or not stream.opened or stream.position < end - 1 or len(rows) == budget:
                continue
            stream.shares = 0
            if stream.reached - (end - 1) > self.rewind_slack - stream.mtp:  # the MTP head's depths: one more
                continue
            while self._kept and self._held_streams() >= self.config.max_streams:
                self._give_way()
            if self._held_streams() >= self.config.max_streams:
                continue
            name, prompt = self._prefix_name(), stream.request.prompt
            self._sharing[name] = Kept(prompt[:end], max(stream.reached, end), stream.mtp, prefix=True)
            last = (prompt[end - 1],)
            rows.append(Row(name, end - 1, last, False, True, mtp=stream.mtp, copy_from=stream.request.id, prefix=True))
        return rows

    def _copy_ready(self, stream: _Stream) -> bool:
        """Whether a stream waiting to start as a copy can open now: its source has been sent its positions
        (stages run frames in order, so this frame sees them) and has not gone past the rewind slack. A
        source gone or too far ahead leaves the stream to compute its prompt itself, from the start. A kept
        stream is ready as long as it is kept (a running source may have finished and been kept)."""
        source: _Stream | Kept | None = self._kept.get(stream.copy_of) or self._active.get(stream.copy_of)
        if source is not None and not self._holds(source, stream):
            source = None
        if isinstance(source, _Stream) and source.position < stream.position:
            return False  # not there yet
        reach = self.rewind_slack - self._follows_mtp(stream.request)  # the MTP head's depths step back one more
        if source is None or source.reached - stream.position > reach:
            stream.copy_of, stream.position = "", 0
            return True
        stream.reached = source.reached
        return True

    @staticmethod
    def _holds(source: _Stream | Kept, stream: _Stream) -> bool:
        """Whether `source` holds the tokens `stream` is to start with: the name may have passed on (a kept
        stream given up, and a new request under its name) while the copy waited."""
        fed = source.tokens if isinstance(source, Kept) else source.request.prompt + tuple(source.generated)
        return fed[: stream.position] == stream.request.prompt[: stream.position]

    def _propose(self, stream: _Stream) -> int:
        """MTP tokens to ask for after this stream's next token: as many as its next round could verify."""
        if not stream.mtp:
            return 0
        limit = min(self.config.max_draft, self.config.mtp_draft)
        k = draft_length(self._load(), self.config.draft_room, limit, stream.accepted_ema)
        return max(0, min(k, stream.request.params.max_tokens - len(stream.generated) - 2))

    def _load(self) -> int:
        """Streams whose rows compete for the groups: every admitted one (prefilling rows fill groups
        as decode rows do) and every one waiting for admission."""
        return len(self._active) + len(self._queue)

    # -- views ------------------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def kept_streams(self) -> int:
        return len(self._kept)

    @property
    def shared_prefixes(self) -> int:
        """Kept streams that are copies left where prompts part (counted in `kept_streams` too)."""
        return sum(held.prefix for held in self._kept.values())

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)
