"""Mutable working entities of the coordinator core, and their durable records.

`CoordinatorState` mutates these small slotted objects in place (a transition touches a
handful of them, so it stays O(1) for a heartbeat) and turns the ones it changed into
frozen records (`domain.WorkerRecord` / `CellRecord` / `RoundRecord`) for the shell.
Each entity converts both ways (`record()` / `from_record()`), which is all that restore
needs. Ordered sets are dicts with None values: iteration follows insertion order, so
the core stays deterministic whatever PYTHONHASHSEED is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from bagel.coordinator.core.records import (
    CellConfig,
    CellRecord,
    CommitRecord,
    MemberPlan,
    ReportEntry,
    RoundRecord,
    RoundState,
    WorkerRecord,
    WorkerState,
)
from bagel.protocol.cellmemory import MemoryBudget
from bagel.protocol.messages import LocalState, Member, PeerAddress, Phase, Profile, RoundPlan

# commits kept per cell in memory (to verify checkpoint uploads); the store keeps them all.
COMMIT_WINDOW = 64


class Worker:
    __slots__ = (
        "id",
        "profile",
        "budget",
        "peer",
        "state",
        "cell",
        "local",
        "reputation",
        "throughput",
        "rounds_contributed",
        "registered_ms",
        "reason",
        # volatile (not in the record)
        "lease_ms",
        "lease_entry",
        "phase",
        "round",
        "inner_step",
        "loss",
        "donors",
        "uplink_measured",
        "uplink_seen",
        "raw",
    )

    def __init__(self, worker_id: str, profile: Profile, peer: PeerAddress, now_ms: int) -> None:
        self.id = worker_id
        self.set_profile(profile)
        self.peer = peer
        self.state = WorkerState.ACTIVE
        self.cell = ""
        self.local = LocalState()
        self.reputation = 0.0
        self.throughput: dict[str, float] = {c: float(v) for c, v in profile.samples_per_s.items() if v > 0}
        self.rounds_contributed = 0
        self.registered_ms = now_ms
        self.reason = ""
        self.lease_ms = 0
        self.lease_entry = 0  # expiry time of its entry in the lease heap (0 = none)
        self.phase = Phase.UNSPECIFIED
        self.round = 0
        self.inner_step = 0
        self.loss = 0.0
        self.donors: tuple[str, ...] = ()  # worker ids of the donors this worker syncs from, best first
        # its uplink as its joiners measured it, bytes/s (0 = not yet measured; see
        # Roster.observe_donor_rates); soft state, measured again after a restart
        self.uplink_measured = 0.0
        # its exchange uplink as each other contributor saw it (observer -> bytes/s, the most
        # recent MAX_UPLINK_OBSERVERS observers; see Roster.observe_peer_rates); soft state
        self.uplink_seen: dict[str, float] = {}
        self.raw = 0.0  # its weighted throughput as counted in the scheduler's Balance

    def set_profile(self, profile: Profile) -> None:
        """Take a (new) profile, and the memory budget the scheduler reads from it."""
        self.profile = profile
        self.budget = MemoryBudget.of(profile.device_kind, profile.vram_bytes, profile.host_memory_bytes)

    def record(self) -> WorkerRecord:
        return WorkerRecord(
            worker_id=self.id,
            profile=self.profile,
            peer=self.peer,
            state=self.state,
            cell_id=self.cell,
            local=self.local,
            reputation=self.reputation,
            throughput=dict(self.throughput),
            rounds_contributed=self.rounds_contributed,
            registered_ms=self.registered_ms,
            reason=self.reason,
        )

    @classmethod
    def from_record(cls, rec: WorkerRecord) -> Worker:
        w = cls(rec.worker_id, rec.profile, rec.peer, rec.registered_ms)
        w.state = rec.state
        w.cell = rec.cell_id
        w.local = rec.local
        w.reputation = rec.reputation
        w.throughput = dict(rec.throughput)
        w.rounds_contributed = rec.rounds_contributed
        w.reason = rec.reason
        return w


class Round:
    """The open attempt of a cell's next round."""

    __slots__ = (
        "cell",
        "round",
        "attempt",
        "state",
        "opened_ms",
        "deadline_ms",
        "inner_steps",
        "plans",
        "dropped",
        "ready",
        "contributors",
        "reduce_attempt",
        "first_reduce_attempt",
        "frozen_ms",
        "reduce_deadline_ms",
        "reports",
        "predicted_compute_ms",
        "predicted_comm_ms",
        "ended_ms",
        "reason",
        "members_wire",
        "contributors_wire",
        "no_reduce",
        "part_weights",
        "catch_up",
        "frozen",
        "member_plans",
        "train_ms",
        "ready_ms",
        "late",
        "late_wire",
        "ready_by_ms",
        "freeze_by_ms",
        "weighted_ids",
        "votes",
        "weighted_reported",
    )

    def __init__(
        self,
        cell: str,
        round: int,
        attempt: int,
        opened_ms: int,
        deadline_ms: int,
        inner_steps: int,
        plans: tuple[MemberPlan, ...],
        compute_ms: int,
        comm_ms: int,
    ) -> None:
        self.cell = cell
        self.round = round
        self.attempt = attempt
        self.state = RoundState.OPEN
        self.opened_ms = opened_ms
        self.deadline_ms = deadline_ms
        self.inner_steps = inner_steps
        self.member_plans = plans
        self.plans: dict[str, MemberPlan] = {p.worker_id: p for p in plans}
        self.dropped: dict[str, None] = {}
        # live members that said READY, with their samples. Volatile until the freeze: a
        # ready worker keeps heartbeating READY, so a restarted core learns it again, and
        # a READY heartbeat then costs no write (O(members) per round instead of squared).
        self.ready: dict[str, int] = {}
        # volatile: when the core first answered TRAIN to a member, and when it said READY
        # (the wall time the coordinator itself measured, which budgets are credited by)
        self.train_ms: dict[str, int] = {}
        self.ready_ms: dict[str, int] = {}
        self.contributors: tuple[str, ...] = ()
        self.weighted_ids: tuple[str, ...] = ()  # contributors that trained (`weighted`)
        self.catch_up: dict[str, None] = {}  # zero-weight contributors
        self.frozen: dict[str, None] = {}  # contributors, as a set
        self.reduce_attempt = 0
        self.first_reduce_attempt = 0
        self.frozen_ms = 0
        self.reduce_deadline_ms = 0
        # the reports of the frozen exchange; written only through `add_report` and
        # `clear_reports`, which keep the tallies `Rounds.evaluate` reads: the votes of the
        # weighted contributors' successful reports per hash (in the order hashes came),
        # and how many weighted contributors reported at all
        self.reports: dict[str, ReportEntry] = {}
        self.votes: dict[str, int] = {}
        self.weighted_reported = 0
        self.predicted_compute_ms = compute_ms
        self.predicted_comm_ms = comm_ms
        self.ended_ms = 0
        self.reason = ""
        # the wire views every member's instruction shares (built once)
        self.members_wire: tuple[Member, ...] = tuple(p.member() for p in plans)
        self.contributors_wire: tuple[Member, ...] = ()
        self.no_reduce: frozenset[str] = frozenset()  # contributors whose part is empty (relayed)
        self.part_weights: dict[str, int] = {}  # contributor -> its part weight, where it is not 1
        # late joiners (`Rounds.admit_late`): their plans in the order they came, and the wire
        self.late: dict[str, MemberPlan] = {}
        self.late_wire: tuple[Member, ...] = ()
        # volatile: when the planner expects the members to be ready (the freeze), which a
        # late joiner's budget is sized to; a restored round assumes no head start
        self.ready_by_ms = opened_ms + compute_ms
        # when the round freezes without its last members (`Rounds.check_freeze`); 0 = not set
        self.freeze_by_ms = 0

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.cell, self.round, self.attempt)

    def is_live_member(self, worker_id: str) -> bool:
        return worker_id in self.plans and worker_id not in self.dropped

    def live_count(self) -> int:
        return len(self.plans) - len(self.dropped)

    def is_contributor(self, worker_id: str) -> bool:
        return worker_id in self.frozen and worker_id not in self.dropped

    def weighted(self) -> tuple[str, ...]:
        """Contributors that trained (the quorum is counted over them), in contributor order."""
        return self.weighted_ids

    def add_report(self, worker_id: str, entry: ReportEntry) -> None:
        """Record a contributor's first report of the exchange (and tally it)."""
        self.reports[worker_id] = entry
        if worker_id in self.frozen and worker_id not in self.catch_up:
            self.weighted_reported += 1
            if not entry.failed:
                self.votes[entry.state_hash] = self.votes.get(entry.state_hash, 0) + 1

    def clear_reports(self) -> None:
        """A new exchange (a freeze or re-freeze): no reports yet."""
        self.reports, self.votes, self.weighted_reported = {}, {}, 0

    def admit(self, plan: MemberPlan) -> None:
        """Add a late joiner: a member from now on, after the opening members and the late
        joiners before it (its data shard index)."""
        self.plans[plan.worker_id] = plan
        self.late[plan.worker_id] = plan
        self.late_wire = (*self.late_wire, plan.member())

    def plan_for(self, worker_id: str) -> RoundPlan:
        """`worker_id`'s plan. While the round trains, an opening member sees the opening
        members, and a late joiner those and the late joiners up to itself (so nobody's
        plan changes under it); from the freeze on everyone sees them all, which the
        reducers' loss audit needs to know what each sender was assigned."""
        members, late_from = self.members_wire, 0
        if self.late_wire:
            if self.state in (RoundState.OPEN, RoundState.TRAINING):
                k = list(self.late).index(worker_id) + 1 if worker_id in self.late else 0
            else:
                k = len(self.late_wire)
            if k:
                members, late_from = (*self.members_wire, *self.late_wire[:k]), len(self.members_wire)
        p = self.plans.get(worker_id)
        if p is None or worker_id in self.catch_up:  # a catch-up contributor: nothing to train
            return RoundPlan(self.inner_steps, 0, 0, self.deadline_ms, members, late_from)
        return RoundPlan(self.inner_steps, p.micro_batch, p.grad_accum, self.deadline_ms, members, late_from)

    def set_contributors(
        self,
        ids: tuple[str, ...],
        catch_up: tuple[str, ...],
        peers: dict[str, PeerAddress],
        no_reduce: frozenset[str] = frozenset(),
        part_weights: Mapping[str, int] | None = None,
    ) -> None:
        """Freeze `ids` (sorted, catch-up included, which weigh 0 on the wire); `peers` has
        the addresses of catch-up workers that are not members; `no_reduce` reduce no part;
        `part_weights` size each contributor's part of the split (absent: 1)."""
        self.contributors = ids
        self.frozen = dict.fromkeys(ids)
        self.catch_up = dict.fromkeys(catch_up)
        self.weighted_ids = tuple(x for x in ids if x not in self.catch_up)
        self.no_reduce = frozenset(x for x in no_reduce if x in self.frozen)
        self.part_weights = {x: int(v) for x, v in (part_weights or {}).items() if x in self.frozen and v != 1}
        self.contributors_wire = tuple(
            Member(
                i,
                self.plans[i].peer if i in self.plans else peers[i],
                0 if i in self.catch_up else self.budget(i),
                i in self.no_reduce,
                self.part_weights.get(i, 1),
            )
            for i in ids
        )

    def budget(self, worker_id: str) -> int:
        """A weighted contributor's sample budget on the wire: the samples the coordinator
        credited it at the freeze (`ready`, see `Roster.credit`), never above its plan's."""
        cap = self.plans[worker_id].max_samples
        return max(1, min(cap, self.ready.get(worker_id, cap)))

    def record(self) -> RoundRecord:
        return RoundRecord(
            cell_id=self.cell,
            round=self.round,
            attempt=self.attempt,
            state=self.state,
            opened_ms=self.opened_ms,
            deadline_ms=self.deadline_ms,
            inner_steps=self.inner_steps,
            members=self.member_plans,
            dropped=tuple(sorted(self.dropped)),
            ready={} if self.state in (RoundState.OPEN, RoundState.TRAINING) else dict(self.ready),
            contributors=self.contributors,
            catch_up=tuple(self.catch_up),
            reduce_attempt=self.reduce_attempt,
            first_reduce_attempt=self.first_reduce_attempt,
            frozen_ms=self.frozen_ms,
            reduce_deadline_ms=self.reduce_deadline_ms,
            reports=dict(self.reports),
            predicted_compute_ms=self.predicted_compute_ms,
            predicted_comm_ms=self.predicted_comm_ms,
            ended_ms=self.ended_ms,
            reason=self.reason,
            late=tuple(self.late.values()),
            freeze_by_ms=self.freeze_by_ms,
            no_reduce=tuple(sorted(self.no_reduce)),
            part_weights=dict(self.part_weights),
        )

    @classmethod
    def from_record(cls, rec: RoundRecord, peers: dict[str, PeerAddress]) -> Round:
        r = cls(
            rec.cell_id,
            rec.round,
            rec.attempt,
            rec.opened_ms,
            rec.deadline_ms,
            rec.inner_steps,
            tuple(sorted(rec.members, key=lambda p: p.worker_id)),
            rec.predicted_compute_ms,
            rec.predicted_comm_ms,
        )
        for p in rec.late:
            r.admit(p)
        r.freeze_by_ms = rec.freeze_by_ms
        r.state = rec.state
        r.dropped = dict.fromkeys(rec.dropped)
        r.ready = dict(rec.ready)
        r.set_contributors(rec.contributors, rec.catch_up, peers, frozenset(rec.no_reduce), rec.part_weights)
        r.reduce_attempt = rec.reduce_attempt
        r.first_reduce_attempt = rec.first_reduce_attempt
        r.frozen_ms = rec.frozen_ms
        r.reduce_deadline_ms = rec.reduce_deadline_ms
        r.clear_reports()
        for wid, entry in rec.reports.items():
            r.add_report(wid, entry)
        r.ended_ms = rec.ended_ms
        r.reason = rec.reason
        return r


