"""Discrete-event engine: synthetic workers drive the real coordinator core.

One `Engine` simulates one policy over one scenario. It owns a virtual clock and an event
heap (`heapq` of `(time_ms, seq, kind, worker, token)`, each packed into one int, see
`Engine.push`; `seq` breaks ties, so two runs with the same seed pop events in the same
order). All randomness comes from numpy
generators spawned from the scenario seed; the core gets its own `random.Random(seed)`.
No I/O and no clock: this is a pure core like `coordinator/state.py`, which it drives
through the very same `CoordinatorState.apply(now_ms, event)` the daemon's gRPC shell
calls, with the same events (Register, Heartbeat with phases, ReportRound, Leave, Tick,
CheckpointStored).

Workers follow their instructions with the real worker's own decisions (level-triggered,
`bagel.worker.reconciler.decide`, see workers.py): TRAIN -> compute for the cost model's
time -> heartbeat READY; REDUCE -> exchange over the contributors' links -> ReportRound
with the state hash (honest members derive the same deterministic hash from the
exchange, Byzantine ones report another); SYNC -> download over the joiner's link ->
heartbeat IDLE with the new LocalState. Dead workers simply stop sending; the core
notices through its own leases.

The heartbeat approximation (what makes 10,000 workers x 24 h affordable):
- A real worker heartbeats every `schedule.heartbeat_s`. Most heartbeats change nothing;
  the simulator sends only the ones that matter:
  * a phase change the core acts on (READY, IDLE after a sync) is sent at once, as the
    real worker does;
  * a change of the worker's instruction (another member's event opened, froze, committed
    or aborted its round, or moved it) reaches a worker that waits on the coordinator
    (IDLE, READY, REDUCING) through its held watch (the real worker keeps a
    `WatchInstruction` long poll open then, which the coordinator answers when its
    instruction changes): one link latency after the change
    (`W.watch_ms`), the worker heartbeats and acts on the answer. A worker that trains
    or downloads hears it at its next periodic heartbeat (`_hear_change`). The
    engine reads the change off `Outcome.effects` (rounds whose state, attempt or
    contributor set changed; workers that changed cell or status: the core is built with
    `records=False`, so these are its live entities, read at once, not frozen records).
    A member that is READY when its round freezes repeats that READY to hear the REDUCE;
    in declared lease mode such a heartbeat changes nothing in the core, so the engine
    reads the REDUCE with a query instead (`_repeat_ready`; `EngineResult.core_calls`
    leaves these out);
  * what no change prompts goes at the worker's next periodic heartbeat: each worker has
    a fixed heartbeat phase in [0, heartbeat_s), and `_poll_later` schedules one at the
    next tick of that phase (a waiting worker's heartbeat, which may open its cell's next
    round; a message refused as stale; contact regained after a cut or a SIGSTOP);
  * leases (`engine.lease_mode`):
    - "declared" (default): live workers send no lease-only heartbeats. When a worker
      dies, is cut off or stopped, the engine sends `LeaseExpired` at exactly the moment
      the daemon's lease would run out: its last periodic heartbeat before the loss plus
      `schedule.lease_s`. Because the core's own lease timer would otherwise expire the
      silent-but-alive workers, the core is built with `schedule.lease_s` = 10^7 s in this
      mode; the one other place the core reads lease_s, the reduce deadline's grace, is
      therefore unbounded (stuck exchanges still end: failed reports make the quorum
      impossible, and lost contributors are declared). See the final report's request
      for a core knob that removes this difference.
    - "heartbeat": a heartbeat that only renews the lease is sent when the lease would
      otherwise come within one heartbeat period of expiring (a lazily re-armed timer per
      worker); the core's own timer expires the dead. Faithful on the wire, but one event
      per live worker per (lease_s - heartbeat_s): affordable only with coarse leases.
  Phases the core does not act on (SYNCING, TRAINING, REDUCING) ride on those
  heartbeats instead of being sent on their own, so a round is OPEN until its first
  READY (cosmetic: the core only distinguishes OPEN from TRAINING for status).
- The core's time-driven transitions run on `Tick` events at the round and reduce
  deadlines the engine reads off round records, at the lease expiries of silent
  workers (heartbeat mode), and on a coarse periodic tick (`engine.tick_s`).
- All contributors of an exchange finish it at the same instant (the all-gather ends
  for everyone together), so their reports arrive in one burst, in the order they
  joined.

Overlap: with `[diloco] overlap = "delayed"` in the run spec (and a policy that leaves it
on: the baselines turn it off), a worker trains the next round ahead while its weighted
exchange runs and until that round opens, as the real worker does (workers.py). Every
interval of a worker's time still goes to exactly one bucket: `_set_act` splits an
interval spent training ahead from the activity's own bucket.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from bagel.coordinator.core.entities import Round, Worker
from bagel.coordinator.core.errors import Banned, CoordinatorError, UnknownWorker
from bagel.coordinator.core.events import Event, Heartbeat, Outcome, Register, Tick
from bagel.coordinator.core.records import CellConfig, CommitRecord, RoundState, WorkerState
from bagel.coordinator.core.scheduler import cell_targets
from bagel.coordinator.core.state import CoordinatorState
from bagel.protocol.messages import Instruction, Order, PeerAddress, Phase, Profile
from bagel.protocol.runspec import ROUTER_CELL, RunSpec
from bagel.sim.discrete import costmodel as cm
from bagel.sim.discrete import population as popmod
from bagel.sim.discrete.ledger import Ledger
from bagel.sim.discrete.policies import SimPolicy
from bagel.sim.discrete.scenario import Scenario
from bagel.sim.discrete.workers import (
    ACT_BUCKET,
    ARRIVE,
    CONT,
    DEPART,
    FAULT,
    HEAL,
    IDLE,
    LEASE,
    OFF,
    POLL,
    PTICK,
    READY,
    REDUCE,
    REDUCE_DONE,
    RENEW,
    SAMPLE,
    STALL,
    SYNC,
    SYNC_DONE,
    TICK,
    TRAIN,
    TRAIN_DONE,
    UPLOAD,
    WAITV,
    XTIMEOUT,
    Exchange,
    Lockstep,
    W,
    WorkerBehaviour,
)

# an event's bit fields (`Engine.push`), from the bottom: token (32 bits), worker index + 1
# (24), kind (8), seq (32), then the time in ms
_TOKEN_MASK = (1 << 32) - 1
_WORKER, _WORKER_MASK = 32, (1 << 24) - 1
_KIND, _KIND_MASK = 56, (1 << 8) - 1
_SEQ, _SEQ_MASK = 64, (1 << 32) - 1
_T = 96
T0_MS = 1_767_225_600_000  # virtual epoch: 2026-01-01T00:00:00Z (the core works in unix ms)
DECLARED_CORE_LEASE_S = 10_000_000.0  # declared lease mode: longer than any simulation
# the activities whose heartbeat phase (IDLE, READY, REDUCING) holds a watch between beats
WATCHING_ACTS = frozenset({IDLE, READY, REDUCE, WAITV})


@dataclass(frozen=True)
class EngineResult:
    policy: str
    ledger: Ledger
    workers: int
    hours: float
    events: int
    core_calls: int  # transitions of the coordinator core (`CoordinatorState.apply`)
    cells: tuple[str, ...]
    cell_targets: dict[str, float]
    cell_flops_per_sample: dict[str, float]
    timeline_h: np.ndarray  # sample times (hours)
    rounds_timeline: np.ndarray  # [points, cells] cumulative committed rounds
    util_timeline: np.ndarray  # [points] instantaneous training / online compute
    online_timeline: np.ndarray  # [points] workers online
    bytes_sent: np.ndarray  # per worker
    bytes_recv: np.ndarray
    ever_online: np.ndarray  # bool per worker
    steps_per_round: int
    throughput_spread: float  # p95 / p5 of achieved FLOP/s of the population
    overlap: str = "off"  # the run spec's [diloco] overlap as the workers ran it
    core_queries: int = 0  # heartbeats answered by a read-only core query (`Engine._repeat_ready`)


class Engine(WorkerBehaviour):
    """Simulate one policy on one scenario: `Engine(scenario, policy, ...).run()`."""

    def __init__(
        self,
        scenario: Scenario,
        policy: SimPolicy,
        *,
        workers: int | None = None,
        hours: float | None = None,
        seed: int | None = None,
    ) -> None:
        sc = scenario.scenario
        self.sc = scenario
        self.n = workers or sc.workers
        self.hours = hours or sc.hours
        self.seed = sc.seed if seed is None else seed
        self.work = scenario.workload
        ss = np.random.SeedSequence(self.seed)
        pop_seed, av_seed, fault_seed, byz_seed, est_seed = ss.spawn(5)
        self.rng = np.random.default_rng(av_seed)
        self.frng = np.random.default_rng(fault_seed)
        self.brng = np.random.default_rng(byz_seed)
        self.pop = popmod.sample_population(scenario.population, self.n, np.random.default_rng(pop_seed))
        base: dict[str, dict[str, object]] = {}
        if self.n != sc.workers and scenario.engine.scale_batch_with_workers:
            # keep each member's per-step batch (so the round's length) as the scenario intends
            gb = scenario.run_spec().diloco.group_batch
            base["diloco"] = {"group_batch": max(1, round(gb * self.n / sc.workers))}
        k = scenario.engine.sync_dp_steps_per_round
        if policy.comm_every_step and k == 0:
            k = sync_steps_per_round(scenario, scenario.run_spec(base), self.pop, np.random.default_rng(est_seed))
        self.policy = policy.resolved(max(1, k))
        overrides = {s_: dict(v) for s_, v in base.items()}
        for s_, v in self.policy.spec_overrides.items():
            overrides.setdefault(s_, {}).update(v)
        self.declared = scenario.engine.lease_mode == "declared"
        self.lease_ms = int(scenario.run_spec(overrides).schedule.lease_s * 1000)
        if self.declared:
            # the core's own lease timer must not expire live workers that the engine does
            # not heartbeat: it gets a lease it never reaches, and LeaseExpired at the
            # moment the daemon's lease would have run out (see actors._lost_contact)
            overrides.setdefault("schedule", {})["lease_s"] = DECLARED_CORE_LEASE_S
        self.spec: RunSpec = scenario.run_spec(overrides)
        # workers train the next round ahead during the exchange (lock-stepped ones cannot)
        self.overlap = self.spec.diloco.overlap == "delayed" and not self.policy.lockstep
        self.av = scenario.population.availability
        self.cells = self.spec.cell_ids
        self.flops_per_sample = {c: cm.cell_flops_per_sample(self.work, c) for c in self.cells}
        # the daemon's own per-cell compute targets (uniform cluster sizes: no dataset here)
        self.targets = cell_targets(self.spec, None)
        codec = self.spec.diloco.codec
        comm_k = self.policy.core.inner_steps if self.policy.comm_every_step else 1
        self.comm_rounds = comm_k or 1
        self.payload = {c: cm.encoded_nbytes(codec, int(cm.cell_params(self.work, c))) for c in self.cells}
        # catching up by committed updates (`[sync] catch_up_rounds`, workers.py): how many
        # rounds' updates a worker keeps per cell (its state server also keeps no more of them
        # than fit in the state's own bytes), and the recent committed hashes of each cell
        # (an update applies only to the committed state of the round before it)
        self.catch_up_rounds = self.spec.sync.catch_up_rounds
        self.keep_updates = {
            c: min(self.catch_up_rounds, cm.cell_state_bytes(self.work, c) // max(1, self.payload[c]))
            for c in self.cells
        }
        self.commit_hashes: dict[str, dict[int, str]] = {}
        cfgs = [
            CellConfig(
                c,
                cm.cell_memory_bytes(self.work, c),
                self.targets[c],
                self.payload[c] * self.comm_rounds,
                host_bytes=cm.cell_host_bytes(self.work, c),
            )
            for c in self.cells
        ]
        # the core hands back the live entities it changed, not frozen records: the engine
        # reads them at once and persists nothing
        self.core = CoordinatorState(
            self.spec, cfgs, policy=self.policy.core, rng=random.Random(self.seed), now_ms=T0_MS, records=False
        )
        self.hb_ms = int(self.spec.schedule.heartbeat_s * 1000)
        self.end_ms = int(self.hours * 3600_000)
        self.heap: list[int] = []  # packed events (`push`)
        self.seq = 0
        self.now = 0
        self.ledger = Ledger()
        self.core_calls = 0
        self.core_queries = 0  # answers read without a transition (`_repeat_ready`)
        self.events = 0
        self.last_tick = -1
        self.exchanges: dict[tuple[str, int, int], Exchange] = {}
        self.ex_list: list[Exchange] = []
        self.locksteps: dict[tuple[str, int, int], Lockstep] = {}
        self.uploads: dict[int, tuple[str, int, str]] = {}
        self.seen_round: dict[str, tuple[int, int, RoundState, int]] = {}
        self.member_ids: dict[tuple[str, int, int], tuple[str, ...]] = {}
        self.online_flops = 0.0
        self.train_flops = 0.0
        self.online_count = 0
        self.samples_t: list[float] = []
        self.samples_rounds: list[list[int]] = []
        self.samples_util: list[float] = []
        self.samples_online: list[int] = []
        self.cell_index = {c: j for j, c in enumerate(self.cells)}
        self.rounds_now = [0] * len(self.cells)
        self.by_id: dict[str, W] = {}
        self._expert0 = self.spec.expert_cells[0]  # (a property that builds every cell id)
        self.ws = [self._make_worker(i) for i in range(self.n)]

    # ------------------------------------------------------------ setup

    def _make_worker(self, i: int) -> W:
        p = self.pop
        w = W(i)
        w.flops = float(p.tflops[i]) * 1e12 * self.work.mfu
        rate_e = w.rate_e = cm.samples_per_s(self.work, float(p.tflops[i]), self._expert0)
        rate_r = w.rate_r = cm.samples_per_s(self.work, float(p.tflops[i]), ROUTER_CELL)
        w.bw = float(p.bandwidth_bytes_per_s[i])
        w.lat = float(p.latency_s[i])
        w.watch_ms = max(1, int(w.lat * 1000))
        w.byz = bool(p.byzantine[i])
        w.spot = bool(p.spot[i])
        w.hb_phase = int(self.rng.integers(0, self.hb_ms))
        w.profile = Profile(
            name=w.wid,
            device_kind="cuda",
            device_name=p.gpu[i],
            vram_bytes=int(p.vram_bytes[i]),
            host_memory_bytes=0 if p.host_bytes is None else int(p.host_bytes[i]),
            link_bandwidth_bytes_per_s=w.bw,
            samples_per_s={c: (rate_r if c == ROUTER_CELL else rate_e) for c in self.cells},
        )
        self.by_id[w.wid] = w
        return w

    @staticmethod
    def rate(w: W, cell: str) -> float:
        return w.rate_r if cell == ROUTER_CELL else w.rate_e

    def push(self, t: int, kind: int, i: int = -1, token: int = 0) -> None:
        """Schedule event `kind` of worker `i` (-1: none) with `token` at virtual time `t` ms.

        An event is one int, (t, seq, kind, i + 1, token) packed in fixed bit fields from
        the top (`_SEQ`, `_KIND`, `_WORKER` shifts): ints compare in C without building or
        walking a tuple, and the order is exactly (t, seq), seq unique, as the tuple's was.
        The heap's pops were the engine's largest single cost."""
        seq = self.seq = self.seq + 1
        if not (0 <= token <= _TOKEN_MASK and -1 <= i < _WORKER_MASK and seq <= _SEQ_MASK):
            raise OverflowError(f"event field out of range: seq {seq}, worker {i}, token {token}")
        heapq.heappush(self.heap, (t << _T) | (seq << _SEQ) | (kind << _KIND) | ((i + 1) << _WORKER) | token)

    # ------------------------------------------------------------ the loop

    def run(self, progress: Callable[[float], None] | None = None) -> EngineResult:
        av = self.av
        for w in self.ws:
            if self.rng.random() < av.initial_online_fraction:
                # the volunteers online when the coordinator starts were already retrying to
                # reach it: they all register at t=0, before anyone's first heartbeat opens a round
                self.push(0, ARRIVE, w.i, w.gen)
            else:
                self.push(int(popmod.draw_offline_s(av, 0.0, self.rng) * 1000), ARRIVE, w.i, w.gen)
        for j, f in enumerate(self.sc.faults):
            self.push(int(f.at_s * 1000), FAULT, j)
        pts = self.sc.engine.timeline_points
        for k in range(pts):
            self.push(int(self.end_ms * k / (pts - 1)), SAMPLE)
        ptick = int(self.sc.engine.tick_s * 1000)
        self.push(ptick, PTICK)
        handlers = {
            ARRIVE: self._on_arrive,
            DEPART: self._on_depart,
            SYNC_DONE: self._on_sync_done,
            TRAIN_DONE: self._on_train_done,
            REDUCE_DONE: self._on_reduce_done,
            POLL: self._on_poll,
            RENEW: self._on_renew,
            UPLOAD: self._on_upload,
            LEASE: self._on_lease,
            HEAL: self._on_heal,
            CONT: self._on_cont,
        }
        heap = self.heap
        pop = heapq.heappop
        end = self.end_ms
        ws = self.ws
        next_report = 1 << 14
        while heap:
            e = pop(heap)
            t = e >> _T
            if t > end:
                break
            kind = (e >> _KIND) & _KIND_MASK
            i = ((e >> _WORKER) & _WORKER_MASK) - 1
            token = e & _TOKEN_MASK
            self.now = t
            self.events += 1
            if kind == TICK:
                self._tick()
            elif kind == PTICK:
                self._tick()
                self.push(t + ptick, PTICK)
            elif kind == SAMPLE:
                self._sample()
            elif kind == FAULT:
                self._fault(self.sc.faults[i])
            elif kind == XTIMEOUT:
                self._on_xtimeout(self.ex_list[token])
            else:
                w = ws[i]
                handlers[kind](w, token)
            if progress is not None and self.events >= next_report:
                next_report += 1 << 14
                progress(t / end)
        self.now = end
        for w in ws:
            if w.online:
                self._drop_ahead(w, "run ended", "unresolved")
                self._set_act(w, OFF)
        self.ledger.close()
        if progress is not None:
            progress(1.0)
        return self._result()

    # ------------------------------------------------------------ core calls

    def _apply(self, ev: Event) -> Outcome:
        self.core_calls += 1
        out = self.core.apply(T0_MS + self.now, ev)
        if out.effects:
            self._absorb(out.effects, getattr(ev, "worker_id", ""))
        return out

    def _send(self, w: W, ev: Event) -> Outcome | None:
        """Deliver a worker's message; None if it was lost or refused (then the worker reacts)."""
        if w.cut or w.stopped or not w.online:
            return None
        try:
            out = self._apply(ev)
        except UnknownWorker:
            # the coordinator lost us (lease expired while cut off, or a Leave raced): re-register
            self.ledger.core_errors["UnknownWorker"] += 1
            return self._register(w)
        except Banned:
            self.ledger.core_errors["Banned"] += 1
            self._ban(w)
            return None
        except CoordinatorError as e:
            # a late or stale message: the real worker logs it and heartbeats again
            self.ledger.core_errors[type(e).__name__] += 1
            self._poll_later(w)
            return None
        self._contacted(w, out)
        return out

    def _register(self, w: W) -> Outcome | None:
        if w.cut or w.stopped:
            return None  # lost on the way; it registers when it can reach the coordinator
        ev = Register(w.wid, w.profile, PeerAddress(peer_id=w.wid), w.local)
        w.regs += 1
        try:
            out = self._apply(ev)
        except Banned:
            self._ban(w)
            return None
        except CoordinatorError as e:
            self.ledger.core_errors[type(e).__name__] += 1
            return None
        self._contacted(w, out)
        return out

    def _contacted(self, w: W, out: Outcome) -> None:
        if out.lease_expires_ms is not None and not self.declared:
            w.lease_until = out.lease_expires_ms - T0_MS
            w.renew_due = w.lease_until - self.hb_ms
            if not w.renew_armed:
                w.renew_armed = True
                self.push(max(w.renew_due, self.now + 1), RENEW, w.i, w.gen)

    def _tick_at(self, t: int) -> None:
        """Run the core's timers at t (a deadline or a lease expiry the engine knows of)."""
        if t > self.now:
            self.push(t, TICK)

    def _tick(self) -> None:
        if self.now != self.last_tick:
            self.last_tick = self.now
            self._apply(Tick())

    def _heartbeat(self, w: W) -> Outcome | None:
        a = w.act
        key = w.key
        ready_hb, w.ready_hb = w.ready_hb, None
        if a == READY and key is not None:
            if ready_hb == key and self.declared and not (w.cut or w.stopped or not w.online):
                # The same READY again, while its round exchanges with it as a contributor
                # (the REDUCE that a freeze makes every member hear): the core would change
                # nothing but the lease, which it does not keep in declared mode, and answer
                # that REDUCE (`_repeat_ready`). Else it is sent as any heartbeat.
                ins = self._repeat_ready(w, key)
                if ins is not None:
                    w.ready_hb = key
                    return Outcome(ins, None, None, ())
            ev = Heartbeat(w.wid, Phase.READY, key[0], key[1], samples=w.samples, local=w.local, round_attempt=key[2])
            regs = w.regs
            out = self._send(w, ev)
            if out is not None and w.regs == regs:  # the heartbeat itself got through
                w.ready_hb = key
            return out
        elif a in (TRAIN, STALL) and key is not None:
            # progress so far, as the real worker reports it (the core estimates a late
            # member's speed from it), counting the steps trained ahead it started with
            h, h0 = w.h, w.h0
            done = h if a == STALL else min(h, h0 + int((h - h0) * (self.now - w.since) / (w.dur_s * 1000.0 + 1e-9)))
            ev = Heartbeat(w.wid, Phase.TRAINING, key[0], key[1], inner_step=done, local=w.local, round_attempt=key[2])
        elif a in (REDUCE, WAITV) and w.rkey is not None:
            r = w.rkey
            ev = Heartbeat(w.wid, Phase.REDUCING, r[0], r[1], local=w.local, reduce_attempt=r[2])
        elif a == SYNC and w.sync_target is not None:
            ev = Heartbeat(w.wid, Phase.SYNCING, w.sync_target[0], local=w.local)
        else:
            ev = Heartbeat(w.wid, Phase.IDLE, w.local.cell_id, local=w.local, donor_rates=w.sync_rates)
            w.sync_rates = ()  # the real worker repeats them, but only the first is read
        return self._send(w, ev)

    def _repeat_ready(self, w: W, key: tuple[str, int, int]) -> Instruction | None:
        """The REDUCE the core answers a READY heartbeat of `w` that repeats its last one
        (`_heartbeat`), or None if the answer may be anything else.

        Such a heartbeat is a no-op for the core, apart from renewing the lease, when the
        round it names is exchanging and `w` is one of its contributors: the phase, round,
        step and held state it carries are what the core already has from `w`; a READY
        counts only while the round trains; no round can open or admit `w` while that
        round is open and `w` is its member; a cell waits for late reporters only between a
        commit and the next round's open; and a REDUCE answer starts no clock. In declared
        lease mode the core's lease is never read (`DECLARED_CORE_LEASE_S`), so the
        instruction the core would answer, read without a transition
        (`CoordinatorState.instruction_for`), is the whole outcome. It is a query, not a
        core call (`core_queries`)."""
        try:
            ins = self.core.instruction_for(w.wid)
        except CoordinatorError:
            return None
        if ins.order is Order.REDUCE and ins.cell_id == key[0] and ins.round == key[1] and ins.round_attempt == key[2]:
            self.core_queries += 1
            return ins
        return None

    # ------------------------------------------------------------ effects -> who must hear

    def _absorb(self, effects: tuple[object, ...], caller: str) -> None:
        """Hear what a transition changed. The core runs with `records=False`: the effects
        are the live `Round` and `Worker` entities it touched (and `Cell`s, not read here),
        and the commit records."""
        for r in effects:
            if isinstance(r, Round):
                self._on_round_record(r, caller)
            elif isinstance(r, CommitRecord):
                self._on_commit(r)
            elif isinstance(r, Worker) and r.id != caller:
                w = self.by_id.get(r.id)
                if (
                    w is not None
                    and w.online
                    and (r.state is not WorkerState.ACTIVE or r.cell != self._believed_cell(w))
                ):
                    self._hear_change(w)

    def _believed_cell(self, w: W) -> str:
        if w.key is not None and w.act in (TRAIN, READY, STALL):
            return w.key[0]
        if w.sync_target is not None and w.act == SYNC:
            return w.sync_target[0]
        return w.local.cell_id

    def _on_round_record(self, r: Round, caller: str) -> None:
        """A round changed: arm its deadline, settle the ledger, and make everyone whose
        instruction changed hear it (`_hear_change`)."""
        if r.freeze_by_ms and r.state in (RoundState.OPEN, RoundState.TRAINING):
            self._tick_at(r.freeze_by_ms - T0_MS)  # the core's wait for the last members ends then
        sig = (r.round, r.attempt, r.state, r.reduce_attempt)
        prev = self.seen_round.get(r.cell)
        if prev == sig:
            return
        self.seen_round[r.cell] = sig
        st = r.state
        key = (r.cell, r.round, r.attempt)
        if st is RoundState.TRAINING and prev is not None and prev[:2] == sig[:2]:
            return  # OPEN -> TRAINING: every member's order is still TRAIN
        if st is RoundState.REDUCING:
            self._tick_at(r.reduce_deadline_ms - T0_MS)
            who = self.member_ids.get(key, ()) + r.contributors  # catch-up contributors too
        elif st.terminal:
            who = self.member_ids.pop(key, ()) + r.contributors
            if st is RoundState.ABORTED:
                self.ledger.aborts += 1
                self.ledger.abort_reasons[_reason_kind(r.reason)] += 1
                self.ledger.resolve_abort(key)
                self.locksteps.pop(key, None)
        else:  # a new attempt opened
            self._tick_at(r.deadline_ms - T0_MS)
            who = self.member_ids[key] = tuple(m.worker_id for m in r.member_plans)
        by = self.by_id
        for wid in who:
            if wid != caller:
                w = by.get(wid)
                if w is not None and w.online:
                    self._hear_change(w)

    def _on_commit(self, c: CommitRecord) -> None:
        led = self.ledger
        by = self.by_id
        members = [by[x] for x in c.contributors if x in by]
        key = (c.cell_id, c.round, c.attempt)
        # every frozen contributor that trained this round is in the committed average,
        # whatever order the reports then came in (the core's CommitRecord.samples counts
        # only those that reported before the quorum did); catch-up contributors add nothing
        trained = [w for w in members if w.key == key and w.samples > 0]
        useful = {w.i for w in trained if not w.byz}
        rejected = {w.i for w in trained if w.byz}
        samples = sum(w.samples for w in trained if not w.byz)
        led.committed_rounds += 1
        led.commits.append((self.now / 1000.0, c.cell_id, samples))
        j = self.cell_index.get(c.cell_id)
        if j is not None:
            self.rounds_now[j] += 1
        led.resolve_commit(key, useful, rejected)
        self.locksteps.pop(key, None)
        if self.catch_up_rounds:
            hashes = self.commit_hashes.setdefault(c.cell_id, {})
            hashes[c.round] = c.state_hash
            hashes.pop(c.round - self.catch_up_rounds - 1, None)
        hold = self.core.next_round_hold_ms(c.cell_id)
        if hold is not None:  # the next round waits for late reporters, at most until then
            self._tick_at(hold - T0_MS)
        # the commit changed the instruction of the cell's other workers too: one that held
        # or was fetching the state before it is now a round behind (SYNC, or a catch-up by
        # the updates), and a real worker's held watch tells it so
        frozen = set(c.contributors)
        for wid in self.core.cell_workers(c.cell_id):
            w = by.get(wid)
            if w is not None and w.online and wid not in frozen:
                self._hear_change(w)

    def _poll_later(self, w: W) -> None:
        """The worker's next periodic heartbeat (fixed phase): what a worker that is not told
        of a change sends anyway (it waits, it was refused, it is back in contact)."""
        hb = self.hb_ms
        self._poll_at(w, self.now + ((w.hb_phase - self.now) % hb or hb))

    def _hear_change(self, w: W) -> None:
        """Another event changed the worker's instruction. A worker that waits on the
        coordinator holds a watch, which answers one link latency later, and then it
        heartbeats at once; one that trains or downloads holds none and hears it at its
        next heartbeat (worker/link.py)."""
        if w.act in WATCHING_ACTS:
            self._poll_at(w, self.now + w.watch_ms)
        else:
            self._poll_later(w)

    def _poll_at(self, w: W, t: int) -> None:
        """A POLL (a heartbeat and its answer) at t, unless one is due by then already; a
        later one still pending is superseded (`_on_poll` skips it)."""
        if 0 <= w.poll_at <= t:
            return
        w.poll_at = t
        self.push(t, POLL, w.i, w.gen)

    # ------------------------------------------------------------ activity accounting

    def _set_act(self, w: W, act: int) -> None:
        """Book the worker's time since its last change to the activity it had, then switch
        to `act` (the same one: just book so far)."""
        now = self.now
        dt = (now - w.since) / 1000.0
        old = w.act
        if dt > 0 and old != OFF:
            fl = dt * w.flops
            if old == TRAIN:
                useful = fl * (w.own_s / w.dur_s if w.dur_s > w.own_s > 0 else 1.0)
                if w.key is not None:
                    self.ledger.train(w.key, w.i, useful)
                self.ledger.add("barrier", fl - useful)  # lock-step: waiting for the slowest
            else:
                room = w.ahead_room
                if room > 0.0 and not w.stopped:
                    # training ahead (only ever in REDUCE, WAITV or IDLE): the first `room`
                    # seconds are training, held on the worker; the rest is the activity's
                    if dt < room:
                        w.ahead_room = room - dt
                        w.ahead_fl += fl
                    else:
                        w.ahead_room = 0.0
                        ahead = room * w.flops
                        w.ahead_fl += ahead
                        self.ledger.add(ACT_BUCKET[old], fl - ahead)
                else:
                    self.ledger.add(ACT_BUCKET[old], fl)
            self.ledger.offered += fl
        if old == TRAIN and act != TRAIN:
            self.train_flops -= w.flops
        elif act == TRAIN and old != TRAIN:
            self.train_flops += w.flops
        w.act = act
        w.since = now

    # ------------------------------------------------------------ observation

    def _sample(self) -> None:
        self.samples_t.append(self.now / 3600_000.0)
        self.samples_rounds.append(list(self.rounds_now))
        training = self.train_flops
        if self.overlap:  # and those training ahead right now (no event marks the cap)
            now = self.now
            for w in self.ws:
                if w.ahead_room > 0.0 and not w.stopped and now - w.since < w.ahead_room * 1000.0:
                    training += w.flops
        self.samples_util.append(training / self.online_flops if self.online_flops > 0 else 0.0)
        self.samples_online.append(self.online_count)

    def _result(self) -> EngineResult:
        fl = np.array([w.flops for w in self.ws])
        spread = float(np.percentile(fl, 95) / np.percentile(fl, 5)) if len(fl) else 1.0
        return EngineResult(
            policy=self.policy.name,
            ledger=self.ledger,
            workers=self.n,
            hours=self.hours,
            events=self.events,
            core_calls=self.core_calls,
            cells=tuple(self.cells),
            cell_targets=dict(self.targets),
            cell_flops_per_sample=dict(self.flops_per_sample),
            timeline_h=np.array(self.samples_t),
            rounds_timeline=np.array(self.samples_rounds, dtype=np.int64).reshape(len(self.samples_t), len(self.cells)),
            util_timeline=np.array(self.samples_util),
            online_timeline=np.array(self.samples_online),
            bytes_sent=np.array([w.sent for w in self.ws], dtype=np.float64),
            bytes_recv=np.array([w.recv for w in self.ws], dtype=np.float64),
            ever_online=np.array([w.ever for w in self.ws]),
            steps_per_round=int(self.policy.core.inner_steps or self.spec.diloco.inner_steps),
            throughput_spread=spread,
            overlap="delayed" if self.overlap else "off",
            core_queries=self.core_queries,
        )


