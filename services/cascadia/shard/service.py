"""`cascadia shard`: one stage of the chain, serving frames over asyncio gRPC.

Frames are checked when they arrive (a malformed one is refused with INVALID_ARGUMENT and changes
nothing), queued, and run strictly in order by one worker, which hands each result on while the
next frame computes: over one stream to the next stage's Push, or on the last stage the sampled
tokens to the collector's DeliverAll at --reply-to. Submit takes one frame at a time (and refuses a
bad one with INVALID_ARGUMENT); Push answers each frame with a receipt.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from cascadia.engine.batch import Segment
from cascadia.engine.engine import StageEngine
from cascadia.engine.mtp import MtpDrafter
from cascadia.engine.sampling import (
    Sampler,
    SamplingParams,
    apply_logit_bias,
    log_softmax,
    scored_tokens,
)
from cascadia.engine.speculation import verified_tokens
from cascadia.frame_stream import FrameStream
from cascadia.grammar import GrammarError, GrammarVocabulary, TokenConstraint
from cascadia.shard.capture import CaptureError, CaptureRecorder, CaptureSettings, RecordedBlock, StageInfo
from cascadia.wire import CHANNEL_OPTIONS, pb, rows_array, rows_mismatch, rows_tensor, rpc, sampling_params, tls

log = logging.getLogger("cascadia.shard")


class FrameRejected(ValueError):
    pass


@dataclass
class _Sampler(Sampler):
    """A stream's `Sampler` on the last stage, with what scoring its prompt needs."""

    scores_prompt: bool = False  # until its first token, every prompt token is scored
    sampled: bool = False
    carry: np.ndarray | None = None  # the log-probs after the last block's last row, for the next block's first token

    def scoring(self, block) -> bool:
        return self.scores_prompt and not self.sampled and not block.draft

    def logit_rows(self, block) -> int:
        """How many of `block`'s last rows the last stage needs logits of: every row of a scored prompt, a
        verified block's drafted positions and the row before them, a sampled row, or none."""
        if self.scoring(block):
            return block.length
        return len(block.draft) + 1 if block.wants_token else 0


