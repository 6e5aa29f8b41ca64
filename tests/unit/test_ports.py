"""Local roles never share a port: no port handed out twice by one process, no second server on a served port."""

from __future__ import annotations

import asyncio

import pytest

from cascadia.router import local
from cascadia.router.local import free_port
from cascadia.wire import tls


def test_free_port_never_repeats_within_a_process():
    ports = [free_port() for _ in range(400)]  # the kernel alone repeats within a few hundred draws
    assert len(set(ports)) == len(ports)


def test_a_port_the_kernel_offers_again_is_skipped(monkeypatch):
    offers = iter([7001, 7001, 7002, 7003, 7004])  # a kernel that repeats itself, as it does

    class Probe:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(offers)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(local.socket, "socket", Probe)
    monkeypatch.setattr(local, "_handed_out", set())
    local.reserve_port(7003)  # given on the command line
    assert [local.free_port() for _ in range(3)] == [7001, 7002, 7004]


def test_a_second_server_on_a_served_port_fails_to_start():
    async def go() -> None:
        address = f"127.0.0.1:{free_port()}"
        first = tls.server()
        first.add_insecure_port(address)
        await first.start()
        try:
            with pytest.raises(RuntimeError):
                tls.server().add_insecure_port(address)
        finally:
            await first.stop(None)

    asyncio.run(go())
