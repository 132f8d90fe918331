"""Signed envelopes: every rejection has its own typed error (and gRPC status)."""

from __future__ import annotations

import grpc
import pytest

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.envelope import (
    NONCE_BYTES,
    BadNonce,
    BadPublicKey,
    BadSignature,
    MalformedPayload,
    ReplayCache,
    ReplayCacheFull,
    ReplayedNonce,
    StaleTimestamp,
    Verifier,
    WrongMethod,
    WrongRun,
    sign_request,
)
from bagel.protocol.identity import Identity

RUN = "digits-2x2"
NOW = 1_700_000_000_000
SKEW_S = 30.0


@pytest.fixture(scope="module")
def ident() -> Identity:
    return Identity.generate()


def hb(ident: Identity, **kw) -> pb.SignedRequest:
    kw.setdefault("run_id", RUN)
    kw.setdefault("method", "Heartbeat")
    kw.setdefault("now_ms", NOW)
    return sign_request(ident, pb.HeartbeatRequest(phase=pb.PHASE_IDLE), **kw)


def verifier(**kw) -> Verifier:
    return Verifier(RUN, max_clock_skew_s=SKEW_S, **kw)


def test_round_trip_returns_message_and_derived_worker_id(ident):
    signed = hb(ident)
    got = verifier().verify(signed, "Heartbeat", NOW)
    assert got.message.phase == pb.PHASE_IDLE
    assert got.public_key == ident.public_key
    assert got.worker_id == ident.worker_id
    assert got.message.header.run_id == RUN and len(got.message.header.nonce) == NONCE_BYTES


def test_signature_covers_exact_payload_bytes(ident):
    signed = hb(ident)
    assert ident.verify(signed.signature, signed.payload)
    # Each message gets a fresh nonce.
    assert hb(ident).payload != signed.payload


def test_flipped_payload_byte(ident):
    signed = hb(ident)
    payload = bytearray(signed.payload)
    payload[-1] ^= 0x01
    signed.payload = bytes(payload)
    with pytest.raises(BadSignature):
        verifier().verify(signed, "Heartbeat", NOW)


def test_bad_signature(ident):
    signed = hb(ident)
    signed.signature = bytes(64)
    with pytest.raises(BadSignature):
        verifier().verify(signed, "Heartbeat", NOW)
    signed.signature = b"\x01" * 63
    with pytest.raises(BadSignature, match="64 bytes"):
        verifier().verify(signed, "Heartbeat", NOW)


def test_signed_by_another_key(ident):
    signed = hb(ident)
    signed.public_key = Identity.generate().public_key
    with pytest.raises(BadSignature):
        verifier().verify(signed, "Heartbeat", NOW)


@pytest.mark.parametrize("key", [b"", b"\x01" * 31, b"\x01" * 33])
def test_short_or_long_public_key(ident, key):
    signed = hb(ident)
    signed.public_key = key
    with pytest.raises(BadPublicKey):
        verifier().verify(signed, "Heartbeat", NOW)


def test_validly_signed_garbage_payload(ident):
    payload = b"\xff\xff\xff"
    signed = pb.SignedRequest(payload=payload, signature=ident.sign(payload), public_key=ident.public_key)
    with pytest.raises(MalformedPayload):
        verifier().verify(signed, "Heartbeat", NOW)


def test_payload_without_header(ident):
    payload = pb.HeartbeatRequest(phase=pb.PHASE_IDLE).SerializeToString()
    signed = pb.SignedRequest(payload=payload, signature=ident.sign(payload), public_key=ident.public_key)
    with pytest.raises(MalformedPayload, match="header"):
        verifier().verify(signed, "Heartbeat", NOW)


def test_wrong_run(ident):
    with pytest.raises(WrongRun):
        verifier().verify(hb(ident, run_id="other-run"), "Heartbeat", NOW)


def test_wrong_method(ident):
    # A Leave payload re-targeted at Heartbeat: different type, but header says "Leave".
    signed = sign_request(ident, pb.LeaveRequest(reason="x"), run_id=RUN, method="Leave", now_ms=NOW)
    with pytest.raises(WrongMethod):
        verifier().verify(signed, "Heartbeat", NOW)
    with pytest.raises(WrongMethod):
        verifier().verify(hb(ident), "Leave", NOW)


@pytest.mark.parametrize("offset_ms", [-30_001, 30_001, -(10**9), 10**9])
def test_stale_or_future_timestamp(ident, offset_ms):
    with pytest.raises(StaleTimestamp):
        verifier().verify(hb(ident, now_ms=NOW + offset_ms), "Heartbeat", NOW)


@pytest.mark.parametrize("offset_ms", [-30_000, 0, 30_000])
def test_timestamp_at_window_edges_accepted(ident, offset_ms):
    verifier().verify(hb(ident, now_ms=NOW + offset_ms), "Heartbeat", NOW)