def sync_steps_per_round(scenario: Scenario, spec: RunSpec, pop: popmod.Population, rng: np.random.Generator) -> int:
    """K for sync_dp: lock-step steps folded into one core round, chosen so that a typical
    cell's round lasts about `engine.sync_dp_min_round_s`.

    A step of a group is its slowest member's compute on an equal share of
    `diloco.group_batch` plus one fp32 all-reduce of the expert (a group of one exchanges
    nothing). The typical step is the median over 32 groups of the size a cell gets at
    t=0, drawn from the population; K = ceil(min round / that step), at least 1. At
    10,000 volunteers every group has a home uplink, a step takes about an hour, and
    K = 1. (A core round is also sync_dp's checkpoint: a failure loses the block.)
    Cells much faster than the typical one still commit every K steps, which costs events
    but not accuracy.
    """
    work = scenario.workload
    n = len(pop)
    cells = len(spec.cell_ids)
    g = int(
        min(
            max(1, round(n * scenario.population.availability.initial_online_fraction / cells)),
            spec.schedule.max_replicas,
            n,
        )
    )
    nbytes = cm.encoded_nbytes("fp32", int(work.expert_params))
    rates = pop.tflops * 1e12 * work.mfu / cm.cell_flops_per_sample(work, spec.expert_cells[0])
    gb = spec.diloco.group_batch
    steps = []
    for _ in range(32):
        idx = rng.choice(n, size=g, replace=False)
        compute = (gb / g) / float(rates[idx].min())
        steps.append(
            compute + cm.allreduce_s(nbytes, pop.bandwidth_bytes_per_s[idx].tolist(), pop.latency_s[idx].tolist())
        )
    step = float(np.median(steps))
    return int(min(1000, max(1, math.ceil(scenario.engine.sync_dp_min_round_s / step - 1e-9))))


def _reason_kind(reason: str) -> str:
    """An abort reason without its numbers, so reasons can be counted."""
    return "".join("#" if ch.isdigit() else ch for ch in reason).replace("##", "#")
