"""Async client of the coordinator: signs every request and speaks grpc.aio.

Used by the worker agent, the tests' simulated workers and the load benchmark. Every
method builds the request, signs it with a fresh envelope (`bagel.protocol.envelope`)
and sends it with a per-call timeout. Failures surface as `grpc.aio.AioRpcError` with the
server's status code (e.g. NOT_FOUND means "re-register"); integrity problems the client
detects itself raise `ClientError` subclasses.

Retries belong to the caller, through `with_retries`, because each attempt must be
re-signed (a fresh nonce and timestamp: the coordinator may have seen the first one).
Backoff is exponential with "full jitter" (Marc Brooker, "Exponential Backoff And
Jitter", AWS Architecture Blog, 2015), so workers reconnecting after a coordinator
restart do not arrive in lock-step.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import bagel_pb2_grpc as pb_grpc
from bagel.protocol.convert import audit_to_pb
from bagel.protocol.envelope import sign_request
from bagel.protocol.grpc_options import CHECKPOINT_CHUNK_BYTES, MAX_MESSAGE_BYTES, channel_options
from bagel.protocol.identity import Identity
from bagel.protocol.messages import PartAudit
from bagel.protocol.pow import solve_pow
from bagel.protocol.runspec import SpecError, spec_source_hash
from bagel.protocol.tls import DEFAULT_PROBE_TIMEOUT_S, PinnedTLS, pinned_credentials

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_CHECKPOINT_BYTES = 2 << 30
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
# the most proof-of-work bits a client pays for (~2^28 hashes, minutes of one core): a
# coordinator that asks for more is refused rather than obeyed forever
MAX_POW_BITS = 28


class ClientError(Exception):
    """The coordinator's answer failed a client-side check."""


class SpecMismatch(ClientError):
    """The spec the coordinator sent does not hash to the expected spec hash."""


class AdmissionError(ClientError):
    """The coordinator's admission challenge is unusable (another run, absurd difficulty)."""


class CheckpointIntegrityError(ClientError):
    """A downloaded checkpoint is malformed, oversized, or fails its size/sha256 check."""


