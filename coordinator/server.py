"""The coordinator's grpc.aio shell: verify, validate, translate, apply, persist, reply.

Every worker request takes the same path (design sections 3, 8, 10):

1. `ErrorInterceptor` (the ONE place where exceptions become gRPC statuses) parses the
   raw request bytes itself, so even an unparseable message gets INVALID_ARGUMENT;
2. `CoordinatorCore.verify`: the signed envelope (`bagel.protocol.envelope.Verifier`,
   time from the shell's clock), then every field (`bagel.protocol.validation`);
3. the servicer translates the payload into a core event (`bagel.coordinator.translate`);
4. `CoordinatorCore.apply`: `CoordinatorState.apply(now_ms, event)` on the event loop
   (the pure core is not thread-safe and needs no lock there), then `outcome.effects`
   go to SQLite in one transaction on the writer thread (`bagel.coordinator.writer`,
   group commit); the reply waits until they, and every earlier batch, are durable. A
   heartbeat that changed nothing durable writes nothing and waits only if its answer
   would reveal a cell change still being written: that is the hot path.
5. the outcome is translated back.

An event the core refuses raises a typed error before it mutates anything, so a
rejected message never changes state. If SQLite itself fails, memory and disk may
disagree: the shell stops taking requests (UNAVAILABLE) and asks the daemon to shut
down, so a restart reloads the durable truth (`CoordinatorCore.fatal`).

Why an interceptor rather than a decorator: grpc.aio's `ServerInterceptor` only sees the
handler *lookup*, not its exceptions, but it may return a different handler; ours wraps
each Coordinator method's behaviour (text-generation-inference's interceptor does the
same), so no handler can forget the mapping.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from bagel.coordinator import translate as wire
from bagel.coordinator.checkpoints import (
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointRejected,
    CheckpointStore,
    CheckpointTooLarge,
)
from bagel.coordinator.core.errors import CoordinatorError, grpc_status_name
from bagel.coordinator.core.events import CheckpointStored, Event, Heartbeat, Outcome, Tick
from bagel.coordinator.core.records import (
    CellRecord,
    CommitRecord,
    Record,
    RoundRecord,
    WorkerRecord,
    WorkerState,
)
from bagel.coordinator.core.state import CoordinatorState
from bagel.coordinator.metrics import Metrics
from bagel.coordinator.writer import AsyncWriter
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import bagel_pb2_grpc as pb_grpc
from bagel.protocol.envelope import EnvelopeError, Verified, Verifier, wall_clock_ms
from bagel.protocol.runspec import RunSpec, parse_cell
from bagel.protocol.validation import ValidationError, validate

log = logging.getLogger(__name__)

SERVICE_NAME = "bagel.v1.Coordinator"
_METHOD_PREFIX = f"/{SERVICE_NAME}/"


# ---------------------------------------------------------------------------- shell errors


class ShellError(Exception):
    """An error raised by the shell itself; `status` is its gRPC code."""

    status = grpc.StatusCode.INTERNAL
    reason = "shell"


class MalformedMessage(ShellError):
    status = grpc.StatusCode.INVALID_ARGUMENT
    reason = "malformed_message"


class UploadProtocolError(ShellError):
    status = grpc.StatusCode.INVALID_ARGUMENT
    reason = "upload_protocol"


class NotAccepting(ShellError):
    """Shutting down, or stopped after a store failure: try again (another coordinator)."""

    status = grpc.StatusCode.UNAVAILABLE
    reason = "unavailable"


class PermissionedNotSupported(ShellError):
    status = grpc.StatusCode.UNIMPLEMENTED
    reason = "permissioned_unsupported"


_CHECKPOINT_STATUS: dict[type, tuple[grpc.StatusCode, str]] = {
    CheckpointTooLarge: (grpc.StatusCode.RESOURCE_EXHAUSTED, "checkpoint_too_large"),
    CheckpointRejected: (grpc.StatusCode.INVALID_ARGUMENT, "checkpoint_rejected"),
    CheckpointNotFound: (grpc.StatusCode.NOT_FOUND, "checkpoint_not_found"),
    CheckpointCorrupt: (grpc.StatusCode.DATA_LOSS, "checkpoint_corrupt"),
}


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in name).lstrip("_")


def classify(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """(status, metric reason, details) for an exception raised while serving a request."""
    if isinstance(exc, ValidationError):
        top = exc.field.split(".", 1)[0].split("[", 1)[0]  # bounded label: the top-level field
        return grpc.StatusCode.INVALID_ARGUMENT, f"invalid_{top}", str(exc)
    if isinstance(exc, EnvelopeError):
        return exc.status, _snake(type(exc).__name__), str(exc)
    if isinstance(exc, CoordinatorError):
        return grpc.StatusCode[grpc_status_name(exc)], _snake(type(exc).__name__), str(exc) or type(exc).__name__
    if isinstance(exc, ShellError):
        return exc.status, exc.reason, str(exc)
    for cls in type(exc).__mro__:
        if cls in _CHECKPOINT_STATUS:
            code, reason = _CHECKPOINT_STATUS[cls]
            return code, reason, str(exc)
    return grpc.StatusCode.INTERNAL, "internal", f"internal error ({type(exc).__name__}); see the coordinator log"


# ---------------------------------------------------------------------------- interceptor


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every Coordinator handler: request parsing, exception -> status, metrics.

    The wrapped handler receives raw bytes (no request deserializer), parses them itself
    and turns a DecodeError into INVALID_ARGUMENT (gRPC would answer INTERNAL). Any
    other unexpected exception becomes INTERNAL with the traceback logged; the daemon
    keeps serving. Health and reflection handlers pass through untouched.
    """

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._cache: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        full = handler_call_details.method
        cached = self._cache.get(full)
        if cached is not None:
            return cached
        handler = await continuation(handler_call_details)
        if handler is None or not full.startswith(_METHOD_PREFIX):
            return handler
        wrapped = self._wrap(full[len(_METHOD_PREFIX) :], handler)
        self._cache[full] = wrapped
        return wrapped

    async def _fail(self, method: str, exc: BaseException, context: grpc.aio.ServicerContext) -> None:
        code, reason, details = classify(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.error("%s failed:\n%s", method, "".join(traceback.format_exception(exc)))
        self._metrics.reject(reason)
        await context.abort(code, details[:1000])

    def _wrap(self, method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        deserialize = handler.request_deserializer
        if deserialize is None:  # every generated Coordinator handler has one: nothing to parse
            return handler
        metrics = self._metrics
        fail = self._fail

        def parse(raw: bytes) -> Message:
            try:
                return deserialize(raw)
            except DecodeError as e:
                raise MalformedMessage(f"request does not parse: {e}") from None

        async def parse_stream(raw_iter: AsyncIterator[bytes]) -> AsyncIterator[Message]:
            async for raw in raw_iter:
                yield parse(raw)

        # grpc's stubs type a handler's behaviours as sync (grpc.ServicerContext, Iterator);
        # under grpc.aio they are coroutine functions of a grpc.aio.ServicerContext.
        if handler.unary_unary is not None:
            inner_uu: Any = handler.unary_unary

            async def unary_unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                t0 = time.perf_counter()
                code = "OK"
                try:
                    return await inner_uu(parse(raw), context)
                except grpc.aio.AbortError:
                    code = "ABORTED_BY_HANDLER"
                    raise
                except Exception as e:
                    code = classify(e)[0].name
                    await fail(method, e, context)
                finally:
                    metrics.observe_rpc(method, time.perf_counter() - t0, code)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, request_deserializer=None, response_serializer=handler.response_serializer
            )
        if handler.unary_stream is not None:
            inner_us: Any = handler.unary_stream

            async def unary_stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                t0 = time.perf_counter()
                code = "OK"
                try:
                    async for item in inner_us(parse(raw), context):
                        yield item
                except grpc.aio.AbortError:
                    raise
                except Exception as e:
                    code = classify(e)[0].name
                    await fail(method, e, context)
                finally:
                    metrics.observe_rpc(method, time.perf_counter() - t0, code)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, request_deserializer=None, response_serializer=handler.response_serializer
            )
        if handler.stream_unary is not None:
            inner_su: Any = handler.stream_unary

            async def stream_unary(raw_iter: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
                t0 = time.perf_counter()
                code = "OK"
                try:
                    return await inner_su(parse_stream(raw_iter), context)
                except grpc.aio.AbortError:
                    raise
                except Exception as e:
                    code = classify(e)[0].name
                    await fail(method, e, context)
                finally:
                    metrics.observe_rpc(method, time.perf_counter() - t0, code)

            return grpc.stream_unary_rpc_method_handler(
                stream_unary, request_deserializer=None, response_serializer=handler.response_serializer
            )
        return handler  # no stream-stream methods in the Coordinator service


# ---------------------------------------------------------------------------- the core shell


class WorkerTally:
    """Workers by state, and standby (active without a cell), for the `bagel_workers` gauge.

    Kept up to date from the WorkerRecords in each outcome's effects (every change of a
    worker's state or cell is durable, so it is among them), instead of counting the whole
    fleet: `CoordinatorState.counts()` is O(workers), ~3 ms on the event loop at 10k
    workers, and it ran every second while rounds kept changing worker records.
    """

    def __init__(self, records: Iterable[WorkerRecord] = ()) -> None:
        self._of: dict[str, tuple[str, bool]] = {}  # worker id -> (state, standby)
        self._n: dict[str, int] = {}
        self._standby = 0
        for rec in records:
            self.update(rec)

    def update(self, rec: WorkerRecord) -> None:
        state = rec.state.value
        standby = rec.state is WorkerState.ACTIVE and not rec.cell_id
        old = self._of.get(rec.worker_id)
        if old == (state, standby):
            return
        if old is not None:
            self._n[old[0]] -= 1
            self._standby -= old[1]
        self._of[rec.worker_id] = (state, standby)
        self._n[state] = self._n.get(state, 0) + 1
        self._standby += standby

    def counts(self) -> dict[str, int]:
        """The same figures as `CoordinatorState.counts()` (states with no worker: 0)."""
        return {"standby": self._standby, **{k: v for k, v in self._n.items() if v}}


class CoordinatorCore:
    """Owns the pure state, the verifier, the durable writer and the metrics bookkeeping."""

    def __init__(
        self,
        spec: RunSpec,
        state: CoordinatorState,
        writer: AsyncWriter,
        checkpoints: CheckpointStore,
        metrics: Metrics,
        *,
        clock: Callable[[], int] = wall_clock_ms,
        on_fatal: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.spec = spec
        self.state = state
        self.writer = writer
        self.checkpoints = checkpoints
        self.metrics = metrics
        self.clock = clock
        self.verifier = Verifier(spec.run.id, max_clock_skew_s=spec.security.max_clock_skew_s)
        self.accepting = True
        self.fatal: BaseException | None = None
        self._on_fatal = on_fatal
        self.heartbeat_interval_ms = int(spec.schedule.heartbeat_s * 1000)
        self._counts_dirty = False
        self._cell_writes: dict[str, asyncio.Future[None]] = {}  # latest CellRecord batch per cell
        self.tally = WorkerTally(state.snapshot().workers)
        self._publish_worker_counts()

    # ------------------------------------------------------------------ request path

    def verify(self, signed: pb.SignedRequest, method: str) -> Verified[Any]:
        """Envelope then fields; raises EnvelopeError / ValidationError (no state change,
        except the replay cache remembering a fully valid nonce)."""
        if not self.accepting:
            raise NotAccepting("the coordinator is shutting down")
        verified = self.verifier.verify(signed, method, self.clock())
        validate(method, verified.message, self.spec)
        return verified

    async def apply(self, event: Event) -> Outcome:
        """Apply one event; return once its effects, and whatever its answer reveals, are durable.

        - With effects: await its own batch (FIFO: every earlier batch is durable too).
        - A heartbeat without effects (the hot path) waits only if its instruction names a
          cell whose record change (a commit, a rollback, a checkpoint) is still being
          written: a worker never hears of a commit before it is durable. Other pending
          batches it does not wait for: what else an instruction reveals (a round opened,
          a freeze) is level-triggered and harmless to re-decide after a crash.
        - Any other event without effects waits for every pending batch.
        """
        if not self.accepting:
            raise NotAccepting("the coordinator is shutting down")
        now = self.clock()
        outcome = self.state.apply(now, event)
        try:
            if outcome.effects:
                fut = self.writer.submit(outcome.effects, now)
                self.metrics.store_writes.inc()
                self._observe(outcome.effects)
                for rec in outcome.effects:
                    if isinstance(rec, CellRecord):
                        self._cell_writes[rec.cell_id] = fut
                # shielded: a client that gives up cancels its handler, never the write
                # (or the other handlers waiting for it)
                await asyncio.shield(fut)
            elif isinstance(event, Heartbeat):
                ins = outcome.instruction
                pending = self._cell_writes.get(ins.cell_id) if ins is not None and ins.cell_id else None
                if pending is not None and not pending.done():
                    await asyncio.shield(pending)
            else:
                await self.writer.barrier()
        except Exception as e:
            self._die(e)
            raise NotAccepting("the coordinator's store failed; it is restarting") from e
        return outcome

    def _die(self, exc: BaseException) -> None:
        if self.fatal is None:
            log.critical("store write failed; stopping so a restart reloads the durable state: %r", exc)
            self.fatal = exc
            self.accepting = False
            if self._on_fatal is not None:
                self._on_fatal(exc)

    def _observe(self, effects: tuple[Record, ...]) -> None:
        workers_changed = False
        opened = {(r.cell_id, r.round, r.attempt): r.opened_ms for r in effects if isinstance(r, RoundRecord)}
        for rec in effects:
            if isinstance(rec, WorkerRecord):
                self.tally.update(rec)
                workers_changed = True
            elif isinstance(rec, CommitRecord):
                start = opened.get((rec.cell_id, rec.round, rec.attempt))
                self.metrics.round_committed(
                    rec.cell_id, None if start is None else (rec.committed_ms - start) / 1000.0
                )
        if workers_changed:
            self._counts_dirty = True

    def _publish_worker_counts(self) -> None:
        # from the tick loop, at most once a second (a few gauge updates)
        self._counts_dirty = False
        self.metrics.set_workers(self.tally.counts())

    async def tick(self) -> None:
        """One Tick (leases, deadlines), skipped when the core says nothing is due."""
        if not self.accepting:
            return
        wake = self.state.next_wakeup_ms()
        if wake is not None and wake <= self.clock():
            await self.apply(Tick())

    async def tick_loop(self, period_ms: int) -> None:
        last_counts = 0.0
        loop = asyncio.get_running_loop()
        period_s = period_ms / 1000.0
        while True:
            slept = loop.time()
            await asyncio.sleep(period_s)
            # the timer fires late by as long as the loop was busy or stalled: every request
            # queued behind it waited as long (the operator's view of tail latency)
            self.metrics.loop_lag.observe(max(0.0, loop.time() - slept - period_s))
            self.metrics.flush_gc()
            try:
                if self._counts_dirty and time.monotonic() - last_counts >= 1.0:
                    last_counts = time.monotonic()
                    self._publish_worker_counts()
                await self.tick()
            except NotAccepting:
                return
            except Exception:  # a core bug must not stop the clock of the whole run
                log.exception("tick failed")

    # ------------------------------------------------------------------ status

    def status(self) -> pb.StatusResponse:
        """The operator view, from the core's queries (no transition). O(workers)."""
        st = self.state
        now = self.clock()
        out = pb.StatusResponse(run_id=self.spec.run.id, spec_hash=self.spec.spec_hash, now_unix_ms=now)
        snap = st.snapshot()
        for w in snap.workers:
            ws = out.workers.add(
                worker_id=w.worker_id,
                name=w.profile.name,
                state=w.state.value,
                cell_id=w.cell_id,
                reputation=w.reputation,
                samples_per_s=float(w.throughput.get(w.cell_id, 0.0)) if w.cell_id else 0.0,
                vram_bytes=w.profile.vram_bytes,
                rounds_contributed=w.rounds_contributed,
            )
            if w.state is WorkerState.ACTIVE:
                phase, _round, _step, _loss, lease_ms = st.worker_phase(w.worker_id)
                ws.phase = int(phase)  # type: ignore[assignment]
                ws.lease_expires_unix_ms = lease_ms
        shares, targets = st.shares(), st.targets()
        for cell_id in self.spec.cell_ids:
            rec, rnd, members = st.cell_view(cell_id)
            out.cells.add(
                cell_id=cell_id,
                kind="router" if parse_cell(cell_id) is None else "expert",
                round=rnd.round if rnd else 0,
                round_state=rnd.state.value if rnd else "none",
                committed_round=rec.committed_round,
                committed_hash=rec.committed_hash,
                members=sorted(members),
                target_share=float(targets.get(cell_id, 0.0)),
                actual_share=float(shares.get(cell_id, 0.0)),
                last_loss=rec.last_loss,
                latest_checkpoint_round=rec.checkpoint_round,
                samples_committed=rec.samples_committed,
            )
        return out


# ---------------------------------------------------------------------------- servicer


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

    def __init__(self, core: CoordinatorCore) -> None:
        self.core = core

    async def Register(self, request: pb.SignedRequest, context: grpc.aio.ServicerContext) -> pb.RegisterResponse:
        core = self.core
        v = core.verify(request, "Register")
        if core.spec.security.mode == "permissioned":
            # The join-token format is not defined by the protocol layer yet.
            raise PermissionedNotSupported("permissioned runs (join tokens) are not supported by this coordinator")
        out = await core.apply(wire.register_event(v.worker_id, v.message))
        return pb.RegisterResponse(
            worker_id=v.worker_id,
            lease_expires_unix_ms=out.lease_expires_ms or 0,
            heartbeat_interval_ms=core.heartbeat_interval_ms,
            spec_toml=core.spec.source,
            spec_hash=core.spec.spec_hash,
            instruction=wire.instruction_to_pb(out.instruction),
        )

    async def Heartbeat(self, request: pb.SignedRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        v = self.core.verify(request, "Heartbeat")
        out = await self.core.apply(wire.heartbeat_event(v.worker_id, v.message))
        return pb.HeartbeatResponse(
            lease_expires_unix_ms=out.lease_expires_ms or 0, instruction=wire.instruction_to_pb(out.instruction)
        )

    async def ReportRound(self, request: pb.SignedRequest, context: grpc.aio.ServicerContext) -> pb.ReportRoundResponse:
        v = self.core.verify(request, "ReportRound")
        out = await self.core.apply(wire.report_event(v.worker_id, v.message))
        return pb.ReportRoundResponse(
            verdict=wire.verdict_to_pb(out.verdict),  # type: ignore[arg-type]
            instruction=wire.instruction_to_pb(out.instruction),
        )

    async def Leave(self, request: pb.SignedRequest, context: grpc.aio.ServicerContext) -> pb.LeaveResponse:
        v = self.core.verify(request, "Leave")
        out = await self.core.apply(wire.leave_event(v.worker_id, v.message))
        if out.instruction is not None:  # the last holder: upload first
            return pb.LeaveResponse(upload_first=True, instruction=wire.instruction_to_pb(out.instruction))
        return pb.LeaveResponse()

    async def GetStatus(self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        return self.core.status()

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
        core = self.core
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            raise UploadProtocolError("empty upload: the first chunk must carry the signed header") from None
        if first.WhichOneof("kind") != "header":
            raise UploadProtocolError("the first chunk must carry the signed header")
        v = core.verify(first.header, "UploadCheckpoint")
        h: pb.UploadCheckpointHeader = v.message
        if not core.state.check_upload(v.worker_id, h.cell_id, h.round, h.state_hash):
            await _drain(chunks)  # a checkpoint of this round is stored already
            return pb.UploadCheckpointResponse(stored=False, round=h.round)
        upload = core.checkpoints.begin_upload(h.cell_id, h.round, h.state_hash, h.total_bytes, h.sha256, v.worker_id)
        try:
            async for chunk in chunks:
                if chunk.WhichOneof("kind") != "data":
                    raise UploadProtocolError("only the first chunk may carry a header")
                upload.write(chunk.data)
            await asyncio.to_thread(upload.verify)
            # the index lives in SQLite: publish on the store's thread, in order with writes
            await core.writer.run(upload.publish, core.clock())
        except BaseException:
            upload.abort()
            raise
        await core.apply(CheckpointStored(cell_id=h.cell_id, round=h.round, state_hash=h.state_hash))
        return pb.UploadCheckpointResponse(stored=True, round=h.round)

    async def DownloadCheckpoint(
        self, request: pb.SignedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.CheckpointDownloadChunk]:
        core = self.core
        v = core.verify(request, "DownloadCheckpoint")
        req: pb.DownloadCheckpointRequest = v.message
        core.state.instruction_for(v.worker_id, core.clock())  # registered workers only (else NOT_FOUND)
        meta = core.checkpoints.get(req.cell_id, req.round)
        yield pb.CheckpointDownloadChunk(
            info=pb.CheckpointInfo(
                cell_id=meta.cell_id,
                round=meta.round,
                state_hash=meta.state_hash,
                total_bytes=meta.total_bytes,
                sha256=meta.sha256,
            )
        )
        gen = core.checkpoints.iter_chunks(meta)
        while (chunk := await asyncio.to_thread(next, gen, None)) is not None:
            yield pb.CheckpointDownloadChunk(data=chunk)
