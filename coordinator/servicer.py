"""The gRPC servicer: protobuf requests in, core events to `CoordinatorApp`, protobuf replies out.

No decisions are made here: each method verifies through the app, translates the payload
into a core event (`bagel.coordinator.translate`), applies it and translates the outcome
back. Checkpoint uploads and downloads stream through the app's checkpoint store.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from bagel.coordinator import translate as wire
from bagel.coordinator.app import CoordinatorApp
from bagel.coordinator.core.events import CheckpointStored
from bagel.coordinator.interceptor import PermissionedNotSupported, UploadProtocolError
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import bagel_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


# Refusing an upload before the client has finished sending: grpc.aio clients (grpcio
# <= 1.85) then report INTERNAL "Failed execute_batch" instead of our status whenever one
# of their writes fails after the status arrived (grpc/grpc#36066; fix proposed in
# grpc/grpc#43486). So a refused upload first reads and drops what the client is still
# sending, bounded in bytes and time so that a hostile stream cannot hold the handler.
_DRAIN_MAX_BYTES = 8 << 20
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

    def __init__(self, app: CoordinatorApp) -> None:
        self.app = app

    async def Register(self, request: pb.SignedRequest, context: grpc.aio.ServicerContext) -> pb.RegisterResponse:
        app = self.app
        v = app.verify(request, "Register")
        if app.spec.security.mode == "permissioned":
            # The join-token format is not defined by the protocol layer yet.
            raise PermissionedNotSupported("permissioned runs (join tokens) are not supported by this coordinator")
        out = await app.apply(wire.register_event(v.worker_id, v.message))
        return pb.RegisterResponse(
            worker_id=v.worker_id,
            lease_expires_unix_ms=out.lease_expires_ms or 0,
            heartbeat_interval_ms=app.heartbeat_interval_ms,
            spec_toml=app.spec.source,
            spec_hash=app.spec.spec_hash,
            instruction=wire.instruction_to_pb(out.instruction),
        )

    async def Heartbeat(self, request: pb.SignedRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        v = self.app.verify(request, "Heartbeat")
        out = await self.app.apply(wire.heartbeat_event(v.worker_id, v.message))
        return pb.HeartbeatResponse(
            lease_expires_unix_ms=out.lease_expires_ms or 0, instruction=wire.instruction_to_pb(out.instruction)
        )

    async def ReportRound(self, request: pb.SignedRequest, context: grpc.aio.ServicerContext) -> pb.ReportRoundResponse:
        v = self.app.verify(request, "ReportRound")
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

    async def GetStatus(self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        return self.app.status()

    async def UploadCheckpoint(
        self, request_iterator: AsyncIterator[pb.CheckpointUploadChunk], context: grpc.aio.ServicerContext
    ) -> pb.UploadCheckpointResponse:
        chunks = request_iterator.__aiter__()
        try:
            return await self._upload(chunks)
        except Exception:
            await _drain(chunks)
            raise

    async def _upload(self, chunks: AsyncIterator[pb.CheckpointUploadChunk]) -> pb.UploadCheckpointResponse:
        app = self.app
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            raise UploadProtocolError("empty upload: the first chunk must carry the signed header") from None
        if first.WhichOneof("kind") != "header":
            raise UploadProtocolError("the first chunk must carry the signed header")
        v = app.verify(first.header, "UploadCheckpoint")
        h: pb.UploadCheckpointHeader = v.message
        if not app.state.check_upload(v.worker_id, h.cell_id, h.round, h.state_hash):
            await _drain(chunks)  # a checkpoint of this round is stored already
            return pb.UploadCheckpointResponse(stored=False, round=h.round)
        upload = app.checkpoints.begin_upload(h.cell_id, h.round, h.state_hash, h.total_bytes, h.sha256, v.worker_id)
        try:
            async for chunk in chunks:
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
