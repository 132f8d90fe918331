"""The outer rounds of every cell: OPEN -> TRAINING -> REDUCING -> COMMITTED | ABORTED.

`Rounds` is the part of the coordinator core that owns each cell's open round and the
deadline heap (`CoordinatorState` composes it with `Roster`; see state.py for the whole
protocol). Every change of a round's state goes through `Rounds.change_state`, which
refuses a transition the lifecycle does not have (a core bug, not a bad message). The
rules, in one place:

- contributor floor (`schedule.min_contributors`, default 1): a round opens only once that
  many workers hold the committed state, and freezes only with that many ready, so no
  smaller group (a lone first member, say) decides a round by itself;
- freeze quorum: at the deadline, at least ceil(quorum x live members) (and >= the floor)
  must be ready, else the attempt aborts; with every live member ready it freezes at once;
- freeze patience (`Policy.patience_share`): once that share of the live members is ready
  (and the quorum is), the rest get (n - k) / k x the time since the open, k of n ready:
  waiting longer would cost the ready members more than the late ones' work is worth.
  Then it freezes with the ready ones; the others join the exchange with zero weight, are
  not charged, and their speed estimate drops to the bound they showed;
- commit quorum: strictly more than quorum x |weighted contributors| equal hashes
  (catch-up contributors do not count: they trained nothing);
- commit guard (`guard.CommitGuard`): a hash that reaches the quorum is still refused (the
  attempt aborts, nobody's reputation changes) when the median held-out loss its
  reports give jumps past the cell's bound;
- an attempt that can no longer reach the commit quorum aborts at once; one still
  REDUCING at its reduce deadline aborts then;
- an aborted attempt is re-run at once (same round number, attempt + 1) by whoever holds
  the committed state; `reduce_attempt` keeps counting across re-runs of a round number,
  so a late report names exactly the contributor set it was reduced over;
- no stranded contributors (`hold_next_round`): after a commit the next round opens once
  every contributor of the committed round has reported, or `schedule.next_round_grace_s`
  after the commit, whichever comes first. Contributors finish one exchange at about the
  same time, but the quorum is reached by the first reports: opening at once (as this core
  used to) left the late reporters, which hold the new state a moment later, out of the
  round, to sit it out idle or join its exchange with zero weight. Waiting costs the early
  reporters only the spread of the reports (seconds; the grace bounds it when a contributor
  dies after the exchange), against a whole round for each late one. Admitting the late
  reporters into the round in flight instead was not chosen: the round's batch split,
  members list (every member's data shard index) and deadline are planned at the open and
  sent to every member, so a later member would either change the others' plans or train a
  shorter, differently planned share;
- late join (`admit_late`, `Policy.late_join`): a worker that comes to hold the round's
  base state while the round trains (a download that ended after the open: in
  `bagel-sim`'s heterogeneity-10x a download takes about as long as a round, so this is
  most joiners) is admitted into it with a share sized to the time left, instead of
  idling a whole round. Nobody else's plan changes: it trains the same H steps with a
  smaller per-step batch, on the data shard after the opening members' and the late
  joiners' before it (`RoundPlan.shard_members`), is credited from its own TRAIN, and
  weighs in the exchange with the samples it is credited, like any member. Under the
  round's deadline and freeze it is a member like the others; the freeze is expected
  when the planner expected it, so its budget is what it trains by then.
Timeouts are pure predicates on `now_ms` fired from the deadline heap by Tick (Psyche's
`check_timeout(ts, duration)`).
"""

from __future__ import annotations

import heapq
import itertools
import math
import operator
import random
from collections import Counter, deque

from bagel.coordinator.core.changes import Changes
from bagel.coordinator.core.entities import Cell, Round
from bagel.coordinator.core.guard import CommitGuard, median
from bagel.coordinator.core.policy import Policy
from bagel.coordinator.core.records import CommitRecord, RoundState, WorkerState
from bagel.coordinator.core.roster import CellSpeeds, Roster
from bagel.coordinator.core.scheduler import (
    PlanMember,
    part_weights,
    plan_late_member,
    plan_round,
    reduce_nothing,
    throughput_for,
)
from bagel.protocol.cellmemory import MemoryBudget, micro_batch_cap
from bagel.protocol.messages import FrozenMember, Reachability, frozen_member
from bagel.protocol.runspec import RunSpec

# Frozen contributor sets remembered per cell, so evidence about an exchange that has been
# aborted or re-frozen since can still be checked against the set it was reduced over.
FROZEN_KEPT = 8

# (cell, round, round_attempt, reduce_attempt) -> ((worker id, peer id, budget), ...) sorted
FrozenKey = tuple[str, int, int, int]
# each member: (worker id, peer id, budget), with a fourth element True when it reduces no part
# one `FrozenMember` per contributor, as the group digest binds them
FrozenSet = tuple[FrozenMember, ...]