def check_frame(
    frame,
    expected: dict[str, int],
    is_first: bool,
    hidden_size: int,
    vocab: int,
    mtp_depths: int | None = None,
    mtp_streams: frozenset[str] = frozenset(),
    sampled_vocab: int | None = None,
) -> dict[str, int]:
    """Validate a frame against the positions queued so far; returns the positions after it.

    `mtp_depths` is given on the last stage (0 when it has no MTP head), with the streams opened for it.
    `sampled_vocab`: the tokens the head scores (`vocab` when not given), which a logit_bias may name.
    """
    after = dict(expected)
    for rewind in frame.rewinds:
        if rewind.stream not in after:
            raise FrameRejected(f"rewind of unknown stream '{rewind.stream}'")
        if not 0 <= rewind.position <= after[rewind.stream]:
            raise FrameRejected(f"stream '{rewind.stream}': cannot rewind to {rewind.position}")
        after[rewind.stream] = rewind.position
    for opened in frame.opens:
        if opened.stream in after:
            raise FrameRejected(f"stream '{opened.stream}' is already open")
        if opened.resume_from and opened.copy_from:
            raise FrameRejected(f"stream '{opened.stream}' both resumes and copies another stream")
        if opened.resume_from:
            _check_source(opened, opened.resume_from, ("resume", "resumes"), after, mtp_streams)
            del after[opened.resume_from]
        if opened.copy_from:
            _check_source(opened, opened.copy_from, ("copy", "copies"), after, mtp_streams)
        try:
            sampling_params(opened.sampling)
        except ValueError as exc:
            raise FrameRejected(f"stream '{opened.stream}': {exc}") from None
        beyond = sorted(t for t in opened.sampling.logit_bias if t >= (sampled_vocab or vocab))
        if beyond:
            raise FrameRejected(f"stream '{opened.stream}': logit_bias names token {beyond[0]}, beyond the vocabulary")
        after[opened.stream] = opened.position if opened.resume_from or opened.copy_from else 0
        if opened.mtp and mtp_depths == 0:
            raise FrameRejected(f"stream '{opened.stream}' asks for MTP drafts but this stage has no MTP head")
    mtp = mtp_streams | {o.stream for o in frame.opens if o.mtp}
    rows = 0
    seen = set()
    for block in frame.rows:
        if block.stream not in after:
            raise FrameRejected(f"unknown stream '{block.stream}'")
        if block.stream in seen:
            raise FrameRejected(f"stream '{block.stream}' appears twice in frame {frame.frame_id}")
        seen.add(block.stream)
        if block.length < 1:
            raise FrameRejected(f"stream '{block.stream}': empty row block")
        if block.draft and (len(block.draft) >= block.length or not block.wants_token):
            raise FrameRejected(
                f"stream '{block.stream}': {len(block.draft)} drafted tokens in a block of {block.length} rows"
                + ("" if block.wants_token else " that wants no token")
            )
        if block.propose and mtp_depths is not None:
            if block.stream not in mtp:
                raise FrameRejected(f"stream '{block.stream}': MTP drafts asked of a stream not opened for them")
            if not 0 < block.propose <= mtp_depths or not block.wants_token:
                of = f"a head with {mtp_depths} depths" if block.wants_token else "a block that wants no token"
                raise FrameRejected(f"stream '{block.stream}': {block.propose} MTP drafts asked of {of}")
        if block.start != after[block.stream]:
            raise FrameRejected(
                f"stream '{block.stream}': position gap, rows start at {block.start} but the stream is at "
                f"{after[block.stream]}"
            )
        after[block.stream] += block.length
        rows += block.length
    if is_first:
        if len(frame.token_ids) != rows:
            raise FrameRejected(f"frame {frame.frame_id}: {len(frame.token_ids)} token ids for {rows} rows")
        if any(not 0 <= t < vocab for t in frame.token_ids):
            raise FrameRejected(f"frame {frame.frame_id}: token id outside [0, {vocab})")
    elif rows:
        if mtp_depths and len(frame.token_ids) != rows:
            raise FrameRejected(f"frame {frame.frame_id}: {len(frame.token_ids)} token ids for {rows} rows")
        wrong = rows_mismatch(frame.hidden, rows, hidden_size)
        if wrong is not None:
            raise FrameRejected(f"frame {frame.frame_id}: {wrong}")
    for stream in frame.closes:  # closing is idempotent: a stage that failed a stream already forgot it
        after.pop(stream, None)
    return after


def _check_source(
    opened, source: str, verb: tuple[str, str], after: dict[str, int], mtp_streams: frozenset[str]
) -> None:
    """A stream that opens as `source`'s state (taken over or copied) at `opened.position`: `source` is open
    and that far, and the MTP head follows both or neither."""
    if source not in after:
        raise FrameRejected(f"stream '{opened.stream}' {verb[1]} unknown stream '{source}'")
    if not 0 <= opened.position <= after[source]:
        raise FrameRejected(f"stream '{opened.stream}': cannot {verb[0]} '{source}' at {opened.position}")
    if opened.mtp != (source in mtp_streams):
        raise FrameRejected(
            f"stream '{opened.stream}': a stream the MTP head follows {verb[1]} only such a stream, and only such "
            f"a stream {verb[1]} one"
        )


