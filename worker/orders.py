"""Carrying out the coordinator's orders: the worker's committed state, its round work, and
the jobs that change them (SYNC, TRAIN, REDUCE, the report and what its verdict means).

`Orders` is one object the agent composes (`Agent.orders`). `reconciler.decide` says what
to do about the current instruction; `Orders.perform` does it, and `Orders.view` is what
`decide` sees. The committed state (`held`) is only replaced by a verified sync or a
commit, so an abandoned round (WAIT, a new attempt, ABORTED, RESYNC, SIGTERM) is a
rollback for free.

- SYNC: holding the same cell's state a round or a few behind (`[sync] catch_up_rounds`),
  first the committed updates of the rounds between, from the donors in order, applied to
  it (`statesync.catch_up_from_donors`); else, or when that fails, the named donors over
  P2P, byte ranges from all at once (`statesync.fetch_state_from_donors`; one donor: a
  single stream), else the coordinator's checkpoint (`DownloadCheckpoint`); each must hash
  to the committed hash. Round 0 is the deterministic initial state, built locally.
- TRAIN: `roundwork.train_round` in a thread; then the pseudo-gradient (corrupted on
  purpose with `--byzantine`), and PHASE_READY. With `[diloco] overlap = "delayed"` the
  GPU does not wait for the exchange: once a weighted exchange starts, the next round's
  inner steps are trained ahead (`roundwork.train_ahead`), on the guess that its plan
  repeats this one; when that round's TRAIN comes and the reconciler says the guess held
  (`reconciler.steps_ahead`), they are moved onto the committed outcome and the round goes
  on from there, else they are discarded.
- REDUCE: `roundwork.reduce_round` over exactly the frozen contributors, then ReportRound.
  A failed exchange is reported `failed=True` and the delta kept: a re-freeze (higher
  reduce_attempt) redoes only the exchange, with the committed error-feedback residuals.
  A catch-up contributor (max_samples 0: we hold the base state but trained nothing)
  exchanges a zero delta with weight 0 and applies the same outer step.
- The verdict (`reconciler.decide_verdict`): COMMITTED adopts the new state (saved, served
  to joiners, with the round's committed update); PENDING waits until an instruction shows
  our hash committed (or another one: drop); RESYNC/ABORTED drop.
- The local checkpoint: the held state is saved atomically after every sync and commit,
  and loaded at start (`LocalStore`).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import torch

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.atomicfile import atomic_write_with
from bagel.protocol.client import backoff_delay_s
from bagel.protocol.convert import verdict_from_pb
from bagel.protocol.messages import Instruction, LocalState
from bagel.protocol.runspec import RunSpec
from bagel.worker import ddp, reconciler
from bagel.worker.datafetch import DataFetchError
from bagel.worker.diloco import CellState, OuterConfig, state_dtype
from bagel.worker.display import Display
from bagel.worker.heldout import HeldoutProbe
from bagel.worker.link import CoordinatorLink
from bagel.worker.localstate import LocalCheckpoint, LocalStateError, LocalStore
from bagel.worker.metrics import TRAINING_FIELDS, WorkerMetrics, round_metrics
from bagel.worker.reconciler import (
    AdoptPending,
    BuildInitialState,
    CancelSync,
    DropWork,
    NotAMember,
    ReportMissing,
    ReReport,
    StartCatchUp,
    StartReduce,
    StartSync,
    StartTrain,
    Sync,
    Work,
    WorkerView,
)
from bagel.worker.roundwork import (
    AheadRun,
    ReduceOutcome,
    RoundWork,
    claimed,
    corrupt,
    eager_start,
    exchange_timeout_s,
    fresh_feedback,
    reduce_round,
    train_ahead,
    train_round,
)
from bagel.worker.trainer import CellRuntime, build_runtime

log = logging.getLogger(__name__)


def _ahead_of(a: AheadRun) -> reconciler.Ahead:
    """What the reconciler sees of steps trained ahead."""
    g = a.guess
    return reconciler.Ahead(g.cell_id, a.base_round, g.member_index, g.members, a.steps)


def caught_source(caught: Any, first: int, last: int) -> str:
    """The `synced` event's source for a catch-up by the updates of rounds first..last."""
    rounds = f"update of round {last}" if first == last else f"updates of rounds {first}..{last}"
    return f"donor {caught.donor} ({rounds}, {caught.nbytes} bytes)"


@dataclass
class Counters:
    bytes_sent: int = 0
    bytes_received: int = 0
    exchange_sent: int = 0  # pseudo-gradient exchange only (what DDP's all-reduce replaces)
    exchange_received: int = 0
    checkpoint_sent: int = 0  # whole states: checkpoint uploads
    checkpoint_received: int = 0  # whole states: syncs from a donor or the coordinator's checkpoint
    rounds_committed: int = 0
    samples: int = 0


@dataclass
class SyncJob:
    target: tuple[str, int, str]  # (cell, committed_round, committed_hash)
    task: asyncio.Task[None]