class Cell:
    __slots__ = (
        "id",
        "config",
        "committed_round",
        "committed_hash",
        "samples_committed",
        "last_loss",
        "checkpoint_round",
        "checkpoint_hash",
        "upload_round",
        "uploader",
        "round_attempt",
        "reduce_attempt",
        "rollbacks",
        "heldout_loss",
        "guard_refusals",
        # derived / volatile
        "workers",
        "synced",
        "idle",
        "round",
        "commits",
        "donor_load",
        "awaiting",
        "hold_until_ms",
        "orphan_until_ms",
        "exchange_ms",
        "reduce_overruns",
    )

    def __init__(self, config: CellConfig) -> None:
        self.id = config.cell_id
        self.config = config
        self.committed_round = 0
        self.committed_hash = ""
        self.samples_committed = 0
        self.last_loss = 0.0
        self.checkpoint_round = -1
        self.checkpoint_hash = ""
        self.upload_round = -1
        self.uploader = ""
        self.round_attempt = 0
        self.reduce_attempt = 0
        self.rollbacks = 0
        self.heldout_loss = -1.0
        self.guard_refusals = 0
        self.workers: dict[str, None] = {}  # active workers assigned here
        self.synced: dict[str, None] = {}  # ... that hold the committed state
        self.idle: dict[str, None] = {}  # ... that are not busy in the open round (movable)
        self.round: Round | None = None
        self.commits: deque[CommitRecord] = deque(maxlen=COMMIT_WINDOW)
        self.donor_load: dict[str, int] = {}
        # volatile: contributors of the round just committed that have not reported yet, and
        # until when the next round waits for them (`Rounds.hold_next_round`)
        self.awaiting: dict[str, None] = {}
        self.hold_until_ms = 0
        # volatile: until when a cell whose last holder lost its lease waits for a holder to
        # come back before it falls back to its checkpoint (`Rounds.check_orphan`); 0: no wait
        self.orphan_until_ms = 0
        # volatile: how long the last committed exchange took (freeze to commit), and how
        # many exchange attempts in a row since ran past their deadline
        # (`Rounds.reduce_span_ms`); a restarted coordinator starts again from the prediction
        self.exchange_ms = 0
        self.reduce_overruns = 0

    def holds_committed(self, local: LocalState) -> bool:
        """Does a worker with this LocalState hold the cell's committed state?

        Round 0 is the deterministic initial state every worker builds, so anyone holds it.
        """
        if self.committed_round == 0:
            return True
        return (
            local.cell_id == self.id
            and local.committed_round == self.committed_round
            and local.state_hash == self.committed_hash
        )

    def committed_local(self) -> LocalState:
        return LocalState(self.id, self.committed_round, self.committed_hash)

    def hash_of(self, round: int) -> str | None:
        if round == self.committed_round:
            return self.committed_hash
        for c in self.commits:
            if c.round == round:
                return c.state_hash
        return None

    def record(self) -> CellRecord:
        return CellRecord(
            cell_id=self.id,
            committed_round=self.committed_round,
            committed_hash=self.committed_hash,
            samples_committed=self.samples_committed,
            last_loss=self.last_loss,
            checkpoint_round=self.checkpoint_round,
            checkpoint_hash=self.checkpoint_hash,
            upload_round=self.upload_round,
            uploader=self.uploader,
            round_attempt=self.round_attempt,
            reduce_attempt=self.reduce_attempt,
            rollbacks=self.rollbacks,
            heldout_loss=self.heldout_loss,
            guard_refusals=self.guard_refusals,
        )

    def load(self, rec: CellRecord) -> None:
        self.committed_round = rec.committed_round
        self.committed_hash = rec.committed_hash
        self.samples_committed = rec.samples_committed
        self.last_loss = rec.last_loss
        self.checkpoint_round = rec.checkpoint_round
        self.checkpoint_hash = rec.checkpoint_hash
        self.upload_round = rec.upload_round
        self.uploader = rec.uploader
        self.round_attempt = rec.round_attempt
        self.reduce_attempt = rec.reduce_attempt
        self.rollbacks = rec.rollbacks
        self.heldout_loss = rec.heldout_loss
        self.guard_refusals = rec.guard_refusals
