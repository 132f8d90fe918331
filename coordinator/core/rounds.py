"""The outer-round lifecycle of a cell: OPEN -> TRAINING -> REDUCING -> COMMITTED | ABORTED.

Part of `CoordinatorState` (see state.py for the protocol). The rules, in one place:

- freeze quorum: at the deadline, at least ceil(quorum x live members) (and >= 1) must be
  ready, else the attempt aborts; with every live member ready it freezes at once;
- commit quorum: strictly more than quorum x |weighted contributors| equal hashes
  (catch-up contributors do not count: they trained nothing);
- an attempt that can no longer reach the commit quorum aborts at once; one still
  REDUCING at its reduce deadline aborts then;
- an aborted attempt is re-run at once (same round number, attempt + 1) by whoever holds
  the committed state; `reduce_attempt` keeps counting across re-runs of a round number,
  so a late report names exactly the contributor set it was reduced over.
Timeouts are pure predicates on `now_ms` fired from the deadline heap by Tick (Psyche's
`check_timeout(ts, duration)`).
"""

from __future__ import annotations

import math
from collections import Counter

from bagel.coordinator.core.core_base import REDUCE_DEADLINE, TRAIN_DEADLINE, CoreBase
from bagel.coordinator.core.records import CommitRecord, RoundState, WorkerState
from bagel.coordinator.core.entities import Cell, Round
from bagel.coordinator.core.scheduler import PlanMember, plan_round, throughput_for


