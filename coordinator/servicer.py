"""The gRPC servicer: protobuf requests in, core events to `CoordinatorApp`, protobuf replies out.

No decisions are made here: each method verifies through the app, translates the payload
into a core event (`bagel.coordinator.translate`), applies it and translates the outcome
back. Checkpoint uploads and downloads stream through the app's checkpoint store.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from bagel.coordinator import sizing
from bagel.coordinator import translate as wire
from bagel.coordinator.admission import ShardStreamExpired, UploadIdle, client_address
from bagel.coordinator.app import CoordinatorApp
from bagel.coordinator.checkpoints import CheckpointTooLarge
from bagel.coordinator.core.errors import CoordinatorError
from bagel.coordinator.core.events import CheckpointStored
from bagel.coordinator.datashards import DataShardStore, DataUnavailable
from bagel.coordinator.interceptor import UploadProtocolError
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import bagel_pb2_grpc as pb_grpc
from bagel.protocol.jointoken import verify_token

log = logging.getLogger(__name__)


# Refusing an upload before the client has finished sending: grpc.aio clients (grpcio
# <= 1.85) then report INTERNAL "Failed execute_batch" instead of our status whenever one
# of their writes fails after the status arrived (grpc/grpc#36066; fix proposed in
# grpc/grpc#43486). So a refused upload first reads and drops what the client is still
# sending, bounded in bytes and time so that a hostile stream cannot hold the handler.
_DRAIN_MAX_BYTES = 8 << 20
# a data-shard stream's deadline: this slack plus its bytes at this rate (a worker resumes after)
SHARD_STREAM_SLACK_S = 30.0
SHARD_STREAM_MIN_RATE = 32 << 10
_DRAIN_MAX_S = 2.0


async def _drain(chunks: AsyncIterator[pb.CheckpointUploadChunk]) -> None:
    async def read() -> None:
        seen = 0
        async for chunk in chunks:
            seen += chunk.ByteSize()
            if seen > _DRAIN_MAX_BYTES:
                return

    try:
        await asyncio.wait_for(read(), _DRAIN_MAX_S)
    except Exception:  # the stream broke or timed out: refuse anyway
        pass


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Translates protobuf <-> core events; no decisions are made here."""

    def __init__(self, app: CoordinatorApp, datashards: DataShardStore | None = None) -> None:
        self.app = app
        self._checkpoint_bounds: dict[str, int] = {}
        self.datashards = datashards  # None: this coordinator serves no data

    async def AdmissionChallenge(
        self, request: pb.AdmissionChallengeRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdmissionChallengeResponse:
        app = self.app
        challenge, expires_ms = app.admission.challenge(app.clock())
        return pb.AdmissionChallengeResponse(
            run_id=app.spec.run.id,
            challenge=challenge,
            pow_bits=app.admission.pow_bits,
            expires_unix_ms=expires_ms,
            token_required=app.spec.security.mode == "permissioned",
        )

    async def Register(self, request: pb.SignedRequest, context: grpc.aio.ServicerContext) -> pb.RegisterResponse:
        app = self.app
        app.admission.limit_register(client_address(context.peer() or ""), time.monotonic())
        v = app.verify(request, "Register")
        msg: pb.RegisterRequest = v.message
        app.admission.check_pow(msg.pow_challenge, msg.pow_nonce, v.public_key, app.clock())
        undo: tuple[str, int, str] | None = None
        if app.spec.security.mode == "permissioned":
            claims = verify_token(msg.join_token, app.operator_key, app.spec.run.id, app.clock())
            # a use is counted when the worker joins (new, or back after a Leave), not when a
            # joined worker registers again (the agent's second Register, or after its lease ran out)
            store = app.writer.store
            consume = not app.is_joined(v.worker_id)
            used, bound = await app.writer.run(store.use_token, claims.token_id, v.public_key.hex(), consume)
            undo = (claims.token_id, used, bound)
        try:
            out = await app.apply(wire.register_event(v.worker_id, v.message))
        except CoordinatorError:  # refused by the core (full, banned): the token use is given back
            if undo is not None:
                await app.writer.run(app.writer.store.restore_token, *undo)
            raise
        p = msg.profile
        log.info(
            "worker %s (%s) registered: %s, %s",
            v.worker_id[:12],
            p.name[:40] or "?",
            pb.PeerReachability.Name(p.reachability).removeprefix("PEER_REACHABILITY_").lower(),
            p.reachability_detail[:160] or "reachability not reported",
        )
        return pb.RegisterResponse(
            worker_id=v.worker_id,
            lease_expires_unix_ms=out.lease_expires_ms or 0,
            heartbeat_interval_ms=app.heartbeat_interval_ms,
            spec_toml=app.spec.source,
            spec_hash=app.spec.spec_hash,
            instruction=wire.instruction_to_pb(out.instruction),
            init_sha256=app.spec.init_sha256,
        )

    async def Heartbeat(self, request: pb.SignedRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        v = self.app.verify(request, "Heartbeat")
        out = await self.app.apply(wire.heartbeat_event(v.worker_id, v.message))
        return pb.HeartbeatResponse(
            lease_expires_unix_ms=out.lease_expires_ms or 0, instruction=wire.instruction_to_pb(out.instruction)
        )

    async def WatchInstruction(
        self, request: pb.SignedRequest, context: grpc.aio.ServicerContext
    ) -> pb.WatchInstructionResponse:
        v = self.app.verify(request, "WatchInstruction")
        msg: pb.WatchInstructionRequest = v.message
        ins, changed = await self.app.watch(v.worker_id, msg.known_tag, msg.wait_ms)
        return pb.WatchInstructionResponse(instruction=ins, changed=changed)

    async def ReportRound(self, request: pb.SignedRequest, context: grpc.aio.ServicerContext) -> pb.ReportRoundResponse:
        v = self.app.verify(request, "ReportRound")
        self.app.observe_report(v.worker_id, v.message)
        out = await self.app.apply(wire.report_event(v.worker_id, v.message))
        return pb.ReportRoundResponse(
            verdict=wire.verdict_to_pb(out.verdict),  # type: ignore[arg-type]
            instruction=wire.instruction_to_pb(out.instruction),
        )

    async def Leave(self, request: pb.SignedRequest, context: grpc.aio.ServicerContext) -> pb.LeaveResponse:
        v = self.app.verify(request, "Leave")
        out = await self.app.apply(wire.leave_event(v.worker_id, v.message))
        if out.instruction is not None:  # the last holder: upload first
            return pb.LeaveResponse(upload_first=True, instruction=wire.instruction_to_pb(out.instruction))
        return pb.LeaveResponse()

    async def Accuse(self, request: pb.SignedRequest, context: grpc.aio.ServicerContext) -> pb.AccuseResponse:
        v = self.app.verify(request, "Accuse")
        conviction = await self.app.accuse(v.worker_id, v.message)
        return pb.AccuseResponse(convicted=conviction.worker_id, reason=conviction.reason)

    async def GetStatus(self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext) -> bytes:
        """Cached and rate-limited; worker details only for a signed request by the
        coordinator's or the operator's key or an active worker, else the aggregate view.
        Answers the cached serialized StatusResponse (the interceptor passes bytes through)."""
        app = self.app
        if not request.HasField("auth"):  # unsigned: the per-address public bucket
            app.admission.limit_public(client_address(context.peer() or ""), time.monotonic())
            return app.status_view(False)
        v = app.verifier.verify(request.auth, "GetStatus", app.clock())
        now_s = time.monotonic()
        app.admission.limit_key(v.worker_id, now_s)  # signed: its key's bucket
        if v.public_key in app.status_keys:
            return app.status_view(True)
        if app.is_active(v.worker_id):
            app.admission.limit_detailed(now_s)
            return app.status_view(True)
        return app.status_view(False)

    async def UploadCheckpoint(
        self, request_iterator: AsyncIterator[pb.CheckpointUploadChunk], context: grpc.aio.ServicerContext
    ) -> pb.UploadCheckpointResponse:
        chunks = request_iterator.__aiter__()
        try:
            return await self._upload(chunks)
        except UploadIdle:
            raise  # the client sends nothing: nothing to drain
        except Exception:
            await _drain(chunks)
            raise

    async def _next(self, chunks: AsyncIterator[pb.CheckpointUploadChunk]) -> pb.CheckpointUploadChunk:
        """The next chunk within the idle deadline (UploadIdle: DEADLINE_EXCEEDED)."""
        idle_s = self.app.admission.upload_idle_s
        try:
            return await asyncio.wait_for(chunks.__anext__(), idle_s)
        except TimeoutError:
            raise UploadIdle(f"upload sent nothing for {idle_s:g} s: closed") from None

    async def _checkpoint_bound(self, cell_id: str) -> int:
        bound = self._checkpoint_bounds.get(cell_id)
        if bound is None:
            bound = await asyncio.to_thread(sizing.checkpoint_bytes_bound, self.app.spec, cell_id)
            self._checkpoint_bounds[cell_id] = bound
        return bound

    async def _upload(self, chunks: AsyncIterator[pb.CheckpointUploadChunk]) -> pb.UploadCheckpointResponse:
        app = self.app
        try:
            first = await self._next(chunks)
        except StopAsyncIteration:
            raise UploadProtocolError("empty upload: the first chunk must carry the signed header") from None
        if first.WhichOneof("kind") != "header":
            raise UploadProtocolError("the first chunk must carry the signed header")
        v = app.verify(first.header, "UploadCheckpoint")
        h: pb.UploadCheckpointHeader = v.message
        if not app.state.check_upload(v.worker_id, h.cell_id, h.round, h.state_hash):
            await _drain(chunks)  # a checkpoint of this round is stored already
            return pb.UploadCheckpointResponse(stored=False, round=h.round)
        bound = await self._checkpoint_bound(h.cell_id)
        if h.total_bytes > bound:
            raise CheckpointTooLarge(
                f"a checkpoint of {h.cell_id} takes at most {bound} bytes; {h.total_bytes} declared"
            )
        with app.admission.upload_slot(v.worker_id):
            upload = app.checkpoints.begin_upload(
                h.cell_id, h.round, h.state_hash, h.total_bytes, h.sha256, v.worker_id
            )
            try:
                while True:
                    try:
                        chunk = await self._next(chunks)
                    except StopAsyncIteration:
                        break
                    if chunk.WhichOneof("kind") != "data":
                        raise UploadProtocolError("only the first chunk may carry a header")
                    upload.write(chunk.data)
                await asyncio.to_thread(upload.verify)
                # the index lives in SQLite: publish on the store's thread, in order with writes
                await app.writer.run(upload.publish, app.clock())
            except BaseException:
                upload.abort()
                raise
        await app.apply(CheckpointStored(cell_id=h.cell_id, round=h.round, state_hash=h.state_hash))
        return pb.UploadCheckpointResponse(stored=True, round=h.round)

    async def DownloadCheckpoint(
        self, request: pb.SignedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.CheckpointDownloadChunk]:
        app = self.app
        v = app.verify(request, "DownloadCheckpoint")
        req: pb.DownloadCheckpointRequest = v.message
        app.state.instruction_for(v.worker_id, app.clock())  # registered workers only (else NOT_FOUND)
        meta = app.checkpoints.get(req.cell_id, req.round)
        with app.admission.download_slot():
            yield pb.CheckpointDownloadChunk(
                info=pb.CheckpointInfo(
                    cell_id=meta.cell_id,
                    round=meta.round,
                    state_hash=meta.state_hash,
                    total_bytes=meta.total_bytes,
                    sha256=meta.sha256,
                )
            )
            gen = app.checkpoints.iter_chunks(meta)
            while (chunk := await asyncio.to_thread(next, gen, None)) is not None:
                yield pb.CheckpointDownloadChunk(data=chunk)

    # ------------------------------------------------------------------ data shards

    def _shards(self) -> DataShardStore:
        if self.datashards is None:
            raise DataUnavailable("this coordinator serves no data shards: every worker needs its own copy")
        return self.datashards

    async def GetDataManifest(self, request: pb.SignedRequest, context: grpc.aio.ServicerContext) -> pb.DataManifest:
        app = self.app
        v = app.verify(request, "GetDataManifest")
        app.state.instruction_for(v.worker_id, app.clock())  # registered workers only (else NOT_FOUND)
        req: pb.DataManifestRequest = v.message
        if req.partition_only:
            return await self._shards().partition(req.cell_id)
        return await self._shards().manifest(req.cell_id)

    async def FetchDataShard(
        self, request: pb.SignedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DataShardChunk]:
        app = self.app
        v = app.verify(request, "FetchDataShard")
        req: pb.FetchDataShardRequest = v.message
        app.state.instruction_for(v.worker_id, app.clock())
        store = self._shards()
        ref = await store.lookup(req.sha256, req.offset)
        # a deadline from the size: past it the slot is given back even while a client that
        # stopped reading holds the stream, and the stream ends at its next chunk
        limit_s = SHARD_STREAM_SLACK_S + (ref.nbytes - req.offset) / SHARD_STREAM_MIN_RATE
        deadline = time.monotonic() + limit_s
        admission = app.admission
        slot = admission.take_shard_slot(v.worker_id)
        timer = asyncio.get_running_loop().call_later(limit_s, admission.release_shard_slot, v.worker_id, slot)
        try:
            gen = store.read(ref, req.offset)
            offset = req.offset
            while (chunk := await asyncio.to_thread(next, gen, None)) is not None:
                if time.monotonic() > deadline:
                    raise ShardStreamExpired(f"shard stream past its {limit_s:.0f} s deadline: resume from {offset}")
                yield pb.DataShardChunk(offset=offset, data=chunk, total_bytes=ref.nbytes)
                offset += len(chunk)
        finally:
            timer.cancel()
            admission.release_shard_slot(v.worker_id, slot)
