"""The workers of a run: leases, placement, moves, donors, throughput and reputation.

`Roster` is the part of the coordinator core that owns the workers (`CoordinatorState`
composes it with `Rounds`). Everything here is bounded per transition: placing a joiner is
O(cells), a repair looks at most at `Policy.repair_candidates` idle workers and makes at
most `Policy.max_moves_per_event` moves, and lease expiry uses a heap with lazy deletion
(an entry is re-pushed with the renewed lease when it surfaces), so a heartbeat never
touches the heap.

The roster and the rounds call each other on purpose, through one typed link each way: a
worker that departs, is banned or moves is taken out of its cell's open round
(`Rounds.drop_member`; a ban, out of every open round that still counts it), and a cell
nobody holds falls back to its checkpoint (`Rounds.check_orphan`); a round that ends
charges or credits reputations and lets the roster repair the assignment
(`Roster.reputation`, `Roster.rebalance`).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import heapq
import itertools
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

from bagel.coordinator.core.changes import Changes
from bagel.coordinator.core.entities import Cell, Round, Worker
from bagel.coordinator.core.errors import Banned, InvalidEvent, UnknownWorker
from bagel.coordinator.core.policy import Policy
from bagel.coordinator.core.records import WorkerState
from bagel.coordinator.core.scheduler import Balance, Knobs, WorkerView, throughput_for
from bagel.protocol.messages import Donor, DonorRate, PeerAddress, PeerRates
from bagel.protocol.runspec import RunSpec

# a donor's transfer to one joiner measures its uplink only when it is long enough
MIN_RATE_MS = 200
MIN_RATE_NBYTES = 1 << 20
DONOR_BOUND = 0.8  # a joiner that got less than this share of its own link was held back by its donors
# a worker's exchange uplink (`Roster.exchange_uplink`): the most recent observers kept, and
# how many distinct ones an estimate needs before the split uses it
MAX_UPLINK_OBSERVERS = 16
MIN_UPLINK_OBSERVERS = 2

if TYPE_CHECKING:  # the two-way link: Rounds imports Roster at run time
    from bagel.coordinator.core.rounds import Rounds


class CellSpeeds:
    """The throughput estimates of a cell's workers, sorted, for `Roster.rate_bound` of many
    of them in a row (a freeze credits every ready member, each against the median of the
    others): sorted once, then kept sorted as each credit moves one estimate, instead of
    sorting the others again for every member. The median of the others is read off the
    sorted whole, skipping the member's own value: the same values `sorted(others)` gives,
    so the same bound. Valid while nothing but `moved` changes the cell's estimates."""

    __slots__ = ("_order", "_vals")

    def __init__(self, roster: Roster, c: Cell) -> None:
        workers = roster.workers
        self._vals = {x: throughput_for(workers[x].throughput, c.id) for x in c.workers}
        self._order = sorted(self._vals.values())
        roster.changes.ops += len(self._order)

    def median_without(self, wid: str) -> float | None:
        """The median estimate of the cell's workers other than `wid` (None if there are none)."""
        order = self._order
        v = self._vals.get(wid)
        skip = len(order) if v is None else bisect.bisect_left(order, v)  # `wid`'s place
        n = len(order) - (v is not None)
        if n <= 0:
            return None

        def at(i: int) -> float:  # the i-th of the others
            return order[i] if i < skip else order[i + 1]

        return at(n // 2) if n % 2 else 0.5 * (at(n // 2 - 1) + at(n // 2))

    def moved(self, wid: str, value: float) -> None:
        """`wid`'s estimate is now `value`."""
        old = self._vals.get(wid)
        if old is None:
            return
        order = self._order
        del order[bisect.bisect_left(order, old)]
        bisect.insort(order, value)
        self._vals[wid] = value


@functools.lru_cache(maxsize=1 << 16)  # pure; a joiner ranks the same candidates at every heartbeat
def _pair_hash(a: str, b: str) -> int:
    """A deterministic, well-mixed tie-break for the pair (a, b). Not CRC32: it is affine, so
    every joiner would rank equal donors in the same order."""
    return int.from_bytes(hashlib.blake2b(f"{a}|{b}".encode(), digest_size=8).digest(), "big")


class Roster:
    """Every worker the run has seen, and where the active ones are assigned."""

    rounds: Rounds  # set by CoordinatorState right after both parts are built

    def __init__(
        self,
        spec: RunSpec,
        policy: Policy,
        knobs: Knobs,
        balance: Balance,
        cells: dict[str, Cell],
        changes: Changes,
    ) -> None:
        self.spec = spec
        self.policy = policy
        self.knobs = knobs
        self.balance = balance
        self.cells = cells
        self.changes = changes
        self.lease_ms = int(spec.schedule.lease_s * 1000)
        self.workers: dict[str, Worker] = {}
        # active workers with no cell that a repair may place (ordered set; see `wait`)
        self.standby: dict[str, None] = {}
        self.active = 0
        self.leases: list[tuple[int, str]] = []  # (expiry, worker) heap, lazily deleted

    # ---------------------------------------------------------------- lookups

    def worker(self, worker_id: str) -> Worker:
        """The active worker (UnknownWorker: re-register; Banned: final)."""
        w = self.workers.get(worker_id)
        if w is None or w.state in (WorkerState.LOST, WorkerState.LEFT):
            raise UnknownWorker(f"unknown worker {worker_id!r}: register")
        if w.state is WorkerState.BANNED:
            raise Banned(f"worker {worker_id} is banned: {w.reason}")
        return w

    def cell(self, cell_id: str) -> Cell:
        c = self.cells.get(cell_id)
        if c is None:
            raise InvalidEvent(f"unknown cell {cell_id!r}")
        return c

    # ---------------------------------------------------------------- leases

    def renew(self, w: Worker, now: int) -> int:
        """The run's lease from `now` (every message of an active worker renews it)."""
        w.lease_ms = now + self.lease_ms
        if w.lease_ms < w.lease_entry:
            self._push_lease(w)  # sooner than its heap entry: a worker that measured (below)
        return w.lease_ms

    def _push_lease(self, w: Worker) -> None:
        w.lease_entry = w.lease_ms
        heapq.heappush(self.leases, (w.lease_ms, w.id))

    def expire_leases(self, now: int) -> bool:
        """Expire every lease that ran out by `now`; True if any did."""
        lost = False
        while self.leases and self.leases[0][0] <= now:
            t, wid = heapq.heappop(self.leases)
            w = self.workers[wid]
            if t != w.lease_entry:
                continue  # a stale duplicate
            w.lease_entry = 0
            if w.state is not WorkerState.ACTIVE:
                continue
            if w.lease_ms <= now:
                self.expire(w, now)
                lost = True
            else:
                self._push_lease(w)  # renewed since: look again when the new lease runs out
        return lost

    # ---------------------------------------------------------------- attach / detach

    def activate(self, w: Worker, now: int, *, lease_ms: int = 0) -> None:
        """Count `w` in, with the run's lease or a longer `lease_ms`: a worker that has not
        measured its speed yet may send nothing while it measures (seconds to minutes).

        The heap holds one live entry per worker and looks again when it pops, so a lease
        that moves later needs no new entry; one that ends sooner than the worker's entry
        (the run's lease after a measuring one, at the next Register or message) gets its
        own, here or in `renew`."""
        self.active += 1
        self.balance.add_reference(w.profile.samples_per_s)
        self.renew(w, now)
        if lease_ms > self.lease_ms:
            w.lease_ms = now + lease_ms
        if not w.lease_entry:
            self._push_lease(w)

    def wait(self, w: Worker) -> None:
        """`w` (active, without a cell) waits for a place: in the placement queue once it has
        measured its speed; one that has not is placed when it registers again with it."""
        if w.throughput:
            self.standby[w.id] = None

    def place(self, w: Worker) -> str:
        """A returning worker goes back to the cell whose committed state it holds (if it
        still fits and has room); anyone else where the scheduler says."""
        h = self.cells.get(w.local.cell_id)
        b = self.balance
        if (
            h is not None
            and h.committed_round > 0
            and h.holds_committed(w.local)
            and h.id in b.eligible(w.budget)
            and b.count[h.id] < self.knobs.max_replicas
        ):
            return h.id
        return b.best_cell(w.budget, w.throughput, w.reputation)

    def assign(self, w: Worker, cid: str, now: int, *, restoring: bool = False) -> None:
        c = self.cells[cid]
        w.cell = cid
        w.raw = self.balance.raw_power(w.throughput, w.reputation, cid)
        self.balance.add(cid, w.raw)
        c.workers[w.id] = None
        c.idle[w.id] = None
        if c.holds_committed(w.local):
            c.synced[w.id] = None
        elif not restoring:
            self.rounds.check_orphan(c, now)
        self.standby.pop(w.id, None)
        self.changes.worker(w.id)

    def _unassign(self, w: Worker) -> None:
        c = self.cells[w.cell]
        self.balance.remove(c.id, w.raw)
        for s in (c.workers, c.synced, c.idle, c.awaiting):
            s.pop(w.id, None)
        self._release_donor(w, c)
        w.cell, w.raw = "", 0.0
        if c.uploader == w.id:
            # hand the pending upload to another holder; with none, the next commit asks again
            c.uploader = next(iter(c.synced), "") if c.upload_round == c.committed_round else ""
            self.changes.cell(c.id)
        self.changes.worker(w.id)

    def detach(self, w: Worker, now: int, *, fail_fast: bool, distrust: bool = False, may_return: bool = False) -> None:
        """Take an active worker out of its cell and open round (the caller sets its new
        state). fail_fast=False keeps it counted in its open round until the deadline;
        distrust=True (a ban) also re-freezes a contributor set it is part of, in any cell;
        may_return=True (a lost lease, a second Register) lets a cell it was the last holder
        of wait for it before falling back (`Rounds.lose_last_holder`)."""
        self.active -= 1
        self.balance.add_reference(w.profile.samples_per_s, -1)
        self.standby.pop(w.id, None)
        self.changes.worker(w.id)
        if w.cell:
            c = self.cells[w.cell]
            awaited = w.id in c.awaiting
            held = w.id in c.synced
            self._unassign(w)
            if held and not c.synced:
                self.rounds.lose_last_holder(c, now, may_return=may_return and not distrust)
            r = c.round
            if r is not None and fail_fast and (r.is_live_member(w.id) or r.is_contributor(w.id)):
                self.rounds.drop_member(c, r, w.id, now, distrust=distrust)
            self.rounds.check_orphan(c, now)
            if awaited and not c.awaiting and self.rounds.can_open(c, now):
                self.rounds.open_round(c, now)  # it was the last one the next round waited for
        if distrust:
            self.distrust(w, now)

    def distrust(self, w: Worker, now: int) -> None:
        """A banned worker leaves every open round that still counts it, in any cell.

        A lease lost without fail_fast_leases keeps the worker counted in its old cell's
        round until that round's deadline; re-registered since, it may sit in another cell
        or on standby. A contributor that reported and then left is dropped but still
        frozen (its part was delivered). Either way its round must go on without it: an
        exchange it is frozen in is re-frozen (or aborted), or it would commit with the
        banned worker's bytes and keep naming it in the REDUCE."""
        self.changes.ops += len(self.cells)
        for oc in self.cells.values():
            r = oc.round
            if r is not None and (r.is_live_member(w.id) or w.id in r.frozen):
                self.rounds.drop_member(oc, r, w.id, now, distrust=True)

    def expire(self, w: Worker, now: int) -> None:
        self.detach(w, now, fail_fast=self.policy.fail_fast_leases, may_return=True)
        w.state, w.reason = WorkerState.LOST, "lease expired"

    def _move(self, w: Worker, to: str, now: int) -> None:
        c = self.cells[w.cell]
        r = c.round
        if r is not None and r.is_live_member(w.id):  # only idle workers move: it sat out
            r.dropped[w.id] = None
            self.changes.round(r)
        self._unassign(w)
        self.assign(w, to, now)

    def refresh_synced(self, w: Worker, c: Cell) -> None:
        if c.holds_committed(w.local):
            if w.id not in c.synced:
                c.synced[w.id] = None
                self._release_donor(w, c)
        else:
            c.synced.pop(w.id, None)

    # ---------------------------------------------------------------- donors

    def _release_donor(self, w: Worker, c: Cell) -> None:
        for d in w.donors:
            n = c.donor_load.get(d, 0)
            if n > 1:
                c.donor_load[d] = n - 1
            else:
                c.donor_load.pop(d, None)
        w.donors = ()

    def donor_bandwidth(self, d: Worker) -> float:
        """The uplink a donor is believed to have, in bytes/s. Once its joiners have measured
        it, the measure, never above what the donor declared (a claim can lower a rank but
        not buy one); before that, the declared figure, else the policy's default."""
        declared = d.profile.link_bandwidth_bytes_per_s
        measured = d.uplink_measured
        if measured > 0:
            return min(declared, measured) if declared > 0 else measured
        return declared if declared > 0 else self.policy.default_bandwidth_bytes_per_s

    def observe_donor_rates(self, w: Worker, c: Cell, rates: Iterable[DonorRate]) -> None:
        """Fold what joiner `w` measured of its donors into their measured uplinks.

        Only the donors the coordinator named for `w` (still counted as serving it) are
        read, so a worker can speak only of its own download; the report also ends that
        download (the donors are released), so it is read once per assignment.

        A transfer measures the donors only when they, not the joiner, bounded it: the
        joiner's total rate must stay below `DONOR_BOUND` of its own declared link (a
        joiner of unknown link measures nothing). Otherwise a fast donor that served a slow
        home joiner would be ranked by that joiner's link. A donor serving `load` syncs is
        taken to share its uplink evenly among them, as the ranking in `donors` assumes, so
        its uplink is the measured rate x load. Transfers shorter than `MIN_RATE_MS` or
        `MIN_RATE_NBYTES` measure latency, not bandwidth, and are skipped. The estimate is an
        EMA with the throughput's factor."""
        if not w.donors:
            return
        mine = [r for r in rates if r.worker_id in w.donors and r.ms >= MIN_RATE_MS and r.nbytes >= MIN_RATE_NBYTES]
        link = w.profile.link_bandwidth_bytes_per_s
        total = sum(r.nbytes for r in mine) * 1000.0 / max([r.ms for r in mine], default=1)
        if not mine or link <= 0 or total >= DONOR_BOUND * link:
            self._release_donor(w, c)
            return
        a = self.policy.throughput_ema
        for r in mine:
            d = self.workers.get(r.worker_id)
            if d is None:
                continue
            observed = r.nbytes * 1000.0 / r.ms * max(1, c.donor_load.get(d.id, 1))
            prev = d.uplink_measured
            d.uplink_measured = observed if prev <= 0 else (1 - a) * prev + a * observed
        self._release_donor(w, c)

    def observe_peer_rates(self, w: Worker, contributors: Collection[str], rates: PeerRates) -> None:
        """Fold what contributor `w` measured, as a reducer, of its peers' contributions in one
        exchange over `contributors` (a round's `frozen` set: ids looked up per peer) into
        those peers' exchange uplink estimates.

        Only peers among `contributors` are read, never `w` itself (a worker's claims about
        its own link never count), and transfers shorter than `MIN_RATE_MS` or
        `MIN_RATE_NBYTES` are skipped (latency, not bandwidth). A sender streams its parts
        to the other k - 1 reducers at once, so one stream sees about 1/(k - 1) of its
        uplink: the observation is the stream's rate x (k - 1). Each peer keeps one figure
        per observer (its latest), for the `MAX_UPLINK_OBSERVERS` most recent observers, so
        an observer that reports again replaces its own figure and cannot outvote others."""
        members = contributors
        me = w.id
        if me not in members:
            return
        scale = max(1, len(members) - 1)
        workers = self.workers
        for wid, nbytes, ms in zip(rates.worker_ids, rates.nbytes, rates.ms, strict=True):
            if ms < MIN_RATE_MS or nbytes < MIN_RATE_NBYTES or wid == me or wid not in members:
                continue
            peer = workers.get(wid)
            if peer is None:
                continue
            seen = peer.uplink_seen
            seen.pop(me, None)  # re-inserted last: the most recent observer
            seen[me] = nbytes * 1000.0 / ms * scale
            while len(seen) > MAX_UPLINK_OBSERVERS:
                del seen[next(iter(seen))]
        self.changes.ops += len(members)

    def exchange_uplink(self, w: Worker) -> float:
        """`w`'s exchange uplink in bytes/s as the other contributors measured it: the second
        highest of its observers' figures, once `MIN_UPLINK_OBSERVERS` of them measured it
        (0 = unmeasured).

        Not the median: a stream is bounded by both of its ends, the sender's uplink and the
        observer's downlink, so a datacenter sender seen by home observers looks as slow as
        their links, and the figures the sender itself bounded are the high ones. Not the
        highest either: one lying observer would set it. With two honest figures h1 >= h2
        and one liar, the second highest stays within [h2, h1] whatever the liar says;
        with two observers in all it is the lower one, so a liar can only lower it, which
        shrinks its victim's part and makes the liar's own part larger. The worker's own
        claims never enter (`observe_peer_rates`)."""
        vals = sorted(w.uplink_seen.values(), reverse=True)
        if len(vals) < MIN_UPLINK_OBSERVERS:
            return 0.0
        return vals[1]

    def donors(self, w: Worker, c: Cell) -> tuple[Donor, ...]:
        """Up to `[sync] max_donors` synced workers of the cell for `w` to fetch from, best first.

        A donor is ranked by what it is expected to give this joiner: its uplink divided
        among the syncs it already serves plus this one (`donor_bandwidth / (1 + load)`), so
        a fast donor is preferred until it is shared; ties are spread by a hash of the pair.
        The choice is sticky while every chosen donor still holds the committed state, so
        repeated heartbeats see the same list; each chosen donor counts one sync more for
        later joiners until `w` is synced, leaves or is moved. Each donor's figure is its
        uplink shared evenly among the syncs it serves now, this one included. With no synced
        worker, one entry: the checkpoint (worker id "")."""
        chosen = w.donors
        if not (chosen and all(d in c.synced for d in chosen)):
            self._release_donor(w, c)
            ranked: list[tuple[float, int, str]] = []
            for cand in c.synced:
                if cand != w.id:
                    rate = self.donor_bandwidth(self.workers[cand]) / (1 + c.donor_load.get(cand, 0))
                    ranked.append((-rate, _pair_hash(w.id, cand), cand))
            self.changes.ops += len(ranked)
            chosen = tuple(x[2] for x in heapq.nsmallest(self.spec.sync.max_donors, ranked))
            w.donors = chosen
            for d in chosen:
                c.donor_load[d] = c.donor_load.get(d, 0) + 1
        if not chosen:
            return (Donor("", PeerAddress(), c.checkpoint_round),)
        out = []
        for d in chosen:
            # its uplink shared evenly among the syncs it serves, this one included
            rate = self.donor_bandwidth(self.workers[d]) / max(1, c.donor_load.get(d, 1))
            out.append(Donor(d, self.workers[d].peer, c.checkpoint_round, rate))
        return tuple(out)

    # ---------------------------------------------------------------- estimates

    def observe_throughput(self, w: Worker, cid: str, observed: float) -> None:
        """SWARM's PerformanceEMA: estimate <- (1 - a) estimate + a observed."""
        a = self.policy.throughput_ema
        observed = min(max(observed, 0.0), self.spec.audit.max_samples_per_s)
        w.throughput[cid] = (1 - a) * throughput_for(w.throughput, cid) + a * observed
        self._reweigh(w)
        self.changes.worker(w.id)

    def rate_bound(self, w: Worker, c: Cell, speeds: CellSpeeds | None = None) -> float:
        """The most samples/s the coordinator believes of `w` in `c`: `audit.max_samples_per_s`,
        and `audit.max_speedup` times the median estimate of the cell's other workers.
        `speeds`: the cell's estimates already sorted (`CellSpeeds`), when many members of
        the cell are bounded in a row."""
        a = self.spec.audit
        if speeds is None:
            speeds = CellSpeeds(self, c)
        med = speeds.median_without(w.id)
        if med is None:
            return a.max_samples_per_s
        return min(a.max_samples_per_s, a.max_speedup * med)

    def credit(
        self,
        w: Worker,
        c: Cell,
        r: Round,
        claimed: int,
        now: int,
        *,
        observe: bool = True,
        ahead_since_ms: int | None = None,
        speeds: CellSpeeds | None = None,
    ) -> int:
        """The samples a ready member is credited for this round, from what the coordinator
        observed: its claim, at most its plan's budget, and at most what the absolute
        throughput bound allows in the wall time between the TRAIN the core answered it
        (else the round's opening) and its READY. A member that says READY at once is
        credited almost nothing, whatever it claims. Also feeds the throughput estimate,
        when that span is long enough to say something (at least one heartbeat interval:
        a READY may wait that long): samples credited over the span, clamped to
        `rate_bound`; the `compute_ms` a worker reports is never used for it.
        `ahead_since_ms`: with overlap, when the member's exchange of the round before was
        frozen, since which it may have trained this round's first steps; its span starts
        there. `speeds`: the cell's `CellSpeeds` while a freeze credits its members in turn
        (kept up to date with each estimate this changes)."""
        p = r.plans.get(w.id)
        cap = p.max_samples if p is not None else 0
        start = max(r.opened_ms, r.train_ms.get(w.id, r.opened_ms))
        if ahead_since_ms is not None:
            start = min(start, ahead_since_ms)
        span_ms = max(0, r.ready_ms.get(w.id, now) - start)
        by_time = int(self.spec.audit.max_samples_per_s * span_ms / 1000.0)
        got = max(0, min(claimed, cap, by_time))
        if observe and got > 0 and span_ms >= self.spec.schedule.heartbeat_s * 1000:
            observed = min(got * 1000.0 / span_ms, self.rate_bound(w, c, speeds))
            self.observe_throughput(w, c.id, observed)
            if speeds is not None:
                speeds.moved(w.id, throughput_for(w.throughput, c.id))
        return got

    def observe_progress(self, w: Worker, c: Cell, r: Round, now: int) -> None:
        """A member missed the deadline: estimate its real speed from its last heartbeat."""
        p = r.plans[w.id]
        elapsed_s = (now - max(r.opened_ms, r.train_ms.get(w.id, r.opened_ms))) / 1000.0
        if w.round == r.round and w.inner_step > 0 and elapsed_s > 0:
            observed = w.inner_step * p.micro_batch * p.grad_accum / elapsed_s
        else:
            observed = throughput_for(w.throughput, c.id) / 2.0  # no sign of progress
        self.observe_throughput(w, c.id, observed)

    def _reweigh(self, w: Worker) -> None:
        if w.cell:
            self.balance.remove(w.cell, w.raw)
            w.raw = self.balance.raw_power(w.throughput, w.reputation, w.cell)
            self.balance.add(w.cell, w.raw)

    def reputation(self, w: Worker, delta: float, now: int, why: str) -> None:
        if delta == 0:
            return
        w.reputation = min(self.policy.rep_max, w.reputation + delta)
        self._reweigh(w)
        self.changes.worker(w.id)
        if w.state is WorkerState.ACTIVE and w.reputation <= self.spec.schedule.ban_reputation:
            self.detach(w, now, fail_fast=True, distrust=True)
            w.state, w.reason = WorkerState.BANNED, f"reputation {w.reputation:.2f}: {why}"
            self.rebalance(now, balance=False)

    # ---------------------------------------------------------------- scheduling

    def rebalance(self, now: int, *, balance: bool = True) -> None:
        """Bounded repair: place standby workers, then a few improving moves of idle ones.

        Redundancy moves (some cell below min_replicas) are made on every call. Balance
        moves only with `balance=True`, which the callers pass where a move is worth its
        cost:
        - at a round boundary, when the cell's members have just become movable;
        - on a join while the newcomer's cell has not committed a round yet: nobody there
          holds or downloads state, so moves are free (the cold start, small fleets).
        A departure, a lost lease or a ban only restores redundancy: the hole it leaves
        is where `best_cell` puts the next joiner, and the next boundary moves idle
        members. A join into a trained cell is placed by `best_cell` (the largest
        shortfall) and moves nobody else: the idle workers such a repair would shuffle
        are mostly joiners still downloading, whose move throws that download away.
        With 10,000 workers this also keeps a join or leave O(cells), not O(candidates x
        destinations x moves)."""
        b, m = self.balance, self.knobs.candidates
        if self.standby and any(b.count[c] < self.knobs.max_replicas for c in b.active):
            for wid in list(itertools.islice(self.standby, m)):
                w = self.workers[wid]
                self.changes.ops += 1
                cid = b.best_cell(w.budget, w.throughput, w.reputation)
                if cid:
                    self.assign(w, cid, now)
        if not self.policy.rebalance:
            return
        tol = self.policy.balance_tolerance
        for _ in range(self.knobs.max_moves):
            short = b.short_of_replicas()
            if not (short or balance):
                return
            ratios = b.ratio_view()
            balanced = not ratios or b.max_deviation() <= tol
            if balanced and not short:
                return
            move = b.best_move(self._candidates(ratios, over_only=not short))
            if move is not None:
                (wid, _, to), _ = move
                self._move(self.workers[wid], to, now)
                continue
            if balanced:
                return
            # no single move helps: try an exchange among a few candidates (O(k^2), k small)
            # two downloads for one fix is rarely worth it: a swap needs a worker holding nothing
            cands = list(self._candidates(ratios, self.policy.swap_candidates))
            if all(v.sticky for v in cands):
                return
            swap = b.best_swap(cands, allow_two_downloads=False)
            if swap is None:
                return
            for wid, _, to in swap[:2]:
                self._move(self.workers[wid], to, now)

    def _candidates(
        self, ratios: Mapping[str, float], limit: int = 0, *, over_only: bool = False
    ) -> Iterator[WorkerView]:
        """Idle workers, from the most over-target cell down, at most `limit` (default:
        the `candidates` knob); with over_only, only from cells over their target.
        `ratios` is the balance's current `ratio_view()`."""
        limit = limit or self.knobs.candidates
        n = 0
        for cid in self.balance.cells_by_ratio_desc():
            if over_only and ratios[cid] <= 1.0:
                return
            c = self.cells[cid]
            sole = len(c.synced) == 1 and c.committed_round > max(c.checkpoint_round, 0)
            for wid in c.idle:
                if n >= limit:
                    return
                if sole and wid in c.synced:
                    continue  # never move the last holder of a cell's committed state
                w = self.workers[wid]
                n += 1
                self.changes.ops += 1
                # sticky: once its cell has trained, a worker holding any cell's state (this
                # one's, or another's while it downloads this one) would pay a download
                yield WorkerView(
                    wid,
                    w.budget,
                    w.throughput,
                    w.reputation,
                    cid,
                    True,
                    c.committed_round > 0 and w.local.cell_id != "",
                )
