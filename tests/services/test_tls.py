"""Mutual TLS between the roles: a fleet over TLS gives the same ids; plaintext and foreign certificates are refused."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from cascadia.engine.engine import StageEngine
from cascadia.engine.generate import generate
from cascadia.engine.settings import EngineSettings
from cascadia.gateway.text import TextCodec
from cascadia.model.loader import load_shape, load_stage
from cascadia.router.local import LocalFleet
from cascadia.router.pipeline import PipelineDriver
from cascadia.router.scheduler import Request, SchedulerConfig
from cascadia.sampling_params import SamplingParams
from cascadia.wire import pb, rpc, tls
from tests.helpers import print_logs


def _pem(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_tls_dir(directory: Path, name: str = "fleet") -> Path:
    """A CA and a certificate it signs for 127.0.0.1 and localhost, as ca.pem, cert.pem, key.pem."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} role")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "key.pem").write_bytes(_pem(key))
    return directory


@pytest.fixture
def tls_env(tmp_path, monkeypatch):
    directory = make_tls_dir(tmp_path / "tls")
    monkeypatch.setenv(tls.ENV, str(directory))
    tls.configured.cache_clear()
    yield directory
    tls.configured.cache_clear()


def test_a_missing_file_is_named(tmp_path):
    (tmp_path / "ca.pem").write_text("x")
    with pytest.raises(tls.TlsError, match="missing cert.pem, key.pem"):
        tls.Tls.from_dir(tmp_path)


@pytest.mark.slow
def test_a_fleet_over_mutual_tls_serves_the_same_ids_and_refuses_strangers(tiny, tls_env, tmp_path):
    engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings())
    prompt = (5, 9, 200, 31, 77)
    expected = generate(engine, prompt, SamplingParams(max_tokens=8)).token_ids
    fleet = LocalFleet(tiny, 2)
    fleet.start(tmp_path)  # the shards inherit $CASCADIA_TLS_DIR

    async def go():
        driver = PipelineDriver(fleet.stage_addrs, fleet.reply_addr, SchedulerConfig(stages=2), frame_timeout=60)
        await driver.start()
        try:
            await driver.wait_ready(timeout=120)
            result = await driver.generate(Request("r", prompt, SamplingParams(max_tokens=8)))
        finally:
            await driver.stop()
        frame = pb.Frame(frame_id=1)
        async with grpc.aio.insecure_channel(fleet.stage_addrs[0]) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as refused_plain:
                await rpc.ShardStub(plain).Submit(frame, timeout=5)
        foreign = tls.Tls.from_dir(make_tls_dir(tmp_path / "other", "other"))
        credentials = grpc.ssl_channel_credentials(foreign.ca, foreign.key, foreign.cert)
        async with grpc.aio.secure_channel(fleet.stage_addrs[0], credentials) as stranger:
            with pytest.raises(grpc.aio.AioRpcError) as refused_foreign:
                await rpc.ShardStub(stranger).Submit(frame, timeout=5)
        return result.tokens, refused_plain.value.code(), refused_foreign.value.code()

    try:
        tokens, plain_code, foreign_code = asyncio.run(go())
    finally:
        fleet.stop()
    assert tokens == expected
    assert plain_code == grpc.StatusCode.UNAVAILABLE
    assert foreign_code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow
def test_cascadia_up_runs_every_role_over_mutual_tls(tiny, tmp_path):
    """Gateway -> router -> shards -> router, and router -> draft service, all over TLS."""
    import subprocess
    import sys

    import openai

    from cascadia.bench.load import wait_until_ready
    from cascadia.router.local import free_port

    engine = StageEngine(load_stage(tiny, 0, load_shape(tiny).num_layers), EngineSettings())
    prompt = [5, 9, 200, 31, 77, 5, 9, 200]
    expected = generate(engine, prompt, SamplingParams(max_tokens=8)).token_ids
    directory = make_tls_dir(tmp_path / "tls")
    port, router_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "cascadia.cli", "up", "--model", str(tiny), "--shards", "2", "--port", str(port)]
    cmd += ["--tls-dir", str(directory), "--log-dir", str(tmp_path / "logs"), "--router-port", str(router_port)]
    with open(tmp_path / "up.log", "w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=out)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", process, timeout=180)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0, timeout=60)
        reply = client.completions.create(model=tiny.name, prompt=prompt, max_tokens=8, temperature=0)
        assert reply.usage.completion_tokens == 8
        assert reply.choices[0].text == TextCodec.from_model(tiny).decode(expected)
        with grpc.insecure_channel(f"127.0.0.1:{router_port}") as plain, pytest.raises(grpc.RpcError):
            rpc.RouterStub(plain).Stats(pb.StatsRequest(), timeout=5)  # the router takes TLS clients only
    finally:
        process.terminate()
        process.wait(30)
        print_logs(tmp_path)
        print_logs(tmp_path / "logs")
