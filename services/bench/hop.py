"""One hop across an emulated link: a frame sink in one shard namespace, the sender in another.

Run as `python -m cascadia.bench.hop serve ADDR` and `python -m cascadia.bench.hop measure ADDR`;
`hop_over_link` starts both inside an `EmulatedNetwork` so the frame crosses a shaped egress.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

from cascadia.router.netem import EmulatedNetwork, LinkShape


async def _serve(listen: str) -> None:
    import grpc

    from cascadia.bench.fleet import FrameSink
    from cascadia.shard.service import CHANNEL_OPTIONS, rpc

    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    rpc.add_ShardServicer_to_server(FrameSink(), server)
    server.add_insecure_port(listen)
    await server.start()
    await server.wait_for_termination()


async def _measure(address: str, repeats: int = 100) -> dict[str, float]:
    import statistics

    import grpc
    import numpy as np

    from cascadia.shard.service import CHANNEL_OPTIONS, pb, rpc

    rows, hidden = 8, 6144
    data = np.random.default_rng(0).standard_normal((rows, hidden)).astype("<f4")
    frame = pb.Frame(frame_id=1, hidden=pb.Tensor(shape=[rows, hidden], data=data.tobytes()))
    frame.rows.extend(pb.RowBlock(stream=f"s{i}", start=100, length=1) for i in range(rows))
    times = []
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = rpc.ShardStub(channel)
        await channel.channel_ready()
        for i in range(repeats + 10):
            start = time.perf_counter()
            await stub.Submit(frame, timeout=30)
            if i >= 10:
                times.append(time.perf_counter() - start)
    return {"rows": rows, "hidden": hidden, "bytes": data.nbytes, "median_ms": statistics.median(times) * 1e3}


def hop_over_link(link: LinkShape, port: int = 7600) -> dict[str, float]:
    """Median time for an 8 x 6144 FP32 frame from one namespace to another over the shaped link."""
    with EmulatedNetwork(2, link) as network:
        address = f"{network.plan.hosts[0].address}:{port}"
        sink = subprocess.Popen([*network.prefix(0), sys.executable, "-m", "cascadia.bench.hop", "serve", address])
        try:
            out = subprocess.run(
                [*network.prefix(1), sys.executable, "-m", "cascadia.bench.hop", "measure", address],
                capture_output=True, text=True, timeout=300, check=True,
            )  # fmt: skip
        finally:
            sink.terminate()
            sink.wait(10)
    return json.loads(out.stdout)


if __name__ == "__main__":
    mode, addr = sys.argv[1], sys.argv[2]
    if mode == "serve":
        asyncio.run(_serve(addr))
    else:
        sys.stdout.write(json.dumps(asyncio.run(_measure(addr))) + "\n")
