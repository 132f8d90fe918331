"""Bad input for every RPC: each gets its precise gRPC status, and
the coordinator's state is unchanged afterwards: every row of every SQLite table, the
core's in-memory snapshot and GetStatus (minus its clock field).

A real coordinator on port 0 with one registered worker. The lease is long (600 s), so no
tick changes anything while the bad messages are sent.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from bagel.coordinator.daemon import CoordinatorHandle, start_coordinator
from bagel.coordinator.store import Store
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import bagel_pb2_grpc as pb_grpc
from bagel.protocol.envelope import sign_request, wall_clock_ms
from bagel.protocol.grpc_options import MAX_MESSAGE_BYTES
from bagel.protocol.identity import Identity
from bagel.protocol.pow import solve_pow
from bagel.protocol.runspec import parse_spec

from simworkers import cluster_spec_text, fake_peer_id, uniform_cells

SIGNED = ("Register", "Heartbeat", "ReportRound", "Leave", "DownloadCheckpoint", "GetDataManifest", "FetchDataShard")
STREAMING = ("DownloadCheckpoint", "FetchDataShard")


def good_payload(method: str) -> Any:
    """A valid payload for each signed unary RPC (the envelope fills the header)."""
    if method == "Register":
        return pb.RegisterRequest(
            profile=pb.WorkerProfile(name="w", device_kind="cpu", vram_bytes=8 << 30, num_devices=1),
            peer=pb.PeerAddress(peer_id=fake_peer_id("x"), maddrs=["/ip4/127.0.0.1/tcp/1"]),
        )
    if method == "Heartbeat":
        return pb.HeartbeatRequest(phase=pb.PHASE_IDLE)
    if method == "ReportRound":
        return pb.ReportRoundRequest(cell_id="k0.r0", round=1, state_hash="a" * 64, samples=8)
    if method == "Leave":
        return pb.LeaveRequest(reason="bye")
    if method == "DownloadCheckpoint":
        return pb.DownloadCheckpointRequest(cell_id="k0.r0", round=0)
    if method == "GetDataManifest":
        return pb.DataManifestRequest(cell_id="k0.r0")
    if method == "FetchDataShard":
        return pb.FetchDataShardRequest(sha256="a" * 64, offset=0)
    raise AssertionError(method)


def invalid_payload(method: str) -> Any:
    """Missing or out-of-range fields, one per RPC."""
    if method == "Register":
        return pb.RegisterRequest(peer=pb.PeerAddress(peer_id=fake_peer_id("x")))  # no profile
    if method == "Heartbeat":
        return pb.HeartbeatRequest(phase=pb.PHASE_TRAINING, cell_id="k0.r0", round=0)  # round out of range
    if method == "ReportRound":
        return pb.ReportRoundRequest(cell_id="k9.r9", round=1, state_hash="a" * 64)  # not a cell
    if method == "Leave":
        return pb.LeaveRequest(reason="x" * 5000)  # too long
    if method == "DownloadCheckpoint":
        return pb.DownloadCheckpointRequest(cell_id="", round=-1)  # missing cell
    if method == "GetDataManifest":
        return pb.DataManifestRequest(cell_id="k7.r0")  # not a cell
    if method == "FetchDataShard":
        return pb.FetchDataShardRequest(sha256="A" * 64, offset=-1)  # not lowercase hex, negative offset
    raise AssertionError(method)


class Caller:
    """Raw access to every RPC (and a channel that may send oversized messages)."""

    def __init__(self, target: str) -> None:
        opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        self.channel = grpc.aio.insecure_channel(target, options=opts)
        self.stub = pb_grpc.CoordinatorStub(self.channel)

    async def send(self, method: str, signed: pb.SignedRequest | bytes) -> None:
        """Send one request; drain a streaming answer."""
        if isinstance(signed, bytes):  # raw bytes, not even a SignedRequest
            rpc = (
                self.channel.unary_unary(f"/bagel.v1.Coordinator/{method}")
                if method not in STREAMING
                else self.channel.unary_stream(f"/bagel.v1.Coordinator/{method}")
            )
            call = rpc(signed, timeout=10)
        else:
            call = getattr(self.stub, method)(signed, timeout=10)
        if method in STREAMING:
            async for _ in call:
                pass
        else:
            await call

    async def upload(self, chunks: list[pb.CheckpointUploadChunk]) -> None:
        async def gen() -> AsyncIterator[pb.CheckpointUploadChunk]:
            for c in chunks:
                yield c

        await self.stub.UploadCheckpoint(gen(), timeout=10)


async def fingerprint(h: CoordinatorHandle, caller: Caller) -> tuple[Any, ...]:
    await h.app.writer.barrier()
    store = Store.open_readonly(h.data_dir)
    try:
        dump = store.dump()
    finally:
        store.close()
    status = await caller.stub.GetStatus(pb.GetStatusRequest(), timeout=10)
    status.now_unix_ms = 0
    return dump, h.state.snapshot(), status.SerializeToString(deterministic=True)


async def expect(code: grpc.StatusCode, fn: Callable[[], Awaitable[None]]) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await fn()
    assert err.value.code() == code, f"expected {code.name}, got {err.value.code().name}: {err.value.details()}"
    return err.value.details() or ""


@pytest.fixture
async def coordinator(tmp_path: Path):
    spec = parse_spec(cluster_spec_text(lease_s=600.0, heartbeat_s=1.0))
    h = await start_coordinator(spec, tmp_path / "c", cells=uniform_cells(spec.cell_ids), tick_ms=50)
    caller = Caller(f"127.0.0.1:{h.port}")
    me = Identity.generate()
    # a registered worker, so unknown-worker rejections do not hide the others
    reg = good_payload("Register")
    challenge = await caller.stub.AdmissionChallenge(pb.AdmissionChallengeRequest(), timeout=10)
    reg.pow_challenge = challenge.challenge
    reg.pow_nonce = solve_pow(challenge.challenge, spec.run.id, me.public_key, challenge.pow_bits)
    await caller.stub.Register(sign_request(me, reg, run_id=spec.run.id, method="Register"), timeout=10)
    try:
        yield h, caller, me
    finally:
        await caller.channel.close()
        await h.stop()


def signed(me: Identity, method: str, payload: Any, run_id: str, **kw: Any) -> pb.SignedRequest:
    return sign_request(me, payload, run_id=run_id, method=method, **kw)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", SIGNED)
async def test_every_signed_rpc_rejects_bad_input_without_state_change(coordinator, method: str) -> None:
    h, caller, me = coordinator
    run_id = h.spec.run.id
    before = await fingerprint(h, caller)
    cases: list[tuple[str, grpc.StatusCode, Callable[[], Awaitable[None]]]] = []

    def case(name: str, code: grpc.StatusCode, fn: Callable[[], Awaitable[None]]) -> None:
        cases.append((name, code, fn))

    case(
        "invalid fields",
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: caller.send(method, signed(me, method, invalid_payload(method), run_id)),
    )
    case(
        "wrong run id",
        grpc.StatusCode.FAILED_PRECONDITION,
        lambda: caller.send(method, signed(me, method, good_payload(method), "another-run")),
    )

    def bad_signature() -> pb.SignedRequest:
        s = signed(me, method, good_payload(method), run_id)
        return pb.SignedRequest(payload=s.payload, signature=bytes(64), public_key=s.public_key)

    case("bad signature", grpc.StatusCode.UNAUTHENTICATED, lambda: caller.send(method, bad_signature()))

    def other_key() -> pb.SignedRequest:  # signed by one key, claiming another
        s = signed(Identity.generate(), method, good_payload(method), run_id)
        return pb.SignedRequest(payload=s.payload, signature=s.signature, public_key=me.public_key)

    case("signature by another key", grpc.StatusCode.UNAUTHENTICATED, lambda: caller.send(method, other_key()))
    case(
        "stale timestamp",
        grpc.StatusCode.UNAUTHENTICATED,
        lambda: caller.send(
            method, signed(me, method, good_payload(method), run_id, now_ms=wall_clock_ms() - 10 * 60_000)
        ),
    )
    case(
        "future timestamp",
        grpc.StatusCode.UNAUTHENTICATED,
        lambda: caller.send(
            method, signed(me, method, good_payload(method), run_id, now_ms=wall_clock_ms() + 10 * 60_000)
        ),
    )
    other_method = "Leave" if method != "Leave" else "Heartbeat"
    case(
        "payload signed for another RPC",
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: caller.send(method, signed(me, other_method, good_payload(other_method), run_id)),
    )
    case("malformed bytes", grpc.StatusCode.INVALID_ARGUMENT, lambda: caller.send(method, b"\xff\xff\xff\xff"))
    case(
        "garbage payload",
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: caller.send(
            method, pb.SignedRequest(payload=b"\x0a\xff", signature=me.sign(b"\x0a\xff"), public_key=me.public_key)
        ),
    )
    case(
        "oversized message",
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        lambda: caller.send(
            method,
            pb.SignedRequest(
                payload=os.urandom(MAX_MESSAGE_BYTES + 1024), signature=bytes(64), public_key=me.public_key
            ),
        ),
    )
    if method != "Register":
        case(
            "unknown worker",
            grpc.StatusCode.NOT_FOUND,
            lambda: caller.send(method, signed(Identity.generate(), method, good_payload(method), run_id)),
        )

    for name, code, fn in cases:
        await expect(code, fn)
        assert await fingerprint(h, caller) == before, f"{method}: state changed after '{name}'"

    # replay: a message the coordinator accepted (or refused on its merits) once is refused
    # as a replay the second time, and the replay changes nothing.
    msg = signed(me, method, good_payload(method), run_id)
    try:
        await caller.send(method, msg)
    except grpc.aio.AioRpcError:
        pass  # e.g. ReportRound for a round that is not open; the nonce is spent anyway
    after_first = await fingerprint(h, caller)
    await expect(grpc.StatusCode.UNAUTHENTICATED, lambda: caller.send(method, msg))
    assert await fingerprint(h, caller) == after_first, f"{method}: state changed after a replay"


@pytest.mark.timeout(60)
async def test_upload_checkpoint_rejects_bad_input_without_state_change(coordinator) -> None:
    h, caller, me = coordinator
    run_id = h.spec.run.id
    data = b"not a checkpoint" * 10
    header = pb.UploadCheckpointHeader(
        cell_id="k0.r0", round=1, state_hash="a" * 64, total_bytes=len(data), sha256=hashlib.sha256(data).hexdigest()
    )

    def hdr(payload: pb.UploadCheckpointHeader | None = None, identity: Identity = me, rid: str = run_id, **kw: Any):
        p = pb.UploadCheckpointHeader()
        p.CopyFrom(payload or header)
        return pb.CheckpointUploadChunk(header=sign_request(identity, p, run_id=rid, method="UploadCheckpoint", **kw))

    data_chunk = pb.CheckpointUploadChunk(data=data)
    bad_sig = hdr()
    bad_sig.header.signature = bytes(64)
    too_big = pb.UploadCheckpointHeader()
    too_big.CopyFrom(header)
    too_big.total_bytes = h.spec.checkpoint.max_bytes + 1
    no_hash = pb.UploadCheckpointHeader()
    no_hash.CopyFrom(header)
    no_hash.state_hash = ""
    replay = hdr()
    before = await fingerprint(h, caller)
    cases = [
        ("empty stream", grpc.StatusCode.INVALID_ARGUMENT, []),
        ("data before header", grpc.StatusCode.INVALID_ARGUMENT, [data_chunk, hdr()]),
        ("missing state hash", grpc.StatusCode.INVALID_ARGUMENT, [hdr(no_hash), data_chunk]),
        ("declared size over checkpoint.max_bytes", grpc.StatusCode.INVALID_ARGUMENT, [hdr(too_big), data_chunk]),
        ("wrong run id", grpc.StatusCode.FAILED_PRECONDITION, [hdr(rid="another-run"), data_chunk]),
        ("bad signature", grpc.StatusCode.UNAUTHENTICATED, [bad_sig, data_chunk]),
        ("stale timestamp", grpc.StatusCode.UNAUTHENTICATED, [hdr(now_ms=wall_clock_ms() - 600_000), data_chunk]),
        ("unknown worker", grpc.StatusCode.NOT_FOUND, [hdr(identity=Identity.generate()), data_chunk]),
        ("upload nobody asked for", grpc.StatusCode.FAILED_PRECONDITION, [replay, data_chunk]),
        ("replayed header", grpc.StatusCode.UNAUTHENTICATED, [replay, data_chunk]),
        # (a too-long stream of an accepted upload: tests/test_server_checkpoints.py)
        (
            "oversized message",
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            [pb.CheckpointUploadChunk(data=os.urandom(MAX_MESSAGE_BYTES + 1024))],
        ),
    ]
    for name, code, chunks in cases:
        await expect(code, lambda chunks=chunks: caller.upload(chunks))
        assert await fingerprint(h, caller) == before, f"UploadCheckpoint: state changed after '{name}'"
    assert list((h.data_dir / "checkpoints").rglob("*.safetensors")) == []


@pytest.mark.timeout(60)
async def test_get_status_rejects_malformed_and_oversized(coordinator) -> None:
    h, caller, _me = coordinator
    before = await fingerprint(h, caller)
    raw = caller.channel.unary_unary("/bagel.v1.Coordinator/GetStatus")
    await expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: raw(b"\xff\xff\xff", timeout=10))
    await expect(
        grpc.StatusCode.RESOURCE_EXHAUSTED, lambda: raw(b"\x0a" + os.urandom(MAX_MESSAGE_BYTES + 100), timeout=10)
    )
    assert await fingerprint(h, caller) == before
    # and the daemon is still healthy
    assert (await caller.stub.GetStatus(pb.GetStatusRequest(), timeout=10)).run_id == h.spec.run.id


@pytest.mark.timeout(60)
async def test_rejections_are_counted_by_reason(coordinator) -> None:
    h, caller, me = coordinator
    msg = sign_request(me, pb.HeartbeatRequest(phase=pb.PHASE_IDLE), run_id="another-run", method="Heartbeat")
    await expect(grpc.StatusCode.FAILED_PRECONDITION, lambda: caller.send("Heartbeat", msg))
    await expect(grpc.StatusCode.INVALID_ARGUMENT, lambda: caller.send("Heartbeat", b"\xff"))
    text = h.metrics.text()
    assert 'bagel_rejected_messages_total{reason="wrong_run"} 1.0' in text
    assert 'bagel_rejected_messages_total{reason="malformed_message"} 1.0' in text
