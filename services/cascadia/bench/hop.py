"""The cost of one hop: a frame of rows x hidden FP32 sent to a shard-shaped sink that does nothing.

Two figures: the round trip of one `Submit` (send, wait for the ack), and the cost per frame when
frames go back to back over one `Push` stream, as the pipeline sends them. `hop_cost` measures on
loopback; `hop_over_link` runs the sink in one emulated host's namespace and the sender in
another's, so each frame crosses a shaped link (`python -m cascadia.bench.hop serve|measure ADDR`).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time

import grpc
import numpy as np

from cascadia.router.netem import EmulatedNetwork, LinkShape
from cascadia.wire import CHANNEL_OPTIONS, pb, rpc, tls


class FrameSink(rpc.ShardServicer):
    """Acknowledges every frame and does nothing else: what is left is the cost of the hop."""

    async def Submit(self, frame, context):
        return pb.Ack()

    async def Push(self, frames, context):
        async for frame in frames:
            yield pb.Receipt(frame_id=frame.frame_id)


async def start_sink(listen: str) -> grpc.aio.Server:
    server = tls.server(CHANNEL_OPTIONS)
    rpc.add_ShardServicer_to_server(FrameSink(), server)
    server.add_insecure_port(listen)
    await server.start()
    return server


def sample_frame(rows: int, hidden: int, frame_id: int = 1):
    data = np.random.default_rng(0).standard_normal((rows, hidden)).astype("<f4")
    frame = pb.Frame(frame_id=frame_id, hidden=pb.Tensor(shape=[rows, hidden], data=data.tobytes()))
    frame.rows.extend(pb.RowBlock(stream=f"s{i}", start=100, length=1) for i in range(rows))
    return frame


async def measure_hop(address: str, rows: int = 8, hidden: int = 6144, repeats: int = 200) -> dict[str, float]:
    frame = sample_frame(rows, hidden)
    round_trips = []
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        await channel.channel_ready()
        stub = rpc.ShardStub(channel)
        for i in range(repeats + 10):
            start = time.perf_counter()
            await stub.Submit(frame, timeout=30)
            if i >= 10:
                round_trips.append(time.perf_counter() - start)
        per_frame = []
        call = stub.Push()
        for burst in range(6):
            start = time.perf_counter()
            for _ in range(repeats // 4):
                await call.write(frame)
            for _ in range(repeats // 4):
                await call.read()
            if burst:  # the first burst warms the stream up
                per_frame.append((time.perf_counter() - start) / (repeats // 4))
        await call.done_writing()
        await call.code()  # the sink ends its side before the channel closes
    return {
        "rows": rows,
        "hidden": hidden,
        "bytes": rows * hidden * 4,
        "median_ms": statistics.median(round_trips) * 1e3,  # a Submit's round trip
        "streamed_ms": statistics.median(per_frame) * 1e3,  # per frame, back to back over Push
    }


async def hop_cost(rows: int = 8, hidden: int = 6144, repeats: int = 200) -> dict[str, float]:
    """The hop on loopback, sink and sender in this process."""
    from cascadia.router.local import free_port

    address = f"127.0.0.1:{free_port()}"
    server = await start_sink(address)
    try:
        return await measure_hop(address, rows, hidden, repeats)
    finally:
        await server.stop(0)


def hop_over_link(link: LinkShape, port: int = 7600) -> dict[str, float]:
    """The hop from one emulated host to another, over the shaped link."""
    with EmulatedNetwork(2, link) as network:
        address = f"{network.plan.hosts[0].address}:{port}"
        sink = subprocess.Popen([*network.prefix(0), sys.executable, "-m", "cascadia.bench.hop", "serve", address])
        try:
            out = subprocess.run(
                [*network.prefix(1), sys.executable, "-m", "cascadia.bench.hop", "measure", address],
                capture_output=True, text=True, timeout=600, check=True,
            )  # fmt: skip
        finally:
            sink.terminate()
            sink.wait(10)
    return json.loads(out.stdout)


async def _serve(listen: str) -> None:
    server = await start_sink(listen)
    await server.wait_for_termination()


if __name__ == "__main__":
    mode, addr = sys.argv[1], sys.argv[2]
    if mode == "serve":
        asyncio.run(_serve(addr))
    else:
        sys.stdout.write(json.dumps(asyncio.run(measure_hop(addr))) + "\n")