@pytest.mark.parametrize("nonce", [b"", b"\x00" * 15, b"\x00" * 17])
def test_bad_nonce_length(ident, nonce):
    with pytest.raises(BadNonce):
        verifier().verify(hb(ident, nonce=nonce), "Heartbeat", NOW)


def test_replayed_nonce(ident):
    v = verifier()
    signed = hb(ident)
    v.verify(signed, "Heartbeat", NOW)
    with pytest.raises(ReplayedNonce):
        v.verify(signed, "Heartbeat", NOW + 1000)
    # The same nonce from another sender is a different message.
    v.verify(hb(Identity.generate(), nonce=signed_nonce(signed)), "Heartbeat", NOW)


def signed_nonce(signed: pb.SignedRequest) -> bytes:
    return pb.HeartbeatRequest.FromString(signed.payload).header.nonce


def test_rejected_message_does_not_consume_its_nonce(ident):
    v = verifier()
    nonce = b"\x07" * 16
    with pytest.raises(WrongRun):
        v.verify(hb(ident, nonce=nonce, run_id="other"), "Heartbeat", NOW)
    v.verify(hb(ident, nonce=nonce), "Heartbeat", NOW)
    assert len(v.replay) == 1


def test_replay_entries_expire_with_the_window(ident):
    v = verifier()
    signed = hb(ident)
    v.verify(signed, "Heartbeat", NOW)
    later = NOW + 30_001
    v.replay.prune(later)
    assert len(v.replay) == 0
    # Replay after expiry is still refused, now by the timestamp check.
    with pytest.raises(StaleTimestamp):
        v.verify(signed, "Heartbeat", later)


def test_full_replay_cache_refuses_instead_of_evicting(ident):
    v = verifier(replay_capacity=3)
    first = hb(ident, now_ms=NOW)
    v.verify(first, "Heartbeat", NOW)
    for _ in range(2):
        v.verify(hb(ident, now_ms=NOW), "Heartbeat", NOW)
    with pytest.raises(ReplayCacheFull):
        v.verify(hb(ident, now_ms=NOW), "Heartbeat", NOW)
    with pytest.raises(ReplayedNonce):  # the oldest entry was not evicted
        v.verify(first, "Heartbeat", NOW)
    # Once the entries leave the window, capacity frees up.
    v.verify(hb(ident, now_ms=NOW + 30_001), "Heartbeat", NOW + 30_001)


def test_replay_cache_prunes_only_expired():
    cache = ReplayCache(capacity=10)
    cache.add(b"a", 100, 0)
    cache.add(b"b", 200, 0)
    cache.prune(150)
    assert not cache.seen(b"a") and cache.seen(b"b")


def test_replay_cache_prunes_as_it_goes():
    # A steady stream (one message per ms, each valid for 10 ms) stays near the live
    # window without any explicit prune: each insert drops a few expired entries.
    cache = ReplayCache(capacity=1000)
    for t in range(5000):
        cache.add(t.to_bytes(4, "big"), t + 10, t)
        assert len(cache) <= 12
    assert cache.seen((4999).to_bytes(4, "big")) and not cache.seen((4980).to_bytes(4, "big"))


def test_error_statuses():
    assert BadSignature.status == grpc.StatusCode.UNAUTHENTICATED
    assert BadPublicKey.status == grpc.StatusCode.UNAUTHENTICATED
    assert MalformedPayload.status == grpc.StatusCode.INVALID_ARGUMENT
    assert WrongRun.status == grpc.StatusCode.FAILED_PRECONDITION
    assert WrongMethod.status == grpc.StatusCode.INVALID_ARGUMENT
    assert StaleTimestamp.status == grpc.StatusCode.UNAUTHENTICATED
    assert BadNonce.status == grpc.StatusCode.INVALID_ARGUMENT
    assert ReplayedNonce.status == grpc.StatusCode.UNAUTHENTICATED
    assert ReplayCacheFull.status == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_sign_request_refuses_mismatched_type(ident):
    with pytest.raises(TypeError):
        sign_request(ident, pb.LeaveRequest(), run_id=RUN, method="Heartbeat")
    with pytest.raises(ValueError):
        sign_request(ident, pb.LeaveRequest(), run_id=RUN, method="Nope")


@pytest.mark.parametrize(
    "method,message",
    [
        ("Register", pb.RegisterRequest()),
        ("ReportRound", pb.ReportRoundRequest(cell_id="k0.r0", round=1)),
        ("Leave", pb.LeaveRequest()),
        ("UploadCheckpoint", pb.UploadCheckpointHeader(cell_id="router")),
        ("DownloadCheckpoint", pb.DownloadCheckpointRequest(cell_id="router")),
    ],
)
def test_every_method_round_trips(ident, method, message):
    signed = sign_request(ident, message, run_id=RUN, method=method, now_ms=NOW)
    got = verifier().verify(signed, method, NOW)
    assert type(got.message) is type(message)