_LEGAL = frozenset(
    {
        (RoundState.OPEN, RoundState.TRAINING),
        (RoundState.OPEN, RoundState.REDUCING),
        (RoundState.TRAINING, RoundState.REDUCING),
        (RoundState.REDUCING, RoundState.REDUCING),
        (RoundState.REDUCING, RoundState.COMMITTED),
        (RoundState.OPEN, RoundState.ABORTED),
        (RoundState.TRAINING, RoundState.ABORTED),
        (RoundState.REDUCING, RoundState.ABORTED),
    }
)

TRAIN_DEADLINE, REDUCE_DEADLINE, HOLD_DEADLINE, PATIENCE_DEADLINE = "train", "reduce", "hold", "patience"
ORPHAN_DEADLINE = "orphan"
# An exchange's deadline follows what the cell's exchanges really take: at least this many
# times the last committed one (freeze to commit), and doubled after each attempt in a row
# that ran past its deadline, up to this many doublings (`Rounds.reduce_span_ms`).
EXCHANGE_MARGIN = 2
MAX_OVERRUN_DOUBLINGS = 4
_count = operator.itemgetter(1)


class IllegalTransition(RuntimeError):
    """A round state change the lifecycle does not have: a bug in the core, never a bad
    message (so not a `CoordinatorError`: the daemon stops instead of answering)."""