class ShardServicer(rpc.ShardServicer):
    def __init__(
        self,
        engine: StageEngine,
        stage: int,
        drafter: MtpDrafter | None = None,
        vocabulary: GrammarVocabulary | None = None,
    ) -> None:
        self.engine = engine
        self.drafter = drafter  # the MTP head, on the last stage when it serves one
        self.vocabulary = vocabulary  # the model's tokens for grammars, on the last stage when it has a tokenizer
        self.constraints: dict[str, TokenConstraint] = {}  # admitted streams' grammars, taken when they open
        self.mtp_streams: set[str] = set()
        self.capture: CaptureRecorder | None = None
        self.capture_info: StageInfo | None = None  # set by serve(): what capture files say of this stage
        self._capture_lock = threading.Lock()
        self.stage = stage
        self.queue: asyncio.Queue = asyncio.Queue()
        self.expected: dict[str, int] = {}
        self.samplers: dict[str, _Sampler] = {}
        self.sender: FrameStream | None = None  # to the next stage, or from the last one to the collector
        self.compute_seconds = 0.0
        self.frames_computed = 0

    async def Submit(self, frame, context):
        error = self._admit(frame)
        if error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        await self.queue.put(frame)
        return pb.Ack()

    async def Push(self, frames, context):
        async for frame in frames:
            error = self._admit(frame)
            if not error:
                await self.queue.put(frame)
            yield pb.Receipt(frame_id=frame.frame_id, error=error)

    def _admit(self, frame) -> str:
        """Check a frame against the positions queued so far; on success take its opens and closes."""
        if frame.error:
            return ""
        try:
            constraints = self._grammars(frame)
            self.expected = check_frame(
                frame,
                self.expected,
                self.engine.is_first,
                self.engine.shape.hidden_size,
                self.engine.shape.vocab_size,
                self._mtp_depths,
                frozenset(self.mtp_streams),
                self.engine.shape.unpadded_vocab_size,
            )
        except FrameRejected as exc:
            return str(exc)
        self.constraints.update(constraints)
        self.mtp_streams.update(o.stream for o in frame.opens if o.mtp)
        self.mtp_streams.difference_update([*frame.closes, *(o.resume_from for o in frame.opens if o.resume_from)])
        return ""

    def _grammars(self, frame) -> dict[str, TokenConstraint]:
        """The last stage's matcher for each stream the frame opens with a grammar (built here, where a bad
        grammar refuses the frame before it changes anything)."""
        if not self.engine.is_last:
            return {}
        out = {}
        for opened in frame.opens:
            if not opened.sampling.grammar:
                continue
            if self.vocabulary is None:
                raise FrameRejected(f"stream '{opened.stream}': a grammar, but this stage has no tokenizer to match it")
            try:
                out[opened.stream] = self.vocabulary.constraint(opened.sampling.grammar, opened.sampling.stop_ids)
            except GrammarError as exc:
                raise FrameRejected(f"stream '{opened.stream}': grammar: {exc}") from None
        return out

    async def Capture(self, request, context):
        with self._capture_lock:
            if request.status_only:
                pass
            elif request.enable:
                try:
                    settings = CaptureSettings(
                        Path(request.directory), request.budget_bytes, frozenset(request.streams), request.every_layer
                    )
                    if not request.directory:
                        raise CaptureError("capture needs a directory")
                    recorder = CaptureRecorder(settings, self.capture_info)
                except CaptureError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                if self.capture is not None:
                    self.capture.flush()
                self.capture = recorder
            elif self.capture is not None:
                self.capture.flush()
                stopped = self._capture_status(enabled=False)  # what was written, reported once more
                self.capture = None
                return stopped
            return self._capture_status()

    def _capture_status(self, enabled: bool = True):
        c = self.capture
        if c is None:
            return pb.CaptureStatus(stage=self.stage)
        return pb.CaptureStatus(
            stage=self.stage,
            enabled=enabled and not c.full,
            full=c.full,
            used_bytes=c.used_bytes,
            budget_bytes=c.settings.budget_bytes,
            files=c.files,
            streams=len(c.captured),
        )

    @property
    def _mtp_depths(self) -> int | None:
        if not self.engine.is_last:
            return None
        return self.drafter.head.depths if self.drafter is not None else 0

    async def Stats(self, request, context):
        # the engine's tables change under a running step (`_compute` runs in a thread): each figure
        # is read from a copy of them, never by looking streams up one by one
        return pb.ShardStats(
            open_streams=len(self.engine.streams),
            state_bytes=self.engine.state_bytes(),
            held_state_bytes=self.engine.held_state_bytes(),
            queued_frames=self.queue.qsize(),
            compute_seconds=self.compute_seconds,
            frames_computed=self.frames_computed,
            vocab_size=self.engine.shape.vocab_size,
            sampled_vocab=self.engine.shape.unpadded_vocab_size,
            context=self.engine.context_limit,
            grammars=self.vocabulary is not None,
            rewind_slack=self.engine.reach,
        )

    async def run(self) -> None:
        while True:
            frame = await self.queue.get()
            if frame.error:
                out = frame
            else:
                started = time.perf_counter()
                try:
                    out = await asyncio.to_thread(self._compute, frame)
                except Exception as exc:  # the stream's requests fail; the shard keeps serving
                    log.exception("frame %s failed", frame.frame_id)
                    self._forget(frame)
                    out = pb.Frame(frame_id=frame.frame_id, error=f"stage {self.stage}: {exc}", failed_stage=self.stage)
                self.compute_seconds += time.perf_counter() - started
                self.frames_computed += 1
            self._pass_on(out)

    def _forget(self, frame) -> None:
        resumed = [o.resume_from for o in frame.opens if o.resume_from]
        for name in [*(o.stream for o in frame.opens), *resumed, *(b.stream for b in frame.rows)]:
            self.expected.pop(name, None)
            self.samplers.pop(name, None)
            self.constraints.pop(name, None)
            self.mtp_streams.discard(name)
            if name in self.engine.streams:
                self.engine.close(name)
            if self.drafter is not None:
                self.drafter.close(name)

    def _compute(self, frame):
        engine = self.engine
        drafter = self.drafter
        for rewind in frame.rewinds:
            engine.rewind(rewind.stream, rewind.position)
            if drafter is not None and rewind.stream in drafter.streams:
                drafter.rewind(rewind.stream, rewind.position)
        capture = self.capture
        for opened in frame.opens:
            if opened.resume_from:
                engine.adopt(opened.resume_from, opened.stream, opened.position)
                self.samplers.pop(opened.resume_from, None)
                # the MTP head follows the stream on where it was (unless it had given up on it)
                if drafter is not None and opened.resume_from in drafter.streams:
                    drafter.adopt(opened.resume_from, opened.stream, opened.position)
                if capture is not None:
                    capture.closed(opened.resume_from)
            elif opened.copy_from:
                engine.copy(opened.copy_from, opened.stream, opened.position)
                # the MTP head follows the copy from where it was (unless it had given up on the source)
                if drafter is not None and opened.mtp and opened.copy_from in drafter.streams:
                    drafter.copy(opened.copy_from, opened.stream, opened.position)
            else:
                engine.open(opened.stream, opened.context or None)
                if drafter is not None and opened.mtp:
                    drafter.open(opened.stream)
            if capture is not None:
                capture.opened(opened.stream)
            if engine.is_last:
                params = sampling_params(opened.sampling)
                self.samplers[opened.stream] = _Sampler(
                    params,
                    np.random.default_rng(params.seed),
                    scores_prompt=opened.score_prompt,
                    constraint=self.constraints.pop(opened.stream, None),
                )
        segments = [Segment(b.stream, b.start, b.length) for b in frame.rows]
        out = pb.Frame(frame_id=frame.frame_id)
        result = None
        if segments:
            if engine.is_first:
                inputs = np.asarray(frame.token_ids, dtype=np.int64)
            else:
                inputs = rows_array(frame.hidden, engine.shape.hidden_size)
            wanted, offset = [], 0
            for block in frame.rows:
                offset += block.length
                if engine.is_last:
                    wanted.extend(range(offset - self.samplers[block.stream].logit_rows(block), offset))
            trace: list[np.ndarray] | None = [] if capture is not None and capture.settings.every_layer else None
            step = engine.step(segments, inputs, np.array(wanted, dtype=np.int64) if engine.is_last else None, trace)
            if engine.is_last:
                result = self._sample(frame, step.logits)
                if drafter is not None:
                    try:
                        self._follow_mtp(frame, step.hidden, result)
                    except Exception:  # drafts are an optimisation: the tokens stand, the streams lose MTP
                        log.exception("frame %s: the MTP head failed; its streams decode without it", frame.frame_id)
                        for block in frame.rows:
                            drafter.close(block.stream)
            else:
                rows_tensor(step.hidden, into=out.hidden)
            if capture is not None:
                self._record(capture, frame, inputs, step.hidden, trace or (), result)
        for stream in frame.closes:
            if stream in engine.streams:
                engine.close(stream)
            self.samplers.pop(stream, None)
            if drafter is not None:
                drafter.close(stream)
            if capture is not None:
                capture.closed(stream)
        if engine.is_last:
            return result or pb.FrameResult(frame_id=frame.frame_id)
        out.token_ids.extend(frame.token_ids)
        out.opens.extend(frame.opens)
        out.rows.extend(frame.rows)
        out.closes.extend(frame.closes)
        out.rewinds.extend(frame.rewinds)
        return out

    def _record(self, capture: CaptureRecorder, frame, inputs, outputs, layers, result) -> None:
        blocks = [RecordedBlock(b.stream, b.start, b.length, len(b.draft)) for b in frame.rows]
        sampled = [(t.stream, t.token) for t in result.tokens] if result is not None else []
        with self._capture_lock:
            try:
                capture.record(blocks, frame.token_ids, np.asarray(inputs), outputs, layers, sampled)
            except OSError:  # a full disk ends the capture, never the frame
                log.exception("capture failed; stopping it")
                capture.full = True
                capture.captured.clear()

    def _follow_mtp(self, frame, final: np.ndarray, result) -> None:
        """Keep the MTP head on every confirmed row, then draft where a block asked for it."""
        drafter = self.drafter
        sampled: dict[str, list] = {}
        for token in result.tokens:
            sampled.setdefault(token.stream, []).append(token)
        wanted: dict[str, int] = {}
        offset = 0
        for block in frame.rows:
            first, offset = offset, offset + block.length
            if block.stream not in drafter.streams:
                continue
            tokens = sampled.get(block.stream, [])
            # a verified block keeps its accepted drafts and the row before them; the rest is rewound
            confirmed = len(tokens) if block.draft else block.length
            ids = frame.token_ids[first : first + confirmed]
            drafter.confirm(block.stream, block.start, final[first : first + confirmed], ids)
            if block.wants_token:
                drafter.sampled(block.stream, tokens[-1].token)
                # no draft wanted still lets depths that fell behind catch up, which bounds what is held
                wanted[block.stream] = block.propose
        for stream, draft in drafter.propose(wanted).items():
            if draft:
                sampled[stream][-1].draft.extend(draft)

    def _sample(self, frame, logits: np.ndarray):
        result = pb.FrameResult(frame_id=frame.frame_id)
        k, offset = 0, 0  # the block's first logits row, and its first row in the frame
        for block in frame.rows:
            sampler = self.samplers[block.stream]
            params = sampler.params
            width = sampler.logit_rows(block)
            rows = logits[k : k + width]
            k, offset, block_offset = k + width, offset + block.length, offset
            if sampler.scoring(block):
                ids = np.asarray(frame.token_ids[block_offset:offset])
                result.scores.append(self._scores(block, rows, ids, sampler))
            if not block.wants_token:
                continue
            sampler.sampled = True
            if block.draft:
                rows = apply_logit_bias(rows, params)
                for row, token in verified_tokens(rows, list(block.draft), params, sampler.rng, sampler.constraint):
                    result.tokens.append(self._sampled(block.stream, row, token, params))
                if sampler.constraint is not None:
                    result.tokens[-1].forced.extend(sampler.constraint.forced())
                continue
            row, token = sampler.pick(rows[-1])
            result.tokens.append(self._sampled(block.stream, row, token, params))
            if sampler.constraint is not None:
                result.tokens[-1].forced.extend(sampler.constraint.forced())
        return result

    @staticmethod
    def _scores(block, rows: np.ndarray, ids: np.ndarray, sampler: _Sampler):
        """Each prompt token of `block` after the stream's first, given the tokens before it (the model's own
        distribution: no bias, penalty or temperature); the last row's log-probs wait for the next block."""
        logprobs = log_softmax(rows)
        if sampler.carry is None:  # the stream's first token has nothing before it
            scored, targets, position = logprobs[:-1], ids[1:], block.start + 1
        else:
            scored, targets, position = np.concatenate([sampler.carry[None], logprobs[:-1]]), ids, block.start
        sampler.carry = None if block.wants_token else logprobs[-1]
        out = pb.PromptScores(stream=block.stream, position=position)
        for logprob, best in scored_tokens(scored, targets, sampler.params.top_logprobs):
            out.tokens.add(logprob=logprob, top=_top(best))
        return out

    @staticmethod
    def _sampled(stream: str, row: np.ndarray, token: int, params: SamplingParams):
        sampled = pb.SampledToken(stream=stream, token=token)
        if not params.wants_logprobs:  # a softmax over the vocabulary costs ~0.25 ms a row
            return sampled
        [(logprob, best)] = scored_tokens(log_softmax(row)[None], np.array([token]), params.top_logprobs)
        sampled.logprob = logprob
        sampled.top.extend(_top(best))
        return sampled

    def _pass_on(self, out) -> None:
        if self.engine.is_last and isinstance(out, pb.Frame):  # an earlier stage's error
            out = pb.FrameResult(frame_id=out.frame_id, error=out.error, failed_stage=out.failed_stage)
        self.sender.send(out)


