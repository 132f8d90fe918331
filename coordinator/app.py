"""The coordinator's application object: verify, validate, apply, persist; the status view.

`CoordinatorApp` is the impure shell around the pure `CoordinatorState`: it owns the
verifier, the durable writer, the checkpoint store and the metrics bookkeeping, and every
servicer method goes through it.

Every worker request takes the same path:

1. `ErrorInterceptor` (the ONE place where exceptions become gRPC statuses) parses the
   raw request bytes itself, so even an unparseable message gets INVALID_ARGUMENT;
2. `CoordinatorApp.verify`: the signed envelope (`bagel.protocol.envelope.Verifier`,
   time from the shell's clock), then every field (`bagel.protocol.validation`);
3. the servicer translates the payload into a core event (`bagel.coordinator.translate`);
4. `CoordinatorApp.apply`: `CoordinatorState.apply(now_ms, event)` on the event loop
   (the pure core is not thread-safe and needs no lock there), then `outcome.effects`
   go to SQLite in one transaction on the writer thread (`bagel.coordinator.writer`,
   group commit); the reply waits until they, and every earlier batch, are durable. A
   heartbeat that changed nothing durable writes nothing and waits only if its answer
   would reveal a cell change still being written: that is the hot path.
5. the outcome is translated back.

An event the core refuses raises a typed error before it mutates anything, so a
rejected message never changes state. Two failures mean memory and disk may disagree:
SQLite itself fails, or the core fails with a bug (`CoreFault`: an exception that is not
a `CoordinatorError`, possibly raised after a mutation). Then the shell stops taking
requests (UNAVAILABLE), logs the offending event and asks the daemon to shut down
non-zero, so a restart reloads the durable truth (`CoordinatorApp.fatal`).

"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from bagel.compression import get_codec
from bagel.coordinator.admission import Admission
from bagel.coordinator.checkpoints import (
    CheckpointStore,
)
from bagel.coordinator.core.errors import CoordinatorError, CoreFault
from bagel.coordinator.core.events import Convicted, Event, Heartbeat, Leave, Outcome, ReportRound, Tick
from bagel.coordinator.core.records import (
    CellRecord,
    CommitRecord,
    Record,
    RoundRecord,
    WorkerRecord,
    WorkerState,
)
from bagel.coordinator.core.state import CoordinatorState
from bagel.coordinator.eventfeed import EventFeed
from bagel.coordinator.interceptor import AccusationLimited, NotAccepting
from bagel.coordinator.metrics import Metrics, RunBook, commit_rate, worker_class
from bagel.coordinator.ratelimit import RateLimiter
from bagel.coordinator.runhistory import RunHistory
from bagel.coordinator.watchers import InstructionWatchers
from bagel.coordinator.writer import AsyncWriter
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.convert import instruction_to_pb
from bagel.protocol.envelope import Verified, Verifier, wall_clock_ms
from bagel.protocol.identity import worker_id_of
from bagel.protocol.jointoken import operator_key_bytes
from bagel.protocol.runspec import RunSpec, parse_cell
from bagel.protocol.validation import validate
from bagel.robust.aggregation import get_reducer
from bagel.robust.evidence import Conviction, adjudicate, parse_evidence

log = logging.getLogger(__name__)

REVOCATION_POLL_S = 1.0  # how often a permissioned run looks for revoked join tokens
STATUS_HOLD_FACTOR = 10.0
# Checking an accusation re-runs one part's reduction (decode + aggregate, CPU work off the
# event loop): at most ACCUSE_CONCURRENCY at once, and per worker a token bucket of
# ACCUSE_BURST accusations refilled one per ACCUSE_INTERVAL_MS (a worker holds evidence
# about at most two parts per exchange: the one it reduces and the one it shadows).
ACCUSE_CONCURRENCY = 2
ACCUSE_BURST = 2
ACCUSE_INTERVAL_MS = 1000
ACCUSERS_KEPT = 10_000  # the rate limiter's memory (oldest forgotten first)


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


class CoordinatorApp:
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
        self.watchers = InstructionWatchers()  # held WatchInstruction calls (`watch`)
        # a held call waits at most a lease: the heartbeats, not the watch, keep a worker alive
        self.watch_cap_ms = int(spec.schedule.lease_s * 1000)
        snap = state.snapshot()
        workers = snap.workers
        self.tally = WorkerTally(workers)
        # the run's story (log lines, the dashboard's events) and series, from the same effects
        self.feed = EventFeed(spec.cell_ids, workers, snap.cells)
        self.history = RunHistory(spec.cell_ids, start_ms=clock())
        self._publish_worker_counts()
        self.admission = Admission(spec)
        self.operator_key = (
            operator_key_bytes(spec.security.operator_public_key) if spec.security.operator_public_key else b""
        )
        # keys whose signed GetStatus sees every worker (the daemon adds its own key)
        self.status_keys: set[bytes] = {self.operator_key} if self.operator_key else set()
        self._status_cache: dict[bool, tuple[float, bytes, float]] = {}  # (at, bytes, hold_s)
        self._last_revocation_poll = 0.0
        self._accusations = RateLimiter(1000.0 / ACCUSE_INTERVAL_MS, ACCUSE_BURST, capacity=ACCUSERS_KEPT)
        self._judging = 0
        self.started_ms = clock()
        self.book = RunBook(spec, metrics, snap, self.started_ms)  # the run series

    # ------------------------------------------------------------------ request path

    def verify(self, signed: pb.SignedRequest, method: str) -> Verified[Any]:
        """Envelope then fields; raises EnvelopeError / ValidationError (no state change,
        except the replay cache remembering a fully valid nonce)."""
        if not self.accepting:
            raise NotAccepting("the coordinator is shutting down")
        verified = self.verifier.verify(signed, method, self.clock())
        # after the signature: nobody can spend another key's bucket
        self.admission.limit_key(verified.worker_id, time.monotonic())
        validate(method, verified.message, self.spec)
        return verified

    def observe_report(self, worker_id: str, req: pb.ReportRoundRequest) -> None:
        """The round metrics of a validated report (before the core sees it, while its round
        is still the open one); `RunBook.report` decides whether it counts."""
        w = self.state.roster.workers.get(worker_id)
        if w is None:
            return
        try:
            _rec, rnd, _members = self.state.cell_view(req.cell_id)
        except CoordinatorError:
            return
        cls = worker_class(w.profile, self.spec.cost)
        self.book.report(cls, w.profile.num_devices, req, rnd, worker_id, self.clock())

    def is_joined(self, worker_id: str) -> bool:
        """True if the run knows `worker_id` and it has not left: active, lost (its lease ran
        out: registering again re-attaches it) or banned. A join token's use is counted
        only for a worker that is not joined (`Store.use_token`)."""
        w = self.state.roster.workers.get(worker_id)
        return w is not None and w.state is not WorkerState.LEFT

    def is_active(self, worker_id: str) -> bool:
        """True if `worker_id` is an active (registered, not banned) worker now."""
        try:
            self.state.worker_phase(worker_id)
        except CoordinatorError:
            return False
        return True

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
        audit = self.state.auditor
        seen = audit.counts["confirmed"]
        flags = audit.counts.total()
        try:
            outcome = self.state.apply(now, event)
        except CoreFault as e:
            self._die(e, "the coordinator core failed")
            raise NotAccepting("the coordinator hit an internal error; it is restarting") from e
        if audit.counts["confirmed"] != seen:  # the operator's record of what the audit found
            for f in list(audit.findings)[seen - audit.counts["confirmed"] :]:
                log.warning(
                    "audit: %s round %d: %s update from %s, confirmed by %d reducers",
                    f.cell_id,
                    f.round,
                    "/".join(f.kinds),
                    f.worker_id,
                    f.reporters,
                )
        if audit.counts.total() != flags and isinstance(event, ReportRound):
            log.debug("audit counts after a report of %s: %s", event.worker_id, dict(sorted(audit.counts.items())))
        try:
            if outcome.effects:
                self.watchers.notify(outcome.effects)  # they answer once the batch is durable
                fut = self.writer.submit(outcome.effects, now)
                self.metrics.store_writes.inc()
                self._observe(outcome.effects)
                self._record_story(event, outcome.effects, now)
                for rec in outcome.effects:
                    if isinstance(rec, CellRecord):
                        self._cell_writes[rec.cell_id] = fut
                # shielded: a client that gives up cancels its handler, never the write
                # (or the other handlers waiting for it)
                await asyncio.shield(fut)
            elif isinstance(event, Heartbeat):
                ins = outcome.instruction
                await self._cell_durable(ins.cell_id if ins is not None else "")
            else:
                await self.writer.barrier()
        except Exception as e:
            self._die(e, "store write failed")
            raise NotAccepting("the coordinator's store failed; it is restarting") from e
        return outcome

    async def _cell_durable(self, cell_id: str) -> None:
        """Wait until the latest change of `cell_id` being written is durable: an answer
        naming the cell never reveals a commit before a crash could lose it."""
        pending = self._cell_writes.get(cell_id) if cell_id else None
        if pending is not None and not pending.done():
            await asyncio.shield(pending)

    async def watch(self, worker_id: str, known_tag: int, wait_ms: int) -> tuple[pb.Instruction, bool]:
        """`WatchInstruction`: the worker's instruction (with its tag) as soon as its tag
        differs from `known_tag`, or when `wait_ms` (at most a lease) runs out; and whether
        it differs. A read, like `CoordinatorState.instruction_for`: it changes nothing.

        The call is held in `watchers`, woken by every transition whose records name the
        worker or its instruction's cell (`InstructionWatchers.notify`). The event is
        cleared before each read, so a change between the read and the wait is not lost.
        A newer call of the same worker, or shutting down, answers it at once. An unknown
        or banned worker is refused as its heartbeat would be."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(wait_ms, self.watch_cap_ms) / 1000.0
        held = None
        try:
            while True:
                if not self.accepting:
                    raise NotAccepting("the coordinator is shutting down")
                if held is not None:
                    held.event.clear()
                # refused as a heartbeat is: NOT_FOUND when unknown, PERMISSION_DENIED when
                # banned (a banned worker hears the refusal, not a LEAVE of its own)
                self.state.roster.worker(worker_id)
                ins = self.state.instruction_for(worker_id)
                await self._cell_durable(ins.cell_id)
                msg = instruction_to_pb(ins)
                if msg.tag != known_tag:
                    return msg, True
                remaining = deadline - loop.time()
                if remaining <= 0 or (held is not None and held.superseded) or self.watchers.closed:
                    return msg, False
                if held is None:
                    held = self.watchers.arm(worker_id, ins.cell_id)
                    self.metrics.watches_held.set(len(self.watchers))
                    continue  # read again once armed: nothing may change unseen in between
                self.watchers.move(held, ins.cell_id)
                try:
                    await asyncio.wait_for(held.event.wait(), remaining)
                except TimeoutError:
                    pass
        finally:
            if held is not None:
                self.watchers.disarm(held)
                self.metrics.watches_held.set(len(self.watchers))

    async def accuse(self, accuser: str, req: pb.EvidenceRequest) -> Conviction:
        """Check evidence against a reducer (`bagel.robust.evidence.adjudicate`, off the event
        loop) and, only on proof, apply `Convicted`. Raises an `EvidenceError` (no state change)
        when the evidence convicts nobody, `AccusationLimited` past the rate limits."""
        if self._judging >= ACCUSE_CONCURRENCY:
            raise AccusationLimited("other accusations are being checked; retry shortly")
        self.state.worker_phase(accuser)  # a registered worker (else NOT_FOUND), not banned (PERMISSION_DENIED)
        if self._accusations.take(accuser, self.clock() / 1000.0) > 0:
            raise AccusationLimited(f"{ACCUSE_BURST} accusations per worker, then one per {ACCUSE_INTERVAL_MS} ms")
        evidence = parse_evidence(req)  # bounds and the receipt's signature: cheap
        t = evidence.receipt.tag
        members = self.state.frozen_set(t.cell_id, t.round, t.round_attempt, t.reduce_attempt)
        self._judging += 1
        try:
            conviction = await asyncio.to_thread(
                adjudicate,
                evidence,
                run_id=self.spec.run.id,
                accuser=accuser,
                members=members,
                codec=get_codec(self.spec.diloco.codec),
                reducer=get_reducer(self.spec.diloco.aggregation),
            )
        finally:
            self._judging -= 1
        log.warning("convicted %s on evidence from %s: %s", conviction.worker_id, accuser, conviction.reason)
        await self.apply(
            Convicted(
                worker_id=conviction.worker_id,
                accuser=accuser,
                cell_id=t.cell_id,
                round=t.round,
                round_attempt=t.round_attempt,
                reduce_attempt=t.reduce_attempt,
                reason=conviction.reason,
            )
        )
        return conviction

    def _die(self, exc: BaseException, what: str) -> None:
        if self.fatal is None:
            log.critical("%s; stopping so a restart reloads the durable state: %s", what, exc)
            self.fatal = exc
            self.accepting = False
            if self._on_fatal is not None:
                self._on_fatal(exc)

    def _record_story(self, event: Event, effects: tuple[Record, ...], now: int) -> None:
        """The event feed (log lines, the dashboard's events) and the dashboard's series."""
        try:
            self.feed.record(effects, now)
            self.history.record(event, effects, now)
        except Exception:  # the run's story must never stop the run
            log.exception("event feed failed")

    def _observe(self, effects: tuple[Record, ...]) -> None:
        self.book.records(effects)
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

    def publish_run_metrics(self) -> None:
        """The gauges computed over windows (p99s, memory) and the queue counts; O(cells)."""
        empty = sum(1 for c in self.spec.cell_ids if not self.state.cell_view(c)[2])
        self.book.publish(self.tally.counts().get("standby", 0), empty)

    async def tick(self) -> None:
        """One Tick (leases, deadlines), skipped when the core says nothing is due."""
        if not self.accepting:
            return
        wake = self.state.next_wakeup_ms()
        if wake is not None and wake <= self.clock():
            await self.apply(Tick())

    async def tick_loop(self, period_ms: int) -> None:
        last_counts = last_run = 0.0
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
                if time.monotonic() - last_run >= 1.0:
                    last_run = time.monotonic()
                    self.publish_run_metrics()
                await self.tick()
                if self.operator_key and time.monotonic() - self._last_revocation_poll >= REVOCATION_POLL_S:
                    self._last_revocation_poll = time.monotonic()
                    await self.enforce_revocations()
            except NotAccepting:
                return  # the core or the store failed (the daemon is stopping), or shutdown
            except Exception:  # the metrics bookkeeping must not stop the clock of the run
                log.exception("tick failed")

    async def enforce_revocations(self) -> None:
        """Remove the active workers whose join token the operator revoked (`token revoke`
        writes SQLite from another process; this reads it back): their next call is
        NOT_FOUND, and the Register that follows is refused."""
        keys = await self.writer.run(self.writer.store.revoked_bound_keys)
        for key_hex in keys:
            try:
                worker_id = worker_id_of(bytes.fromhex(key_hex))
            except ValueError:
                continue
            if self.is_active(worker_id):
                log.warning("removing worker %s: its join token was revoked", worker_id)
                try:
                    await self.apply(Leave(worker_id=worker_id, reason="join token revoked"))
                except CoordinatorError as e:
                    log.warning("could not remove %s: %s", worker_id, e)

    # ------------------------------------------------------------------ status

    def status_view(self, detailed: bool) -> bytes:
        """GetStatus's answer, serialized: recomputed at most every `security.status_cache_ms`.

        `detailed`: every worker and each cell's members (authenticated callers);
        otherwise the aggregate view: cells and worker counts by state, O(cells). The bytes
        are shared by every caller within the period (the detailed view of 10k workers is
        ~0.5 MB: serializing it per answer would cost more than computing it once).
        """
        now_s = time.monotonic()
        hit = self._status_cache.get(detailed)
        if hit is not None and now_s - hit[0] < hit[2]:
            return hit[1]
        out = self.status(detailed=detailed).SerializeToString()
        took_s = time.monotonic() - now_s
        # held at least STATUS_HOLD_FACTOR x what it cost, so recomputing it never takes more
        # than ~1/(1 + factor) of the loop however large the fleet grows
        hold_s = max(self.spec.security.status_cache_ms / 1000.0, STATUS_HOLD_FACTOR * took_s)
        self._status_cache[detailed] = (now_s, out, hold_s)
        return out

    def status(self, *, detailed: bool = True) -> pb.StatusResponse:
        """The operator view, from the core's queries (no transition). O(workers) if detailed."""
        st = self.state
        now = self.clock()
        out = pb.StatusResponse(run_id=self.spec.run.id, spec_hash=self.spec.spec_hash, now_unix_ms=now)
        out.detailed = detailed
        out.started_unix_ms = self.started_ms
        lease_span_ms = int(self.spec.schedule.lease_s * 1000)
        for state_name, n in self.tally.counts().items():
            out.worker_counts[state_name] = n
        snap = st.snapshot() if detailed else None
        for w in snap.workers if snap is not None else ():
            ws = out.workers.add(
                worker_id=w.worker_id,
                name=w.profile.name,
                state=w.state.value,
                cell_id=w.cell_id,
                reputation=w.reputation,
                samples_per_s=float(w.throughput.get(w.cell_id, 0.0)) if w.cell_id else 0.0,
                vram_bytes=w.profile.vram_bytes,
                host_memory_bytes=w.profile.host_memory_bytes,
                rounds_contributed=w.rounds_contributed,
                reachability=int(w.profile.reachability),
                reachability_detail=w.profile.reachability_detail,
            )
            if w.state is WorkerState.ACTIVE:
                phase, _round, _step, _loss, lease_ms = st.worker_phase(w.worker_id)
                ws.phase = int(phase)  # type: ignore[assignment]
                ws.lease_expires_unix_ms = lease_ms
                ws.last_heartbeat_unix_ms = max(0, lease_ms - lease_span_ms)  # a lease is renewed by each call
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
                members=sorted(members) if detailed else [],
                target_share=float(targets.get(cell_id, 0.0)),
                actual_share=float(shares.get(cell_id, 0.0)),
                last_loss=rec.last_loss,
                latest_checkpoint_round=rec.checkpoint_round,
                samples_committed=rec.samples_committed,
                sample_target=self.spec.slo.cell_sample_target,
                samples_per_s=commit_rate(list(self.book.commits.get(cell_id, ()))),
                last_commit_unix_ms=self.book.commits[cell_id][-1][0] if self.book.commits.get(cell_id) else 0,
                rollbacks=rec.rollbacks,
            )
        return out