class Rounds:
    """Each cell's open round and the deadlines that end them."""

    def __init__(
        self,
        spec: RunSpec,
        policy: Policy,
        rng: random.Random,
        cells: dict[str, Cell],
        changes: Changes,
        roster: Roster,
    ) -> None:
        self.spec = spec
        self.policy = policy
        self.rng = rng
        self.cells = cells
        self.changes = changes
        self.roster = roster
        self.lease_ms = roster.lease_ms
        self.min_round_ms = int(spec.schedule.min_round_s * 1000)
        self.slack = policy.deadline_slack or spec.schedule.deadline_slack
        self.quorum = spec.schedule.quorum
        self.min_contributors = spec.schedule.min_contributors
        self.grace_ms = int(spec.schedule.next_round_grace_s * 1000)
        self.orphan_grace_ms = int(spec.schedule.orphan_grace_s * 1000)
        self.guard = CommitGuard(spec.guard)
        # (at, seq, cell, round, attempt, kind, reduce_attempt); stale entries are skipped
        self.deadlines: list[tuple[int, int, str, int, int, str, int]] = []
        # each cell's last committed round (volatile): a straggler's report of it is still
        # checked against its plan and the times the core saw
        self.last_committed: dict[str, Round] = {}
        self._seq = itertools.count()
        # the last FROZEN_KEPT frozen contributor sets of each cell (memory only: after a
        # restart, evidence about an exchange frozen before it cannot be checked)
        self.frozen_sets: dict[str, deque[tuple[FrozenKey, FrozenSet]]] = {}

    # ---------------------------------------------------------------- deadlines

    def push_deadline(self, at_ms: int, r: Round, kind: str) -> None:
        heapq.heappush(self.deadlines, (at_ms, next(self._seq), r.cell, r.round, r.attempt, kind, r.reduce_attempt))

    def fire_deadlines(self, now: int) -> None:
        """Run every deadline due by `now` (Psyche's `check_timeout(ts, duration)`: timeouts
        are pure predicates on the time the shell passes in)."""
        while self.deadlines and self.deadlines[0][0] <= now:
            at, _, cid, rnd, attempt, kind, ra = heapq.heappop(self.deadlines)
            c = self.cells[cid]
            if kind == HOLD_DEADLINE:
                if c.awaiting and c.hold_until_ms == at and c.committed_round == rnd:
                    c.awaiting.clear()  # the grace is over: open with the holders there are
                    self._boundary(c, now)
                continue
            if kind == ORPHAN_DEADLINE:
                if c.orphan_until_ms == at and c.committed_round == rnd:
                    self.check_orphan(c, now)
                continue
            r = c.round
            if r is None or (r.round, r.attempt) != (rnd, attempt):
                continue  # that attempt ended: a stale entry
            if kind == TRAIN_DEADLINE and r.state in (RoundState.OPEN, RoundState.TRAINING):
                self.train_deadline(c, r, now)
            elif kind == PATIENCE_DEADLINE and r.state in (RoundState.OPEN, RoundState.TRAINING):
                if r.freeze_by_ms == at:
                    self.patience_over(c, r, now)
            elif (
                kind == REDUCE_DEADLINE
                and r.state is RoundState.REDUCING
                and r.reduce_attempt == ra
                # a quorum the guard was still waiting on is judged with the reports there are
                and self.evaluate(c, r, now, final=True) is None
            ):
                c.reduce_overruns += 1
                self.abort(c, r, now, f"reduce deadline of attempt {ra} passed")

    # ---------------------------------------------------------------- lifecycle

    def open_round(self, c: Cell, now: int) -> None:
        """Open the next attempt with every worker that holds the committed state."""
        ids = sorted(c.synced)
        self.changes.ops += len(ids)
        # with overlap, each weighted contributor of the round just committed has trained this
        # one ahead since its freeze, in that round's batch shape: its share of H is the time
        # since the freeze x its speed / its budget there. Under a throughput split that share
        # is about the same for all of them, so all get the median: per-member shares fed
        # back into the next split made the batches oscillate round after round
        prev = self.last_committed.get(c.id) if self.spec.diloco.overlap == "delayed" else None
        if prev is None or prev.round != c.committed_round or not prev.frozen_ms:
            prev = None
        speeds = {wid: throughput_for(self.roster.workers[wid].throughput, c.id) for wid in ids}
        shares = []
        for wid in ids:
            if prev is not None and wid in prev.plans and prev.is_contributor(wid) and wid not in prev.catch_up:
                budget = prev.plans[wid].max_samples
                if budget > 0:
                    shares.append((wid, (now - prev.frozen_ms) / 1000.0 * speeds[wid] / budget))
        head = median([x for _, x in shares]) if shares else 0.0
        ahead = {wid for wid, _ in shares}
        members = []
        for wid in ids:
            w = self.roster.workers[wid]
            bw = w.profile.link_bandwidth_bytes_per_s
            members.append(
                PlanMember(
                    wid,
                    w.peer,
                    speeds[wid],
                    bw,
                    head if wid in ahead else 0.0,
                    self._micro_cap(c, w.budget),
                )
            )
        payload = c.config.payload_bytes or c.config.memory_bytes // 16
        plan = plan_round(members, self.spec, now, self.policy, payload)
        c.round_attempt += 1
        r = Round(
            c.id,
            c.committed_round + 1,
            c.round_attempt,
            now,
            plan.deadline_ms,
            plan.inner_steps,
            plan.members,
            plan.predicted_compute_ms,
            plan.predicted_comm_ms,
        )
        if plan.ready_in_ms:
            r.ready_by_ms = now + plan.ready_in_ms
        c.round = r
        for wid in ids:
            c.idle.pop(wid, None)
        self.push_deadline(r.deadline_ms, r, TRAIN_DEADLINE)
        self.changes.round(r)
        self.changes.cell(c.id)

    def _micro_cap(self, c: Cell, budget: MemoryBudget) -> int:
        """The largest micro-batch a worker with memory `budget` is planned with in c."""
        cfg = c.config
        return micro_batch_cap(
            budget,
            cfg.memory_bytes,
            cfg.sample_bytes,
            cfg.host_bytes,
            self.roster.knobs.vram_headroom,
            self.spec.diloco.max_micro_batch,
        )

    def _members_ready_by(self, c: Cell, r: Round) -> int:
        """When the round's members still training are expected ready: the round's own
        estimate (`ready_by_ms`, from its plan at open), or earlier when the opening members
        that set it have since dropped out or are ready. Each opening member still training
        counts its budget at its throughput; one that claimed no throughput (a worker's first
        contact, made before it could measure; it registers again at once, which drops it)
        sets no pace, and late joiners were sized to fit the estimate. So a late joiner is
        never sized to keep the round waiting for a member that is gone or done."""
        t = r.opened_ms
        for x, plan in r.plans.items():
            w = self.roster.workers.get(x)
            if x in r.dropped or x in r.ready or x in r.late or w is None or not w.throughput:
                continue
            t = max(t, r.opened_ms + int(plan.max_samples / throughput_for(w.throughput, c.id) * 1000.0))
        return min(r.ready_by_ms, t)

    def admit_late(self, c: Cell, r: Round, wid: str, now: int) -> bool:
        """`wid` holds c's committed state (the base of the round r in training) and is not
        a member: admit it with a share of the time left (`scheduler.plan_late_member`),
        if that pays; True if admitted. Durable: the round's record lists it."""
        if r.state not in (RoundState.OPEN, RoundState.TRAINING) or wid in r.plans or wid not in c.synced:
            return False
        w = self.roster.workers[wid]
        share = self.policy.late_join_min_share
        # a synced non-member heartbeats this every few seconds: refuse on time first, cheaply.
        # Time left over the round's length only shrinks with an earlier expected freeze, so
        # what is too late by the round's own estimate is too late by the members' (O(members))
        if (
            w.state is WorkerState.BANNED
            or not self.policy.late_join
            or r.ready_by_ms - now < share * (r.ready_by_ms - r.opened_ms)
        ):
            return False
        ready_by = self._members_ready_by(c, r)
        left_ms, round_ms = ready_by - now, ready_by - r.opened_ms
        if left_ms <= 0 or left_ms < share * round_ms:
            return False
        speeds = [throughput_for(self.roster.workers[x].throughput, c.id) for x in r.plans if x in self.roster.workers]
        plan = plan_late_member(
            throughput_for(w.throughput, c.id),
            speeds,
            r.inner_steps,
            left_ms,
            round_ms,
            wid,
            w.peer,
            self.spec,
            self.policy,
            self._micro_cap(c, w.budget),
        )
        if plan is None:
            return False
        r.admit(plan)
        c.idle.pop(wid, None)
        self.changes.round(r)
        self.changes.cell(c.id)
        return True

    def can_open(self, c: Cell, now: int) -> bool:
        """No round is open, enough workers hold the committed state (the floor), and the
        next round is not held for the last round's late reporters (`holding`)."""
        return c.round is None and len(c.synced) >= max(1, self.min_contributors) and not self.holding(c, now)

    def holding(self, c: Cell, now: int) -> bool:
        """Is c's next round still waiting for contributors of its last commit to report?"""
        if not c.awaiting:
            return False
        if now >= c.hold_until_ms:
            c.awaiting.clear()
            return False
        return True

    def hold_next_round(self, c: Cell, r: Round, now: int) -> bool:
        """Round r of c just committed: wait for its contributors that have not reported yet
        (live, still in the cell) before the round boundary (rebalance, then the next round),
        at most the grace (see the module docstring); True if it waits. Volatile: a restarted
        core opens the next round at once."""
        late = [x for x in r.contributors if x not in r.reports and x not in r.dropped and x in c.workers]
        self.changes.ops += len(r.contributors)
        c.awaiting = dict.fromkeys(late) if self.grace_ms > 0 else {}
        if not c.awaiting:
            return False
        c.hold_until_ms = now + self.grace_ms
        heapq.heappush(self.deadlines, (c.hold_until_ms, next(self._seq), c.id, r.round, r.attempt, HOLD_DEADLINE, 0))
        return True

    def release(self, c: Cell, wid: str, now: int) -> None:
        """`wid` reported the round just committed: the last one awaited ends the wait, and
        the round boundary comes (rebalance, then the next round opens with it as a member)."""
        if wid not in c.awaiting:
            return
        del c.awaiting[wid]
        if not c.awaiting:
            self._boundary(c, now)

    def _freeze_ok(self, ready: int, live: int) -> bool:
        return ready >= max(1, self.min_contributors, math.ceil(self.quorum * live - 1e-9))

    def _below_floor(self, live: int) -> str:
        return f"{live} members left, fewer than schedule.min_contributors = {self.min_contributors}"

    def check_freeze(self, c: Cell, r: Round, now: int) -> None:
        live = r.live_count()
        if live == 0:
            self.abort(c, r, now, "no members left")
        elif live < self.min_contributors:
            self.abort(c, r, now, self._below_floor(live))
        elif len(r.ready) == live:
            self._freeze(c, r, tuple(sorted(r.ready)), now)
        elif (
            not r.freeze_by_ms
            and self.policy.patience_share > 0
            and not self.policy.wait_for_all
            and len(r.ready) >= math.ceil(self.policy.patience_share * live - 1e-9)
            and self._freeze_ok(len(r.ready), live)
        ):
            # k of n ready: waiting t more costs the ready k x t of compute, and freezing
            # without the n - k drops their work so far, about (n - k) x the time since the
            # open; the round waits until the two are equal (the backup-worker trade of
            # synchronous SGD, Chen et al. 2016, "Revisiting distributed synchronous SGD")
            k = len(r.ready)
            wait = int((live - k) / k * max(0, now - r.opened_ms))
            r.freeze_by_ms = min(r.deadline_ms, now + max(wait, int(self.spec.schedule.heartbeat_s * 1000)))
            self.push_deadline(r.freeze_by_ms, r, PATIENCE_DEADLINE)
            self.changes.round(r)

    def patience_over(self, c: Cell, r: Round, now: int) -> None:
        """The wait `check_freeze` gave the last members of r is over: freeze with the ready
        ones (the others join the exchange with zero weight). A member cut here is not
        charged (it did not miss the deadline), but the coordinator learns from it: it has
        not finished its budget in the time since its TRAIN, so its speed is at most that."""
        live = [wid for wid in r.plans if wid not in r.dropped]
        late = [wid for wid in live if wid not in r.ready]
        if not late or not self._freeze_ok(len(r.ready), len(live)):
            return
        for wid in late:
            w = self.roster.workers[wid]
            span_s = (now - max(r.opened_ms, r.train_ms.get(wid, r.opened_ms))) / 1000.0
            if span_s > 0:
                bound = r.plans[wid].max_samples / span_s
                if bound < throughput_for(w.throughput, c.id):
                    self.roster.observe_throughput(w, c.id, bound)
        self.changes.ops += len(live)
        self._freeze(c, r, tuple(sorted(r.ready)), now)

    def _freeze(self, c: Cell, r: Round, weighted: tuple[str, ...], now: int) -> None:
        """Freeze the contributors: `weighted` (ready members) plus, under catch_up, every
        other worker of the cell that holds the round's base state, with zero weight."""
        c.reduce_attempt += 1
        r.reduce_attempt = c.reduce_attempt
        if not r.first_reduce_attempt:
            r.first_reduce_attempt = r.reduce_attempt
        w_set = set(weighted)
        first = r.reduce_attempt == r.first_reduce_attempt  # a re-freeze learns nothing new
        # with overlap, a member of the round before trained this round's first steps while
        # that round's exchange ran, from its freeze on: its span starts there, or an honest
        # member that says READY soon after this round opens is credited almost nothing
        prev = self.last_committed.get(c.id) if self.spec.diloco.overlap == "delayed" else None
        if prev is not None and prev.round != r.round - 1:
            prev = None
        speeds = CellSpeeds(self.roster, c) if first else None  # each credit bounds by the others' median
        for x in weighted:  # what each ready member is credited, and so weighs on the wire
            if x in r.ready and x in r.plans:
                since = None
                if prev is not None and prev.frozen_ms and prev.is_contributor(x) and x not in prev.catch_up:
                    since = prev.frozen_ms
                r.ready[x] = self.roster.credit(
                    self.roster.workers[x], c, r, r.ready[x], now, observe=first, ahead_since_ms=since, speeds=speeds
                )
        catch = tuple(sorted(x for x in c.synced if x not in w_set)) if self.policy.catch_up else ()
        self.changes.ops += len(c.synced)
        peers = {x: self.roster.workers[x].peer for x in catch if x not in r.plans}
        ids = tuple(sorted(w_set.union(catch)))
        relayed = {x for x in ids if self.roster.workers[x].profile.reachability == Reachability.RELAYED}
        skip = reduce_nothing(ids, relayed)
        weights = None
        if self.policy.part_split == "measured":
            uplinks = {x: self.roster.exchange_uplink(self.roster.workers[x]) for x in ids}
            weights = part_weights(ids, uplinks, skip)
        r.set_contributors(ids, catch, peers, no_reduce=skip, part_weights=weights)
        # as the workers' data plane sees the set: a zero budget (catch-up) counts as 1
        frozen: FrozenSet = tuple(
            frozen_member(m.worker_id, m.peer.peer_id, max(1, m.max_samples), m.no_reduce, m.part_weight)
            for m in r.contributors_wire
        )
        kept = self.frozen_sets.setdefault(c.id, deque(maxlen=FROZEN_KEPT))
        kept.append(((c.id, r.round, r.attempt, r.reduce_attempt), frozen))
        self.change_state(c, r, RoundState.REDUCING, now)
        r.frozen_ms = now
        r.clear_reports()
        r.reduce_deadline_ms = now + self.reduce_span_ms(c, r)
        self.push_deadline(r.reduce_deadline_ms, r, REDUCE_DEADLINE)
        for wid in r.plans:  # live members left out (catch_up off) sit out: movable again
            if wid not in r.frozen and wid not in r.dropped and wid in c.workers:
                c.idle[wid] = None
        for wid in catch:
            c.idle.pop(wid, None)
        self.changes.round(r)
        self.changes.cell(c.id)

    def train_deadline(self, c: Cell, r: Round, now: int) -> None:
        for wid in r.plans:  # members kept past their lease (fail_fast_leases=False) go now
            w = self.roster.workers[wid]
            if wid not in r.dropped and (w.state is not WorkerState.ACTIVE or w.cell != c.id):
                r.dropped[wid] = None
                r.ready.pop(wid, None)
        self.changes.ops += len(r.plans)
        self.changes.round(r)
        live = [wid for wid in r.plans if wid not in r.dropped]
        late = [wid for wid in live if wid not in r.ready]
        for wid in late:  # learn from the miss before a re-run is planned
            self.roster.observe_progress(self.roster.workers[wid], c, r, now)
        frozen = False
        if not live:
            self.abort(c, r, now, "no members left")
        elif len(live) < self.min_contributors:
            self.abort(c, r, now, self._below_floor(len(live)))
        elif not late:
            self._freeze(c, r, tuple(sorted(r.ready)), now)
        elif not self.policy.wait_for_all and self._freeze_ok(len(r.ready), len(live)):
            self._freeze(c, r, tuple(sorted(r.ready)), now)
            frozen = True
        else:
            self.abort(c, r, now, f"deadline: {len(r.ready)} of {len(live)} members ready")
        # A straggler is only a straggler if a quorum made the same deadline: when too few
        # members are ready, the deadline was mispredicted (e.g. added network latency),
        # and charging reputation for it would ban honest workers (seen in chaos runs).
        if frozen:
            for wid in late:
                self.roster.reputation(
                    self.roster.workers[wid], self.policy.rep_missed_deadline, now, "missed a round deadline"
                )

    def evaluate(self, c: Cell, r: Round, now: int, *, final: bool = False) -> RoundState | None:
        """Commit on a quorum of equal hashes, abort once a quorum is impossible.

        When the agreeing reports carry held-out losses and the guard is on, the commit
        waits for every live weighted contributor's report (or `final`: the reduce
        deadline): judged at the quorum, the median would be over the first reports only,
        and a minority that reports first would decide it."""
        weighted = r.weighted()
        need = self.quorum * len(weighted)
        # the round keeps the weighted contributors' votes per hash as reports come
        # (`Round.add_report`); those not reported yet are the rest, less the dropped ones
        votes = r.votes
        reports = r.reports
        outstanding = len(weighted) - r.weighted_reported
        if r.dropped:
            outstanding -= sum(1 for x in r.dropped if x not in reports and x in r.frozen and x not in r.catch_up)
        if self.quorum >= 0.5:
            # at most one hash can have more than half of the votes: the one with the most
            top = max(votes.items(), key=_count, default=None)
            leaders = [top] if top is not None else []
        else:  # several may pass the quorum: the first in contributor order wins, as counted
            leaders = Counter(
                reports[x].state_hash for x in weighted if x in reports and not reports[x].failed
            ).most_common(1)
        for h, k in leaders:
            if k > need:
                agreeing = [e for e in r.reports.values() if not e.failed and e.state_hash == h]
                measured = self.guard.cfg.enabled and any(e.heldout_loss >= 0 for e in agreeing)
                if measured and outstanding and not final:
                    return None
                verdict = self.guard.judge(
                    c.heldout_loss, [e.heldout_loss for e in agreeing], [e.heldout_loss_base for e in agreeing]
                )
                if not verdict.ok:  # nobody is charged: the members may all be honest
                    c.guard_refusals += 1
                    self.abort(c, r, now, verdict.reason)
                    return RoundState.ABORTED
                self.commit(c, r, h, now)
                return RoundState.COMMITTED
        if max(votes.values(), default=0) + outstanding <= need:
            self.abort(c, r, now, "no hash can reach the quorum")
            return RoundState.ABORTED
        return None

    def reduce_span_ms(self, c: Cell, r: Round) -> int:
        """How long an exchange attempt of c may take before the coordinator gives up on it.

        The prediction (the slowest link's transfer, with slack) plus a lease, so that a lost
        contributor has time to be noticed and the survivors re-frozen. The prediction
        knows the links but not the members' CPUs: encoding, the robust reduction in
        float64 and the outer step can take longer than the transfer (a 32.5 M-parameter
        cell on two CPU workers never committed a round with the prediction alone). So
        the span is also at least EXCHANGE_MARGIN x the cell's last committed exchange,
        and it doubles after each attempt in a row that ran past its deadline (up to
        MAX_OVERRUN_DOUBLINGS times), as a retransmission timer backs off, until one
        commits. A contributor that died still ends the attempt sooner: its failed or
        missing reports make the quorum impossible or it loses its lease."""
        span = max(self.min_round_ms, int(r.predicted_comm_ms * self.slack)) + self.lease_ms
        span = max(span, EXCHANGE_MARGIN * c.exchange_ms)
        return span << min(c.reduce_overruns, MAX_OVERRUN_DOUBLINGS)

    def commit(self, c: Cell, r: Round, state_hash: str, now: int) -> None:
        reports = r.reports
        agreeing = tuple(sorted(x for x, e in reports.items() if not e.failed and e.state_hash == state_hash))
        disagreeing = tuple(sorted(x for x, e in reports.items() if not e.failed and e.state_hash != state_hash))
        trained = [x for x in agreeing if x not in r.catch_up]
        samples = sum(min(reports[x].samples, r.budget(x)) for x in trained)
        loss = sum(reports[x].loss for x in trained) / len(trained)
        heldout_loss = median([reports[x].heldout_loss for x in agreeing if reports[x].heldout_loss >= 0])
        commit = CommitRecord(
            c.id, r.round, r.attempt, state_hash, now, r.contributors, agreeing, samples, loss, heldout_loss
        )
        c.committed_round, c.committed_hash = r.round, state_hash
        c.heldout_loss = heldout_loss  # the guard's next reference (-1: unknown, members report a base)
        c.samples_committed += samples
        c.last_loss = loss
        c.round_attempt = c.reduce_attempt = 0
        if r.frozen_ms:
            c.exchange_ms = max(0, now - r.frozen_ms)
        c.reduce_overruns = 0
        c.commits.append(commit)
        self.last_committed[c.id] = r
        self.changes.commit(commit)
        self.change_state(c, r, RoundState.COMMITTED, now)
        for x in agreeing:
            w = self.roster.workers[x]
            w.local = c.committed_local()
            self.changes.worker(x)
        for x in trained:
            self.roster.workers[x].rounds_contributed += 1
        # who holds the new state: the agreeing contributors (and nobody else)
        c.synced = {x: None for x in c.workers if c.holds_committed(self.roster.workers[x].local)}
        self.changes.ops += len(c.workers)
        self.check_orphan(c, now)
        every = self.spec.checkpoint.every_rounds
        if c.upload_round > c.checkpoint_round:
            # One upload per cell at a time. An upload may take longer than a round (a full
            # state over a home uplink); asking another holder for the newer round at every
            # commit would start a second upload on top of it, refuse the first when it ends
            # (it is no longer the one asked for) and keep the uplinks full of checkpoint
            # bytes the exchange and the heartbeats queue behind. So the request stands
            # until it lands, its uploader leaves (`Roster.detach` hands it on), or a whole
            # interval passes without it: then it is presumed lost and asked again.
            ask = not c.uploader or r.round - c.upload_round >= every
        else:
            ask = r.round % every == 0
        if ask:
            holders = [x for x in agreeing if x in c.synced]
            if holders:
                c.upload_round, c.uploader = r.round, self.rng.choice(holders)
        # a round nobody else reduced a part of was audited by nobody: it earns no reputation
        if len(r.contributors) > 1:
            for x in trained:
                self.roster.reputation(self.roster.workers[x], self.policy.rep_commit, now, "")
        if not self.hold_next_round(c, r, now):
            self._boundary(c, now)
        for x in disagreeing:
            self.roster.reputation(
                self.roster.workers[x], self.policy.rep_bad_hash, now, "reported a hash the quorum rejected"
            )

    def abort(self, c: Cell, r: Round, now: int, reason: str) -> None:
        """End the attempt; its members roll back locally and the round is re-run at once."""
        self.change_state(c, r, RoundState.ABORTED, now, reason)
        self._boundary(c, now)

    def change_state(self, c: Cell, r: Round, new: RoundState, now: int, reason: str = "") -> None:
        """The one place a round's state changes. A round is born OPEN (`open_round`).

        OPEN -> TRAINING (the first member says it trains), OPEN | TRAINING -> REDUCING (the
        freeze), REDUCING -> REDUCING (a re-freeze of the survivors), and any live state ->
        ABORTED; only REDUCING -> COMMITTED. Ending a round frees its members (idle again,
        so movable) and the cell's slot for the next one.
        """
        old = r.state
        if (old, new) not in _LEGAL or c.round is not r:
            raise IllegalTransition(f"{r.cell} round {r.round} attempt {r.attempt}: {old.value} -> {new.value}")
        r.state = new
        self.changes.round(r)
        if not new.terminal:
            return
        r.ended_ms, r.reason = now, reason
        c.round = None
        for wid in (*r.plans, *r.catch_up):
            if wid not in r.dropped and wid in c.workers:
                c.idle[wid] = None
        self.changes.ops += len(r.plans)
        self.changes.cell(c.id)

    def _boundary(self, c: Cell, now: int) -> None:
        """A round of c ended: rebalance (its members are movable now), then open the next."""
        self.roster.rebalance(now)
        if self.can_open(c, now):
            self.open_round(c, now)

    def frozen_set(self, key: FrozenKey) -> FrozenSet | None:
        """The contributor set frozen for (cell, round, round_attempt, reduce_attempt), if remembered."""
        for k, members in self.frozen_sets.get(key[0], ()):
            if k == key:
                return members
        return None

    def discard_exchange(self, c: Cell, r: Round, wid: str, now: int, reason: str) -> None:
        """A contributor was convicted of lying in the open exchange: its result must not
        commit. Re-freeze the others (they redo only the exchange) if enough remain, else abort."""
        weighted = r.weighted()
        survivors = tuple(x for x in weighted if x not in r.dropped and x != wid)
        if survivors and self._freeze_ok(len(survivors), len(weighted)):
            self._freeze(c, r, survivors, now)
        else:
            self.abort(c, r, now, reason)

    def drop_member(self, c: Cell, r: Round, wid: str, now: int, *, distrust: bool = False) -> None:
        """A member or contributor left the round (lease lost, left, banned).

        `distrust` (a ban): what it sent or reduced can no longer be trusted, so a frozen
        contributor set that includes it is re-frozen without it (or aborted) even when its
        part was delivered and reports came in: no commit is made of a banned worker's bytes,
        and no instruction names it as a contributor again."""
        r.dropped[wid] = None
        if r.state in (RoundState.OPEN, RoundState.TRAINING):
            # before the freeze `ready` says who is ready; from the freeze on it holds the
            # budgets the REDUCE carries, which the exchange's group digest binds: a member
            # that leaves after the freeze keeps its budget there, so the REDUCE answered
            # before and after a restart (which rebuilds it from `ready`) is the same
            r.ready.pop(wid, None)
        self.changes.round(r)
        if r.state in (RoundState.OPEN, RoundState.TRAINING):
            self.check_freeze(c, r, now)
        elif r.state is RoundState.REDUCING and wid in r.frozen and (distrust or wid not in r.reports):
            if not distrust and any(not e.failed for e in r.reports.values()):
                # someone finished the exchange, so the lost part was delivered: the
                # remaining reports decide (an impossible quorum aborts now)
                self.evaluate(c, r, now)
                return
            weighted = r.weighted()
            survivors = tuple(x for x in weighted if x not in r.dropped)
            if survivors and self._freeze_ok(len(survivors), len(weighted)):
                self._freeze(c, r, survivors, now)  # survivors redo only the exchange
            else:
                why = "banned" if distrust else "lost"
                self.abort(c, r, now, f"contributor {wid} {why}, too few survivors")

    # ---------------------------------------------------------------- orphaned cells

    def lose_last_holder(self, c: Cell, now: int, *, may_return: bool) -> None:
        """The last live holder of c's committed state was just detached. One that lost its
        lease (a network cut, a reboot) or registered again may come back with the state:
        the cell waits `schedule.orphan_grace_s` for it before it falls back. One that left
        or was banned will not: no wait."""
        c.orphan_until_ms = 0
        if may_return and self.orphan_grace_ms > 0:
            self.wait_for_holder(c, now + self.orphan_grace_ms)

    def wait_for_holder(self, c: Cell, until_ms: int) -> None:
        """c falls back no earlier than `until_ms`: then the deadline heap checks it again."""
        c.orphan_until_ms = until_ms
        heapq.heappush(self.deadlines, (until_ms, next(self._seq), c.id, c.committed_round, 0, ORPHAN_DEADLINE, 0))

    def orphaned(self, c: Cell) -> bool:
        """Nobody live holds c's committed state, a worker of the cell needs it, and it is
        not the checkpoint's (what `check_orphan` would fall back to, now or after the wait)."""
        return not (c.committed_round == 0 or c.synced or not c.workers or c.checkpoint_round == c.committed_round)

    def check_orphan(self, c: Cell, now: int) -> None:
        """Nobody live holds the committed state and an assigned worker needs it: fall back
        to the latest checkpoint (the loss is bounded by the checkpoint interval). Lazy on
        purpose: a holder that re-attaches before anyone needs the state (a restart, a
        reboot) loses nothing. Patient too: while the last holder may still come back
        (`lose_last_holder`), the fallback waits on the deadline heap, and the workers that
        need the state are told to wait (`CoordinatorState._instruction`); a holder that
        re-attaches meanwhile is their donor and nothing is rolled back."""
        if not self.orphaned(c):
            return
        if now < c.orphan_until_ms:
            return  # the deadline heap looks again when the wait is over
        c.orphan_until_ms = 0
        if c.round is not None:
            self.change_state(c, c.round, RoundState.ABORTED, now, "cell orphaned")
        if c.checkpoint_round >= 1:
            c.committed_round, c.committed_hash = c.checkpoint_round, c.checkpoint_hash
        else:
            c.committed_round, c.committed_hash = 0, ""
        c.rollbacks += 1
        c.heldout_loss = -1.0  # the guard's reference was of the lost state
        c.round_attempt = c.reduce_attempt = 0
        c.upload_round, c.uploader = -1, ""
        c.synced = {wid: None for wid in c.workers if c.holds_committed(self.roster.workers[wid].local)}
        self.changes.cell(c.id)
