"""What a synthetic worker does: the worker half of the discrete-event engine.

`WorkerBehaviour` is mixed into `engine.Engine`; it reacts to instructions with the real
worker's own decisions (`bagel.worker.reconciler.decide`: follow the level-triggered
order; start training, reducing or syncing when the order says so and it is not already
doing it), mapping each action onto virtual time (a job on the heap), and to the
population's events (arrive, depart, get cut off, get stopped). It relies on the engine
for the clock (`self.now`), the heap (`self.push`), sending to the core (`self._send`)
and accounting (`self._set_act`, `self.ledger`).

What `decide` sees of a synthetic worker (`_view`): its activity gives the work (TRAIN and
STALL: training; READY: ready; REDUCE: exchanging; WAITV: reported) and the sync in
flight. The simulator's `local` is what the worker's heartbeats report: after an exchange
it already names the outcome (the candidate), so while that report awaits its verdict
the view holds the state before the outer step (`prev_local`) with the candidate as the
pending outcome, as the real worker holds them.

Overlap (`[diloco] overlap = "delayed"` in the run spec, and a policy that does not turn
it off): when a worker starts the weighted exchange of a round n it trained, its GPU goes
on training round n + 1 on the guess that its plan repeats round n's (same member index,
members and batch shape), at its own rate, while it exchanges (REDUCE), while
its report awaits the verdict (WAITV) and while it waits idle for round n + 1 after the
commit (IDLE), up to the guessed round's full training time (round n's `own_s`). The
exchange itself takes as long as without overlap (the GPU and the link work apart).
`_view` hands `decide` those steps (`reconciler.Ahead`), which matches them against the
next TRAIN (`reconciler.steps_ahead`: the same data shard, whatever the batch shape);
`StartTrain.ahead_steps` of them are carried into that round, which then trains only the
rest, in its own batch shape (what it claims stays within its plan's budget, as the real
worker's `roundwork.train_round` does). The steps are thrown away whenever the worker
drops that work (a DropWork of that round, an ABORTED or RESYNC verdict on it), syncs,
departs, or the next TRAIN does not match (as in the real worker, a catch-up exchange
does not stop them: they are thrown away at the next TRAIN or sync). Accounting (the engine's
`_set_act`): time trained ahead is training, not the activity's bucket; its FLOPs are held
on the worker (`W.ahead_fl`) and, when carried, join round n + 1's pending training (the
carried steps' share; the rest, a step begun but not finished, is "aborted"); thrown away,
they are "aborted", or "preempted" when the worker departs or is cut off or stopped, and
"unresolved" at the end of the run. Time past the cap is the activity's own bucket.

Catching up by committed updates (`[sync] catch_up_rounds` > 0, a policy that does not turn
it off: the baselines do): as in the real worker (`Orders._sync`, `worker/catchup.py`), every
worker keeps the committed updates of its cell's last rounds it applied (`W.upd`: a round
it exchanged and adopted, or the rounds it caught up by; a download or a restart keeps
none), and a worker told to sync to the round R of the cell whose committed state of round
j it holds, 1 <= R - j <= catch_up_rounds, asks its donors in order for the updates of
rounds j+1..R (one round's update is the exchange's encoded vector, `Engine.payload`). A
donor that does not hold them all refuses; the first that does sends them over its link,
and the worker reports what it measured of it (`DonorRate`), as after a download. A catch-up
that no donor serves costs its refusals, then the whole state is downloaded. The real
worker gives a catch-up the budget of the download it saves (`--sync-timeout-s`); the
simulator's downloads always finish (a volunteer sets that budget to fit its state), so a
catch-up, which moves fewer bytes, finishes too. Applying the updates (the outer steps) is
not timed.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np

from bagel.coordinator.core.errors import CoordinatorError
from bagel.coordinator.core.events import CheckpointStored, LeaseExpired, Leave, ReportRound
from bagel.protocol.messages import DonorRate, Instruction, LocalState, Order, PeerRates, Verdict
from bagel.sim.discrete import costmodel as cm
from bagel.sim.discrete import population as popmod
from bagel.sim.faults import Fault, FaultKind
from bagel.worker import reconciler
from bagel.worker.reconciler import (
    AdoptPending,
    Ahead,
    BuildInitialState,
    CancelSync,
    DropWork,
    ReportMissing,
    StartCatchUp,
    StartReduce,
    StartSync,
    StartTrain,
    Sync,
    Upload,
    Work,
    WorkerView,
)
from bagel.worker.reconciler import (
    Leave as LeaveOrder,
)

if TYPE_CHECKING:  # pragma: no cover
    from bagel.coordinator.core.events import Event, Outcome
    from bagel.protocol.messages import Profile, RoundPlan
    from bagel.sim.discrete.ledger import Ledger
    from bagel.sim.discrete.policies import SimPolicy
    from bagel.sim.discrete.population import AvailabilitySpec

# event kinds
(
    ARRIVE,
    DEPART,
    SYNC_DONE,
    TRAIN_DONE,
    REDUCE_DONE,
    POLL,
    RENEW,
    TICK,
    FAULT,
    SAMPLE,
    HEAL,
    XTIMEOUT,
    UPLOAD,
    PTICK,
    CONT,
    LEASE,
) = range(16)
# worker activities (what its time is spent on)
OFF, IDLE, SYNC, TRAIN, READY, REDUCE, WAITV, STALL = range(8)
ACT_BUCKET = {IDLE: "idle", SYNC: "resync", READY: "barrier", REDUCE: "comm", WAITV: "barrier", STALL: "barrier"}
# bandwidth of the coordinator's checkpoint store when it is the donor (datacenter, 1 Gbit/s)
COORDINATOR_BW = 125e6
# an exchange whose contributors do not all show up fails after this long (or 2x its time)
EXCHANGE_TIMEOUT_MS = 60_000


def honest_hash(key: tuple) -> str:
    """What every honest contributor of one exchange ends with (identical by construction)."""
    return hashlib.sha256(repr(key).encode()).hexdigest()


def _mismatch(w: W, ins: Instruction, steps: int) -> str:
    """Why `reconciler.steps_ahead` carried none of `w`'s steps trained ahead into the
    round `ins` says to train (for the report's tally; the decision is the reconciler's)."""
    k, plan, guess = w.ahead_key, ins.plan, w.plan
    if k is None or plan is None or guess is None:
        return "no plan"
    if (ins.cell_id, ins.round, ins.committed_round) != (k[0], k[1] + 1, k[1]):
        return "not the next round"
    if steps > plan.inner_steps:
        return "more steps than the round has"
    return "no step finished"


_NOTHING: frozenset[tuple[str, int]] = frozenset()
_NO_RATES = PeerRates()
_NONE_MISSING: frozenset[tuple[str, int, int, int]] = frozenset()


class W:
    """One synthetic worker's live state (slots: there are 10,000 of them)."""

    # set by `Engine._make_worker` from the population sample (declarations only: a slot
    # cannot also have a class-level value)
    flops: float  # achieved FLOP/s
    rate_e: float  # samples/s on an expert cell
    rate_r: float  # samples/s on the router cell
    bw: float  # link bandwidth, bytes/s
    lat: float  # link latency, s
    watch_ms: int  # how long a held watch's answer takes to reach it: its latency in ms, >= 1
    byz: bool
    spot: bool
    hb_phase: int  # ms offset of its periodic heartbeat in [0, heartbeat_ms)
    profile: Profile

    __slots__ = (
        "act",
        "ahead_cap",
        "ahead_fl",
        "ahead_key",
        "ahead_room",
        "banned",
        "bw",
        "byz",
        "cut",
        "dur_s",
        "epoch",
        "ever",
        "ex",
        "flops",
        "gen",
        "h",
        "h0",
        "hb_phase",
        "i",
        "job",
        "job_due",
        "job_kind",
        "key",
        "lat",
        "lease_until",
        "local",
        "lock",
        "midx",
        "missing",
        "online",
        "own_s",
        "pending",
        "plan",
        "poll_at",
        "prev_local",
        "profile",
        "rate_e",
        "rate_r",
        "rattempt",
        "ready_hb",
        "recv",
        "regs",
        "renew_armed",
        "renew_due",
        "report",
        "rkey",
        "samples",
        "sent",
        "since",
        "spot",
        "stopped",
        "sync_from",
        "sync_rates",
        "sync_target",
        "upd",
        "uploaded",
        "uploaded_fs",
        "waited",
        "watch_ms",
        "wid",
    )

    def __init__(self, i: int) -> None:
        self.i = i
        self.wid = f"w{i:05d}"
        self.online = False
        self.gen = 0  # bumps per life (arrive/depart): invalidates poll/renew/depart events
        self.job = 0  # bumps per job: invalidates SYNC_DONE/TRAIN_DONE/REDUCE_DONE events
        self.sync_rates: tuple[DonorRate, ...] = ()  # what its last download measured of its donors
        self.act = OFF
        self.since = 0
        self.key: tuple[str, int, int] | None = None  # (cell, round, round_attempt) trained / ready
        # the key of the READY heartbeat the coordinator last got from it, if its last
        # heartbeat was that READY (engine `_heartbeat`: a repeat of it may be answered by a query)
        self.ready_hb: tuple[str, int, int] | None = None
        self.regs = 0  # registrations sent (a registration resets what the core has of it)
        self.rkey: tuple[str, int, int] | None = None  # (cell, round, reduce_attempt) reduced / reported
        self.samples = 0
        self.own_s = 0.0  # own compute time of the round
        self.dur_s = 0.0  # wall time of the round's training (> own_s at a lock-step barrier)
        self.job_due = 0
        self.job_kind = -1
        self.local = LocalState()
        self.prev_local = LocalState()
        self.poll_at = -1  # when its pending POLL is due (-1: none)
        self.renew_due = 0
        self.renew_armed = False
        self.cut = False  # partitioned from coordinator and peers
        self.stopped = False  # SIGSTOP
        self.banned = False
        self.ever = False
        self.sent = 0
        self.recv = 0
        self.ex: Exchange | None = None
        self.lock: Lockstep | None = None
        self.sync_target: tuple[str, int, str] | None = None  # (cell, committed round, hash)
        self.sync_from = -1  # the held round the sync in flight catches up from (-1: a full download)
        # (cell, first round, last round): the committed updates it holds and serves to peers
        # catching up (`WorkerBehaviour._start_sync`)
        self.upd: tuple[str, int, int] | None = None
        self.uploaded: tuple[str, int, str] | None = None
        self.uploaded_fs: frozenset[tuple[str, int]] = _NOTHING  # {uploaded[:2]}, as a view reads it
        self.report: ReportRound | None = None  # sent but not acknowledged (lost): resend
        self.lease_until = 0  # lease expiry the core last granted (heartbeat lease mode)
        self.epoch = 0  # bumps whenever the worker (re)gains contact: invalidates LEASE events
        self.waited: tuple[str, int] | None = None  # (cell, committed round) of the WAIT it last got
        self.h = 0  # inner steps of the round it trains
        self.h0 = 0  # of which trained ahead (overlap = "delayed"), carried in at its start
        self.plan: RoundPlan | None = None  # the plan of the round it trains (or trained last)
        self.midx = 0  # its member index (data shard) in that plan
        # training ahead (overlap = "delayed", `WorkerBehaviour._start_reduce`): the round
        # whose weighted exchange it overlaps (None: not training ahead), the guessed next
        # round's full training time (the cap), the seconds of it still to train, and the
        # FLOPs trained ahead so far, held until they are carried into the next round or
        # thrown away
        self.ahead_key: tuple[str, int, int] | None = None
        self.ahead_cap = 0.0
        self.ahead_room = 0.0
        self.ahead_fl = 0.0
        self.pending: str | None = None  # hash it reported for rkey, awaiting the commit
        self.rattempt = 0  # round_attempt of a catch-up contribution (no training key)
        self.missing: set[tuple[str, int, int, int]] | None = None  # lost contributions it reported


