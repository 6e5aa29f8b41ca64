"""Frames over one stream to a real gRPC server: order, refusals, a peer that dies and comes back."""

from __future__ import annotations

import asyncio

import grpc

from cascadia.bench.hop import hop_cost
from cascadia.frame_stream import FrameStream
from cascadia.router.local import free_port
from cascadia.wire import CHANNEL_OPTIONS, pb, rpc


class Recorder(rpc.ShardServicer):
    """Takes frames in the order they arrive; refuses those whose id is in `refuse`; can stall."""

    def __init__(self, refuse: frozenset[int] = frozenset()) -> None:
        self.seen: list[int] = []
        self.refuse = refuse
        self.stall = asyncio.Event()
        self.stall.set()

    async def Push(self, frames, context):
        async for frame in frames:
            await self.stall.wait()
            self.seen.append(frame.frame_id)
            error = f"frame {frame.frame_id} refused" if frame.frame_id in self.refuse else ""
            yield pb.Receipt(frame_id=frame.frame_id, error=error)


async def serve(servicer: Recorder, address: str) -> grpc.aio.Server:
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    rpc.add_ShardServicer_to_server(servicer, server)
    server.add_insecure_port(address)
    await server.start()
    return server


async def settle(sender: FrameStream, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if not sender.in_flight:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{sender.in_flight} frames still in flight")


def test_frames_arrive_in_order_without_waiting_and_refusals_come_back_by_id():
    async def main():
        address = f"127.0.0.1:{free_port()}"
        recorder = Recorder(refuse=frozenset({7, 30}))
        server = await serve(recorder, address)
        failed: list[tuple[int, str]] = []
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            sender = FrameStream(rpc.ShardStub(channel).Push, lambda fid, why: failed.append((fid, why)), "sink")
            recorder.stall.clear()  # the receiver holds everything: send() must not wait for it
            for i in range(1, 41):
                sender.send(pb.Frame(frame_id=i))
            await asyncio.sleep(0.2)
            assert recorder.seen == [] and sender.in_flight == 40
            recorder.stall.set()
            await settle(sender)
            await sender.close()
        await server.stop(0)
        assert recorder.seen == list(range(1, 41))
        assert failed == [(7, "frame 7 refused"), (30, "frame 30 refused")]

    asyncio.run(main())


def test_a_peer_that_dies_fails_its_unanswered_frames_and_the_next_frame_reopens_the_stream():
    async def main():
        address = f"127.0.0.1:{free_port()}"
        first = Recorder()
        server = await serve(first, address)
        failed: list[int] = []
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
            sender = FrameStream(rpc.ShardStub(channel).Push, lambda fid, why: failed.append(fid), "sink")
            sender.send(pb.Frame(frame_id=1))
            await settle(sender)
            first.stall.clear()
            for i in (2, 3, 4):
                sender.send(pb.Frame(frame_id=i))
            await asyncio.sleep(0.2)
            await server.stop(0)  # dies holding 2, 3, 4
            for _ in range(500):
                if len(failed) == 3:
                    break
                await asyncio.sleep(0.01)
            assert sorted(failed) == [2, 3, 4] and sender.in_flight == 0
            second = Recorder()
            server = await serve(second, address)
            await channel.channel_ready()
            sender.send(pb.Frame(frame_id=5))
            await settle(sender)
            await sender.close()
        await server.stop(0)
        assert first.seen == [1] and second.seen == [5] and sorted(failed) == [2, 3, 4]

    asyncio.run(main())


def test_hop_cost_reports_a_round_trip_and_a_streamed_cost_per_frame():
    hop = asyncio.run(hop_cost(rows=2, hidden=64, repeats=8))
    assert hop["bytes"] == 2 * 64 * 4
    assert 0 < hop["median_ms"] < 1000 and 0 < hop["streamed_ms"] < 1000
