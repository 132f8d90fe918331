"""Following the coordinator's orders: SYNC, TRAIN, REDUCE, and what a verdict means.

A mixin of `Agent` (`agent.py`); `_reconcile` there dispatches the current Instruction here.
The committed state (`Agent.held`) is only replaced by a verified sync or a commit, so an
abandoned round (WAIT, a new attempt, ABORTED, RESYNC, SIGTERM) is a rollback for free.

- SYNC: the named donor over P2P (`statesync.fetch_state`), else the coordinator's
  checkpoint (`DownloadCheckpoint`); either must hash to the committed hash. Round 0 is
  the deterministic initial state, built locally.
- TRAIN: `rounds.train_round` in a thread; then the pseudo-gradient (corrupted on purpose
  with `--byzantine`), and PHASE_READY.
- REDUCE: `rounds.reduce_round` over exactly the frozen contributors, then ReportRound.
  A failed exchange is reported `failed=True` and the delta kept: a re-freeze (higher
  reduce_attempt) redoes only the exchange, with the committed error-feedback residuals.
  A catch-up contributor (max_samples 0: we hold the base state but trained nothing)
  exchanges a zero delta with weight 0 and applies the same outer step.
- The verdict: COMMITTED adopts the new state (saved, served to joiners); PENDING waits
  until an instruction shows our hash committed (or another one: drop); RESYNC/ABORTED drop.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import grpc

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.client import backoff_delay_s
from bagel.worker.localstate import LocalCheckpoint
from bagel.worker.roundwork import RoundWork, corrupt, fresh_feedback, reduce_round, train_round
from bagel.worker.trainer import CellRuntime, build_runtime

log = logging.getLogger(__name__)


@dataclass
class _SyncJob:
    target: tuple[str, int, str]  # (cell, committed_round, committed_hash)
    task: asyncio.Task


class OrderHandlers:
    """Order-following half of the Agent (state lives on the Agent; see agent.py)."""

    cfg: Any
    display: Any

    # ------------------------------------------------------------------ SYNC

    async def _on_sync(self, i: pb.Instruction) -> None:
        target = (i.cell_id, i.committed_round, i.committed_hash)
        if self._holds(*target):
            self._cancel_sync()
            self._drop_work("synced")
            return
        if self.sync is not None and self.sync.target == target and not self.sync.task.done():
            return
        self._cancel_sync()
        self._drop_work("resync")
        self.sync = _SyncJob(target, self._spawn(self._sync(i), "sync"))
        self._hb_wake.set()

    def _cancel_sync(self) -> None:
        if self.sync is not None:
            self.sync.task.cancel()
            self.sync = None

    async def _sync(self, i: pb.Instruction) -> None:
        from bagel.worker.statesync import StateSyncError, fetch_state, verify_state_bytes

        cell, rnd, want = i.cell_id, i.committed_round, i.committed_hash
        assert self.spec is not None and self.client is not None
        self.display.update(phase="syncing", cell=cell, round=rnd)
        try:
            if rnd == 0 and not want:
                from bagel.worker.diloco import CellState

                rt = await self._runtime_for(cell)
                state = CellState.from_model(rt.task.build_model())
                source = "initial state (built locally)"
            else:
                state, source = None, ""
                donor = i.donor
                if donor.worker_id and donor.peer.peer_id:
                    try:
                        synced = await fetch_state(
                            self.p2p, donor.peer.peer_id, run_id=self.join.run_id, cell_id=cell, committed_round=rnd,
                            state_hash=want, max_nbytes=self.spec.checkpoint.max_bytes,
                            donor_maddrs=list(donor.peer.maddrs), timeout_s=self.cfg.sync_timeout_s,
                        )
                        state, source = synced.state, f"donor {donor.worker_id} ({synced.nbytes} bytes)"
                        self.counters.bytes_received += synced.nbytes
                    except StateSyncError as e:
                        self.display.event("sync-donor-failed", level="warning", donor=donor.worker_id, message=str(e))
                if state is None:
                    resp = await self._rpc(lambda: self.client.download_checkpoint(cell, rnd))  # type: ignore[union-attr]
                    if resp is None:
                        raise StateSyncError("coordinator unreachable for the checkpoint fallback")
                    info, data = resp
                    state = await asyncio.to_thread(verify_state_bytes, data, want)
                    source = f"coordinator checkpoint ({len(data)} bytes)"
                    self.counters.bytes_received += len(data)
            h = state.state_hash()
            self.held = LocalCheckpoint(cell, rnd, state, h, {})
            self._reset_optimizer = True
            self.stateserver.withdraw()
            if rnd:
                self.stateserver.publish(cell, rnd, state)
            self.display.event("synced", cell=cell, round=rnd, hash=h[:12], source=source)
            self.display.update(committed=rnd)
            await self._save_local()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # grpc errors, integrity errors: retry on the next instruction
            self.display.event("sync-failed", level="warning", cell=cell, round=rnd, message=f"{type(e).__name__}: {e}")
            await self._sleep(1.0)
        finally:
            if self.sync is not None and self.sync.task is asyncio.current_task():
                self.sync = None
            self._wake.set()
            self._hb_wake.set()

    async def _runtime_for(self, cell: str) -> CellRuntime:
        if self.runtime is None or self.runtime.cell_id != cell:
            assert self.spec is not None
            collective = self.ctx if self.ctx.enabled else None
            self.runtime = await asyncio.to_thread(
                build_runtime, self.spec, cell, self.device, throttle=self.cfg.throttle, collective=collective
            )
            self._reset_optimizer = False  # a fresh trainer has a fresh optimizer
        return self.runtime

    # ------------------------------------------------------------------ TRAIN

    async def _on_train(self, i: pb.Instruction) -> None:
        if self.sync is not None:
            return  # finishing a sync; the coordinator will see our new LocalState
        if not self._holds(i.cell_id, i.committed_round, i.committed_hash):
            if i.committed_round == 0 and not i.committed_hash:
                await self._sync(i)  # round 0: build the initial state locally (instant)
                if not self._holds(i.cell_id, 0, ""):
                    return
            else:
                self._drop_work("told to train from a state we do not hold")
                return
        w = self.work
        if w is not None and w.matches(i.cell_id, i.round, i.round_attempt):
            return
        ids = [m.worker_id for m in i.plan.members]
        if self.worker_id not in ids:
            self.display.event("not-a-member", level="warning", cell=i.cell_id, round=i.round)
            return
        self._drop_work("a new round")
        await self._trainer_idle()
        rt = await self._runtime_for(i.cell_id)
        if self._stop.is_set() or self.instr is not i:
            self._wake.set()  # things changed while the model was built: look again
            return
        reset = self._reset_optimizer
        self._reset_optimizer = False
        w = RoundWork.from_instruction(i, ids.index(self.worker_id))
        self.work = w
        self.display.update(cell=i.cell_id, round=i.round, step=0, steps=i.plan.inner_steps, deadline_unix_ms=i.plan.deadline_unix_ms)
        self.display.event("train", cell=i.cell_id, round=i.round, attempt=i.round_attempt, micro_batch=i.plan.micro_batch, grad_accum=i.plan.grad_accum, members=len(ids))
        w.task = self._train_task = self._spawn(self._train(w, rt, reset), "train")
        self._hb_wake.set()

    async def _trainer_idle(self) -> None:
        """Wait for a dropped round's training thread to stop (it checks its stop flag every
        inner step): two rounds must never train the same model at once, and in a DDP
        worker their collectives would interleave."""
        t = self._train_task
        if t is not None and not t.done():
            await asyncio.wait({t})

    async def _train(self, w: RoundWork, rt: CellRuntime, reset_optimizer: bool) -> None:
        assert self.held is not None and self.spec is not None
        held = self.held

        def on_step(p: Any) -> None:
            w.inner_step, w.last_loss = p.step, p.loss
            self.display.update(step=p.step, loss=p.loss, samples_per_s=p.samples_per_s)

        try:
            res, delta = await asyncio.to_thread(
                train_round, self.join.run_id, rt, held.state, w, self.ctx, reset_optimizer, on_step
            )
        except Exception as e:
            log.exception("training failed")
            self.display.event("train-failed", level="error", message=f"{type(e).__name__}: {e}")
            if self.work is w:
                self.work = None
            self._wake.set()
            return
        if self.work is not w or not res.completed:
            return
        if self.cfg.byzantine:
            honest = delta
            delta = corrupt(honest, self.cfg.byzantine, self._last_delta)
            self._last_delta = honest
        w.result, w.delta = res, delta
        self.counters.samples += res.samples
        self.display.event("ready", cell=w.cell_id, round=w.round, samples=res.samples, loss=round(res.mean_loss, 5), compute_s=round(res.compute_s, 2))
        self._hb_wake.set()
        self._wake.set()

    def _drop_work(self, why: str) -> None:
        """Abandon the current round (training, ready or reducing); the committed state is intact."""
        w = self.work
        if w is None:
            return
        w.stop.set()
        if w.reduce_task is not None and not w.reduce_task.done():
            w.reduce_task.cancel()
        self.work = None
        log.info("dropped round %s/%d: %s", w.cell_id, w.round, why)
        self.display.update(step=0)

    # ------------------------------------------------------------------ REDUCE

    async def _on_reduce(self, i: pb.Instruction) -> None:
        me = next((m for m in i.contributors if m.worker_id == self.worker_id), None)
        if me is None:
            return  # not ours (a stale answer): the next heartbeat corrects it
        w = self.work
        ours = w is not None and w.matches(i.cell_id, i.round, i.round_attempt)
        if me.max_samples == 0 and not (ours and w is not None and w.catch_up):
            # catch-up contributor: we hold the round's base state but trained nothing (we
            # synced during the round, or missed the freeze): exchange a zero pseudo-gradient
            # (weight 0) and apply the same outer step, so we hold the new state without a sync
            if self.sync is not None or not self._holds(i.cell_id, i.committed_round, i.committed_hash):
                return
            self._drop_work("catching up through the exchange")
            w = RoundWork.for_catch_up(i, self.held.state)  # type: ignore[union-attr]
            self.work = w
            self.display.event("catch-up", cell=i.cell_id, round=i.round, reduce_attempt=i.reduce_attempt)
        elif not ours:
            key = (i.cell_id, i.round, i.round_attempt, i.reduce_attempt)
            already = self.held is not None and self.held.cell_id == i.cell_id and self.held.committed_round >= i.round
            if not already and key not in self._missing_reported and self.sync is None:
                # we are a weighted contributor but lost our contribution (restart): say so,
                # so the coordinator re-freezes without us instead of waiting for its deadline
                self._missing_reported.add(key)
                self._spawn(self._report_missing(i), "report-missing")
            return
        assert w is not None
        if w.result is None or w.delta is None:
            return  # still training: a freeze names us only once we are ready
        if w.pending is not None and w.pending_attempt == i.reduce_attempt:
            if w.report_epoch != self._coord_epoch and (w.reduce_task is None or w.reduce_task.done()):
                w.report_epoch = self._coord_epoch  # the coordinator restarted: our report may be lost
                w.reduce_task = self._spawn(self._report(w), "re-report")
            return
        if i.reduce_attempt <= w.reduce_attempt:
            return  # this attempt is running, done, or failed (wait for a re-freeze or abort)
        if w.reduce_task is not None and not w.reduce_task.done():
            w.reduce_task.cancel()
        w.reduce_attempt = i.reduce_attempt
        w.contributors = sum(1 for m in i.contributors if m.max_samples > 0)
        w.pending = None
        w.reduce_task = self._spawn(self._reduce(w, i), "reduce")
        self._hb_wake.set()

    async def _reduce(self, w: RoundWork, i: pb.Instruction) -> None:
        from bagel.worker.averaging import ExchangeError

        assert self.spec is not None and self.held is not None and w.result is not None
        held = self.held
        self.display.update(phase="reducing")
        # a catch-up exchange sends nothing, so it must not touch our residuals
        ef = fresh_feedback(held.residuals) if self.spec.diloco.error_feedback and not w.catch_up else None
        try:
            out = await reduce_round(
                self.dataplane, self.spec, self.worker_id, held.state, w, i, ef, self.cfg.reduce_timeout_s
            )
            if w.catch_up or not self.spec.diloco.error_feedback:
                out.residuals = dict(held.residuals) if w.catch_up else {}
        except ExchangeError as e:
            self.display.event("exchange-failed", level="warning", round=w.round, round_attempt=w.round_attempt, reduce_attempt=i.reduce_attempt, message=str(e))
            await self._report(w, failed=True, reason=str(e)[:500])
            return
        self.counters.bytes_sent += out.bytes_sent
        self.counters.bytes_received += out.bytes_received
        self.counters.exchange_sent += out.bytes_sent
        self.counters.exchange_received += out.bytes_received
        self.display.update(bytes_sent=self.counters.bytes_sent, bytes_received=self.counters.bytes_received)
        w.pending, w.pending_attempt, w.report_epoch = out, i.reduce_attempt, self._coord_epoch
        await self._report(w)

    async def _report(self, w: RoundWork, *, failed: bool = False, reason: str = "") -> None:
        """ReportRound, retried while the coordinator is down; then act on the verdict."""
        assert w.result is not None
        out = w.pending
        kw: dict[str, Any] = dict(
            cell_id=w.cell_id, round=w.round, samples=w.result.samples, loss=w.result.mean_loss,
            compute_ms=int(w.result.compute_s * 1000), reduce_attempt=w.reduce_attempt, failed=failed, reason=reason,
        )
        if out is not None and not failed:
            kw.update(state_hash=out.state_hash, comm_ms=int(out.comm_s * 1000), bytes_sent=out.bytes_sent, bytes_received=out.bytes_received)
        attempt = 0
        while self.work is w:
            try:
                resp = await self._rpc(lambda: self.client.report_round(**kw))  # type: ignore[union-attr]
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    await self._register()
                    return
                self.display.event("report-refused", level="warning", message=f"{e.code().name}: {e.details()}")
                return
            if resp is not None:
                break
            attempt += 1
            await asyncio.sleep(backoff_delay_s(attempt, max_s=self.hb_interval_s))
            await self._maybe_reresolve()
        else:
            return
        v = resp.verdict
        self.display.event(
            "verdict", cell=w.cell_id, round=w.round, round_attempt=w.round_attempt, reduce_attempt=w.reduce_attempt,
            verdict=pb.Verdict.Name(v).removeprefix("VERDICT_").lower(), failed=failed,
            next=pb.Order.Name(resp.instruction.order).removeprefix("ORDER_").lower(),
        )
        if v == pb.VERDICT_COMMITTED and out is not None and not failed and self.work is w:
            self._commit(w)
        elif v in (pb.VERDICT_RESYNC, pb.VERDICT_ABORTED):
            if self.work is w:
                self._drop_work(pb.Verdict.Name(v))
        self._on_instruction(resp.instruction)
        self._hb_wake.set()

    async def _report_missing(self, i: pb.Instruction) -> None:
        try:
            await self._rpc(lambda: self.client.report_round(  # type: ignore[union-attr]
                cell_id=i.cell_id, round=i.round, failed=True, reduce_attempt=i.reduce_attempt,
                reason="this contributor lost its contribution (restarted)",
            ))
        except grpc.aio.AioRpcError as e:
            log.info("reporting a lost contribution: %s", e.details())

    def _commit(self, w: RoundWork) -> None:
        out = w.pending
        assert out is not None and w.result is not None
        cp = LocalCheckpoint(w.cell_id, w.round, out.state, out.state_hash, out.residuals)
        self.held = cp
        self.work = None
        self.counters.rounds_committed += 1
        self.stateserver.publish(w.cell_id, w.round, out.state)  # keeps the last few per cell
        self.display.update(committed=w.round, step=0)
        event = dict(
            cell=w.cell_id, round=w.round, hash=out.state_hash, loss=round(w.result.mean_loss, 5),
            samples=w.result.samples, contributors=w.contributors, inner_steps=w.plan.inner_steps,
            micro_batch=w.plan.micro_batch, grad_accum=w.plan.grad_accum, catch_up=w.catch_up,
            bytes_sent=out.bytes_sent, bytes_received=out.bytes_received,
            exchange_sent_total=self.counters.exchange_sent, exchange_received_total=self.counters.exchange_received,
            bytes_sent_total=self.counters.bytes_sent, bytes_received_total=self.counters.bytes_received,
        )
        self._spawn(self._save_local(cp, "committed", event), "save")