class Exchange:
    """One all-reduce over a frozen contributor set: completes once all joined, unless broken."""

    __slots__ = (
        "broken",
        "done_at",
        "dur_ms",
        "hash",
        "joined",
        "key",
        "members",
        "nbytes",
        "parts",
        "peers",
        "senders",
        "_senders",
    )

    def __init__(
        self,
        key: tuple[str, int, int],
        members: tuple[str, ...],
        dur_ms: int,
        h: str,
        nbytes: dict[str, int],
        parts: dict[str, float] | None = None,
        peers: tuple[W, ...] = (),
        senders: frozenset[str] = frozenset(),
    ) -> None:
        self.key = key
        self.members = members
        self.joined: dict[W, None] = {}  # insertion-ordered set: O(1) leave
        self.broken = False
        self.dur_ms = dur_ms
        self.done_at = -1
        self.hash = h
        self.nbytes = nbytes  # worker id -> bytes it sends (and receives)
        self.parts = parts or {}  # worker id -> bytes of the part it reduces (one exchange)
        self.peers = peers  # the contributors' workers, as they were at the freeze
        self.senders = senders  # those that send a payload (a catch-up contributor abstains)
        # the senders' ids, uplinks, latencies and positions, built at the first report
        self._senders: tuple[tuple[str, ...], np.ndarray, np.ndarray, dict[str, int]] | None = None

    def peer_rates(self, w: W) -> PeerRates:
        """What `w`, as the reducer of its part, measures of each other contributor's
        contribution, as the real data plane does (`ExchangeResult.peer_rates`): its part's
        bytes, over a stream that shares the sender's uplink and `w`'s downlink with the
        k - 1 others (the population's one link rate per worker, both ways), after the two
        one-way latencies. A catch-up contributor (zero budget) sends no payload: not timed.

        Each sender's figure is min(sender bw, w.bw) / (k - 1) bytes/s and
        (sender lat + w.lat + part / rate) x 1000 ms, truncated, at least 1: computed for all
        senders at once (the same IEEE operations, element-wise), then `w` left out."""
        n = self.parts.get(w.wid, 0.0)
        k = len(self.peers)
        if n <= 0 or k < 2:
            return _NO_RATES
        cols = self._senders
        if cols is None:
            snd = [p for p in self.peers if p.wid in self.senders]
            cols = self._senders = (
                tuple(p.wid for p in snd),
                np.array([p.bw for p in snd], dtype=np.float64),
                np.array([p.lat for p in snd], dtype=np.float64),
                {p.wid: j for j, p in enumerate(snd)},
            )
        ids, bw, lat, index = cols
        if not ids:
            return _NO_RATES
        rate = np.minimum(bw, w.bw) / (k - 1)
        ms = np.maximum(((lat + w.lat + n / rate) * 1000).astype(np.int64), 1).tolist()
        j = index.get(w.wid)
        if j is None:
            return PeerRates(ids, (int(n),) * len(ids), tuple(ms))
        return PeerRates(ids[:j] + ids[j + 1 :], (int(n),) * (len(ids) - 1), tuple(ms[:j] + ms[j + 1 :]))


