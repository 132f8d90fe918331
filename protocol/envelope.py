"""Signed envelopes: build a `SignedRequest` on the sender, verify it on the coordinator.

The signature covers exactly the payload bytes that travel, never a
re-serialization (protobuf serialization is not canonical, so "parse, re-serialize,
verify" would both reject honest messages and open malleability holes). The payload's
`RequestHeader` binds the run id, the RPC method, the sender's time and a random nonce;
the verifier rejects another run's messages, a payload re-targeted at another RPC,
timestamps outside the skew window and replayed nonces.

Each rejection is its own exception class carrying the gRPC status it should map to
(`EnvelopeError.status`), so the server's single interceptor maps them precisely:

| error               | status              | meaning                                    |
| ------------------- | ------------------- | ------------------------------------------ |
| BadPublicKey        | UNAUTHENTICATED     | public key missing / not 32 bytes / invalid |
| BadSignature        | UNAUTHENTICATED     | signature not 64 bytes or does not verify   |
| MalformedPayload    | INVALID_ARGUMENT    | payload does not parse / no header          |
| WrongRun            | FAILED_PRECONDITION | signed for another run                      |
| WrongMethod         | INVALID_ARGUMENT    | signed for another RPC                      |
| StaleTimestamp      | UNAUTHENTICATED     | outside +-max_clock_skew_s of our clock     |
| BadNonce            | INVALID_ARGUMENT    | nonce is not 16 bytes                       |
| ReplayedNonce       | UNAUTHENTICATED     | (public key, nonce) already seen            |
| ReplayCacheFull     | RESOURCE_EXHAUSTED  | replay cache at capacity: retry later       |

The verifier is not pure (the replay cache is state), but it reads no clock: `now_ms` is
an argument. Checks run cheapest-first after the signature, and the nonce is recorded
only once every other check has passed, so a rejected message never consumes a nonce.
"""

from __future__ import annotations

import heapq
import os
import time
from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    InvalidSignature,
    load_public_key,
    worker_id_of,
)

NONCE_BYTES = 16
DEFAULT_MAX_CLOCK_SKEW_S = 30.0
# At 2,000 messages/s an entry lives at most 2 x skew = 60 s: 120k entries. 2^18 gives
# headroom and bounds memory to roughly 50 MB under a flood of validly signed messages.
DEFAULT_REPLAY_CAPACITY = 1 << 18
PRUNE_PER_ADD = 4  # expired replay entries dropped with each new one (see ReplayCache.add)

# RPC name -> the payload message type it carries (see bagel.proto).
PAYLOAD_TYPES: dict[str, type[Message]] = {
    "Register": pb.RegisterRequest,
    "Heartbeat": pb.HeartbeatRequest,
    "ReportRound": pb.ReportRoundRequest,
    "Leave": pb.LeaveRequest,
    "UploadCheckpoint": pb.UploadCheckpointHeader,
    "DownloadCheckpoint": pb.DownloadCheckpointRequest,
    "GetStatus": pb.StatusAuthRequest,  # optional: a signed GetStatus sees worker details
    "Accuse": pb.EvidenceRequest,
    "GetDataManifest": pb.DataManifestRequest,
    "FetchDataShard": pb.FetchDataShardRequest,
    "WatchInstruction": pb.WatchInstructionRequest,
}

M = TypeVar("M", bound=Message)


# ---------------------------------------------------------------------------- errors


class EnvelopeError(Exception):
    """A signed request was rejected; `status` is the gRPC code the server should answer."""

    status: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED


class BadPublicKey(EnvelopeError):
    status = grpc.StatusCode.UNAUTHENTICATED


class BadSignature(EnvelopeError):
    status = grpc.StatusCode.UNAUTHENTICATED


class MalformedPayload(EnvelopeError):
    status = grpc.StatusCode.INVALID_ARGUMENT


class WrongRun(EnvelopeError):
    status = grpc.StatusCode.FAILED_PRECONDITION


