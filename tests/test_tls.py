"""TLS on the coordinator's gRPC port, pinned by fingerprint: the matrix and the certificates.

A real in-process coordinator (`start_coordinator(tls=True)`, its self-signed certificate
generated into the data dir) and real gRPC clients:

- a plaintext client to the TLS server fails with UNAVAILABLE and registers nobody;
- a client pinning a wrong fingerprint is refused before any request is sent (it never
  gets a channel; the coordinator sees no worker);
- the right fingerprint works, with no CA anywhere;
- a pinned client to a plaintext server is refused (no downgrade);
- an operator's CA-signed certificate (`tls_cert`/`tls_key`) is pinned by its leaf, no CA
  given to the client;
- the generated certificate is reused across restarts (same fingerprint), its key is 0600,
  and broken certificate files are refused with a message.
"""

from __future__ import annotations

import datetime
import stat
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bagel.coordinator.core.records import WorkerState
from bagel.coordinator.daemon import start_coordinator
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.client import CoordinatorClient
from bagel.protocol.identity import Identity
from bagel.protocol.runspec import parse_spec
from bagel.protocol.tls import (
    TLS_CERT_FILE,
    TLS_KEY_FILE,
    FingerprintMismatch,
    TLSError,
    check_fingerprint,
    fingerprint,
    load_or_create_self_signed,
    load_server_certificate,
)

from simworkers import cluster_spec_text, fake_peer_id, uniform_cells

RUN = "tlsrun"
PROFILE = pb.WorkerProfile(name="tls", device_kind="cpu", vram_bytes=8 << 30, num_devices=1)
PEER = pb.PeerAddress(peer_id=fake_peer_id("tls"), maddrs=["/ip4/127.0.0.1/tcp/1"])


async def _start(data_dir: Path, **kw):
    spec = parse_spec(cluster_spec_text(RUN, lease_s=30.0))
    return await start_coordinator(spec, data_dir, cells=uniform_cells(spec.cell_ids), tick_ms=50, **kw)


def _active_workers(h) -> int:
    return sum(1 for w in h.state.snapshot().workers if w.state == WorkerState.ACTIVE)


@pytest.mark.timeout(60)
async def test_tls_matrix(tmp_path: Path) -> None:
    h = await _start(tmp_path / "d", tls=True)
    target = f"127.0.0.1:{h.port}"
    try:
        fp = h.tls_fingerprint
        assert fp == check_fingerprint(fp)
        assert fp == fingerprint(
            x509.load_pem_x509_certificate((tmp_path / "d" / TLS_CERT_FILE).read_bytes()).public_bytes(
                serialization.Encoding.DER
            )
        )

        # 1. plaintext client to the TLS server: UNAVAILABLE, nothing reaches the handlers
        async with CoordinatorClient(target, Identity.generate(), RUN, timeout_s=3.0) as plain:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await plain.register(PROFILE, PEER)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert _active_workers(h) == 0

        # 2. a wrong fingerprint: refused before a channel exists, so no request is sent
        with pytest.raises(FingerprintMismatch, match="not the pinned"):
            await CoordinatorClient.connect(target, Identity.generate(), RUN, tls_fingerprint="ab" * 32)
        assert _active_workers(h) == 0

        # 3. the right fingerprint: works, and the client needs no CA
        ident = Identity.generate()
        async with await CoordinatorClient.connect(target, ident, RUN, tls_fingerprint=fp) as c:
            assert c.tls_fingerprint == fp
            resp = await c.register(PROFILE, PEER)
            assert resp.worker_id == ident.worker_id
            hb = await c.heartbeat(pb.PHASE_IDLE)
            assert hb.instruction.order != pb.ORDER_UNSPECIFIED
        assert _active_workers(h) == 1
    finally:
        await h.stop(0)

    # the certificate is reused on restart: the same fingerprint, so join strings stay valid
    h2 = await _start(tmp_path / "d", tls=True)
    try:
        assert h2.tls_fingerprint == fp
        assert stat.S_IMODE((tmp_path / "d" / TLS_KEY_FILE).stat().st_mode) == 0o600
    finally:
        await h2.stop(0)


@pytest.mark.timeout(60)
async def test_pinned_client_refuses_a_plaintext_server(tmp_path: Path) -> None:
    h = await _start(tmp_path / "d")  # in-process default: plaintext
    try:
        assert h.tls_fingerprint == ""
        with pytest.raises(TLSError, match="does not speak TLS"):
            await CoordinatorClient.connect(f"127.0.0.1:{h.port}", Identity.generate(), RUN, tls_fingerprint="cd" * 32)
        assert _active_workers(h) == 0
    finally:
        await h.stop(0)