class OrdersHost(Protocol):
    """What `Orders` needs from the agent that runs it."""

    spec: RunSpec | None

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """A tracked task; when it ends, the agent reconciles again."""
        ...

    def wake(self) -> None:
        """Reconcile the current instruction again."""
        ...

    async def sleep(self, s: float) -> None:
        """Sleep, unless the worker is stopping."""
        ...

    def still_current(self, i: Instruction) -> bool:
        """Is `i` still the instruction to follow (and the worker not stopping)?"""
        ...

    def on_instruction(self, instr: pb.Instruction) -> None: ...

    async def ensure_data(self, cell_id: str) -> None:
        """Make the cell's data available (fetch its shards when this worker has no copy)."""
        ...


class Orders:
    """The worker's committed state and round work, and the jobs that change them."""

    def __init__(
        self,
        host: OrdersHost,
        link: CoordinatorLink,
        cfg: Any,
        display: Display,
        ctx: ddp.DistContext,
        device: torch.device,
        run_id: str,
        worker_id: str,
    ) -> None:
        self.host = host
        self.link = link
        self.cfg = cfg
        self.display = display
        self.ctx = ctx
        self.device = device
        self.run_id = run_id
        self.worker_id = worker_id
        # the data plane and the local store, once the agent has started them (`attach`)
        self.p2p: Any = None
        self.dataplane: Any = None
        self.stateserver: Any = None
        self.store: LocalStore | None = None
        self.held: LocalCheckpoint | None = None  # committed state we hold
        self.runtime: CellRuntime | None = None
        self.probe: HeldoutProbe | None = None  # the commit guard's measurement, for one cell
        self.work: RoundWork | None = None
        self.sync: SyncJob | None = None
        # what the last verified donor sync measured of each donor: (cell, round, [(donor
        # worker id, bytes, ms)]), sent with the heartbeats while that state is held
        self.donor_rates: tuple[str, int, tuple[tuple[str, int, int], ...]] | None = None
        self.train_task: asyncio.Task[None] | None = None
        self.ahead: AheadRun | None = None  # the next round's steps, trained during an exchange
        self.counters = Counters()
        self.reset_optimizer = True
        self.missing_reported: set[tuple[str, int, int, int]] = set()
        self._last_delta: dict[str, torch.Tensor] | None = None  # --byzantine stale
        self._first_delta: dict[str, torch.Tensor] | None = None  # --byzantine freeload-replay
        self._save_lock = asyncio.Lock()
        self.metrics: WorkerMetrics | None = None  # the worker's own endpoint (--metrics-listen)

    def moved_checkpoint(self, sent: int, received: int) -> None:
        """Count a whole state moved (an upload, a sync), apart from the exchange bytes."""
        c = self.counters
        c.bytes_sent += sent
        c.bytes_received += received
        c.checkpoint_sent += sent
        c.checkpoint_received += received
        self.display.update(checkpoint_sent=c.checkpoint_sent, checkpoint_received=c.checkpoint_received)
        if self.metrics is not None:
            self.metrics.moved("checkpoint", "sent", sent)
            self.metrics.moved("checkpoint", "received", received)

    def attach(self, p2p: Any, dataplane: Any, stateserver: Any, store: LocalStore) -> None:
        self.p2p, self.dataplane, self.stateserver, self.store = p2p, dataplane, stateserver, store

    # ------------------------------------------------------------------ what decide sees

    def held_local(self) -> LocalState | None:
        h = self.held
        return None if h is None else LocalState(h.cell_id, h.committed_round, h.state_hash)

    def view(self, uploaded: frozenset[tuple[str, int]]) -> WorkerView:
        work = None
        w = self.work
        if w is not None:
            work = Work(
                w.cell_id,
                w.round,
                w.round_attempt,
                ready=w.result is not None and w.delta is not None,
                catch_up=w.catch_up,
                reduce_attempt=w.reduce_attempt,
                exchanging=w.reduce_task is not None and not w.reduce_task.done(),
                pending_hash=w.pending.state_hash if w.pending is not None else None,
                pending_attempt=w.pending_attempt,
                report_stale=w.report_epoch != self.link.epoch,
            )
        sync = None
        if self.sync is not None:
            sync = Sync(LocalState(*self.sync.target), running=not self.sync.task.done())
        ahead = _ahead_of(self.ahead) if self.ahead is not None else None
        spec = self.host.spec
        return WorkerView(
            self.worker_id,
            self.held_local(),
            work,
            sync,
            uploaded,
            frozenset(self.missing_reported),
            ahead,
            spec.sync.catch_up_rounds if spec is not None else 0,
        )

    async def perform(self, i: Instruction, a: reconciler.Action) -> bool:
        """Carry out one action `decide` returned for `i` (Leave and Upload are the agent's);
        False if the remaining ones must be skipped."""
        if isinstance(a, AdoptPending):
            assert self.work is not None
            self.commit(self.work)
        elif isinstance(a, DropWork):
            self.drop_work(a.why)
        elif isinstance(a, CancelSync):
            self.cancel_sync()
        elif isinstance(a, StartSync):
            target = (a.cell_id, a.committed_round, a.committed_hash)
            donors = a.donors or ((a.donor,) if a.donor is not None else ())
            self.donor_rates = None
            self.drop_ahead("resync")
            self.sync = SyncJob(target, self.host.spawn(self._sync(*target, donors), "sync"))
            self.link.wake_heartbeat()
        elif isinstance(a, BuildInitialState):
            await self._sync(a.cell_id, 0, "", ())  # instant: no download
            return reconciler.holds(self.held_local(), a.cell_id, 0, "")
        elif isinstance(a, StartTrain):
            return await self._start_train(i, a.member_index, a.ahead_steps)
        elif isinstance(a, NotAMember):
            self.display.event("not-a-member", level="warning", cell=i.cell_id, round=i.round)
        elif isinstance(a, StartCatchUp):
            assert self.held is not None
            self.work = RoundWork.for_catch_up(i, self.held.state)
            self.display.event("catch-up", cell=i.cell_id, round=i.round, reduce_attempt=i.reduce_attempt)
        elif isinstance(a, StartReduce):
            self._start_reduce(i, a)
        elif isinstance(a, ReReport):
            w = self.work
            assert w is not None
            w.report_epoch = self.link.epoch
            self._spawn_exchange(w, self._report(w), "re-report")
        elif isinstance(a, ReportMissing):
            self.missing_reported.add((a.cell_id, a.round, a.round_attempt, a.reduce_attempt))
            self.host.spawn(self._report_missing(a), "report-missing")
        return True

    # ------------------------------------------------------------------ SYNC

    def cancel_sync(self) -> None:
        if self.sync is not None:
            if not self.sync.task.done():
                cell, rnd, _want = self.sync.target
                self.display.event("sync-cancelled", cell=cell, round=rnd)
            self.sync.task.cancel()
            self.sync = None

    async def _sync(self, cell: str, rnd: int, want: str, donors: tuple[Any, ...]) -> None:
        from bagel.worker.statesync import DonorRef, StateSyncError, fetch_state_from_donors, verify_state_bytes

        spec = self.host.spec
        assert spec is not None and self.link.client is not None
        live = [d for d in donors if d.worker_id and d.peer.peer_id]
        updates: tuple[Any, ...] = ()  # the committed updates applied, when caught up by them
        self.display.update(phase="syncing", cell=cell, round=rnd)
        # the start of the download, for the time accounting (`worker/goodput.py`)
        self.display.event("sync", cell=cell, round=rnd, donor=",".join(d.worker_id for d in live))
        try:
            if rnd == 0 and not want:
                rt = await self.runtime_for(cell)
                state = CellState.from_model(rt.task.build_model(), ema=spec.ema.decay > 0, dtype=state_dtype(spec))
                source = "initial state (built locally)"
            else:
                state, source = None, ""
                refs = [
                    DonorRef(d.peer.peer_id, tuple(d.peer.maddrs), d.expected_bytes_per_s, d.worker_id) for d in live
                ]
                # holding the same cell's state a round or a few behind: its committed updates first
                mine = self.held
                if (
                    refs
                    and mine is not None
                    and mine.cell_id == cell
                    and 1 <= rnd - mine.committed_round <= spec.sync.catch_up_rounds
                ):
                    caught, liars = await self._catch_up(mine, rnd, want, refs)
                    if caught is not None:
                        state, source = caught.state, caught_source(caught, mine.committed_round + 1, rnd)
                        updates = caught.updates
                    refs = [r for r in refs if r.label not in liars]  # not asked again in this sync
                if state is None and refs:
                    try:
                        got = await fetch_state_from_donors(
                            self.p2p,
                            refs,
                            run_id=self.run_id,
                            cell_id=cell,
                            committed_round=rnd,
                            state_hash=want,
                            max_nbytes=spec.checkpoint.max_bytes,
                            timeout_s=self.cfg.sync_timeout_s,
                            dtype=state_dtype(spec),
                        )
                        synced = got.synced
                        used = "+".join(n for n, b in got.nbytes_by_donor.items() if b)
                        rates = tuple(
                            (n, b, int(got.seconds_by_donor.get(n, 0.0) * 1000))
                            for n, b in got.nbytes_by_donor.items()
                            if b and n
                        )
                        self.donor_rates = (cell, rnd, rates)
                        state, source = synced.state, f"donor {used} ({synced.nbytes} bytes)"
                        self.moved_checkpoint(0, synced.nbytes)
                        for name, why in got.failed.items():
                            liar = name in got.liars
                            self.display.event("sync-donor-failed", level="warning", donor=name, message=why, lied=liar)
                    except StateSyncError as e:
                        names = ",".join(d.worker_id for d in live)
                        self.display.event("sync-donor-failed", level="warning", donor=names, message=str(e))
                if state is None:
                    resp = await self.link.rpc(lambda: self.link.client.download_checkpoint(cell, rnd))  # type: ignore[union-attr]
                    if resp is None:
                        raise StateSyncError("coordinator unreachable for the checkpoint fallback")
                    _info, data = resp
                    state = await asyncio.to_thread(verify_state_bytes, data, want, state_dtype(spec))
                    source = f"coordinator checkpoint ({len(data)} bytes)"
                    self.moved_checkpoint(0, len(data))
            assert state is not None
            h = state.state_hash()
            self.held = LocalCheckpoint(cell, rnd, state, h, {})
            self.reset_optimizer = True
            self.stateserver.withdraw()
            if rnd:
                # a worker that caught up by updates serves them in turn
                self.stateserver.publish(
                    cell, rnd, state, updates=updates, keep_updates=spec.sync.catch_up_rounds, state_hash=h
                )
            # what it measured of each donor (reported to the coordinator with its heartbeats)
            dr = self.donor_rates
            measured = {n: {"bytes": b, "ms": ms} for n, b, ms in dr[2]} if dr and dr[:2] == (cell, rnd) else {}
            self.display.event("synced", cell=cell, round=rnd, hash=h[:12], source=source, donor_rates=measured)
            self.display.update(committed=rnd)
            await self.save_local()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001  (grpc errors, integrity errors: retry on the next instruction)
            self.display.event("sync-failed", level="warning", cell=cell, round=rnd, message=f"{type(e).__name__}: {e}")
            await self.host.sleep(1.0)
        finally:
            if self.sync is not None and self.sync.task is asyncio.current_task():
                self.sync = None
            self.host.wake()
            self.link.wake_heartbeat()

    async def _catch_up(self, held: LocalCheckpoint, rnd: int, want: str, refs: list[Any]) -> tuple[Any, set[str]]:
        """Try to reach (held's cell, rnd, want) from the held state by the committed updates
        of the rounds between (`statesync.catch_up_from_donors`): (the verified result or
        None, the donors proven to have lied). Every donor given up is said in a
        `sync-donor-failed` event; the caller then downloads the whole state."""
        from bagel.worker.parts import resolve_codec
        from bagel.worker.statesync import CatchUpFailed, catch_up_from_donors

        spec = self.host.spec
        assert spec is not None
        try:
            caught = await catch_up_from_donors(
                self.p2p,
                refs,
                run_id=self.run_id,
                cell_id=held.cell_id,
                held=held.state,
                held_round=held.committed_round,
                held_hash=held.state_hash,
                committed_round=rnd,
                state_hash=want,
                codec=resolve_codec(spec.diloco.codec),
                cfg=OuterConfig.from_spec(spec.diloco, spec.ema),
                # never more than the download it saves (nor than the largest state taken)
                max_nbytes=min(spec.checkpoint.max_bytes, held.state.nbytes()),
                # the budget of the download it saves: it fetches fewer bytes than that one
                timeout_s=self.cfg.sync_timeout_s,
            )
            failed, liars = caught.failed, caught.liars
        except CatchUpFailed as e:
            failed, liars, caught = e.failed, e.liars, None
        except Exception as e:  # noqa: BLE001  (a bug here must cost the catch-up only: the download follows)
            log.warning("catch-up by updates failed: %s: %s", type(e).__name__, e)
            failed, liars, caught = {",".join(r.label for r in refs): f"{type(e).__name__}: {e}"}, (), None
        for name, why in failed.items():
            self.display.event(
                "sync-donor-failed",
                level="warning",
                donor=name,
                message=f"catch-up by updates: {why}",
                lied=name in liars,
            )
        if caught is not None:
            self.donor_rates = (held.cell_id, rnd, ((caught.donor, caught.nbytes, int(caught.seconds * 1000)),))
            self.moved_checkpoint(0, caught.nbytes)
        return caught, set(liars)

    async def runtime_for(self, cell: str) -> CellRuntime:
        if self.runtime is None or self.runtime.cell_id != cell:
            assert self.host.spec is not None
            await self.host.ensure_data(cell)
            collective = self.ctx if self.ctx.enabled else None
            self.runtime = await asyncio.to_thread(
                build_runtime, self.host.spec, cell, self.device, throttle=self.cfg.throttle, collective=collective
            )
            self.reset_optimizer = False  # a fresh trainer has a fresh optimizer
        return self.runtime

    # ------------------------------------------------------------------ TRAIN

    async def _start_train(self, i: Instruction, member_index: int, ahead_steps: int = 0) -> bool:
        """Start training `i`'s round. Steps trained ahead are stopped first (their thread
        shares the model); whether they count is decided on what they finally are, by the
        reconciler's own rule (`reconciler.steps_ahead`: `ahead_steps` is what it said
        while they still ran), and only once the round really starts, so an instruction
        that changed meanwhile leaves them for the next decision."""
        if self.ahead is not None:
            self.ahead.guess.stop.set()  # stops at its next inner step; its steps so far are kept
        await self._trainer_idle()
        try:
            rt = await self.runtime_for(i.cell_id)
        except DataFetchError:  # said on the display; the fetcher backs off before trying again
            await self.host.sleep(1.0)
            self.host.wake()
            return False
        if not self.host.still_current(i):
            self.host.wake()  # things changed while the model was built: look again
            return False
        assert i.plan is not None
        reset = self.reset_optimizer
        self.reset_optimizer = False
        w = RoundWork.from_instruction(i, member_index)
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            carried = ahead.result is not None and reconciler.steps_ahead(
                _ahead_of(ahead), i, member_index, self.held_local()
            )
            if not carried or (ahead.guess.cell_id, ahead.guess.round) != (w.cell_id, w.round):
                why = "the round's plan is not the one trained ahead" if ahead.steps else "no step was trained ahead"
                self._ahead_dropped(ahead, why)
                ahead = None
        self.work = w
        self.display.update(
            cell=i.cell_id, round=i.round, step=0, steps=i.plan.inner_steps, deadline_unix_ms=i.plan.deadline_unix_ms
        )
        self.display.event(
            "train",
            cell=i.cell_id,
            round=i.round,
            attempt=i.round_attempt,
            micro_batch=i.plan.micro_batch,
            grad_accum=i.plan.grad_accum,
            members=len(i.plan.members),
            late=0 < i.plan.late_from <= member_index,
            ahead_steps=ahead.result.steps if ahead is not None and ahead.result is not None else 0,
        )
        self.train_task = self.host.spawn(self._train(w, rt, reset, ahead), "train")
        self.link.wake_heartbeat()
        return True

    async def _trainer_idle(self) -> None:
        """Wait for a dropped round's training thread to stop (it checks its stop flag every
        inner step): two rounds must never train the same model at once, and in a DDP
        worker their collectives would interleave."""
        t = self.train_task
        if t is not None and not t.done():
            await asyncio.wait({t})

    async def _train(self, w: RoundWork, rt: CellRuntime, reset_optimizer: bool, ahead: AheadRun | None = None) -> None:
        assert self.held is not None and self.host.spec is not None
        held = self.held
        if ahead is not None:
            w.inner_step = ahead.steps

        def on_step(p: Any) -> None:
            w.inner_step, w.last_loss = p.step, p.loss
            self.display.update(step=p.step, loss=p.loss, samples_per_s=p.samples_per_s)

        def on_data_sent(cell_id: str, nbytes: int) -> None:
            self.display.event("data-to-ranks", cell=cell_id, ranks=self.ctx.world_size - 1, nbytes=nbytes)

        try:
            res, delta = await asyncio.to_thread(
                train_round, self.run_id, rt, held.state, w, self.ctx, reset_optimizer, on_step, ahead, on_data_sent
            )
        except Exception as e:
            log.exception("training failed")
            self.display.event("train-failed", level="error", message=f"{type(e).__name__}: {e}")
            if self.work is w:
                self.work = None
            self.host.wake()
            return
        if self.work is not w or not res.completed:
            return
        if self.cfg.byzantine:
            honest = delta
            delta = corrupt(honest, self.cfg.byzantine, self._last_delta, self._first_delta)
            self._last_delta = honest
            if self._first_delta is None:
                self._first_delta = honest
        w.result, w.delta = res, delta
        w.ready_at = time.monotonic()
        self.counters.samples += res.samples
        self.display.event(
            "ready",
            cell=w.cell_id,
            round=w.round,
            samples=res.samples,
            loss=round(res.mean_loss, 5),
            compute_s=round(res.compute_s, 2),
        )
        self.link.wake_heartbeat()
        self.host.wake()

    def drop_work(self, why: str) -> None:
        """Abandon the current round (training, ready or reducing); the committed state is intact."""
        w = self.work
        if w is None:
            return
        w.stop.set()
        if w.reduce_task is not None and not w.reduce_task.done():
            w.reduce_task.cancel()
        self.work = None
        a = self.ahead
        if a is not None and (a.guess.cell_id, a.base_round) == (w.cell_id, w.round):
            self.drop_ahead(why)  # its base, that exchange's outcome, will not be held
        log.info("dropped round %s/%d: %s", w.cell_id, w.round, why)
        self.display.event("dropped", cell=w.cell_id, round=w.round, attempt=w.round_attempt, why=why)
        self.display.update(step=0)

    # ------------------------------------------------------------------ REDUCE

    def _start_reduce(self, i: Instruction, a: StartReduce) -> None:
        w = self.work
        assert w is not None
        if w.reduce_task is not None and not w.reduce_task.done():
            w.reduce_task.cancel()
        w.reduce_attempt = a.reduce_attempt
        w.contributors = a.contributors
        w.pending = None
        if not w.reduce_started_at:
            w.reduce_started_at = time.monotonic()
        self.display.event(
            "exchange", cell=w.cell_id, round=w.round, reduce_attempt=a.reduce_attempt, catch_up=w.catch_up
        )
        self._spawn_exchange(w, self._reduce(w, i), "reduce")
        self._maybe_train_ahead(w)
        self.link.wake_heartbeat()

    def _spawn_exchange(self, w: RoundWork, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Run `coro` (w's exchange, or its report) as `w.reduce_task`, which reads None once it ended.

        The coroutine's frames hold `w`; a task that ends in an exception (cancelled when its
        attempt is aborted, most often) holds them through the exception's traceback, and `w`
        holding the task would close that cycle: the exchange's contribution, decoded parts
        and round state would then stay in memory until Python's cyclic collector ran."""
        task = self.host.spawn(coro, name)
        w.reduce_task = task

        def forget(t: asyncio.Task[Any]) -> None:
            if w.reduce_task is t:
                w.reduce_task = None

        task.add_done_callback(forget)

    # ------------------------------------------------------------------ training ahead (overlap)

    def _maybe_train_ahead(self, w: RoundWork) -> None:
        """Start training the next round ahead while `w`'s exchange runs, if the run spec
        says so. Not for a catch-up (nothing was trained, and it holds no trained model),
        nor for a multi-rank worker (its ranks follow rank 0's rounds in lock step)."""
        spec = self.host.spec
        rt = self.runtime
        if (
            spec is None
            or spec.diloco.overlap != "delayed"
            or w.catch_up
            or self.ctx.enabled
            or w.result is None
            or rt is None
            or rt.cell_id != w.cell_id
            or self.ahead is not None
        ):
            return
        t = self.train_task
        if t is not None and not t.done():
            return  # the round's own training thread has not returned yet
        guess = RoundWork(w.cell_id, w.round + 1, 1, w.member_index, w.members, w.plan, deadline_unix_ms=0)
        a = AheadRun(guess, w.round)
        self.ahead = a
        self.display.event("ahead", cell=w.cell_id, round=guess.round, base_round=w.round)
        assert self.held is not None and w.delta is not None
        # from the eager estimate of the coming outer step, with our own honest pseudo-gradient
        own = self._last_delta if self.cfg.byzantine and self._last_delta is not None else w.delta
        cfg = OuterConfig.from_spec(spec.diloco, spec.ema)
        self.train_task = self.host.spawn(self._train_ahead(a, rt, self.held.state, own, cfg), "train-ahead")

    async def _train_ahead(
        self, a: AheadRun, rt: CellRuntime, base: CellState, own: dict[str, torch.Tensor], cfg: OuterConfig
    ) -> None:
        def on_step(p: Any) -> None:
            a.guess.inner_step, a.guess.last_loss = p.step, p.loss

        def job() -> None:
            train_ahead(self.run_id, rt, a, on_step, eager_start(base, own, cfg))

        try:
            await asyncio.to_thread(job)
        except Exception as e:  # noqa: BLE001  (a failed step ahead costs only the steps)
            log.warning("training ahead failed: %s: %s", type(e).__name__, e)
            if self.ahead is a:
                self.ahead = None
                self._ahead_dropped(a, f"failed: {type(e).__name__}")
            return
        if self.ahead is a:  # stopped for the round it trained, or out of steps: its time ends here
            self.display.event("ahead-done", cell=a.guess.cell_id, round=a.guess.round, steps=a.steps)

    def drop_ahead(self, why: str) -> None:
        """Discard the steps trained ahead (their base will not be held); the training thread
        stops at its next inner step, and the next round reloads the committed weights."""
        a = self.ahead
        if a is None:
            return
        a.guess.stop.set()
        self.ahead = None
        self._ahead_dropped(a, why)

    def _ahead_dropped(self, a: AheadRun, why: str) -> None:
        self.display.event("ahead-dropped", cell=a.guess.cell_id, round=a.guess.round, steps=a.steps, why=why)

    async def _reduce(self, w: RoundWork, i: Instruction) -> None:
        from bagel.worker.averaging import ExchangeError

        spec = self.host.spec
        assert spec is not None and self.held is not None and w.result is not None
        held = self.held
        self.display.update(phase="reducing")
        # a catch-up exchange sends nothing, so it must not touch our residuals
        ef = fresh_feedback(held.residuals) if spec.diloco.error_feedback and not w.catch_up else None
        try:
            out = await reduce_round(
                self.dataplane,
                spec,
                self.worker_id,
                held.state,
                w,
                i,
                ef,
                exchange_timeout_s(i, time.time(), self.cfg.reduce_timeout_s),
                base_hash=held.state_hash,
            )
            if w.catch_up or not spec.diloco.error_feedback:
                out.residuals = dict(held.residuals) if w.catch_up else {}
            self.display.event("exchanged", cell=w.cell_id, round=w.round, comm_s=round(out.comm_s, 3))
            await self._measure(out, held)
            out.paths = await self.dataplane.paths({m.worker_id: m.peer.peer_id for m in i.contributors})
        except ExchangeError as e:
            # accuse first: the failure reports may end the exchange at the coordinator, which
            # then still checks the evidence against the contributor set it remembers
            for ev in getattr(e, "evidence", ()):
                await self._accuse(ev)
            self.display.event(
                "exchange-failed",
                level="warning",
                round=w.round,
                round_attempt=w.round_attempt,
                reduce_attempt=i.reduce_attempt,
                message=str(e),
            )
            await self._report(w, failed=True, reason=str(e)[:500])
            return
        c = self.counters
        c.bytes_sent += out.bytes_sent
        c.bytes_received += out.bytes_received
        c.exchange_sent += out.bytes_sent
        c.exchange_received += out.bytes_received
        self.display.update(exchange_sent=c.exchange_sent, exchange_received=c.exchange_received)
        if self.metrics is not None:
            self.metrics.moved("exchange", "sent", out.bytes_sent)
            self.metrics.moved("exchange", "received", out.bytes_received)
        w.pending, w.pending_attempt, w.report_epoch = out, i.reduce_attempt, self.link.epoch
        await self._report(w)

    async def _measure(self, out: ReduceOutcome, held: LocalCheckpoint) -> None:
        """The commit guard's measurements: held-out loss of the round's base and new state."""
        spec = self.host.spec
        assert spec is not None
        if not spec.guard.enabled:
            return
        cell = held.cell_id
        try:
            if self.probe is None or self.probe.cell_id != cell:
                await self.host.ensure_data(cell)
                self.probe = await asyncio.to_thread(HeldoutProbe, spec, cell)
            probe = self.probe
            out.heldout_loss_base = await asyncio.to_thread(probe.loss, held.state, held.state_hash)
            out.heldout_loss = await asyncio.to_thread(probe.loss, out.state, out.state_hash)
        except Exception as e:  # noqa: BLE001  (data or model errors: report unmeasured, the round still counts)
            log.warning("held-out measurement failed: %s: %s", type(e).__name__, e)

    async def _accuse(self, evidence: pb.EvidenceRequest) -> None:
        """Send evidence against a reducer of a part we also reduced (the coordinator checks it)."""
        try:
            resp = await self.link.rpc(lambda: self.link.client.accuse(evidence))  # type: ignore[union-attr]
        except grpc.aio.AioRpcError as e:
            self.display.event("accusation-refused", level="warning", message=f"{e.code().name}: {e.details()}")
            return
        if resp is not None:
            self.display.event("accused", level="warning", convicted=resp.convicted, reason=resp.reason)

    async def _report(self, w: RoundWork, *, failed: bool = False, reason: str = "") -> None:
        """ReportRound, retried while the coordinator is down; then act on the verdict."""
        assert w.result is not None
        out = w.pending
        samples, compute_ms = claimed(self.cfg.byzantine, w.result.samples, int(w.result.compute_s * 1000))
        kw: dict[str, Any] = {
            "cell_id": w.cell_id,
            "round": w.round,
            "samples": samples,
            "loss": w.result.mean_loss,
            "compute_ms": compute_ms,
            "reduce_attempt": w.reduce_attempt,
            "failed": failed,
            "reason": reason,
        }
        fields = round_metrics(
            w.result,
            None if failed else out,
            max(0.0, w.reduce_started_at - w.ready_at) if w.ready_at and w.reduce_started_at else 0.0,
            self.device,
        )
        if w.metrics_reported:  # a re-frozen exchange: its training was reported with the first one
            fields = {k: v for k, v in fields.items() if k not in TRAINING_FIELDS}
        w.metrics_reported = True
        kw["round_metrics"] = fields
        if self.metrics is not None:
            self.metrics.round(fields, 0 if "data_ms" not in fields else w.result.samples)
        if out is not None and not failed:
            kw.update(
                state_hash=out.state_hash,
                comm_ms=int(out.comm_s * 1000),
                bytes_sent=out.bytes_sent,
                bytes_received=out.bytes_received,
                audit=out.audit,
                heldout_loss=out.heldout_loss,
                heldout_loss_base=out.heldout_loss_base,
                peer_rates=out.peer_rates,
            )
        attempt = 0
        while self.work is w:
            try:
                resp = await self.link.rpc(lambda: self.link.client.report_round(**kw))  # type: ignore[union-attr]
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    await self.link.reregister(e)
                    return
                self.display.event("report-refused", level="warning", message=f"{e.code().name}: {e.details()}")
                return
            if resp is not None:
                break
            attempt += 1
            await asyncio.sleep(backoff_delay_s(attempt, max_s=self.link.hb_interval_s))
            await self.link.maybe_reresolve()
        else:
            return
        v = resp.verdict
        self.display.event(
            "verdict",
            cell=w.cell_id,
            round=w.round,
            round_attempt=w.round_attempt,
            reduce_attempt=w.reduce_attempt,
            verdict=pb.Verdict.Name(v).removeprefix("VERDICT_").lower(),
            failed=failed,
            next=pb.Order.Name(resp.instruction.order).removeprefix("ORDER_").lower(),
        )
        for a in reconciler.decide_verdict(
            verdict_from_pb(v), reported_outcome=out is not None and not failed, current=self.work is w
        ):
            if isinstance(a, AdoptPending):
                self.commit(w)
            elif isinstance(a, DropWork):
                self.drop_work(a.why)
        self.host.on_instruction(resp.instruction)
        self.link.wake_heartbeat()

    async def _report_missing(self, a: ReportMissing) -> None:
        try:
            await self.link.rpc(
                lambda: self.link.client.report_round(  # type: ignore[union-attr]
                    cell_id=a.cell_id,
                    round=a.round,
                    failed=True,
                    reduce_attempt=a.reduce_attempt,
                    reason="this contributor lost its contribution (restarted)",
                )
            )
        except grpc.aio.AioRpcError as e:
            log.info("reporting a lost contribution: %s", e.details())

    def commit(self, w: RoundWork) -> None:
        out = w.pending
        assert out is not None and w.result is not None
        cp = LocalCheckpoint(w.cell_id, w.round, out.state, out.state_hash, out.residuals)
        self.held = cp
        self.work = None
        c = self.counters
        c.rounds_committed += 1
        if self.metrics is not None:
            self.metrics.rounds_committed.inc()
        spec = self.host.spec
        keep = spec.sync.catch_up_rounds if spec is not None else 0
        # the last few states per cell, and the updates that led to them (a catch-up applies the same)
        updates = (out.update,) if out.update is not None else ()
        self.stateserver.publish(
            w.cell_id, w.round, out.state, updates=updates, keep_updates=keep, state_hash=out.state_hash
        )
        self.display.update(committed=w.round, step=0)
        event = {
            "cell": w.cell_id,
            "round": w.round,
            "hash": out.state_hash,
            "loss": round(w.result.mean_loss, 5),
            "samples": w.result.samples,
            "contributors": w.contributors,
            "inner_steps": w.plan.inner_steps,
            "micro_batch": w.plan.micro_batch,
            "grad_accum": w.plan.grad_accum,
            "catch_up": w.catch_up,
            "bytes_sent": out.bytes_sent,
            "bytes_received": out.bytes_received,
            "exchange_s": round(out.comm_s, 4),
            "comm_s": round(out.comm_s, 3),
            "paths": out.paths,
            "exchange_sent_total": c.exchange_sent,
            "exchange_received_total": c.exchange_received,
            "bytes_sent_total": c.bytes_sent,
            "bytes_received_total": c.bytes_received,
            "checkpoint_sent_total": c.checkpoint_sent,
            "checkpoint_received_total": c.checkpoint_received,
        }
        self.host.spawn(self.save_local(cp, "committed", event), "save")

    # ------------------------------------------------------------------ the local checkpoint

    def load_local(self) -> None:
        assert self.store is not None
        try:
            cp = self.store.load()
        except LocalStateError as e:
            self.display.event("local-checkpoint-ignored", level="warning", message=str(e))
            return
        if cp is not None:
            self.held = cp
            self.reset_optimizer = True
            self.display.event("resumed", cell=cp.cell_id, round=cp.committed_round, hash=cp.state_hash[:12])
            self.display.update(committed=cp.committed_round, cell=cp.cell_id)

    async def save_local(
        self, cp: LocalCheckpoint | None = None, event: str = "", fields: dict[str, Any] | None = None
    ) -> None:
        """Write `cp` (default: the held state) atomically, then announce `event`: a
        "committed" event is only emitted once the state it names is on disk."""
        cp = cp or self.held
        store = self.store
        if cp is None or store is None:
            return
        async with self._save_lock:
            await asyncio.to_thread(store.save, cp)
            if self.cfg.keep_round_history:
                hist = store.path.parent / "history" / f"{cp.cell_id}.r{cp.committed_round}.safetensors"
                src = store.path
                await asyncio.to_thread(atomic_write_with, hist, lambda tmp: shutil.copyfile(src, tmp))
        if event:
            self.display.event(event, **(fields or {}))

    # ------------------------------------------------------------------ what heartbeats say

    def local_pb(self) -> pb.LocalState:
        h = self.held
        if h is None:
            return pb.LocalState()
        # round 0 is the deterministic initial state, whose committed hash is "" on the wire
        return pb.LocalState(
            cell_id=h.cell_id, committed_round=h.committed_round, state_hash=h.state_hash if h.committed_round else ""
        )

    def phase(self) -> int:
        """The proto phase the heartbeat reports (the reconciler's reading of the view)."""
        return int(reconciler.phase(self.view(frozenset())))

    def heartbeat_request(self) -> pb.HeartbeatRequest:
        phase = self.phase()
        req = pb.HeartbeatRequest(phase=phase, local=self.local_pb())  # type: ignore[arg-type]
        w = self.work
        if self.sync is not None:
            req.cell_id = self.sync.target[0]
        elif w is not None:
            req.cell_id, req.round, req.round_attempt = w.cell_id, w.round, w.round_attempt
            req.inner_step, req.loss = w.inner_step, w.last_loss if w.last_loss == w.last_loss else 0.0
            if w.result is not None:
                req.samples = claimed(self.cfg.byzantine, w.result.samples, 0)[0]
            req.reduce_attempt = w.reduce_attempt
        elif self.held is not None:
            req.cell_id = self.held.cell_id
        h, dr = self.held, self.donor_rates
        if dr is not None and h is not None and (h.cell_id, h.committed_round) == dr[:2]:
            for name, nbytes, ms in dr[2]:
                req.donor_rates.add(worker_id=name, nbytes=nbytes, ms=ms)
        return req
