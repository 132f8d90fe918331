"""CoordinatorClient against a minimal in-test grpc.aio servicer on port 0.

The servicer is a stand-in, not the coordinator: it verifies envelopes with the real
`Verifier` and validates payloads with the real validators, records what it got, and
answers canned responses. The real server's tests cover its behaviour.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from pathlib import Path

import grpc
import pytest

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import bagel_pb2_grpc as pb_grpc
from bagel.protocol import grpc_options
from bagel.protocol.client import (
    CheckpointIntegrityError,
    CoordinatorClient,
    SpecMismatch,
    backoff_delay_s,
    with_retries,
)
from bagel.protocol.envelope import EnvelopeError, Verifier, wall_clock_ms
from bagel.protocol.identity import Identity
from bagel.protocol.runspec import load_spec
from bagel.protocol.validation import ValidationError, validate

SPEC = load_spec(Path(__file__).resolve().parents[1] / "examples" / "digits-2x2.toml")
RUN = SPEC.run.id
PEER_ID = "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo"


class EchoServicer(pb_grpc.CoordinatorServicer):
    def __init__(self) -> None:
        self.verifier = Verifier(RUN, max_clock_skew_s=SPEC.security.max_clock_skew_s)
        self.seen: list[tuple[str, str]] = []  # (method, worker id)
        self.uploads: dict[tuple[str, int], bytes] = {}
        self.download_mode = "ok"
        self.blob = random.Random(0).randbytes(300_000)

    async def _check(self, signed, method, context):
        try:
            got = self.verifier.verify(signed, method, wall_clock_ms())
            validate(method, got.message, SPEC)
        except EnvelopeError as e:
            await context.abort(e.status, str(e))
        except ValidationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.seen.append((method, got.worker_id))
        return got

    async def Register(self, request, context):
        got = await self._check(request, "Register", context)
        text = SPEC.source
        return pb.RegisterResponse(
            worker_id=got.worker_id,
            spec_toml=text,
            spec_hash=SPEC.spec_hash,
            instruction=pb.Instruction(order=pb.ORDER_WAIT),
        )

    async def Heartbeat(self, request, context):
        got = await self._check(request, "Heartbeat", context)
        return pb.HeartbeatResponse(
            lease_expires_unix_ms=got.timestamp_unix_ms + 10_000,
            instruction=pb.Instruction(order=pb.ORDER_WAIT, cell_id=got.message.cell_id),
        )

    async def ReportRound(self, request, context):
        await self._check(request, "ReportRound", context)
        return pb.ReportRoundResponse(verdict=pb.VERDICT_PENDING)

    async def Leave(self, request, context):
        await self._check(request, "Leave", context)
        return pb.LeaveResponse()

    async def GetStatus(self, request, context):
        return pb.StatusResponse(run_id=RUN, spec_hash=SPEC.spec_hash)

    async def UploadCheckpoint(self, request_iterator, context):
        header = None
        h = hashlib.sha256()
        buf = bytearray()
        async for chunk in request_iterator:
            if header is None:
                header = (await self._check(chunk.header, "UploadCheckpoint", context)).message
                continue
            buf += chunk.data
            h.update(chunk.data)
            if len(buf) > header.total_bytes:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "too much data")
        if len(buf) != header.total_bytes or h.hexdigest() != header.sha256:
            await context.abort(grpc.StatusCode.DATA_LOSS, "size or sha256 mismatch")
        self.uploads[(header.cell_id, header.round)] = bytes(buf)
        return pb.UploadCheckpointResponse(stored=True, round=header.round)

    async def DownloadCheckpoint(self, request, context):
        req = (await self._check(request, "DownloadCheckpoint", context)).message
        blob, mode = self.blob, self.download_mode
        info = pb.CheckpointInfo(
            cell_id=req.cell_id,
            round=req.round or 4,
            state_hash="ab" * 32,
            total_bytes=len(blob),
            sha256=hashlib.sha256(blob).hexdigest(),
        )
        if mode == "bad_sha":
            info.sha256 = "00" * 32
        if mode == "huge":
            info.total_bytes = 10 << 30
        if mode == "short":
            blob = blob[:-1]
        if mode == "long":
            blob = blob + b"x"
        if mode == "wrong_cell":
            info.cell_id = "router"
        if mode != "no_info":
            yield pb.CheckpointDownloadChunk(info=info)
        for off in range(0, len(blob), 1 << 16):
            yield pb.CheckpointDownloadChunk(data=blob[off : off + (1 << 16)])


@pytest.fixture
async def server():
    srv = grpc.aio.server(options=grpc_options.server_options())
    servicer = EchoServicer()
    pb_grpc.add_CoordinatorServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await srv.stop(grace=None)


@pytest.fixture
async def client(server):
    _, target = server
    async with CoordinatorClient(target, Identity.generate(), RUN, spec_hash=SPEC.spec_hash) as c:
        await c.wait_for_ready(10)
        yield c


def profile() -> pb.WorkerProfile:
    return pb.WorkerProfile(
        name="t", device_kind="cpu", vram_bytes=1 << 30, num_devices=1, samples_per_s={"k0.r0": 100.0}
    )


def peer() -> pb.PeerAddress:
    return pb.PeerAddress(peer_id=PEER_ID, maddrs=["/ip4/127.0.0.1/tcp/1"])


async def test_unary_rpcs_are_signed_and_accepted(server, client):
    servicer, _ = server
    resp = await client.register(profile(), peer())
    assert resp.worker_id == client.worker_id and resp.spec_hash == SPEC.spec_hash
    hb = await client.heartbeat(pb.PHASE_TRAINING, cell_id="k0.r0", round=1, inner_step=3, loss=0.5)
    assert hb.instruction.cell_id == "k0.r0"
    rep = await client.report_round(
        cell_id="k0.r0", round=1, state_hash="ab" * 32, samples=64, loss=0.4, reduce_attempt=1
    )
    assert rep.verdict == pb.VERDICT_PENDING
    await client.leave("done")
    status = await client.status()
    assert status.run_id == RUN
    assert [m for m, _ in servicer.seen] == ["Register", "Heartbeat", "ReportRound", "Leave"]
    assert {w for _, w in servicer.seen} == {client.worker_id}


async def test_redial_moves_later_calls_to_a_new_connection(server, client):
    """A redial opens a new channel to the same target (a new TCP connection), later calls
    go over it, and a call already on the old one still gets its answer before it closes."""
    servicer, _ = server
    # a call started on the old channel (grpc.aio sends it when the call object is made)
    in_flight = client._stub.Heartbeat(client.sign("Heartbeat", pb.HeartbeatRequest(phase=pb.PHASE_IDLE)), timeout=5)
    old = client.redial()
    assert old is not client._channel
    await client.heartbeat(pb.PHASE_IDLE)
    assert (await in_flight).instruction is not None
    await old.close(grace=5.0)
    await client.heartbeat(pb.PHASE_IDLE)  # the new connection is unaffected by the old one closing
    assert [m for m, _ in servicer.seen] == ["Heartbeat"] * 3


async def test_repeated_calls_use_fresh_nonces(client):
    for _ in range(5):  # a reused nonce would be refused as a replay
        await client.heartbeat(pb.PHASE_IDLE)


async def test_send_forged_envelope(client):
    signed = client.sign("Heartbeat", pb.HeartbeatRequest(phase=pb.PHASE_IDLE))
    await client.send("Heartbeat", signed)
    with pytest.raises(grpc.aio.AioRpcError) as err:  # the same envelope again: a replay
        await client.send("Heartbeat", signed)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_server_rejections_surface_as_status_codes(server, client):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await client.heartbeat(pb.PHASE_TRAINING, cell_id="k9.r9", round=1)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cell_id" in err.value.details()
    _, target = server
    async with CoordinatorClient(target, Identity.generate(), "another-run") as other:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await other.heartbeat(pb.PHASE_IDLE)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_register_checks_spec_hash(server):
    _, target = server
    async with CoordinatorClient(target, Identity.generate(), RUN, spec_hash="cd" * 32) as c:
        with pytest.raises(SpecMismatch):
            await c.register(profile(), peer())


async def test_oversized_message_is_refused(server):
    _, target = server
    big = grpc_options.MAX_MESSAGE_BYTES + 1
    opts = [("grpc.max_send_message_length", 2 * big)]
    async with grpc.aio.insecure_channel(target, options=opts) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Heartbeat(pb.SignedRequest(payload=b"\x00" * big), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_upload_bytes_and_file(server, client, tmp_path):
    servicer, _ = server
    data = bytes(range(256)) * 5000  # 1.28 MB: several chunks
    resp = await client.upload_checkpoint("k0.r1", 2, "ab" * 32, data, chunk_bytes=100_000)
    assert resp.stored and servicer.uploads[("k0.r1", 2)] == data
    path = tmp_path / "ckpt.safetensors"
    path.write_bytes(data[::-1])
    await client.upload_checkpoint("router", 4, "ab" * 32, path)
    assert servicer.uploads[("router", 4)] == data[::-1]


async def test_download_verifies_size_and_hash(server, client):
    servicer, _ = server
    info, blob = await client.download_checkpoint("k1.r1")
    assert blob == servicer.blob and info.round == 4 and info.total_bytes == len(blob)
    for mode, match in [
        ("bad_sha", "sha256"),
        ("huge", "exceeds"),
        ("short", "expected"),
        ("long", "more data"),
        ("no_info", "first chunk"),
        ("wrong_cell", "asked for"),
    ]:
        servicer.download_mode = mode
        with pytest.raises(CheckpointIntegrityError, match=match):
            await client.download_checkpoint("k1.r1", max_bytes=1 << 30)


async def test_retries_until_the_server_comes_back(tmp_path):
    """UNAVAILABLE while no server listens; the retry helper waits it out."""
    srv = grpc.aio.server(options=grpc_options.server_options())
    servicer = EchoServicer()
    pb_grpc.add_CoordinatorServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    await srv.stop(grace=None)  # the port is known, nothing listens: a "restarting" coordinator
    attempts = 0
    async with CoordinatorClient(f"127.0.0.1:{port}", Identity.generate(), RUN, timeout_s=2.0) as c:

        async def call():
            nonlocal attempts
            attempts += 1
            if attempts == 3:  # bring the coordinator back on the same port
                srv2 = grpc.aio.server(options=grpc_options.server_options())
                pb_grpc.add_CoordinatorServicer_to_server(servicer, srv2)
                srv2.add_insecure_port(f"127.0.0.1:{port}")
                await srv2.start()
                restarted.append(srv2)
            return await c.heartbeat(pb.PHASE_IDLE)

        restarted: list = []
        try:
            resp = await with_retries(call, base_s=0.05, max_s=0.2, deadline_s=60)
        finally:
            for s in restarted:
                await s.stop(grace=None)
    assert attempts >= 3 and resp.instruction.order == pb.ORDER_WAIT


def _rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")


async def test_with_retries_policy():
    delays: list[float] = []

    async def sleep(d: float) -> None:
        delays.append(d)

    calls = 0

    async def flaky():
        nonlocal calls
        calls += 1
        raise _rpc_error(grpc.StatusCode.UNAVAILABLE)

    with pytest.raises(grpc.aio.AioRpcError):
        await with_retries(flaky, max_attempts=4, sleep=sleep, rng=random.Random(1))
    assert calls == 4 and len(delays) == 3

    async def denied():
        raise _rpc_error(grpc.StatusCode.UNAUTHENTICATED)

    delays.clear()
    with pytest.raises(grpc.aio.AioRpcError):
        await with_retries(denied, sleep=sleep)
    assert delays == []  # not retryable: no wait


def test_backoff_is_bounded_full_jitter():
    rng = random.Random(0)
    for attempt in range(20):
        cap = min(10.0, 0.2 * 2**attempt)
        samples = [backoff_delay_s(attempt, rng=rng) for _ in range(50)]
        assert all(0.0 <= s <= cap for s in samples)
    late = [backoff_delay_s(30, rng=rng) for _ in range(200)]
    assert max(late) > 5.0  # jitter spreads over the whole [0, cap] range


def test_keepalive_settings_are_consistent():
    server = dict(grpc_options.server_options())
    channel = dict(grpc_options.channel_options())
    assert channel["grpc.keepalive_time_ms"] >= server["grpc.http2.min_recv_ping_interval_without_data_ms"]
    assert channel["grpc.keepalive_permit_without_calls"] == server["grpc.keepalive_permit_without_calls"]
    for key in ("grpc.max_send_message_length", "grpc.max_receive_message_length"):
        assert server[key] == channel[key] == grpc_options.MAX_MESSAGE_BYTES
    assert grpc_options.CHECKPOINT_CHUNK_BYTES < grpc_options.MAX_MESSAGE_BYTES


async def test_wait_for_ready_times_out_without_server():
    async with CoordinatorClient("127.0.0.1:1", Identity.generate(), RUN) as c:
        with pytest.raises(asyncio.TimeoutError):
            await c.wait_for_ready(0.3)


def _self_signed_cert() -> tuple[bytes, bytes]:
    """(key PEM, cert PEM) for 127.0.0.1, valid for a day."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bagel-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


async def test_tls_channel():
    key_pem, cert_pem = _self_signed_cert()
    srv = grpc.aio.server(options=grpc_options.server_options())
    pb_grpc.add_CoordinatorServicer_to_server(EchoServicer(), srv)
    port = srv.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key_pem, cert_pem)]))
    await srv.start()
    try:
        async with CoordinatorClient(f"127.0.0.1:{port}", Identity.generate(), RUN, tls=cert_pem) as c:
            resp = await c.heartbeat(pb.PHASE_IDLE)
            assert resp.instruction.order == pb.ORDER_WAIT
        _, other_cert = _self_signed_cert()  # a client that trusts another certificate refuses
        async with CoordinatorClient(f"127.0.0.1:{port}", Identity.generate(), RUN, tls=other_cert, timeout_s=3.0) as c:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.heartbeat(pb.PHASE_IDLE)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await srv.stop(grace=None)