class WrongMethod(EnvelopeError):
    status = grpc.StatusCode.INVALID_ARGUMENT


class StaleTimestamp(EnvelopeError):
    status = grpc.StatusCode.UNAUTHENTICATED


class BadNonce(EnvelopeError):
    status = grpc.StatusCode.INVALID_ARGUMENT


class ReplayedNonce(EnvelopeError):
    status = grpc.StatusCode.UNAUTHENTICATED


class ReplayCacheFull(EnvelopeError):
    status = grpc.StatusCode.RESOURCE_EXHAUSTED


# ---------------------------------------------------------------------------- signing


def wall_clock_ms() -> int:
    """Milliseconds since the Unix epoch (the shell's clock; cores take time as an argument)."""
    return time.time_ns() // 1_000_000


def sign_request(
    identity: Identity,
    request: Message,
    *,
    run_id: str,
    method: str,
    now_ms: int | None = None,
    nonce: bytes | None = None,
) -> pb.SignedRequest:
    """Fill `request.header` (run id, method, time, fresh 16-byte nonce), serialize once, sign.

    `request` is modified in place (its header is overwritten). `now_ms` and `nonce`
    default to the wall clock and os.urandom; tests pass them to forge edge cases.
    """
    if method not in PAYLOAD_TYPES:
        raise ValueError(f"unknown method {method!r}; expected one of {sorted(PAYLOAD_TYPES)}")
    if not isinstance(request, PAYLOAD_TYPES[method]):
        raise TypeError(f"{method} carries {PAYLOAD_TYPES[method].__name__}, got {type(request).__name__}")
    header = request.header  # type: ignore[attr-defined]
    header.run_id = run_id
    header.method = method
    header.timestamp_unix_ms = wall_clock_ms() if now_ms is None else now_ms
    header.nonce = os.urandom(NONCE_BYTES) if nonce is None else nonce
    payload = request.SerializeToString()
    return pb.SignedRequest(payload=payload, signature=identity.sign(payload), public_key=identity.public_key)


# ---------------------------------------------------------------------------- verifying


@dataclass(frozen=True, slots=True)
class Verified(Generic[M]):
    """A request that passed every envelope check."""

    message: M  # the parsed payload (RegisterRequest, HeartbeatRequest, ...)
    public_key: bytes
    worker_id: str  # derived from public_key: the only worker id the server may trust
    timestamp_unix_ms: int