class RoundLifecycle(CoreBase):
    def _open_round(self, c: Cell, now: int) -> None:
        """Open the next attempt with every worker that holds the committed state."""
        ids = sorted(c.synced)
        self.ops += len(ids)
        members = []
        for wid in ids:
            w = self._workers[wid]
            members.append(PlanMember(wid, w.peer, throughput_for(w.throughput, c.id), w.profile.link_bandwidth_bytes_per_s))
        payload = c.config.payload_bytes or c.config.memory_bytes // 16
        plan = plan_round(members, self.spec, now, self.policy, payload)
        c.round_attempt += 1
        r = Round(c.id, c.committed_round + 1, c.round_attempt, now, plan.deadline_ms, plan.inner_steps,
                  plan.members, plan.predicted_compute_ms, plan.predicted_comm_ms)
        c.round = r
        for wid in ids:
            c.idle.pop(wid, None)
        self._push_deadline(r.deadline_ms, r, TRAIN_DEADLINE)
        self._dr[r.key] = r
        self._dc[c.id] = None

    def _freeze_ok(self, ready: int, live: int) -> bool:
        return ready >= max(1, math.ceil(self._quorum * live - 1e-9))

    def _check_freeze(self, c: Cell, r: Round, now: int) -> None:
        live = r.live_count()
        if live == 0:
            self._abort(c, r, now, "no members left")
        elif len(r.ready) == live:
            self._freeze(c, r, tuple(sorted(r.ready)), now)

    def _freeze(self, c: Cell, r: Round, weighted: tuple[str, ...], now: int) -> None:
        """Freeze the contributors: `weighted` (ready members) plus, under catch_up, every
        other worker of the cell that holds the round's base state, with zero weight."""
        c.reduce_attempt += 1
        r.reduce_attempt = c.reduce_attempt
        if not r.first_reduce_attempt:
            r.first_reduce_attempt = r.reduce_attempt
        w_set = set(weighted)
        catch = tuple(sorted(x for x in c.synced if x not in w_set)) if self.policy.catch_up else ()
        self.ops += len(c.synced)
        peers = {x: self._workers[x].peer for x in catch if x not in r.plans}
        r.set_contributors(tuple(sorted(w_set.union(catch))), catch, peers)
        r.state = RoundState.REDUCING
        r.frozen_ms = now
        r.reports = {}
        # give up once the exchange had its predicted time (with slack) and a lost
        # contributor had time to be noticed and the survivors re-frozen
        span = max(self._min_round_ms, int(r.predicted_comm_ms * self._slack)) + self._lease_ms
        r.reduce_deadline_ms = now + span
        self._push_deadline(r.reduce_deadline_ms, r, REDUCE_DEADLINE)
        for wid in r.plans:  # live members left out (catch_up off) sit out: movable again
            if wid not in r.frozen and wid not in r.dropped and wid in c.workers:
                c.idle[wid] = None
        for wid in catch:
            c.idle.pop(wid, None)
        self._dr[r.key] = r
        self._dc[c.id] = None

    def _train_deadline(self, c: Cell, r: Round, now: int) -> None:
        for wid in r.plans:  # members kept past their lease (fail_fast_leases=False) go now
            w = self._workers[wid]
            if wid not in r.dropped and (w.state is not WorkerState.ACTIVE or w.cell != c.id):
                r.dropped[wid] = None
                r.ready.pop(wid, None)
        self.ops += len(r.plans)
        self._dr[r.key] = r
        live = [wid for wid in r.plans if wid not in r.dropped]
        late = [wid for wid in live if wid not in r.ready]
        for wid in late:  # learn from the miss before a re-run is planned
            self._observe_progress(self._workers[wid], c, r, now)
        frozen = False
        if not live:
            self._abort(c, r, now, "no members left")
        elif not late:
            self._freeze(c, r, tuple(sorted(r.ready)), now)
        elif not self.policy.wait_for_all and self._freeze_ok(len(r.ready), len(live)):
            self._freeze(c, r, tuple(sorted(r.ready)), now)
            frozen = True
        else:
            self._abort(c, r, now, f"deadline: {len(r.ready)} of {len(live)} members ready")
        # A straggler is only a straggler if a quorum made the same deadline: when too few
        # members are ready, the deadline was mispredicted (e.g. added network latency),
        # and charging reputation for it would ban honest workers (seen in chaos runs).
        if frozen:
            for wid in late:
                self._reputation(self._workers[wid], self.policy.rep_missed_deadline, now, "missed a round deadline")

    def _evaluate(self, c: Cell, r: Round, now: int) -> RoundState | None:
        """Commit on a quorum of equal hashes, abort once a quorum is impossible."""
        weighted = r.weighted()
        need = self._quorum * len(weighted)
        votes = Counter(r.reports[x].state_hash for x in weighted if x in r.reports and not r.reports[x].failed)
        for h, k in votes.most_common(1):
            if k > need:
                self._commit(c, r, h, now)
                return RoundState.COMMITTED
        outstanding = sum(1 for x in weighted if x not in r.reports and x not in r.dropped)
        if max(votes.values(), default=0) + outstanding <= need:
            self._abort(c, r, now, "no hash can reach the quorum")
            return RoundState.ABORTED
        return None

    def _commit(self, c: Cell, r: Round, state_hash: str, now: int) -> None:
        reports = r.reports
        agreeing = tuple(sorted(x for x, e in reports.items() if not e.failed and e.state_hash == state_hash))
        disagreeing = tuple(sorted(x for x, e in reports.items() if not e.failed and e.state_hash != state_hash))
        trained = [x for x in agreeing if x not in r.catch_up]
        samples = sum(min(reports[x].samples, r.plans[x].max_samples) for x in trained)
        loss = sum(reports[x].loss for x in trained) / len(trained)
        commit = CommitRecord(c.id, r.round, r.attempt, state_hash, now, r.contributors, agreeing, samples, loss)
        c.committed_round, c.committed_hash = r.round, state_hash
        c.samples_committed += samples
        c.last_loss = loss
        c.round_attempt = c.reduce_attempt = 0
        c.commits.append(commit)
        self._new_commits.append(commit)
        self._end_round(c, r, now, RoundState.COMMITTED, "")
        for x in agreeing:
            w = self._workers[x]
            w.local = c.committed_local()
            self._dw[x] = None
        for x in trained:
            self._workers[x].rounds_contributed += 1
        # who holds the new state: the agreeing contributors (and nobody else)
        c.synced = {x: None for x in c.workers if c.holds_committed(self._workers[x].local)}
        self.ops += len(c.workers)
        self._check_orphan(c, now)
        every = self.spec.checkpoint.every_rounds
        if r.round % every == 0 or c.upload_round > c.checkpoint_round:
            holders = [x for x in agreeing if x in c.synced]
            if holders:
                c.upload_round, c.uploader = r.round, self.rng.choice(holders)
        for x in trained:
            self._reputation(self._workers[x], self.policy.rep_commit, now, "")
        self._boundary(c, now)
        for x in disagreeing:
            self._reputation(self._workers[x], self.policy.rep_bad_hash, now, "reported a hash the quorum rejected")

    def _abort(self, c: Cell, r: Round, now: int, reason: str) -> None:
        """End the attempt; its members roll back locally and the round is re-run at once."""
        self._end_round(c, r, now, RoundState.ABORTED, reason)
        self._boundary(c, now)

    def _end_round(self, c: Cell, r: Round, now: int, state: RoundState, reason: str) -> None:
        r.state, r.ended_ms, r.reason = state, now, reason
        c.round = None
        for wid in (*r.plans, *r.catch_up):
            if wid not in r.dropped and wid in c.workers:
                c.idle[wid] = None
        self.ops += len(r.plans)
        self._dr[r.key] = r
        self._dc[c.id] = None

    def _boundary(self, c: Cell, now: int) -> None:
        """A round of c ended: rebalance (its members are movable now), then open the next."""
        self._rebalance(now)
        if c.round is None and c.synced:
            self._open_round(c, now)

    def _drop_member(self, c: Cell, r: Round, wid: str, now: int) -> None:
        """A member or contributor left the round (lease lost, left, banned)."""
        r.dropped[wid] = None
        r.ready.pop(wid, None)
        self._dr[r.key] = r
        if r.state in (RoundState.OPEN, RoundState.TRAINING):
            self._check_freeze(c, r, now)
        elif r.state is RoundState.REDUCING and wid in r.frozen and wid not in r.reports:
            if any(not e.failed for e in r.reports.values()):
                # someone finished the exchange, so the lost part was delivered: the
                # remaining reports decide (an impossible quorum aborts now)
                self._evaluate(c, r, now)
                return
            weighted = r.weighted()
            survivors = tuple(x for x in weighted if x not in r.dropped)
            if survivors and self._freeze_ok(len(survivors), len(weighted)):
                self._freeze(c, r, survivors, now)  # survivors redo only the exchange
            else:
                self._abort(c, r, now, f"contributor {wid} lost, too few survivors")