class Lockstep:
    """A lock-stepped (sync_dp) round attempt: one dead member stalls everyone."""

    __slots__ = ("broken", "dur_s", "key")

    def __init__(self, key: tuple[str, int, int], dur_s: float) -> None:
        self.key = key
        self.dur_s = dur_s
        self.broken = False


class WorkerBehaviour:
    """The worker side of the engine (a mixin of `Engine`)."""

    if TYPE_CHECKING:  # pragma: no cover
        # what the mixin uses of `Engine`, which defines all of these
        now: int
        av: AvailabilitySpec
        work: cm.WorkloadSpec
        policy: SimPolicy
        ledger: Ledger
        overlap: bool
        rng: np.random.Generator
        frng: np.random.Generator
        ws: list[W]
        by_id: dict[str, W]
        declared: bool
        hb_ms: int
        lease_ms: int
        comm_rounds: int
        payload: dict[str, int]
        catch_up_rounds: int
        keep_updates: dict[str, int]
        commit_hashes: dict[str, dict[int, str]]
        online_flops: float
        online_count: int
        exchanges: dict[tuple[str, int, int], Exchange]
        ex_list: list[Exchange]
        locksteps: dict[tuple[str, int, int], Lockstep]
        uploads: dict[int, tuple[str, int, str]]

        def push(self, t: int, kind: int, i: int = -1, token: int = 0) -> None: ...
        def _apply(self, ev: Event) -> Outcome: ...
        def _send(self, w: W, ev: Event) -> Outcome | None: ...
        def _register(self, w: W) -> Outcome | None: ...
        def _heartbeat(self, w: W) -> Outcome | None: ...
        def _poll_later(self, w: W) -> None: ...
        def _hear_change(self, w: W) -> None: ...
        def _tick_at(self, t: int) -> None: ...
        def _set_act(self, w: W, act: int) -> None: ...
        @staticmethod
        def rate(w: W, cell: str) -> float: ...

    # ------------------------------------------------------------ arrive / depart

    def _on_arrive(self, w: W, token: int) -> None:
        if token != w.gen or w.online or w.banned:
            return
        w.online = True
        w.ever = True
        w.gen += 1
        w.epoch += 1
        w.act = IDLE
        w.since = self.now
        self.online_flops += w.flops
        self.online_count += 1
        session_s, preempted = popmod.draw_session_s(self.av, w.spot, self.rng)
        graceful = (not preempted) and popmod.graceful(self.av, self.rng)
        self.push(self.now + int(session_s * 1000) + 1, DEPART, w.i, (w.gen << 1) | int(graceful))
        out = self._register(w)
        if out is not None:
            self._react(w, out.instruction)

    def _on_depart(self, w: W, token: int) -> None:
        if (token >> 1) != w.gen or not w.online:
            return
        self._depart(w, graceful=bool(token & 1))

    def _depart(self, w: W, *, graceful: bool, comes_back: bool = True) -> None:
        self._abandon(w, "preempted", dead=True)
        self._drop_ahead(w, "departed", "preempted")
        self._set_act(w, OFF)
        if graceful and not w.cut and not w.stopped:
            try:
                self._apply(Leave(w.wid, "session over"))
            except CoordinatorError as e:
                self.ledger.core_errors[type(e).__name__] += 1
        elif not w.cut and not w.stopped:
            self._lost_contact(w)  # (a cut-off or stopped worker's expiry is already scheduled)
        self.online_flops -= w.flops
        self.online_count -= 1
        w.online = False
        w.gen += 1
        w.poll_at = -1
        w.renew_armed = False
        w.stopped = False
        w.report = None
        w.sync_target = None
        w.sync_from = -1
        w.upd = None  # the state server's updates are in memory: a restarted worker serves none
        if comes_back and not w.banned:
            gap_s = popmod.draw_offline_s(self.av, self.now / 1000.0, self.rng)
            self.push(self.now + int(gap_s * 1000) + 1, ARRIVE, w.i, w.gen)

    def _ban(self, w: W) -> None:
        w.banned = True
        if w.online:
            self._depart(w, graceful=False, comes_back=False)

    def _abandon(self, w: W, cause: str, *, dead: bool = False) -> None:
        """Stop the worker's current job; its training so far stays pending on the round."""
        act = w.act
        if act in (TRAIN, STALL, READY, REDUCE, WAITV) and w.key is not None:
            if act == TRAIN:
                self._set_act(w, IDLE)
            if cause:
                self.ledger.mark(w.key, w.i, cause)
        if dead or w.cut or w.stopped:
            if w.lock is not None:
                w.lock.broken = True
            ex = w.ex
            if ex is not None and (ex.done_at < 0 or ex.done_at > self.now):
                ex.broken = True
        if w.ex is not None and w.ex.done_at < 0:
            w.ex.joined.pop(w, None)
        w.ex = None
        w.lock = None
        w.job += 1
        w.job_kind = -1
        if act != OFF and w.act != IDLE:
            self._set_act(w, IDLE)
        w.key = None
        w.rkey = None
        w.report = None
        w.pending = None

    # ------------------------------------------------------------ instructions

    def _view(self, w: W) -> WorkerView:
        """What the real worker's reconciler would see of this worker (module docstring)."""
        a = w.act
        held = w.local
        work = sync = None
        if a == SYNC and w.sync_target is not None:
            sync = Sync(LocalState(*w.sync_target))
        elif a in (TRAIN, STALL) and w.key is not None:
            work = Work(*w.key)
        elif a == READY and w.key is not None:
            work = Work(*w.key, ready=True)
        elif a in (REDUCE, WAITV) and w.rkey is not None:
            cell, rnd, ra = w.rkey
            catch_up = w.key is None
            if w.pending is not None:
                held = w.prev_local
            work = Work(
                cell,
                rnd,
                w.rattempt if w.key is None else w.key[2],
                ready=True,
                catch_up=catch_up,
                reduce_attempt=ra,
                exchanging=a == REDUCE or w.report is not None,
                pending_hash=w.pending,
                pending_attempt=ra,
            )
        missing = frozenset(w.missing) if w.missing else _NONE_MISSING
        ahead = None
        k = w.ahead_key
        if k is not None and w.plan is not None:
            ahead = Ahead(k[0], k[1], w.midx, len(w.plan.members), self._steps_ahead(w))
        return WorkerView(w.wid, held, work, sync, w.uploaded_fs, missing, ahead, self.catch_up_rounds)

    # ------------------------------------------------------------ training ahead

    def _steps_ahead(self, w: W) -> int:
        """Inner steps trained ahead so far: the fraction of the guessed round's training
        time done (booked, plus the interval since the last booking), floored."""
        cap = w.ahead_cap
        room = w.ahead_room
        if room > 0.0 and not w.stopped:
            room = max(0.0, room - (self.now - w.since) / 1000.0)
        h = w.h
        return min(h, int((cap - room) / cap * h)) if cap > 0 else 0

    def _carry_ahead(self, w: W, ins: Instruction, a: StartTrain) -> int:
        """The TRAIN `ins` takes `a.ahead_steps` of the steps trained ahead: their FLOPs join
        that round's training; what was trained beyond them (a step begun) is wasted.
        Returns the steps carried (0 if nothing is held any more)."""
        steps = a.ahead_steps
        if w.ahead_key is None:
            return 0
        if steps <= 0:
            self._drop_ahead(w, _mismatch(w, ins, self._steps_ahead(w)))
            return 0
        self._set_act(w, w.act)  # book the interval so far, its ahead training included
        led = self.ledger
        held = w.ahead_fl
        carried = min(held, w.flops * w.ahead_cap * steps / w.h)
        led.train((ins.cell_id, ins.round, ins.round_attempt), w.i, carried)
        led.add("aborted", held - carried)
        led.ahead_trained += held
        led.ahead_carried += carried
        led.ahead_kept += 1
        w.ahead_key = None
        w.ahead_room = 0.0
        w.ahead_fl = 0.0
        return steps

    @staticmethod
    def _drops_ahead_base(w: W) -> bool:
        """Is the work `w` is about to drop the round its steps trained ahead build on? Then
        that round's outcome will not be held, and the steps go with it."""
        k = w.ahead_key
        if k is None:
            return False
        a = w.act
        r = w.key if a in (TRAIN, STALL, READY) else w.rkey if a in (REDUCE, WAITV) else None
        return r is not None and r[0] == k[0] and r[1] == k[1]

    def _drop_ahead(self, w: W, why: str, bucket: str = "") -> None:
        """Throw away the steps trained ahead (module docstring): their FLOPs go to `bucket`,
        by default "preempted" if the worker is cut off or stopped, else "aborted"."""
        if w.ahead_key is None:
            return
        self._set_act(w, w.act)  # book the interval so far, its ahead training included
        led = self.ledger
        led.add(bucket or ("preempted" if w.cut or w.stopped else "aborted"), w.ahead_fl)
        led.ahead_trained += w.ahead_fl
        tally = led.ahead_dropped.get(why)
        if tally is None:
            tally = led.ahead_dropped[why] = [0, 0.0]
        tally[0] += 1
        tally[1] += w.ahead_fl
        w.ahead_key = None
        w.ahead_room = 0.0
        w.ahead_fl = 0.0

    def _react(self, w: W, ins: Instruction | None) -> None:
        """Follow `ins` as the real worker decides to, each action as a virtual-time effect."""
        if ins is None or not w.online:
            return
        o = ins.order
        if o is not Order.WAIT:
            w.waited = None
        upload: Upload | None = None
        for a in reconciler.decide(ins, self._view(w)):
            t = type(a)
            if isinstance(a, StartTrain):
                self._abandon(w, "")
                self._start_train(w, ins, a)
            elif t is StartReduce:
                if w.key is None:  # a re-frozen catch-up contribution: a fresh job record
                    self._abandon(w, "")
                self._start_reduce(w, ins)
            elif t is StartCatchUp:
                self._catch_up(w, ins)
            elif t is StartSync:
                # the committed state it holds (an outcome awaiting its verdict is not one)
                held = w.prev_local if w.pending is not None else w.local
                self._abandon(w, "")
                self._drop_ahead(w, "synced")
                self._start_sync(w, ins, (ins.cell_id, ins.committed_round, ins.committed_hash), held)
            elif t is DropWork:
                base = self._drops_ahead_base(w)
                self._abandon(w, "")
                if base:
                    self._drop_ahead(w, "work dropped")
            elif t is CancelSync or t is AdoptPending:
                # the round's job ends (an adopted outcome is already the worker's `local`;
                # training ahead goes on: it is the committed round's successor)
                if t is AdoptPending:
                    self._keep_update(w)
                self._abandon(w, "")
            elif t is BuildInitialState:
                w.local = LocalState(ins.cell_id, 0, "")
                w.upd = None
            elif isinstance(a, Upload):
                upload = a
            elif isinstance(a, ReportMissing):
                self._report_missing(w, a)
            elif t is LeaveOrder:
                self._ban(w)
                return
            # NotAMember: nothing to do; ReReport: the engine never restarts the coordinator
            # (a lost report is resent at the next heartbeat that gets through)
        if o is Order.WAIT:
            wait = (ins.cell_id, ins.committed_round)
            if ins.cell_id and w.waited != wait:
                # a waiting worker keeps heartbeating, and a heartbeat of a synced worker is
                # what opens a cell's next round: deliver the next one (once per new wait)
                self._poll_later(w)
            w.waited = wait
        if upload is not None:  # (after the order's own job: heap ties break by push order)
            up = (upload.cell_id, upload.committed_round, upload.committed_hash)
            w.uploaded = up
            w.uploaded_fs = frozenset((up[:2],))
            nbytes = cm.cell_state_bytes(self.work, ins.cell_id)
            w.sent += nbytes
            self.uploads[w.i] = up
            self.push(self.now + int(1000 * nbytes / min(w.bw, COORDINATOR_BW)) + 1, UPLOAD, w.i, w.gen)

    def _report_missing(self, w: W, a: ReportMissing) -> None:
        """A weighted contributor that lost its contribution (it re-registered before its
        lease ran out) says so with a failed report; the answer's instruction is not read."""
        if w.missing is None:
            w.missing = set()
        w.missing.add((a.cell_id, a.round, a.round_attempt, a.reduce_attempt))
        self._send(
            w,
            ReportRound(
                w.wid,
                a.cell_id,
                a.round,
                failed=True,
                reason="this contributor lost its contribution (restarted)",
                reduce_attempt=a.reduce_attempt,
            ),
        )

    def _start_sync(self, w: W, ins: Instruction, target: tuple, held: LocalState) -> None:
        """Fetch the committed state `target` names, as the real worker's `Orders._sync` does:
        a worker that `held` the same cell's committed state 1..`[sync] catch_up_rounds` rounds
        behind first catches up by the committed updates of the rounds between
        (`_catch_up_s`), and downloads the whole state only if that fails."""
        # the donors the coordinator named (its list, else its one donor), each giving what the
        # coordinator expects of it (its uplink shared among the syncs it serves); none reachable:
        # the coordinator's checkpoint store
        named = ins.donors or ((ins.donor,) if ins.donor is not None else ())
        donors, bws = [], []
        for d in named:
            x = self.by_id.get(d.worker_id) if d.worker_id else None
            if x is not None and x.online and not x.cut:
                donors.append(x)
                bws.append(min(x.bw, d.expected_bytes_per_s) if d.expected_bytes_per_s > 0 else x.bw)
        cell, rnd = target[0], target[1]
        w.sync_from = -1
        spent = 0.0  # seconds of a catch-up that no donor served, before the download
        behind = rnd - held.committed_round
        if donors and held.cell_id == cell and 1 <= behind <= self.catch_up_rounds:
            took, served = self._catch_up_s(w, held, target, donors, bws)
            if served is not None:
                w.sync_from = held.committed_round
                w.sync_rates = (served,)
                w.sync_target = target
                self._set_act(w, SYNC)
                self._job(w, SYNC_DONE, took)
                return
            spent = took
        if not donors:
            bws = [COORDINATOR_BW]
        nbytes = cm.cell_state_bytes(self.work, cell)
        w.recv += nbytes
        dur = cm.multi_donor_download_s(nbytes, w.bw, bws, w.lat)
        rates = []
        for x, share in zip(donors, cm.multi_donor_shares(bws), strict=False):
            x.sent += int(nbytes * share)
            # what the real joiner reports: each donor's bytes over the time its requests ran
            rates.append(DonorRate(x.wid, int(nbytes * share), int(dur * 1000)))
        w.sync_rates = tuple(rates)
        w.sync_target = target
        self._set_act(w, SYNC)
        self._job(w, SYNC_DONE, spent + dur)

    def _catch_up_s(
        self, w: W, held: LocalState, target: tuple, donors: list[W], bws: list[float]
    ) -> tuple[float, DonorRate | None]:
        """A catch-up from `held` to `target` by the committed updates of the rounds between
        (`statesync.catch_up_from_donors`): (its seconds, what the worker measured of the
        donor that served them, None if none did). The donors are asked in order, one at a
        time; one that does not hold every one of those updates refuses (a round trip), the
        first that does sends them all over its link (`bws`: as for a download) against the
        joiner's. `held` must be the cell's committed state of its round (the first update's
        base), else every donor refuses."""
        cell, rnd, _h = target
        j = held.committed_round
        led = self.ledger
        led.catch_up["tried"] += 1
        took = 0.0
        base = self.commit_hashes.get(cell, {}).get(j) if j else ""  # round 0: the initial state
        for x, bw in zip(donors, bws, strict=True):
            u = x.upd
            if held.state_hash != base or u is None or u[0] != cell or not u[1] <= j + 1 <= rnd <= u[2]:
                took += 2 * w.lat  # refused: the request and its answer
                continue
            nbytes = (rnd - j) * self.payload[cell]
            need = cm.download_s(nbytes, w.bw, bw, w.lat)
            w.recv += nbytes
            x.sent += nbytes
            led.catch_up["caught up"] += 1
            led.catch_up["rounds"] += rnd - j
            return took + need, DonorRate(x.wid, nbytes, int(need * 1000))
        led.catch_up["no donor held them"] += 1
        return took, None

    def _on_sync_done(self, w: W, token: int) -> None:
        if token != w.job or not w.online:
            return
        assert w.sync_target is not None  # set by _start_sync; a stale SYNC_DONE fails the token check
        cell, r, h = w.sync_target
        w.local = LocalState(cell, r, h)
        # the state server serves what this sync applied: the updates it caught up by, or
        # (a download) none
        keep = self.keep_updates.get(cell, 0)
        w.upd = (cell, max(w.sync_from + 1, r - keep + 1), r) if w.sync_from >= 0 and keep > 0 else None
        w.sync_from = -1
        w.sync_target = None
        w.job_kind = -1
        self._set_act(w, IDLE)
        out = self._heartbeat(w)
        if out is not None:
            self._react(w, out.instruction)

    def _keep_update(self, w: W) -> None:
        """`w` adopts the outcome it exchanged (its `local`): it keeps that round's committed
        update after the ones it holds of the rounds just before, the cell's last
        `keep_updates` of them, as the real worker's state server does (`Orders.commit`)."""
        cell, r = w.local.cell_id, w.local.committed_round
        keep = self.keep_updates.get(cell, 0)
        if keep <= 0:
            w.upd = None
            return
        u = w.upd
        first = u[1] if u is not None and u[0] == cell and u[2] == r - 1 else r
        w.upd = (cell, max(first, r - keep + 1), r)

    def _start_train(self, w: W, ins: Instruction, a: StartTrain) -> None:
        plan = ins.plan
        assert plan is not None  # decide() starts training only as a member of the plan
        cell = ins.cell_id
        key = (cell, ins.round, ins.round_attempt)
        batch = plan.micro_batch * plan.grad_accum
        samples = plan.inner_steps * batch
        rate = self.rate(w, cell)
        own = samples / rate
        dur = own
        # the steps trained ahead that decide() matched to this plan's data shard (module
        # docstring), in the batch shape they were trained with; the rest of the round is
        # trained now, in this plan's, and what it claims stays within this plan's budget
        h0 = 0
        if w.ahead_key is not None:
            prev = w.plan
            h0 = self._carry_ahead(w, ins, a)
            if h0 and prev is not None:
                rest = (plan.inner_steps - h0) * batch
                dur = rest / rate
                samples = min(samples, h0 * prev.micro_batch * prev.grad_accum + rest)
        if self.policy.lockstep:
            lk = self.locksteps.get(key)
            if lk is None:
                by = self.by_id
                slowest = max(
                    m.max_samples / self.rate(by[m.worker_id], cell) for m in plan.members if m.worker_id in by
                )
                lk = self.locksteps[key] = Lockstep(key, max(slowest, own))
            w.lock = lk
            dur = lk.dur_s
        # the member trains from the committed state the instruction names
        w.local = LocalState(cell, ins.committed_round, ins.committed_hash)
        w.key = key
        w.h = plan.inner_steps
        w.h0 = h0
        w.plan = plan
        w.midx = a.member_index
        w.samples = samples
        w.own_s = own
        w.dur_s = dur
        self._set_act(w, TRAIN)
        self._job(w, TRAIN_DONE, dur)

    def _on_train_done(self, w: W, token: int) -> None:
        if token != w.job or not w.online:
            return
        w.job_kind = -1
        if w.lock is not None and w.lock.broken:
            self._set_act(w, STALL)  # hung in the lock-step collective until the round times out
            return
        self._set_act(w, READY)
        out = self._heartbeat(w)
        if out is not None:
            self._react(w, out.instruction)

    def _catch_up(self, w: W, ins: Instruction) -> None:
        """Become a zero-weight catch-up contributor (a straggler cut at the freeze, or a
        synced worker that was not a member): drop any training and exchange a zero
        pseudo-gradient, to receive the new state without a download."""
        self._abandon(w, "")
        w.samples = 0
        w.own_s = 0.0
        w.local = LocalState(ins.cell_id, ins.committed_round, ins.committed_hash)
        w.rattempt = ins.round_attempt

    def _start_reduce(self, w: W, ins: Instruction) -> None:
        """Join the exchange of (cell, round, reduce_attempt). A member that trained this
        round contributes its samples; a catch-up contributor (`_catch_up`) none."""
        rkey = (ins.cell_id, ins.round, ins.reduce_attempt)
        ex = self.exchanges.get(rkey)
        if ex is None:
            by = self.by_id
            members = tuple(m.worker_id for m in ins.contributors)
            known = [m for m in ins.contributors if m.worker_id in by]
            peers = tuple(by[m.worker_id] for m in known)
            nbytes = self.payload[ins.cell_id]
            # the plan's split, as the data plane cuts it: relayed members' parts empty
            # (unless all are), the others sized by their part weights
            relayed = all(m.no_reduce for m in known)
            weights = [0 if m.no_reduce and not relayed else max(1, m.part_weight) for m in known]
            bws, lats = [p.bw for p in peers], [p.lat for p in peers]
            dur_s = cm.weighted_allreduce_s(nbytes, weights, bws, bws, lats) * self.comm_rounds
            per = {
                p.wid: b * self.comm_rounds
                for p, b in zip(peers, cm.weighted_allreduce_bytes(nbytes, weights), strict=True)
            }
            parts = {p.wid: b for p, b in zip(peers, cm.part_nbytes(nbytes, weights), strict=True)}
            senders = frozenset(m.worker_id for m in known if m.max_samples > 0)
            ex = self.exchanges[rkey] = Exchange(
                rkey, members, int(dur_s * 1000), honest_hash(rkey), per, parts, peers, senders
            )
            if any(not p.online or p.cut or p.stopped for p in peers):
                ex.broken = True
            self.push(self.now + max(2 * ex.dur_ms, EXCHANGE_TIMEOUT_MS), XTIMEOUT, -1, len(self.ex_list))
            self.ex_list.append(ex)
        if w.ex is not None and w.ex is not ex and w.ex.done_at < 0:
            w.ex.joined.pop(w, None)
        w.ex = ex
        w.rkey = rkey
        w.report = None
        w.pending = None
        w.job += 1
        if w.act == TRAIN:  # cannot happen for a contributor, but never lose its training time
            self._set_act(w, READY)
        self._set_act(w, REDUCE)
        if self.overlap and w.ahead_key is None and w.key is not None and w.samples > 0:
            # a weighted exchange of a round it trained: its GPU trains the next round ahead
            # from now on (a re-freeze of the same round keeps what is running)
            w.ahead_key = w.key
            w.ahead_cap = w.ahead_room = w.own_s
            w.ahead_fl = 0.0
            self.ledger.ahead_rounds += 1
        ex.joined[w] = None
        if ex.done_at < 0 and len(ex.joined) == len(ex.members):
            ex.done_at = self.now + ex.dur_ms
            for m in ex.joined:
                m.job += 1
                m.job_kind = REDUCE_DONE
                m.job_due = ex.done_at
                self.push(ex.done_at, REDUCE_DONE, m.i, m.job)
        elif ex.done_at >= 0:  # joined an exchange that already ran without it (re-freeze race)
            self._job(w, REDUCE_DONE, 0.0)

    def _on_xtimeout(self, ex: Exchange) -> None:
        if ex.done_at >= 0:
            return
        ex.broken = True
        ex.done_at = self.now
        for m in list(ex.joined):
            if m.ex is ex and m.act == REDUCE:
                self._job(m, REDUCE_DONE, 0.0)

    def _on_reduce_done(self, w: W, token: int) -> None:
        if token != w.job or not w.online or w.ex is None:
            return
        ex = w.ex
        w.job_kind = -1
        cell, rnd, attempt = ex.key
        if ex.broken:
            ev = ReportRound(
                w.wid, cell, rnd, samples=w.samples, failed=True, reason="exchange failed", reduce_attempt=attempt
            )
        else:
            sent = ex.nbytes.get(w.wid, 0)
            w.sent += sent
            w.recv += sent
            h = ex.hash if not w.byz else honest_hash((ex.hash, w.wid))
            w.prev_local = w.local
            w.local = LocalState(cell, rnd, h)
            w.pending = h
            ev = ReportRound(
                w.wid,
                cell,
                rnd,
                h,
                samples=w.samples,
                compute_ms=int(w.own_s * 1000),
                comm_ms=ex.dur_ms,
                bytes_sent=sent,
                bytes_received=sent,
                reduce_attempt=attempt,
                peer_rates=ex.peer_rates(w),
            )
        self._set_act(w, WAITV)
        self._report(w, ev)

    def _report(self, w: W, ev: ReportRound) -> None:
        w.report = ev
        out = self._send(w, ev)
        if out is None:
            if not (w.cut or w.stopped):
                w.report = None  # refused (stale): the next instruction tells it what to do
            return  # lost: resent at the next heartbeat that gets through
        w.report = None
        for a in reconciler.decide_verdict(out.verdict, reported_outcome=not ev.failed, current=True):
            if type(a) is AdoptPending:
                self._keep_update(w)
            base = type(a) is DropWork and self._drops_ahead_base(w)
            self._abandon(w, "")  # adopted (already the worker's `local`) or dropped: the job ends
            if base:
                self._drop_ahead(w, "work dropped")
        if out.verdict is Verdict.ABORTED and not ev.failed:
            w.local = w.prev_local  # roll back the outer step to the committed state
        self._react(w, out.instruction)

    # ------------------------------------------------------------ heartbeats

    def _on_poll(self, w: W, token: int) -> None:
        if token != w.gen or self.now != w.poll_at:
            return  # of an earlier life, or superseded by an earlier poll
        w.poll_at = -1
        if not w.online or w.cut or w.stopped:
            return
        if w.report is not None:
            self._report(w, w.report)
            return
        out = self._heartbeat(w)
        if out is not None:
            self._react(w, out.instruction)

    def _on_renew(self, w: W, token: int) -> None:
        if token != w.gen or not w.online:
            return
        if self.now < w.renew_due:
            self.push(w.renew_due, RENEW, w.i, w.gen)
            return
        w.renew_armed = False
        if w.cut or w.stopped:
            return  # its heartbeats are lost; it re-contacts at heal / SIGCONT
        if w.report is not None:
            self._report(w, w.report)
        else:
            out = self._heartbeat(w)
            if out is not None:
                self._react(w, out.instruction)
        if not w.renew_armed and w.online:
            # refused (a stale message): the real worker simply heartbeats again next period
            w.renew_armed = True
            self.push(self.now + self.hb_ms, RENEW, w.i, w.gen)

    def _on_upload(self, w: W, token: int) -> None:
        up = self.uploads.pop(w.i, None)
        if up is None or token != w.gen or not w.online:
            return
        try:
            self._apply(CheckpointStored(*up))
        except CoordinatorError as e:
            self.ledger.core_errors[type(e).__name__] += 1

    # ------------------------------------------------------------ faults

    def _fault(self, f: Fault) -> None:
        online = [w for w in self.ws if w.online]
        if f.workers:
            targets = [self.ws[i] for i in f.workers if i < len(self.ws)]
        else:
            k = f.count if f.count > 0 else round(f.fraction * len(online))
            k = min(k, len(online))
            idx = self.frng.choice(len(online), size=k, replace=False) if k else np.array([], dtype=int)
            targets = [online[int(j)] for j in sorted(idx)]
        self.ledger.faults.append((f.at_s, f.kind.value, len(targets)))
        for w in targets:
            at = self.now + int(self.frng.uniform(0.0, f.within_s) * 1000) if f.within_s > 0 else self.now
            if f.kind is FaultKind.KILL:
                self.push(at, DEPART, w.i, w.gen << 1)
            elif f.kind is FaultKind.LEAVE:
                self.push(at, DEPART, w.i, (w.gen << 1) | 1)
            elif f.kind is FaultKind.PARTITION:
                if not (w.cut or w.stopped):
                    self._lost_contact(w)
                w.cut = True
                self._break_groups(w)
                self.push(self.now + int(f.duration_s * 1000), HEAL, w.i, 0)
            elif f.kind is FaultKind.STOP:
                if not (w.cut or w.stopped):
                    self._lost_contact(w)
                if w.ahead_room > 0.0:
                    self._set_act(w, w.act)  # training ahead pauses with the process
                w.stopped = True
                self._break_groups(w)
                if w.job_kind >= 0:  # its running job resumes after SIGCONT
                    w.job += 1
                    w.job_due += int(f.duration_s * 1000)
                    self.push(w.job_due, w.job_kind, w.i, w.job)
                self.push(self.now + int(f.duration_s * 1000), CONT, w.i, 0)

    def _break_groups(self, w: W) -> None:
        if w.lock is not None:
            w.lock.broken = True
        ex = w.ex
        if ex is not None and (ex.done_at < 0 or ex.done_at > self.now):
            ex.broken = True

    def _on_heal(self, w: W, token: int) -> None:
        w.cut = False
        if w.online and not w.stopped:
            w.epoch += 1
            self._poll_later(w)

    def _on_cont(self, w: W, token: int) -> None:
        if w.ahead_room > 0.0:
            self._set_act(w, w.act)  # the stopped interval trained nothing ahead
        w.stopped = False
        if w.online and not w.cut:
            w.epoch += 1
            self._poll_later(w)

    def _lost_contact(self, w: W) -> None:
        """The worker stops reaching the coordinator now: its lease runs out as in the daemon.

        Heartbeat lease mode: the core's own timer fires; the engine only ticks it then.
        Declared mode: a live worker's last heartbeat before now was at its last phase tick,
        so the daemon would expire it at that tick + lease_s; LeaseExpired is sent then,
        unless the worker regained contact (epoch) in between.
        """
        if self.declared:
            last = self.now - ((self.now - w.hb_phase) % self.hb_ms)
            self.push(last + self.lease_ms, LEASE, w.i, w.epoch)
        else:
            self._tick_at(w.lease_until + 1)

    def _on_lease(self, w: W, token: int) -> None:
        if token != w.epoch or (w.online and not w.cut and not w.stopped):
            return
        try:
            self._apply(LeaseExpired(w.wid))
        except CoordinatorError as e:
            self.ledger.core_errors[type(e).__name__] += 1

    # ------------------------------------------------------------ helpers

    def _job(self, w: W, kind: int, dur_s: float) -> None:
        w.job += 1
        w.job_kind = kind
        w.job_due = self.now + int(dur_s * 1000)
        self.push(w.job_due, kind, w.i, w.job)
