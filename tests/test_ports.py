"""Local roles never share a port: no port handed out twice by one process, no second server on a served port."""

from __future__ import annotations

import asyncio

import pytest

from cascadia import tls
from cascadia.router.local import free_port, reserve_port


def test_free_port_never_repeats_within_a_process():
    ports = [free_port() for _ in range(400)]  # the kernel alone repeats within a few hundred draws
    assert len(set(ports)) == len(ports)


def test_a_reserved_port_is_never_handed_out():
    taken = free_port()
    reserve_port(taken + 1)
    assert taken + 1 not in {free_port() for _ in range(200)}


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