def _cert(name: str, key, issuer_key, issuer: x509.Name | None, *, ca: bool, dns: str | None) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if dns:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(dns)]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@pytest.mark.timeout(60)
async def test_operator_ca_signed_certificate_is_pinned_by_its_leaf(tmp_path: Path) -> None:
    ca_key, leaf_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert("operator CA", ca_key, ca_key, None, ca=True, dns=None)
    leaf = _cert("coordinator", leaf_key, ca_key, ca.subject, ca=False, dns="coord.example.org")
    cert_file, key_file = tmp_path / "chain.pem", tmp_path / "leaf.key"
    cert_file.write_bytes(leaf.public_bytes(serialization.Encoding.PEM) + ca.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(_pem_key(leaf_key))
    h = await _start(tmp_path / "d", tls_cert=cert_file, tls_key=key_file)
    try:
        assert h.tls_fingerprint == fingerprint(leaf.public_bytes(serialization.Encoding.DER))
        assert not (tmp_path / "d" / TLS_CERT_FILE).exists()  # nothing generated
        ident = Identity.generate()
        client = await CoordinatorClient.connect(f"127.0.0.1:{h.port}", ident, RUN, tls_fingerprint=h.tls_fingerprint)
        async with client as c:
            assert (await c.register(PROFILE, PEER)).worker_id == ident.worker_id
    finally:
        await h.stop(0)


def _key_of_another(data_dir: Path) -> Path:
    load_or_create_self_signed(data_dir)
    return data_dir / TLS_KEY_FILE


def test_certificate_files_are_checked(tmp_path: Path) -> None:
    first = load_or_create_self_signed(tmp_path / "a")
    again = load_or_create_self_signed(tmp_path / "a")
    assert first.fingerprint == again.fingerprint
    # a key left alone by a crash before its certificate was written gets a certificate
    (tmp_path / "a" / TLS_CERT_FILE).unlink()
    assert load_or_create_self_signed(tmp_path / "a").fingerprint != first.fingerprint
    # a certificate without its key is never silently replaced
    (tmp_path / "a" / TLS_KEY_FILE).unlink()
    with pytest.raises(TLSError, match="key .* is missing"):
        load_or_create_self_signed(tmp_path / "a")
    # a readable-by-others key is refused
    other = load_or_create_self_signed(tmp_path / "b")
    (tmp_path / "b" / TLS_KEY_FILE).chmod(0o644)
    with pytest.raises(TLSError, match="chmod 600"):
        load_or_create_self_signed(tmp_path / "b")
    # a key of another certificate, garbage, a missing file
    (tmp_path / "b" / TLS_KEY_FILE).chmod(0o600)
    with pytest.raises(TLSError, match="does not belong"):
        load_server_certificate(tmp_path / "b" / TLS_CERT_FILE, _key_of_another(tmp_path / "c"))
    (tmp_path / "junk.pem").write_bytes(b"not a certificate")
    with pytest.raises(TLSError, match="no PEM certificate"):
        load_server_certificate(tmp_path / "junk.pem", tmp_path / "b" / TLS_KEY_FILE)
    with pytest.raises(TLSError, match="cannot read"):
        load_server_certificate(tmp_path / "missing.pem", tmp_path / "b" / TLS_KEY_FILE)
    assert other.fingerprint != first.fingerprint
    for bad in ("", "ab" * 31, "zz" * 32):
        with pytest.raises(TLSError):
            check_fingerprint(bad)
    assert check_fingerprint(":".join(["AB"] * 32)) == "ab" * 32


@pytest.mark.timeout(60)
async def test_worker_link_pins_the_record_and_gives_up_on_an_impostor(tmp_path: Path) -> None:
    """The worker's link connects with the record's fingerprint; a server at the record's
    endpoint that is not the pinned one (here: plaintext) is retried a few times, then the
    TLSError ends the connect, and no request ever reached it."""
    import asyncio
    import io
    import json

    from bagel.protocol.discovery import CoordinatorRecord
    from bagel.protocol.joinstring import JoinInfo
    from bagel.worker.display import Display
    from bagel.worker.link import TLS_REFUSALS_BEFORE_GIVING_UP, CoordinatorLink

    coord = Identity.generate()
    join = JoinInfo(RUN, coord.public_key, ("/ip4/127.0.0.1/tcp/1/p2p/" + fake_peer_id("j"),))
    spec_hash = parse_spec(cluster_spec_text(RUN, lease_s=30.0)).spec_hash
    events = io.StringIO()
    tls_server = await _start(tmp_path / "tls", tls=True)
    plain_server = await _start(tmp_path / "plain")
    try:
        for h, expect_ok in ((tls_server, True), (plain_server, False)):
            record = CoordinatorRecord(
                f"127.0.0.1:{h.port}", RUN, spec_hash, coord.public_key, 0.0, 60.0, tls_server.tls_fingerprint
            )
            link = CoordinatorLink(None, join, Identity.generate(), Display("json", stream=events), asyncio.Event())  # type: ignore[arg-type]
            if expect_ok:
                assert await link.connect(None, record)
                assert link.client is not None and link.client.tls_fingerprint == tls_server.tls_fingerprint
                assert (await link.client.status()).run_id == RUN
                await link.close()
            else:
                with pytest.raises(TLSError, match="does not speak TLS"):
                    await link.connect(None, record)
                assert link.client is None
        warnings = [json.loads(line) for line in events.getvalue().splitlines()]
        refused = [e for e in warnings if e["event"] == "coordinator-unreachable"]
        assert len(refused) == TLS_REFUSALS_BEFORE_GIVING_UP - 1
        assert _active_workers(plain_server) == 0
    finally:
        await tls_server.stop(0)
        await plain_server.stop(0)