class CoordinatorClient:
    """Signed grpc.aio client for one run.

    `target` is "host:port". `tls` is None (plaintext), a `PinnedTLS` (the one
    certificate a pinned fingerprint matched, see `connect` and `bagel.protocol.tls`), a
    `grpc.ChannelCredentials`, or PEM root certificate bytes. `spec_hash`, if given (from
    the DHT record), is checked against the spec the coordinator returns on Register.
    """

    def __init__(
        self,
        target: str,
        identity: Identity,
        run_id: str,
        *,
        spec_hash: str | None = None,
        tls: PinnedTLS | grpc.ChannelCredentials | bytes | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.target = target
        self.identity = identity
        self.run_id = run_id
        self.spec_hash = spec_hash
        self.timeout_s = timeout_s
        self.tls_fingerprint = tls.fingerprint if isinstance(tls, PinnedTLS) else ""
        self._tls = tls
        self._channel = self._open_channel()
        self._stub = pb_grpc.CoordinatorStub(self._channel)

    def _open_channel(self) -> grpc.aio.Channel:
        tls, target = self._tls, self.target
        if tls is None:
            return grpc.aio.insecure_channel(target, options=channel_options())
        if isinstance(tls, PinnedTLS):
            return grpc.aio.secure_channel(target, tls.credentials(), options=channel_options() + tls.channel_options())
        creds = grpc.ssl_channel_credentials(root_certificates=tls) if isinstance(tls, bytes) else tls
        return grpc.aio.secure_channel(target, creds, options=channel_options())

    def redial(self) -> grpc.aio.Channel:
        """Send every later call over a new channel to the same target, with the same
        credentials (a pinned certificate stays pinned), and hand back the old one for the
        caller to close once its calls are over.

        A connection that went quiet through a network cut can stay stuck after the cut
        heals: TCP backs its retransmissions off, and a NAT that dropped its mapping drops
        everything sent on it. gRPC notices only when a keepalive ping goes unanswered
        (`CLIENT_KEEPALIVE_TIME_MS` + `CLIENT_KEEPALIVE_TIMEOUT_MS`, 40 s); a new channel
        dials a new connection at once."""
        old = self._channel
        self._channel = self._open_channel()
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        return old

    @classmethod
    async def connect(
        cls,
        target: str,
        identity: Identity,
        run_id: str,
        *,
        tls_fingerprint: str,
        spec_hash: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
    ) -> CoordinatorClient:
        """A client for `target`, pinned to `tls_fingerprint` ("" = plaintext).

        With a fingerprint the server's certificate is fetched and checked first
        (`bagel.protocol.tls.pinned_credentials`): `FingerprintMismatch` or `TLSError`
        before any request is sent, OSError if the server cannot be reached.
        """
        tls = (
            await asyncio.to_thread(pinned_credentials, target, tls_fingerprint, probe_timeout_s)
            if tls_fingerprint
            else None
        )
        return cls(target, identity, run_id, spec_hash=spec_hash, tls=tls, timeout_s=timeout_s)

    @property
    def worker_id(self) -> str:
        return self.identity.worker_id

    # ------------------------------------------------------------------ plumbing

    def sign(self, method: str, request: Message) -> pb.SignedRequest:
        """Envelope for `request` (its header is filled in place)."""
        return sign_request(self.identity, request, run_id=self.run_id, method=method)

    async def call(self, method: str, request: Message, *, timeout_s: float | None = None) -> Message:
        """Sign `request` and send it to unary RPC `method` ("Register", "Heartbeat", ...)."""
        return await self.send(method, self.sign(method, request), timeout_s=timeout_s)

    async def send(self, method: str, signed: pb.SignedRequest, *, timeout_s: float | None = None) -> Message:
        """Send an already built envelope to unary RPC `method` (tests forge envelopes with it)."""
        return await getattr(self._stub, method)(signed, timeout=timeout_s or self.timeout_s)

    async def wait_for_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until the channel is connected; asyncio.TimeoutError after `timeout_s`."""
        await asyncio.wait_for(self._channel.channel_ready(), timeout_s)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> CoordinatorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ RPCs

    async def register(
        self,
        profile: pb.WorkerProfile,
        peer: pb.PeerAddress,
        local: pb.LocalState | None = None,
        *,
        join_token: bytes = b"",
        timeout_s: float | None = None,
    ) -> pb.RegisterResponse:
        """Register (or re-register after NOT_FOUND) and check the returned spec's hash.

        First asks for the admission challenge and, if the run wants one, solves the proof
        of work (`bagel.protocol.pow`) in a thread; a coordinator without the RPC
        (UNIMPLEMENTED) is registered with as before.
        """
        req = pb.RegisterRequest(profile=profile, peer=peer, local=local or pb.LocalState(), join_token=join_token)
        challenge = await self.admission_challenge(timeout_s=timeout_s)
        if challenge is not None and challenge.pow_bits > 0:
            req.pow_challenge = challenge.challenge
            req.pow_nonce = await asyncio.to_thread(
                solve_pow, challenge.challenge, self.run_id, self.identity.public_key, challenge.pow_bits
            )
        resp: pb.RegisterResponse = await self.call("Register", req, timeout_s=timeout_s)  # type: ignore[assignment]
        try:
            actual = spec_source_hash(resp.spec_toml, resp.init_sha256)
        except SpecError as e:
            raise SpecMismatch(f"the coordinator's spec_toml does not parse: {e}") from None
        if actual != resp.spec_hash:
            raise SpecMismatch(f"spec_toml hashes to {actual}, the coordinator says {resp.spec_hash}")
        if self.spec_hash is not None and resp.spec_hash != self.spec_hash:
            raise SpecMismatch(f"coordinator runs spec {resp.spec_hash}, expected {self.spec_hash}")
        return resp

    async def heartbeat(
        self,
        phase: int,
        *,
        cell_id: str = "",
        round: int = 0,
        inner_step: int = 0,
        loss: float = 0.0,
        samples: int = 0,
        local: pb.LocalState | None = None,
        reduce_attempt: int = 0,
        round_attempt: int = 0,
        timeout_s: float | None = None,
    ) -> pb.HeartbeatResponse:
        req = pb.HeartbeatRequest(
            phase=phase,  # type: ignore[arg-type]
            cell_id=cell_id,
            round=round,
            inner_step=inner_step,
            loss=loss,
            samples=samples,
            local=local or pb.LocalState(),
            reduce_attempt=reduce_attempt,
            round_attempt=round_attempt,
        )
        return await self.call("Heartbeat", req, timeout_s=timeout_s)  # type: ignore[return-value]

    async def watch_instruction(
        self, known_tag: int, wait_ms: int, *, timeout_s: float | None = None
    ) -> pb.WatchInstructionResponse:
        """The current instruction once its tag differs from `known_tag`, or after `wait_ms`
        (a long poll; a read). The call's own deadline is the hold plus the usual timeout."""
        req = pb.WatchInstructionRequest(known_tag=known_tag, wait_ms=wait_ms)
        deadline = timeout_s if timeout_s is not None else wait_ms / 1000.0 + self.timeout_s
        return await self.call("WatchInstruction", req, timeout_s=deadline)  # type: ignore[return-value]

    async def report_round(
        self,
        *,
        cell_id: str,
        round: int,
        state_hash: str = "",
        samples: int = 0,
        loss: float = 0.0,
        compute_ms: int = 0,
        comm_ms: int = 0,
        bytes_sent: int = 0,
        bytes_received: int = 0,
        failed: bool = False,
        reason: str = "",
        reduce_attempt: int = 0,
        audit: PartAudit | None = None,
        heldout_loss: float | None = None,
        heldout_loss_base: float | None = None,
        round_metrics: Mapping[str, int] | None = None,
        peer_rates: Sequence[tuple[str, int, int]] = (),
        timeout_s: float | None = None,
    ) -> pb.ReportRoundResponse:
        """`round_metrics`: the report's phase times and memory fields (`data_ms`, ...,
        `rss_bytes`), by field name; `peer_rates`: (sender, bytes, ms) of each contribution
        this worker received as a reducer."""
        req = pb.ReportRoundRequest(
            cell_id=cell_id,
            round=round,
            state_hash=state_hash,
            samples=samples,
            loss=loss,
            compute_ms=compute_ms,
            comm_ms=comm_ms,
            bytes_sent=bytes_sent,
            bytes_received=bytes_received,
            failed=failed,
            reason=reason,
            reduce_attempt=reduce_attempt,
        )
        if audit is not None:
            req.audit.CopyFrom(audit_to_pb(audit))
        if heldout_loss is not None:  # optional fields: unset means "not measured"
            req.heldout_loss = heldout_loss
        if heldout_loss_base is not None:
            req.heldout_loss_base = heldout_loss_base
        for name, value in (round_metrics or {}).items():
            setattr(req, name, int(value))
        for worker_id, nbytes, ms in peer_rates:
            req.peer_rates.add(worker_id=worker_id, nbytes=int(nbytes), ms=int(ms))
        return await self.call("ReportRound", req, timeout_s=timeout_s)  # type: ignore[return-value]

    async def accuse(self, evidence: pb.EvidenceRequest, *, timeout_s: float | None = None) -> pb.AccuseResponse:
        """Send evidence that another reducer lied (built by the data plane); the coordinator
        re-runs the reduction and answers who was convicted, or a status saying why nobody."""
        return await self.call("Accuse", evidence, timeout_s=timeout_s)  # type: ignore[return-value]

    async def leave(
        self, reason: str = "", *, offer_checkpoint: bool = False, timeout_s: float | None = None
    ) -> pb.LeaveResponse:
        """Leave; with offer_checkpoint the answer may be `upload_first` instead (see the proto)."""
        req = pb.LeaveRequest(reason=reason, offer_checkpoint=offer_checkpoint)
        return await self.call("Leave", req, timeout_s=timeout_s)  # type: ignore[return-value]

    async def admission_challenge(self, *, timeout_s: float | None = None) -> pb.AdmissionChallengeResponse | None:
        """What a Register must carry (None: the coordinator predates the RPC)."""
        try:
            resp: pb.AdmissionChallengeResponse = await self._stub.AdmissionChallenge(
                pb.AdmissionChallengeRequest(), timeout=timeout_s or self.timeout_s
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return None
            raise
        if resp.run_id != self.run_id:
            raise AdmissionError(f"the coordinator runs {resp.run_id[:80]!r}, not {self.run_id!r}")
        if not 0 <= resp.pow_bits <= MAX_POW_BITS:
            raise AdmissionError(
                f"the coordinator asks for a {resp.pow_bits}-bit proof of work (at most {MAX_POW_BITS})"
            )
        return resp

    async def status(self, *, signed: bool = True, timeout_s: float | None = None) -> pb.StatusResponse:
        """The read-only run view. Signed (the default), an active worker or the operator
        sees every worker; unsigned, the aggregate view."""
        req = pb.GetStatusRequest()
        if signed:
            req.auth.CopyFrom(self.sign("GetStatus", pb.StatusAuthRequest()))
        return await self._stub.GetStatus(req, timeout=timeout_s or self.timeout_s)

    async def upload_checkpoint(
        self,
        cell_id: str,
        round: int,
        state_hash: str,
        data: bytes | str | Path,
        *,
        chunk_bytes: int = CHECKPOINT_CHUNK_BYTES,
        timeout_s: float | None = None,
        pace: Callable[[int], Awaitable[None]] | None = None,
    ) -> pb.UploadCheckpointResponse:
        """Stream a safetensors file (bytes or a path) as a signed header then data chunks.

        A file is read twice (sha256 first, then streamed) so memory stays at one chunk.
        `pace(n)` is awaited before each chunk of n bytes leaves (the worker's upload cap).
        """
        if not 0 < chunk_bytes <= MAX_MESSAGE_BYTES - 4096:
            raise ValueError(f"chunk_bytes must be in (0, {MAX_MESSAGE_BYTES - 4096}]")
        if isinstance(data, (bytes, bytearray, memoryview)):
            blob = bytes(data)
            total, digest = len(blob), hashlib.sha256(blob).hexdigest()
            path = None
        else:
            path, blob = Path(data), None
            total, digest = await asyncio.to_thread(_file_sha256, path)
        header = pb.UploadCheckpointHeader(
            cell_id=cell_id, round=round, state_hash=state_hash, total_bytes=total, sha256=digest
        )
        signed = self.sign("UploadCheckpoint", header)

        async def chunks() -> AsyncIterator[pb.CheckpointUploadChunk]:
            yield pb.CheckpointUploadChunk(header=signed)
            if blob is not None:
                for off in range(0, total, chunk_bytes):
                    if pace is not None:
                        await pace(min(chunk_bytes, total - off))
                    yield pb.CheckpointUploadChunk(data=blob[off : off + chunk_bytes])
            else:
                assert path is not None
                with path.open("rb") as f:
                    sent = 0
                    while sent < total:
                        piece = f.read(min(chunk_bytes, total - sent))
                        if not piece:
                            raise CheckpointIntegrityError(f"{path} shrank while uploading")
                        sent += len(piece)
                        if pace is not None:
                            await pace(len(piece))
                        yield pb.CheckpointUploadChunk(data=piece)

        timeout = timeout_s or max(self.timeout_s, 60.0)
        return await self._stub.UploadCheckpoint(chunks(), timeout=timeout)

    async def download_checkpoint(
        self,
        cell_id: str,
        round: int = 0,
        *,
        max_bytes: int = DEFAULT_MAX_CHECKPOINT_BYTES,
        timeout_s: float | None = None,
    ) -> tuple[pb.CheckpointInfo, bytes]:
        """Download a checkpoint (round 0 = the latest); checks size and sha256 while streaming."""
        signed = self.sign("DownloadCheckpoint", pb.DownloadCheckpointRequest(cell_id=cell_id, round=round))
        timeout = timeout_s or max(self.timeout_s, 60.0)
        call = self._stub.DownloadCheckpoint(signed, timeout=timeout)
        info: pb.CheckpointInfo | None = None
        buf = bytearray()
        hasher = hashlib.sha256()
        try:
            async for chunk in call:
                kind = chunk.WhichOneof("kind")
                if info is None:
                    if kind != "info":
                        raise CheckpointIntegrityError("the first chunk must carry the checkpoint info")
                    info = chunk.info
                    if info.cell_id != cell_id or (round and info.round != round):
                        raise CheckpointIntegrityError(
                            f"asked for {cell_id}@{round or 'latest'}, got {info.cell_id}@{info.round}"
                        )
                    if not 0 <= info.total_bytes <= max_bytes:
                        raise CheckpointIntegrityError(f"checkpoint of {info.total_bytes} bytes exceeds {max_bytes}")
                    continue
                if kind != "data":
                    raise CheckpointIntegrityError("checkpoint info sent twice")
                if len(buf) + len(chunk.data) > info.total_bytes:
                    raise CheckpointIntegrityError(f"more data than the announced {info.total_bytes} bytes")
                buf += chunk.data
                hasher.update(chunk.data)
        except CheckpointIntegrityError:
            call.cancel()
            raise
        if info is None:
            raise CheckpointIntegrityError("empty checkpoint stream")
        if len(buf) != info.total_bytes:
            raise CheckpointIntegrityError(f"got {len(buf)} bytes, expected {info.total_bytes}")
        if hasher.hexdigest() != info.sha256:
            raise CheckpointIntegrityError("sha256 of the downloaded bytes does not match the checkpoint info")
        return info, bytes(buf)

    async def get_data_manifest(
        self, cell_id: str, *, partition_only: bool = False, timeout_s: float | None = None
    ) -> pb.DataManifest:
        """The data shards `cell_id` needs (for a worker without a local copy of the dataset);
        with `partition_only`, only the sha256 of the coordinator's cluster manifest."""
        req = pb.DataManifestRequest(cell_id=cell_id, partition_only=partition_only)
        resp = await self.call("GetDataManifest", req, timeout_s=timeout_s)
        assert isinstance(resp, pb.DataManifest)
        return resp

    def fetch_data_shard(self, sha256: str, offset: int = 0, *, timeout_s: float) -> Any:
        """The stream of a data shard's bytes from `offset` on (`DataShardChunk`s, a grpc.aio
        call: iterate it, `cancel()` it); the caller checks offsets, size and sha256."""
        signed = self.sign("FetchDataShard", pb.FetchDataShardRequest(sha256=sha256, offset=offset))
        return self._stub.FetchDataShard(signed, timeout=timeout_s)


def _file_sha256(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with path.open("rb") as f:
        while piece := f.read(1 << 20):
            h.update(piece)
            size += len(piece)
    return size, h.hexdigest()


# ---------------------------------------------------------------------------- retries


def backoff_delay_s(
    attempt: int, *, base_s: float = 0.2, max_s: float = 10.0, rng: random.Random | None = None
) -> float:
    """Full-jitter delay before retry `attempt` (0-based): uniform(0, min(max_s, base_s * 2^attempt))."""
    cap = min(max_s, base_s * (2.0 ** min(attempt, 62)))
    return (rng or random).uniform(0.0, cap)


def is_retryable(error: BaseException) -> bool:
    """UNAVAILABLE (coordinator down/restarting) and DEADLINE_EXCEEDED are worth retrying."""
    return isinstance(error, grpc.aio.AioRpcError) and error.code() in RETRYABLE


async def with_retries(
    fn: Callable[[], Awaitable[T]],
    *,
    max_attempts: int | None = None,
    deadline_s: float | None = None,
    base_s: float = 0.2,
    max_s: float = 10.0,
    retry_if: Callable[[BaseException], bool] = is_retryable,
    rng: random.Random | None = None,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> T:
    """Call `fn()` until it succeeds or fails with a non-retryable error.

    `fn` must build a fresh request each time (client methods do: they re-sign). Gives up
    after `max_attempts` calls or once `deadline_s` seconds have passed, re-raising the
    last error; None means no limit (a worker waiting out a coordinator restart).
    """
    start = time.monotonic()
    attempt = 0
    while True:
        try:
            return await fn()
        except Exception as e:
            attempt += 1
            if not retry_if(e):
                raise
            if max_attempts is not None and attempt >= max_attempts:
                raise
            delay = backoff_delay_s(attempt - 1, base_s=base_s, max_s=max_s, rng=rng)
            if deadline_s is not None and time.monotonic() + delay - start > deadline_s:
                raise
            logger.info(
                "coordinator call failed (%s); retry %d in %.2fs", e.code() if hasattr(e, "code") else e, attempt, delay
            )
            await sleep(delay)