class ReplayCache:
    """Bounded set of (public key, nonce) seen within the skew window.

    An entry is needed only until its message's timestamp leaves the window (after that
    the timestamp check rejects a replay on its own), so each entry expires at
    `timestamp + skew` and is pruned lazily (a few entries with each insert) through a
    min-heap of expiries. Memory is bounded by `capacity`: when the cache is full even
    after pruning, new messages are refused (ReplayCacheFull -> RESOURCE_EXHAUSTED)
    instead of evicting live entries, because evicting would silently re-open a replay
    window. Honest workers retry with backoff; entries drain within 2 x skew.
    """

    __slots__ = ("capacity", "_expiry", "_heap")

    def __init__(self, capacity: int = DEFAULT_REPLAY_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._expiry: dict[bytes, int] = {}
        self._heap: list[tuple[int, bytes]] = []

    def __len__(self) -> int:
        return len(self._expiry)

    def prune(self, now_ms: int, limit: int = -1) -> None:
        """Drop entries expired by `now_ms`: all of them, or at most `limit` heap entries."""
        heap, expiry = self._heap, self._expiry
        while limit != 0 and heap and heap[0][0] < now_ms:
            exp, key = heapq.heappop(heap)
            if expiry.get(key) == exp:
                del expiry[key]
            limit -= 1

    def seen(self, key: bytes) -> bool:
        return key in self._expiry

    def add(self, key: bytes, expires_ms: int, now_ms: int) -> None:
        """Record `key` until `expires_ms`; ReplayedNonce if present, ReplayCacheFull if full."""
        if key in self._expiry:
            raise ReplayedNonce("nonce already used by this sender")
        # Pruning rides along with each insert, a few entries at a time: every entry is
        # pushed once and popped once, so PRUNE_PER_ADD > 1 keeps up with any steady rate,
        # and the cache never stops the event loop for one big sweep (a once-a-second
        # prune popped ~2,000 entries at once at 2,000 messages/s: a few ms of stall).
        self.prune(now_ms, PRUNE_PER_ADD)
        if len(self._expiry) >= self.capacity:
            self.prune(now_ms)
            if len(self._expiry) >= self.capacity:
                raise ReplayCacheFull(f"replay cache full ({self.capacity} entries); retry later")
        self._expiry[key] = expires_ms
        heapq.heappush(self._heap, (expires_ms, key))


class Verifier:
    """Checks SignedRequests for one run. Not thread-safe: use it from one event loop."""

    def __init__(
        self,
        run_id: str,
        *,
        max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S,
        replay_capacity: int = DEFAULT_REPLAY_CAPACITY,
    ) -> None:
        if max_clock_skew_s <= 0:
            raise ValueError("max_clock_skew_s must be positive")
        self.run_id = run_id
        self.max_clock_skew_ms = int(max_clock_skew_s * 1000)
        self.replay = ReplayCache(replay_capacity)

    def verify(self, signed: pb.SignedRequest, method: str, now_ms: int) -> Verified[Message]:
        """Verify `signed` as a request for RPC `method` at time `now_ms`.

        Order: public key length, signature (length, then validity over exactly
        `signed.payload`), payload parse into the method's type, header present, run id,
        method, timestamp within +-max_clock_skew_s, nonce length, replay. Raises the
        matching EnvelopeError subclass; on success the nonce is recorded.
        """
        payload_type = PAYLOAD_TYPES.get(method)
        if payload_type is None:  # a server bug, not a client error
            raise ValueError(f"unknown method {method!r}")
        public_key = signed.public_key
        if len(public_key) != PUBLIC_KEY_BYTES:
            raise BadPublicKey(f"public_key must be {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
        signature = signed.signature
        if len(signature) != SIGNATURE_BYTES:
            raise BadSignature(f"signature must be {SIGNATURE_BYTES} bytes, got {len(signature)}")
        try:
            key = load_public_key(public_key)
        except ValueError:
            raise BadPublicKey("public_key is not a valid Ed25519 point") from None
        payload = signed.payload
        try:
            key.verify(signature, payload)
        except InvalidSignature:
            raise BadSignature("signature does not verify over the payload") from None

        message = payload_type()
        try:
            message.ParseFromString(payload)
        except DecodeError as e:
            raise MalformedPayload(f"payload is not a valid {payload_type.__name__}: {e}") from None
        if not message.HasField("header"):
            raise MalformedPayload("payload has no header")
        header: pb.RequestHeader = message.header  # type: ignore[attr-defined]
        if header.run_id != self.run_id:
            raise WrongRun(f"message is for run {header.run_id[:80]!r}, this is run {self.run_id!r}")
        if header.method != method:
            raise WrongMethod(f"message was signed for {header.method[:40]!r}, not {method!r}")
        ts = header.timestamp_unix_ms
        skew = self.max_clock_skew_ms
        if not (now_ms - skew <= ts <= now_ms + skew):
            raise StaleTimestamp(
                f"timestamp {ts} is {ts - now_ms:+d} ms from the coordinator's clock "
                f"(allowed +-{skew} ms); check the worker's clock"
            )
        nonce = header.nonce
        if len(nonce) != NONCE_BYTES:
            raise BadNonce(f"nonce must be {NONCE_BYTES} bytes, got {len(nonce)}")
        self.replay.add(public_key + nonce, ts + skew, now_ms)
        return Verified(message, public_key, worker_id_of(public_key), ts)
