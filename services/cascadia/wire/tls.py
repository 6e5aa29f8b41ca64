"""Mutual TLS between the roles (shards, router, draft service, gateway), or plaintext when not configured.

Every role reads the same directory, named by $CASCADIA_TLS_DIR: `ca.pem` (the fleet's CA), and the
role's `cert.pem` / `key.pem` signed by it. Servers then accept only clients that present a
certificate from that CA, and clients check the server's certificate against the address they dial
(its SANs must cover the hosts or IPs the roles use). Without the variable everything is plaintext
gRPC, for a private network.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import grpc

ENV = "CASCADIA_TLS_DIR"
FILES = ("ca.pem", "cert.pem", "key.pem")


class TlsError(ValueError):
    pass


@dataclass(frozen=True)
class Tls:
    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def from_dir(cls, directory: Path) -> Tls:
        missing = [name for name in FILES if not (Path(directory) / name).is_file()]
        if missing:
            raise TlsError(f"${ENV}={directory}: missing {', '.join(missing)} (needs {', '.join(FILES)})")
        return cls(*(Path(directory, name).read_bytes() for name in FILES))


@cache
def configured() -> Tls | None:
    directory = os.environ.get(ENV)
    return Tls.from_dir(Path(directory)) if directory else None


def server(options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Server:
    """A role's gRPC server, the only one on its port.

    gRPC's default (SO_REUSEPORT) lets a second server bind a port already served and take a share of
    its new connections: a shard started on a port the draft service had taken would answer the
    router's health checks with UNIMPLEMENTED half the time instead of failing to start.
    """
    return grpc.aio.server(options=[*options, ("grpc.so_reuseport", 0)])


def add_port(server: grpc.aio.Server, address: str) -> int:
    tls = configured()
    if tls is None:
        return server.add_insecure_port(address)
    credentials = grpc.ssl_server_credentials([(tls.key, tls.cert)], root_certificates=tls.ca, require_client_auth=True)
    return server.add_secure_port(address, credentials)


def _credentials(tls: Tls) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert)


# Roles start in any order and restart on their own; gRPC's default backoff (up to 120 s between
# attempts) would leave a peer that came up unused for minutes.
RECONNECT = ("grpc.max_reconnect_backoff_ms", 5000)


def channel(address: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    tls = configured()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=[*options, RECONNECT])
    return grpc.aio.secure_channel(address, _credentials(tls), options=[*options, RECONNECT])


def blocking_channel(address: str) -> grpc.Channel:
    tls = configured()
    return grpc.insecure_channel(address) if tls is None else grpc.secure_channel(address, _credentials(tls))
