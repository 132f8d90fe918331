"""The coordinator's pure state machine: workers, leases, cells, outer rounds, commits.

No I/O, no clock, no global RNG: time (`now_ms`, unix ms) and randomness (a
`random.Random`) are arguments, and every transition goes through one method,
`CoordinatorState.apply(now_ms, event)`, as Psyche's coordinator goes through
`tick(...)`/`change_state(...)` and torchft's quorum through `quorum_compute(now, ...)`.
The gRPC daemon and the simulator drive this same object.

The round protocol, per cell:

- A worker registers and is placed by the scheduler. It is *synced* when its LocalState
  equals the cell's committed state (round 0 is the initial state everyone builds, so
  at round 0 every assigned worker is synced); otherwise it is told ORDER_SYNC with its
  donors (up to `[sync] max_donors` synced members, by expected bandwidth) or the checkpoint.
- When a cell has no open round and a synced worker heartbeats, round n = committed + 1
  opens (OPEN) with all synced workers as members and a plan from `scheduler.plan_round`.
  The first TRAINING (or READY) heartbeat makes it TRAINING.
- When every live member is READY, or at the deadline with at least ceil(quorum x live)
  ready (never under wait_for_all), the contributors are frozen: REDUCING, with a
  `reduce_attempt` that is never reused for the same round number. The ready members
  contribute with their samples; every other worker of the cell that holds the round's
  base state (a member that missed the freeze, a joiner that synced mid-round) joins the
  exchange with zero weight (`catch_up`), so it ends the round holding the new state
  instead of chasing it with downloads. Too few ready at the deadline: the attempt is
  ABORTED and re-run at once (same round number, attempt + 1) by the synced workers.
- ReportRound: the round commits when strictly more than quorum x |weighted
  contributors| reports carry the same hash; it aborts when that has become impossible
  or at the reduce deadline. A contributor lost while REDUCING, before anyone reported
  success, re-freezes the survivors (reduce_attempt + 1) if enough remain, else aborts.
- After a commit the agreeing contributors hold the new state, everybody else resyncs;
  the scheduler may move idle workers (round boundary), and the next round opens once the
  committed round's other contributors have reported (they hold the new state a moment
  after the quorum, and train the next round too), or `schedule.next_round_grace_s` after
  the commit (`Rounds.hold_next_round`).
- Every checkpoint.every_rounds commits, one agreeing contributor is asked to upload; one
  upload per cell at a time: a request stands until it lands, its uploader leaves, or
  another interval passes without it (`Rounds.commit`).
- Convicted (the shell has verified evidence that a worker lied as a reducer, or signed two
  different contributions to one part): the worker is banned with the proof as its reason,
  and if that exchange is still the open one it is re-frozen without the worker (or
  aborted when too few remain), so it never commits with the liar's bytes; the other
  contributors' failure reports of that exchange get their reputation back.
- A lost lease drops the worker from its open round at once (fail_fast_leases) and from
  its cell. A cell whose committed state nobody live holds, when someone needs it, falls
  back to its latest checkpoint; after its last holder lost its lease (or registered
  again) it first waits `schedule.orphan_grace_s` for a holder to come back, telling the
  workers that need the state to wait (`Rounds.check_orphan`).
- Late and duplicate messages are handled on purpose (errors.StaleRound says which are
  errors): a repeated report gets its verdict again, a report of an aborted attempt gets
  VERDICT_ABORTED, a READY of an old attempt (Heartbeat.round_attempt) is ignored.

Effects: every transition returns the durable records it changed (`Outcome.effects`);
a heartbeat that changes nothing returns none and costs O(1). A transition validates
before it mutates, so one that raises a `CoordinatorError` changes nothing.

The class composes two parts that share one `Changes` (what the transition touched):
`roster.Roster` (workers, leases, placement, moves, donors, reputation) and
`rounds.Rounds` (each cell's open round and deadlines: open, freeze, commit, abort, the
orphan fallback; every round-state change goes through `Rounds.change_state`). This
module holds the event handlers, the instructions, the queries and restore.

A transition that raises anything other than a `CoordinatorError` is a bug in the core:
it may have mutated memory halfway, so `apply` raises `CoreFault` naming the event, and
the state refuses every later event (the daemon exits and restarts from SQLite).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from bagel.coordinator.core.audit import Auditor, Finding
from bagel.coordinator.core.changes import Changes
from bagel.coordinator.core.entities import Cell, Round, Worker
from bagel.coordinator.core.errors import (
    Banned,
    CapacityExceeded,
    CoordinatorError,
    CoreFault,
    DuplicateSubmission,
    InvalidEvent,
    InvalidRunState,
    StaleRound,
    UnknownWorker,
    WrongCell,
    WrongPhase,
)
from bagel.coordinator.core.events import (
    CheckpointStored,
    Convicted,
    Event,
    Heartbeat,
    LeaseExpired,
    Leave,
    Outcome,
    Register,
    ReportRound,
    Tick,
)
from bagel.coordinator.core.policy import BAGEL, Policy
from bagel.coordinator.core.records import (
    CellConfig,
    CellRecord,
    CommitRecord,
    ReportEntry,
    RoundRecord,
    RoundState,
    Snapshot,
    WorkerRecord,
    WorkerState,
)
from bagel.coordinator.core.roster import Roster
from bagel.coordinator.core.rounds import PATIENCE_DEADLINE, REDUCE_DEADLINE, TRAIN_DEADLINE, FrozenSet, Rounds
from bagel.coordinator.core.scheduler import Balance, Knobs
from bagel.protocol.grpc_options import RESTART_REATTACH_MS
from bagel.protocol.messages import Instruction, LocalState, Order, PeerRates, Phase, Verdict
from bagel.protocol.runspec import RunSpec


def _wait(c: Cell, reason: str, upload: bool = False) -> Instruction:
    """WAIT in cell c, whose next round is committed_round + 1 (and why)."""
    return Instruction(
        Order.WAIT,
        c.id,
        c.committed_round + 1,
        c.committed_round,
        c.committed_hash,
        upload_checkpoint=upload,
        reason=reason,
    )


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# the lease of a worker that registered without its speeds (measuring them: seconds to
# minutes) until its first message; this project's worker heartbeats while it measures, and
# its first heartbeat brings it back to the run's lease (`Roster.renew`)
MEASURING_LEASE_MS = 300_000
UNMEASURED_REASON = "standby: this worker has not measured its speed yet; it registers again with it"
MAX_PEER_RATES = 256  # entries in one report's peer_rates (an exchange has at most this many peers)
_STR, _INT = {str}, {int}


def _check_peer_rates(rates: PeerRates) -> None:
    """Refuse a report whose peer rates are malformed, before anything changes: columns of
    different lengths, too many entries, a peer named twice or by no name, or bytes and
    milliseconds that are not non-negative integers. Entries naming a worker that was not
    a peer of the exchange are not an error (`Roster.observe_peer_rates` skips them)."""
    ids, nbytes, ms = rates.worker_ids, rates.nbytes, rates.ms
    n = len(ids)
    if len(nbytes) != n or len(ms) != n:
        raise InvalidEvent(f"peer_rates: columns of {n}, {len(nbytes)} and {len(ms)} entries")
    if n > MAX_PEER_RATES:
        raise InvalidEvent(f"peer_rates: {n} entries, at most {MAX_PEER_RATES}")
    if not n:
        return
    # a column at a time, in C: every name a distinct non-empty str, every figure an int >= 0;
    # anything else goes to the loop below, which names the first offending entry
    if (
        set(map(type, ids)) == _STR
        and all(ids)
        and len(set(ids)) == n
        and set(map(type, nbytes)) == _INT
        and set(map(type, ms)) == _INT
        and min(nbytes) >= 0
        and min(ms) >= 0
    ):
        return
    seen: set[str] = set()
    for i, (wid, nb, t) in enumerate(zip(ids, nbytes, ms, strict=True)):
        if not isinstance(wid, str) or not wid or wid in seen:
            raise InvalidEvent(f"peer_rates[{i}].worker_id: empty, or named twice")
        seen.add(wid)
        for name, x in (("nbytes", nb), ("ms", t)):
            if type(x) is not int or x < 0:
                raise InvalidEvent(f"peer_rates[{i}].{name}: must be an integer >= 0, got {x!r}")


_PLAIN = frozenset((int, float))


def _plain_rates(rates: Mapping[str, float]) -> bool:
    """True if every rate is a plain int or float, finite and non-negative (what `_finite`
    and `>= 0` accept, checked without a Python-level loop: a profile has one rate per cell)."""
    vals = rates.values()
    if not vals:
        return True
    if not set(map(type, vals)) <= _PLAIN:
        return False
    return min(vals) >= 0 and not any(map(math.isinf, vals)) and not any(map(math.isnan, vals))


class CoordinatorState:
    """All of the coordinator's decisions, as a deterministic function of its inputs."""

    def __init__(
        self,
        spec: RunSpec,
        cells: Sequence[CellConfig],
        *,
        policy: Policy = BAGEL,
        rng: random.Random | None = None,
        now_ms: int = 0,
        max_workers: int | None = None,
        records: bool = True,
    ) -> None:
        ids = [c.cell_id for c in cells]
        if sorted(ids) != sorted(spec.cell_ids) or len(set(ids)) != len(ids):
            raise ValueError(f"cells {ids} do not match the spec's cells {list(spec.cell_ids)}")
        by_id = {c.cell_id: c for c in cells}
        self.spec = spec
        self.policy = policy
        self.rng = rng if rng is not None else random.Random(spec.run.seed)
        self.max_workers = max_workers
        self.now_ms = now_ms
        # False: `Outcome.effects` carries the changed live entities (`Worker`, `Cell`,
        # `Round`) and the commit records, not frozen records; for a caller that only reads
        # what changed, at once, and persists nothing (the simulator)
        self.records = records
        self._cells: dict[str, Cell] = {cid: Cell(by_id[cid]) for cid in spec.cell_ids}
        self.knobs = Knobs.from_spec(spec, policy)
        self.balance = Balance(
            {c: by_id[c].memory_bytes for c in spec.cell_ids},
            {c: by_id[c].target_share for c in spec.cell_ids},
            self.knobs,
            {c: by_id[c].host_bytes for c in spec.cell_ids},
        )
        self.changes = Changes()
        self.roster = Roster(spec, policy, self.knobs, self.balance, self._cells, self.changes)
        self.rounds = Rounds(spec, policy, self.rng, self._cells, self.changes, self.roster)
        self.roster.rounds = self.rounds
        self.auditor = Auditor(spec.audit)  # volatile: reducers' findings and update sketches
        self.fault: CoreFault | None = None  # set by a transition that failed with a bug
        self._handlers: dict[type, Callable[[int, Any], tuple[Instruction | None, Verdict | None, int | None]]] = {
            Register: self._on_register,
            Heartbeat: self._on_heartbeat,
            ReportRound: self._on_report,
            Leave: self._on_leave,
            Tick: self._on_tick,
            LeaseExpired: self._on_lease_expired,
            CheckpointStored: self._on_checkpoint_stored,
            Convicted: self._on_convicted,
        }

    # ================================================================ entry point

    def apply(self, now_ms: int, event: Event) -> Outcome:
        """Apply one event at time `now_ms`.

        Returns the caller's instruction (Register/Heartbeat/ReportRound), its verdict
        (ReportRound), its renewed lease, and the durable records that changed. Raises a
        `CoordinatorError` subclass, without changing anything, for a bad or ill-timed event.
        """
        handler = self._handlers.get(type(event))
        if handler is None:
            raise InvalidEvent(f"not an event: {type(event).__name__}")
        if isinstance(now_ms, bool) or not isinstance(now_ms, int):
            raise InvalidEvent("now_ms must be an integer")
        if self.fault is not None:
            raise CoreFault(f"the core failed earlier and serves nothing more: {self.fault}")
        try:
            instruction, verdict, lease = handler(now_ms, event)
        except CoordinatorError:
            self.changes.clear()  # refused before any mutation
            raise
        except Exception as e:
            # Not a refusal: a bug, possibly after a mutation. Memory may now hold what the
            # store does not, so nothing more is served from it.
            self.changes.clear()
            self.fault = CoreFault(f"{type(e).__name__}: {e} while applying {event!r} at {now_ms}")
            raise self.fault from e
        self.now_ms = max(self.now_ms, now_ms)
        return Outcome(instruction, verdict, lease, self._take_effects())

    @property
    def ops(self) -> int:
        """Loop iterations outside the O(1) paths so far (complexity tests count them)."""
        return self.changes.ops

    # ================================================================ queries

    def instruction_for(self, worker_id: str, now_ms: int | None = None) -> Instruction:
        """The instruction the worker would get now, without a transition (O(1)).

        It may choose a donor for a syncing worker (volatile, not a durable change).
        `now_ms` is accepted for symmetry with `apply` and not needed.
        """
        w = self.roster.workers.get(worker_id)
        if w is None or w.state in (WorkerState.LOST, WorkerState.LEFT):
            raise UnknownWorker(f"unknown worker {worker_id!r}")
        return self._instruction(w)

    def worker_phase(self, worker_id: str) -> tuple[Phase, int, int, float, int]:
        """Volatile view of a worker: (phase, round, inner_step, loss, lease_expires_ms)."""
        w = self.roster.worker(worker_id)
        return w.phase, w.round, w.inner_step, w.loss, w.lease_ms

    def next_wakeup_ms(self) -> int | None:
        """Earliest time a Tick may change something (a lease or a deadline), or None.
        May be early (entries are deleted lazily); an early Tick is harmless."""
        times = [h[0][0] for h in (self.roster.leases, self.rounds.deadlines) if h]
        return min(times) if times else None

    def next_round_hold_ms(self, cell_id: str) -> int | None:
        """Until when the cell's next round waits for its last commit's late reporters
        (`Rounds.hold_next_round`), or None when it does not wait (O(1))."""
        c = self._cells.get(cell_id)
        if c is None or c.round is not None or not c.awaiting:
            return None
        return c.hold_until_ms

    def committed_hash_of(self, cell_id: str, round: int) -> str | None:
        """Hash of a recent committed round of a cell (None if unknown or no longer kept)."""
        c = self._cells.get(cell_id)
        return None if c is None else c.hash_of(round)

    def frozen_set(self, cell_id: str, round: int, round_attempt: int, reduce_attempt: int) -> FrozenSet | None:
        """The contributors frozen for that exchange as (worker id, peer id, budget[, no_reduce]), sorted, if
        the core still remembers it (the last few of each cell); what evidence is checked against."""
        return self.rounds.frozen_set((cell_id, round, round_attempt, reduce_attempt))

    def check_upload(self, worker_id: str, cell_id: str, round: int, state_hash: str) -> bool:
        """True if `worker_id` was asked to upload the checkpoint of (cell, round, hash); False
        if a checkpoint of that round or a newer one is stored already (another holder's
        upload won a race: nothing to do); else raise."""
        w = self.roster.worker(worker_id)
        c = self.roster.cell(cell_id)
        if (c.uploader != w.id or c.upload_round != round) and 0 < round <= c.checkpoint_round:
            return False
        if c.uploader != w.id or c.upload_round != round:
            raise InvalidRunState(f"no checkpoint upload of {cell_id} round {round} was requested from {worker_id}")
        if c.hash_of(round) != state_hash:
            raise InvalidRunState(f"{cell_id} round {round} was not committed with hash {state_hash[:12]}")
        return True

    def counts(self) -> dict[str, int]:
        """Per-state worker counts, and standby: active workers without a cell (those still
        measuring their speed included, as in the shell's tally; `roster.standby` is only the
        placement queue)."""
        ws = self.roster.workers.values()
        out = Counter(w.state.value for w in ws)
        return {"standby": sum(1 for w in ws if w.state is WorkerState.ACTIVE and not w.cell), **out}

    def cell_view(self, cell_id: str) -> tuple[CellRecord, RoundRecord | None, tuple[str, ...]]:
        """A cell's record, its open round's record and its assigned workers (status pages)."""
        c = self.roster.cell(cell_id)
        return c.record(), (c.round.record() if c.round else None), tuple(c.workers)

    def cell_workers(self, cell_id: str) -> tuple[str, ...]:
        """The workers assigned to a cell (O(workers of the cell), no records built)."""
        return tuple(self.roster.cell(cell_id).workers)

    def shares(self) -> dict[str, float]:
        """Each cell's current share of total (weighted) compute."""
        return self.balance.shares()

    def targets(self) -> dict[str, float]:
        return dict(self.balance.target)

    def snapshot(self) -> Snapshot:
        """Every current durable record, sorted by key; `restore` of it rebuilds this state."""
        return Snapshot(
            workers=tuple(self.roster.workers[k].record() for k in sorted(self.roster.workers)),
            cells=tuple(self._cells[k].record() for k in sorted(self._cells)),
            rounds=tuple(
                self._cells[k].round.record()  # type: ignore[union-attr]
                for k in sorted(self._cells)
                if self._cells[k].round is not None
            ),
            commits=tuple(
                sorted((m for c in self._cells.values() for m in c.commits), key=lambda m: (m.cell_id, m.round))
            ),
        )

    @classmethod
    def restore(
        cls,
        spec: RunSpec,
        cells: Sequence[CellConfig],
        *,
        workers: Iterable[WorkerRecord],
        cell_records: Iterable[CellRecord],
        rounds: Iterable[RoundRecord],
        commits: Iterable[CommitRecord] = (),
        now_ms: int,
        policy: Policy = BAGEL,
        rng: random.Random | None = None,
        max_workers: int | None = None,
    ) -> CoordinatorState:
        """Rebuild a state from stored records after a restart.

        Cells take their committed state from `cell_records`; the most recent commits per
        cell are kept for checkpoint checks. Active workers keep their cell and get their
        lease renewed to now + lease_s + `RESTART_REATTACH_MS`, so they can re-attach before
        they are declared lost: a worker's channel may have backed off for up to
        `MAX_RECONNECT_BACKOFF_MS` while the coordinator was down. (Were a holder declared
        lost first, a newcomer needing the state would roll its cell back to the checkpoint
        and lose committed rounds.) The non-terminal round record of a cell (at most one)
        continues where it was; its deadline fires no earlier than that, so workers can
        re-attach first (a ready member re-sends READY: readiness before the freeze is not
        stored). Terminal round records are history and are ignored.
        """
        st = cls(spec, cells, policy=policy, rng=rng, now_ms=now_ms, max_workers=max_workers)
        for rec in cell_records:
            st._cell_or_value_error(rec.cell_id).load(rec)
        for m in sorted(commits, key=lambda m: (m.cell_id, m.round)):
            st._cell_or_value_error(m.cell_id).commits.append(m)
        for wrec in workers:
            w = Worker.from_record(wrec)
            st.roster.workers[w.id] = w
            if w.state is not WorkerState.ACTIVE:
                continue
            st.roster.activate(w, now_ms + RESTART_REATTACH_MS)  # lease: that + lease_s
            cid, w.cell = w.cell, ""
            if cid:
                st._cell_or_value_error(cid)
                st.roster.assign(w, cid, now_ms, restoring=True)
            else:
                st.roster.wait(w)
        # A cell whose committed state no restored worker holds (and no checkpoint has) may
        # have holders that re-attach: their channels back off while the coordinator is down,
        # and one lost before the crash may register again (the wait it had is volatile). A
        # worker that needs the state meanwhile waits for them, as for a lost lease.
        reattach = now_ms + RESTART_REATTACH_MS + st.roster.lease_ms + st.rounds.orphan_grace_ms
        for c in st._cells.values():
            if c.committed_round and not c.synced and c.checkpoint_round != c.committed_round:
                st.rounds.wait_for_holder(c, reattach)
        for rrec in rounds:
            if rrec.state.terminal:
                continue
            c = st._cell_or_value_error(rrec.cell_id)
            if c.round is not None:
                raise ValueError(f"two open rounds for {c.id}")
            r = Round.from_record(rrec, {x: st.roster.workers[x].peer for x in rrec.catch_up if x in st.roster.workers})
            c.round = r
            for wid in r.plans:
                if st._busy(r, wid):
                    c.idle.pop(wid, None)
            # workers could not report while the coordinator was down: give them a lease's
            # time to re-attach (re-send READY, report) before a deadline fires
            grace = now_ms + RESTART_REATTACH_MS + st.roster.lease_ms
            if r.state is RoundState.REDUCING:
                st.rounds.push_deadline(max(r.reduce_deadline_ms, grace), r, REDUCE_DEADLINE)
            else:
                st.rounds.push_deadline(max(r.deadline_ms, grace), r, TRAIN_DEADLINE)
                if r.freeze_by_ms:
                    st.rounds.push_deadline(max(r.freeze_by_ms, grace), r, PATIENCE_DEADLINE)
                    r.freeze_by_ms = max(r.freeze_by_ms, grace)
        st.changes.clear()
        return st

    def _cell_or_value_error(self, cell_id: str) -> Cell:
        c = self._cells.get(cell_id)
        if c is None:
            raise ValueError(f"record names unknown cell {cell_id!r}")
        return c

    # ================================================================ handlers

    def _on_register(self, now: int, ev: Register) -> tuple[Instruction, None, int]:
        p = ev.profile
        if not isinstance(ev.worker_id, str) or not ev.worker_id:
            raise InvalidEvent("worker_id: required")
        if (
            p.vram_bytes < 0
            or p.host_memory_bytes < 0
            or p.num_devices < 0
            or not _finite(p.link_bandwidth_bytes_per_s)
            or p.link_bandwidth_bytes_per_s < 0
        ):
            raise InvalidEvent(
                "profile: vram_bytes, host_memory_bytes, num_devices and link bandwidth must be non-negative"
            )
        if not _plain_rates(p.samples_per_s):  # the common case is checked in C, the rest here
            for cid, v in p.samples_per_s.items():
                if not _finite(v) or v < 0:
                    raise InvalidEvent(f"profile.samples_per_s[{cid!r}]: must be a finite non-negative number")
        if ev.local.committed_round < 0:
            raise InvalidEvent("local.committed_round: must be >= 0")
        cap = self.spec.audit.max_samples_per_s
        if p.samples_per_s and max(p.samples_per_s.values()) > cap:
            # a claim is all a joiner has; no claim above the run's bound is believed
            p = replace(p, samples_per_s={c: min(float(v), cap) for c, v in p.samples_per_s.items()})
        w = self.roster.workers.get(ev.worker_id)
        if w is not None and w.state is WorkerState.BANNED:
            raise Banned(f"worker {ev.worker_id} is banned: {w.reason}")
        rejoining = w is not None and w.state is WorkerState.ACTIVE
        if not rejoining and self.max_workers is not None and self.roster.active >= self.max_workers:
            raise CapacityExceeded(f"the run has its maximum of {self.max_workers} workers")
        # ---- mutate
        if w is not None and rejoining:
            self.roster.detach(w, now, fail_fast=True, may_return=True)  # it is placed again below
        if w is None:
            w = Worker(ev.worker_id, p, ev.peer, now)
            self.roster.workers[w.id] = w
        else:
            w.set_profile(p)
            w.peer, w.state, w.reason = ev.peer, WorkerState.ACTIVE, ""
            w.throughput = {c: float(v) for c, v in p.samples_per_s.items() if v > 0}
        w.local = ev.local
        w.phase, w.round, w.inner_step = Phase.UNSPECIFIED, 0, 0
        # a worker that claims no speed at all has not measured yet (the agent's first
        # Register, made to learn the spec): placed, it would hold a place in its cell's next
        # round while it measures, and the round would wait for it until its lease ran out.
        # It waits without a cell, in no placement queue, until it registers again with its
        # speeds. Until its first message it holds a lease that outlasts the measurement, so
        # a worker that sends nothing while it measures is not reported lost (status,
        # metrics, event feed) at every first contact; this project's worker heartbeats
        # meanwhile, and its first heartbeat brings it to the run's lease.
        self.roster.activate(w, now, lease_ms=0 if w.throughput else MEASURING_LEASE_MS)
        cid = self.roster.place(w) if w.throughput else ""
        if cid:
            self.roster.assign(w, cid, now)
        else:
            self.roster.wait(w)
        self.changes.worker(w.id)
        # balance moves only while the newcomer's cell is untrained (free moves; see _rebalance)
        self.roster.rebalance(now, balance=bool(cid) and self._cells[cid].committed_round == 0)
        return self._instruction(w), None, w.lease_ms

    def _on_heartbeat(self, now: int, ev: Heartbeat) -> tuple[Instruction, None, int]:
        w = self.roster.worker(ev.worker_id)
        try:
            phase = Phase(ev.phase)
        except ValueError:
            raise InvalidEvent(f"phase: unknown value {ev.phase!r}") from None
        if phase is Phase.UNSPECIFIED:
            raise InvalidEvent("phase: required")
        if min(ev.round, ev.inner_step, ev.samples, ev.reduce_attempt, ev.round_attempt, ev.local.committed_round) < 0:
            raise InvalidEvent("round, inner_step, samples, attempts and local.committed_round must be >= 0")
        # ---- mutate (from here on nothing raises)
        self.roster.renew(w, now)
        w.phase, w.round, w.inner_step, w.loss = phase, ev.round, ev.inner_step, ev.loss
        c = self._cells.get(w.cell) if w.cell else None
        if c is not None and ev.donor_rates:
            self.roster.observe_donor_rates(w, c, ev.donor_rates)  # before a sync releases the donors
        if ev.local != w.local and not self._stale_local(w, c, ev.local):
            w.local = ev.local
            self.changes.worker(w.id)
            if c is not None:
                self.roster.refresh_synced(w, c)
        if c is not None and w.id in c.awaiting and (w.id in c.synced or phase in (Phase.IDLE, Phase.SYNCING)):
            # a late contributor that adopted the commit without reporting it, or dropped its work
            self.rounds.release(c, w.id, now)
        if c is not None:
            r = c.round
            if (
                r is not None
                and ev.cell_id == c.id
                and ev.round == r.round
                and ev.round_attempt in (0, r.attempt)
                and r.is_live_member(w.id)
                and r.state in (RoundState.OPEN, RoundState.TRAINING)
            ):
                if phase in (Phase.TRAINING, Phase.READY) and r.state is RoundState.OPEN:
                    self.rounds.change_state(c, r, RoundState.TRAINING, now)
                if phase is Phase.READY and w.id not in r.ready:
                    r.ready[w.id] = ev.samples  # volatile until the freeze: no write
                    r.ready_ms[w.id] = now
                    self.rounds.check_freeze(c, r, now)
            # A READY of an old attempt, or from a member that sat out, is a late no-op: the
            # instruction below tells the worker what the current attempt wants.
            if self.rounds.can_open(c, now):
                self.rounds.open_round(c, now)
            elif r is not None and w.id in c.synced and w.id not in r.plans:
                self.rounds.admit_late(c, r, w.id, now)
        return self._answer(w, now), None, w.lease_ms

    @staticmethod
    def _stale_local(w: Worker, c: Cell | None, local: LocalState) -> bool:
        """A heartbeat sent before the worker heard its round commit still names the round
        before. The commit already recorded it as a holder of the new state; taking the old
        report would unseat it, and an orphan check in between would roll the cell back
        under a live holder. (A real loss of state lowers the round too, but then `w.local`
        no longer matches the committed state, or the worker re-registers.)"""
        return (
            c is not None
            and local.cell_id == w.local.cell_id == c.id
            and local.committed_round < w.local.committed_round
            and c.holds_committed(w.local)
        )

    def _on_report(self, now: int, ev: ReportRound) -> tuple[Instruction, Verdict, int]:
        w = self.roster.worker(ev.worker_id)
        c = self._cells.get(ev.cell_id)
        if c is None:
            raise InvalidEvent(f"cell_id: unknown cell {ev.cell_id!r}")
        if (
            ev.round < 1
            or min(ev.samples, ev.compute_ms, ev.comm_ms, ev.bytes_sent, ev.bytes_received, ev.reduce_attempt) < 0
        ):
            raise InvalidEvent("round must be >= 1; samples, times, bytes and reduce_attempt >= 0")
        if not ev.failed and not ev.state_hash:
            raise InvalidEvent("state_hash: required unless failed")
        for name, x in (("heldout_loss", ev.heldout_loss), ("heldout_loss_base", ev.heldout_loss_base)):
            if x is not None and not (_finite(x) and x >= 0):
                raise InvalidEvent(f"{name}: must be finite and >= 0 when given")
        _check_peer_rates(ev.peer_rates)
        if w.cell != c.id:
            raise WrongCell(f"worker {w.id} is assigned to {w.cell or 'no cell'}, not {c.id}")
        r = c.round
        if ev.round <= c.committed_round:
            if ev.round < c.committed_round:
                raise StaleRound(f"round {ev.round} of {c.id} is older than the last commit ({c.committed_round})")
            return self._late_report(now, w, c, ev)
        if ev.round > c.committed_round + 1:
            raise InvalidEvent(f"round {ev.round} of {c.id} is not open (next is {c.committed_round + 1})")
        # a report of round committed+1: the open attempt, or an aborted one of the same number
        if r is None or r.state is not RoundState.REDUCING:
            if 0 < ev.reduce_attempt <= c.reduce_attempt:
                return self._instruction(w), Verdict.ABORTED, self.roster.renew(w, now)  # late, harmless
            raise WrongPhase(f"round {ev.round} of {c.id} has no frozen contributors yet")
        attempt = ev.reduce_attempt or r.reduce_attempt  # 0 = "the current one"
        if attempt < r.first_reduce_attempt:
            return self._instruction(w), Verdict.ABORTED, self.roster.renew(w, now)  # of an aborted run
        if attempt < r.reduce_attempt:
            raise StaleRound(f"contributors of {c.id} round {r.round} were re-frozen (attempt {r.reduce_attempt})")
        if attempt > r.reduce_attempt:
            raise InvalidEvent(f"reduce_attempt {attempt} of {c.id} round {r.round} was never frozen")
        if not r.is_contributor(w.id):
            raise WrongPhase(f"worker {w.id} is not a contributor of {c.id} round {r.round}")
        entry = ReportEntry(
            ev.state_hash,
            ev.failed,
            ev.samples,
            attempt,
            ev.loss if _finite(ev.loss) else 0.0,
            -1.0 if ev.heldout_loss is None else float(ev.heldout_loss),
            -1.0 if ev.heldout_loss_base is None else float(ev.heldout_loss_base),
        )
        old = r.reports.get(w.id)
        if old is not None:
            if (old.state_hash, old.failed) != (entry.state_hash, entry.failed):
                raise DuplicateSubmission(f"worker {w.id} already reported {c.id} round {r.round}")
            return self._instruction(w), Verdict.PENDING, self.roster.renew(w, now)  # a retry: no-op
        # ---- mutate
        self.roster.renew(w, now)
        lie = self._claim_lie(w, r, ev, now)
        if lie:
            self.auditor.counts["lies"] += 1
            self.roster.reputation(w, self.spec.audit.rep_finding, now, lie)
            if w.state is not WorkerState.ACTIVE:  # banned for it: the round goes on without it
                return self._instruction(w), Verdict.ABORTED, w.lease_ms
        r.add_report(w.id, entry)
        self.changes.round(r)
        self.roster.observe_peer_rates(w, r.frozen, ev.peer_rates)
        if ev.failed:
            self.roster.reputation(w, self.policy.rep_failed_report, now, f"failed report: {ev.reason}")
            if w.state is WorkerState.BANNED:  # the round went on without it (re-frozen or aborted)
                return self._instruction(w), Verdict.ABORTED, w.lease_ms
        result = self.rounds.evaluate(c, r, now)
        if result == RoundState.COMMITTED:
            ok = not ev.failed and ev.state_hash == c.committed_hash and c.committed_round == ev.round
            verdict = Verdict.COMMITTED if ok else Verdict.RESYNC
        elif result == RoundState.ABORTED:
            verdict = Verdict.ABORTED
        else:
            verdict = Verdict.PENDING
        if ev.audit is not None and not ev.failed:
            ra = self.auditor.exchange(c.id, r.round, attempt, r.contributors, r.catch_up)
            self._charge(self.auditor.report(ra, w.id, ev.audit), now)
        return self._answer(w, now), verdict, w.lease_ms

    def _charge(self, findings: list[Finding], now: int) -> None:
        """Charge each confirmed finding's worker (the roster bans past the threshold)."""
        for f in findings:
            x = self.roster.workers.get(f.worker_id)
            if x is not None:
                why = f"audit of {f.cell_id} round {f.round}: {'/'.join(f.kinds)} update, confirmed by {f.reporters}"
                self.roster.reputation(x, self.spec.audit.rep_finding, now, why)

    def _claim_lie(self, w: Worker, r: Round, ev: ReportRound, now: int) -> str:
        """Why a contributor's own signed figures are a lie ('' if they are not): samples
        above the budget it was planned. An honest worker never reports more (it trains
        exactly micro_batch x grad_accum x H); a catch-up contributor trained nothing. The
        `compute_ms` a report carries is not judged: nothing is computed from it any more
        (budgets and weights come from `Roster.credit`), and an honest worker's first round
        may spend most of its span building the model, so a wall-clock test would charge it."""
        p = r.plans.get(w.id)
        if p is None or w.id in r.catch_up or ev.failed:
            return ""
        if ev.samples > p.max_samples:
            return f"claimed {ev.samples} samples, its budget was {p.max_samples}"
        return ""

    def _answer(self, w: Worker, now: int) -> Instruction:
        """The caller's instruction; a TRAIN answered for the first time starts the wall
        clock its round's credit is measured by (`Roster.credit`)."""
        i = self._instruction(w)
        if i.order is Order.TRAIN:
            r = self._cells[w.cell].round
            if r is not None and w.id not in r.train_ms and w.id not in r.ready:
                r.train_ms[w.id] = now
        return i

    def _late_report(self, now: int, w: Worker, c: Cell, ev: ReportRound) -> tuple[Instruction, Verdict, int]:
        """A report of the round just committed: a duplicate, or a straggler's."""
        self.roster.renew(w, now)
        r = self.rounds.last_committed.get(c.id)
        if r is not None and r.round == ev.round and w.id in r.reports:
            pass  # a duplicate of a report already counted (and checked)
        elif r is not None and r.round == ev.round and r.is_contributor(w.id):
            lie = self._claim_lie(w, r, ev, now)
            if lie:
                self.auditor.counts["lies"] += 1
                self.roster.reputation(w, self.spec.audit.rep_finding, now, lie)
                if w.state is not WorkerState.ACTIVE:
                    return self._instruction(w), Verdict.RESYNC, w.lease_ms
            r.add_report(w.id, ReportEntry(ev.state_hash, ev.failed, ev.samples, ev.reduce_attempt, 0.0))
            self.roster.observe_peer_rates(w, r.frozen, ev.peer_rates)
        if ev.failed or ev.state_hash != c.committed_hash:
            self.rounds.release(c, w.id, now)  # it does not hold the new state: not waited for
            return self._instruction(w), Verdict.RESYNC, w.lease_ms
        m = c.commits[-1] if c.commits else None
        if ev.audit is not None and m is not None and m.round == ev.round and w.id in m.contributors:
            # a straggler's audit of the round just committed still counts
            cur = self.auditor.latest(c.id, ev.round)
            ra = (
                cur
                if cur is not None and ev.reduce_attempt in (0, cur.reduce_attempt)
                else self.auditor.exchange(c.id, ev.round, ev.reduce_attempt, m.contributors, ())
            )
            self._charge(self.auditor.report(ra, w.id, ev.audit), now)
        if w.local != c.committed_local():
            # it holds the committed state after all: it is synced, no download needed
            w.local = c.committed_local()
            self.changes.worker(w.id)
            self.roster.refresh_synced(w, c)
        # it holds the new state: the last of the round's contributors to report opens the
        # next round, with itself as a member (`Rounds.hold_next_round`)
        self.rounds.release(c, w.id, now)
        return self._answer(w, now), Verdict.COMMITTED, w.lease_ms

    def _on_leave(self, now: int, ev: Leave) -> tuple[Instruction | None, None, None]:
        """Leave; or, when the worker offers and is the last live holder of a committed round
        newer than the cell's checkpoint, an upload order first (it stays active meanwhile;
        if it never comes back, its lease runs out as for any lost worker)."""
        w = self.roster.workers.get(ev.worker_id)
        if w is None:
            raise UnknownWorker(f"unknown worker {ev.worker_id!r}")
        if w.state is not WorkerState.ACTIVE:
            return None, None, None  # a duplicate Leave, or of a lost/banned worker: no-op
        c = self._cells[w.cell] if w.cell else None
        if (
            ev.offer_checkpoint
            and c is not None
            and c.committed_round > 0
            and c.checkpoint_round < c.committed_round
            and list(c.synced) == [w.id]
        ):
            if c.uploader != w.id or c.upload_round != c.committed_round:
                c.uploader, c.upload_round = w.id, c.committed_round
                self.changes.cell(c.id)
            return _wait(c, "the last holder of the committed state: upload it, then leave", upload=True), None, None
        self.roster.detach(w, now, fail_fast=True)
        w.state, w.reason = WorkerState.LEFT, ev.reason
        self.roster.rebalance(now, balance=False)  # redundancy only: the next joiner fills the hole
        return None, None, None

    def _on_lease_expired(self, now: int, ev: LeaseExpired) -> tuple[None, None, None]:
        w = self.roster.workers.get(ev.worker_id)
        if w is None:
            raise UnknownWorker(f"unknown worker {ev.worker_id!r}")
        if w.state is WorkerState.ACTIVE:
            self.roster.expire(w, now)
            self.roster.rebalance(now, balance=False)
        return None, None, None

    def _on_tick(self, now: int, ev: Tick) -> tuple[None, None, None]:
        lost = self.roster.expire_leases(now)
        self.rounds.fire_deadlines(now)
        if lost:
            self.roster.rebalance(now, balance=False)
        return None, None, None

    def _on_checkpoint_stored(self, now: int, ev: CheckpointStored) -> tuple[None, None, None]:
        c = self.roster.cell(ev.cell_id)
        if ev.round < 1 or ev.round > c.committed_round:
            raise InvalidRunState(f"{c.id} round {ev.round} is not committed")
        h = c.hash_of(ev.round)
        if h is None:
            raise StaleRound(f"{c.id} round {ev.round} is too old to verify")
        if h != ev.state_hash:
            raise InvalidRunState(f"{c.id} round {ev.round} was committed with another hash")
        if ev.round > c.checkpoint_round:
            c.checkpoint_round, c.checkpoint_hash = ev.round, ev.state_hash
            self.changes.cell(c.id)
        if c.upload_round != -1 and ev.round >= c.upload_round:
            c.upload_round, c.uploader = -1, ""
            self.changes.cell(c.id)
        return None, None, None

    def _on_convicted(self, now: int, ev: Convicted) -> tuple[None, None, None]:
        """Ban a worker proven to lie (the shell verified the evidence), and make sure the
        exchange it lied in never commits: discard it if it is still the open one. Like any
        ban, it also takes the worker out of every other open round that still counts it
        (`Roster.distrust`)."""
        w = self.roster.workers.get(ev.worker_id)
        if w is None:
            raise UnknownWorker(f"unknown worker {ev.worker_id!r}")
        if not ev.reason:
            raise InvalidEvent("reason: required")
        if w.state is WorkerState.BANNED:
            return None, None, None  # a second proof of the same lie, or of another one: banned once
        c = self._cells.get(ev.cell_id)
        if c is None:
            raise InvalidEvent(f"cell_id: unknown cell {ev.cell_id!r}")
        why = f"{ev.reason} (accused by {ev.accuser})"
        if w.state is WorkerState.ACTIVE:
            self.roster.detach(w, now, fail_fast=True)
        w.state, w.reason = WorkerState.BANNED, why
        self.changes.worker(w.id)
        r = c.round
        if (
            r is not None
            and r.state is RoundState.REDUCING
            and (r.round, r.attempt, r.reduce_attempt) == (ev.round, ev.round_attempt, ev.reduce_attempt)
        ):
            # the others' failure reports of this exchange were the liar's doing: refund them
            for x, e in r.reports.items():
                if e.failed and x != w.id and x in self.roster.workers:
                    self.roster.reputation(self.roster.workers[x], -self.policy.rep_failed_report, now, "")
            self.rounds.discard_exchange(c, r, w.id, now, f"contributor {w.id} convicted: {ev.reason}")
        # and out of any other open round that still counts it (after the refund above, so
        # that the discarded exchange's failure reports are judged as the liar's doing)
        self.roster.distrust(w, now)
        self.roster.rebalance(now, balance=False)
        return None, None, None

    # ================================================================ instructions

    def _busy(self, r: Round, wid: str) -> bool:
        """Is the worker taken by its cell's open round (so not movable)?"""
        if r.state is RoundState.REDUCING:
            return r.is_contributor(wid)
        return r.is_live_member(wid)

    def _instruction(self, w: Worker) -> Instruction:
        if w.state is WorkerState.BANNED:
            return Instruction(Order.LEAVE, reason=w.reason)
        if not w.cell:
            if not w.throughput:
                return Instruction(Order.WAIT, reason=UNMEASURED_REASON)
            return Instruction(Order.WAIT, reason="standby: no cell with room fits this worker now")
        c = self._cells[w.cell]
        upload = c.uploader == w.id and c.upload_round == c.committed_round and c.checkpoint_round < c.upload_round
        nxt = c.committed_round + 1
        r = c.round
        if r is not None:
            if r.state is RoundState.REDUCING and r.is_contributor(w.id):
                why = "catch up: exchange a zero pseudo-gradient, apply the outer step" if w.id in r.catch_up else ""
                return Instruction(
                    Order.REDUCE,
                    c.id,
                    nxt,
                    c.committed_round,
                    c.committed_hash,
                    plan=r.plan_for(w.id),
                    contributors=r.contributors_wire,
                    upload_checkpoint=upload,
                    reason=why,
                    reduce_attempt=r.reduce_attempt,
                    round_attempt=r.attempt,
                    reduce_deadline_unix_ms=r.reduce_deadline_ms,
                )
            if r.state is not RoundState.REDUCING and r.is_live_member(w.id):
                return Instruction(
                    Order.TRAIN,
                    c.id,
                    nxt,
                    c.committed_round,
                    c.committed_hash,
                    plan=r.plan_for(w.id),
                    upload_checkpoint=upload,
                    round_attempt=r.attempt,
                )
            if r.is_live_member(w.id):
                return _wait(c, "not ready at the freeze: sit this round out", upload)
        if r is None and w.id in c.awaiting and w.id not in c.synced:
            return _wait(
                c, f"round {c.committed_round} committed: finish its exchange and report; the next round waits"
            )
        if w.id in c.synced:
            why = (
                "holds the committed state: the next round opens when the last contributors report"
                if r is None and c.awaiting
                else "holds the committed state: joins the next exchange or round"
            )
            return _wait(c, why, upload)
        if self.rounds.orphaned(c):
            # the fallback waits for a holder that may come back (`Rounds.check_orphan`)
            return _wait(
                c,
                f"no live worker holds round {c.committed_round}: waiting for one to come back "
                f"before the cell falls back to its checkpoint",
            )
        donors = self.roster.donors(w, c)
        return Instruction(
            Order.SYNC,
            c.id,
            nxt,
            c.committed_round,
            c.committed_hash,
            donor=donors[0],
            donors=donors if donors[0].worker_id else (),
            reason="fetch the committed state",
        )

    # ================================================================ effects

    def _take_effects(self) -> tuple[Any, ...]:
        ch = self.changes
        if ch.empty():
            return ()
        workers = self.roster.workers
        if self.records:
            out: list[Any] = [workers[k].record() for k in ch.workers]
            out += [self._cells[k].record() for k in ch.cells]
            out += [r.record() for r in ch.rounds.values()]
        else:
            out = [workers[k] for k in ch.workers]
            out += [self._cells[k] for k in ch.cells]
            out += ch.rounds.values()
        out += ch.commits
        ch.clear()
        return tuple(out)


__all__ = ["CoordinatorState"]