def _top(best: list[tuple[int, float]]) -> list:
    return [pb.TopLogprob(token=t, logprob=lp) for t, lp in best]


def _log_lost(frame_id: int, reason: str) -> None:
    # the router's watchdog fails the frame's requests when its result never comes
    log.error("frame %s could not be passed on: %s", frame_id, reason)


async def serve(
    engine: StageEngine,
    stage: int,
    listen: str,
    next_addr: str | None,
    reply_to: str | None,
    drafter: MtpDrafter | None = None,
    capture_info: StageInfo | None = None,
    vocabulary: GrammarVocabulary | None = None,
) -> None:
    servicer = ShardServicer(engine, stage, drafter, vocabulary)
    servicer.capture_info = capture_info or StageInfo(
        stage, engine.start_layer, engine.end_layer, "", engine.shape.hidden_size, {}
    )
    server = tls.server(CHANNEL_OPTIONS)
    rpc.add_ShardServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    tls.add_port(server, listen)
    await server.start()
    target = next_addr or reply_to
    channel = tls.channel(target, CHANNEL_OPTIONS)
    if next_addr:
        servicer.sender = FrameStream(rpc.ShardStub(channel).Push, _log_lost, f"stage {stage + 1} at {next_addr}")
    else:
        servicer.sender = FrameStream(rpc.CollectorStub(channel).DeliverAll, _log_lost, f"the collector at {reply_to}")
    worker = asyncio.create_task(servicer.run())
    # ready means: weights loaded (the engine exists) and the next hop answers
    await channel.channel_ready()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("stage %d serving layers %d:%d on %s", stage, engine.start_layer, engine.end_layer, listen)
    try:
        await server.wait_for_termination()
    finally:
        worker.cancel()
        await server.stop(grace=2)
        await channel.close()
