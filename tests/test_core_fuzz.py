"""Stateful fuzz of the coordinator core: random events, in any order, from anyone.

A hypothesis `RuleBasedStateMachine` drives one `CoordinatorState` (through the suite's
`Harness`, so every transition's effects are also checked against a fake store) with:
registrations with valid and invalid profiles; heartbeats with any phase, cell, round,
attempt and local state; reports with any hash (agreeing and disagreeing), failed or
not, for stale, current and future rounds and attempts; leaves, lease expiries, ticks
and time jumps (forward, and small steps back, as a wall clock may); checkpoint notices;
and restarts from the persisted records. Events come from registered, unregistered,
lost, left and banned ids alike (the core sees no signatures: an event names a worker id,
and whether that id is known, active or banned is what "signed or not" means here).

Besides the random events, a cooperative rule lets a worker do what its instruction says
(READY with its plan's samples, a report of the round's honest hash, a sync to the
committed state), so rounds open, freeze, commit and abort often enough to exercise the
invariants. After every step:

- committed rounds per cell never go back, except by a recorded rollback to the cell's
  checkpoint (an orphaned cell), and every commit is of round committed + 1;
- no commit below quorum: strictly more than quorum x |weighted contributors| of the
  committed round's reports carry the committed hash, counted from its own round record;
- samples are counted once: a commit's samples are the sum over its agreeing weighted
  contributors of min(reported, planned), and a cell's `samples_committed` is the sum of
  its commit records' samples (a re-report, a late report or a re-freeze adds nothing);
- a banned worker is never assigned: it is in no cell, no open round's live members or
  contributors, no instruction's plan or contributor list, and is told to LEAVE;
- the commit guard: a commit that carries a held-out loss carries the median of its
  agreeing reports, and never more than max_loss_ratio x the reference + abs_slack;
- no exception other than a `CoordinatorError` (a `CoreFault` fails the test);
- the fake store equals the state's snapshot (`FakeStore.check`).

The default run is small and the same every time (`BAGEL_FUZZ_EXAMPLES` examples x up to
`BAGEL_FUZZ_STEPS` steps, 40 x 100, derandomized: about 10^4 events in seconds). The full
run, about 10^5 steps and 3 x 10^5 core events (a cooperative step applies several):

    BAGEL_FUZZ_EXAMPLES=1000 BAGEL_FUZZ_STEPS=100 BAGEL_FUZZ_TIMEOUT_S=3000 \
        .venv/bin/python -m pytest -q -s tests/test_core_fuzz.py::test_core_fuzz

`-s` prints the counts (events, refusals, commits, guard refusals, restarts, steps):
hypothesis ends some examples early, so they are printed, not assumed. BAGEL_FUZZ_RANDOM=1
draws new examples instead of the fixed ones; BAGEL_FUZZ_SHRINK=0 reports a failure as
found instead of minimising it (minimising a long run can take minutes);
BAGEL_FUZZ_VERBOSE=1 also prints the refusals by event and error class.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import Phase as HPhase
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from bagel.coordinator.core.errors import CoordinatorError, UnknownWorker
from bagel.coordinator.core.events import (
    CheckpointStored,
    Heartbeat,
    LeaseExpired,
    Leave,
    Outcome,
    Register,
    ReportRound,
    Tick,
)
from bagel.coordinator.core.guard import median
from bagel.coordinator.core.policy import POLICIES
from bagel.coordinator.core.records import CellRecord, CommitRecord, RoundRecord, RoundState, WorkerState
from bagel.protocol.messages import Instruction, LocalState, Order, PeerAddress, PeerRates, Phase, Profile

from test_state_harness import GB, Harness, h, make_spec

EXAMPLES = int(os.environ.get("BAGEL_FUZZ_EXAMPLES", "40"))
STEPS = int(os.environ.get("BAGEL_FUZZ_STEPS", "100"))

IDS = ("w0", "w1", "w2", "w3", "w4", "w5", "w6", "w7", "ghost")  # only random rules use "ghost"
HASHES = tuple(h(n) for n in range(1, 5))

# (worker, behaviour): a worker doing what it was told, honestly or not
BEHAVIOURS = ("honest", "honest", "honest", "honest", "short", "lie", "fail", "jump", "unmeasured")
MOVES = st.lists(st.tuples(st.sampled_from(IDS[:-1]), st.sampled_from(BEHAVIOURS)), min_size=1, max_size=12)

counted = Counter[str]()  # events applied and refused, over the whole test


def honest_hash(cell: str, rnd: int, reduce_attempt: int) -> str:
    """What every honest contributor of one contributor set reports (the same bytes applied)."""
    return hashlib.sha256(f"{cell}|{rnd}|{reduce_attempt}".encode()).hexdigest()


class CoreMachine(RuleBasedStateMachine):
    """One coordinator core under random events; invariants checked after each step."""

    def __init__(self) -> None:
        super().__init__()
        self.hz: Harness | None = None
        self.quorum = 0.5
        self.seen_commits = 0
        self.last_committed: dict[str, tuple[int, int]] = {}  # cell -> (committed_round, rollbacks)
        self.before: dict[str, CellRecord] = {}

    # ------------------------------------------------------------------ setup

    @initialize(
        quorum=st.sampled_from((0.5, 0.67, 1.0)),
        policy=st.sampled_from(sorted(POLICIES)),
        clusters=st.sampled_from((1, 2)),
        ban=st.sampled_from((-2.0, -3.0, -5.0)),
        seed=st.integers(0, 2**16),
    )
    def setup(self, quorum: float, policy: str, clusters: int, ban: float, seed: int) -> None:
        spec = make_spec(clusters=clusters, quorum=quorum, ban_reputation=ban, max_replicas=4, min_replicas=1)
        self.hz = Harness(spec=spec, policy=POLICIES[policy], max_workers=6)
        self.hz.st.rng.seed(seed)
        self.quorum = quorum
        self.last_committed = {c: (0, 0) for c in spec.cell_ids}

    @property
    def cells(self) -> tuple[str, ...]:
        assert self.hz is not None
        return self.hz.spec.cell_ids

    # ------------------------------------------------------------------ applying

    def _apply(self, event: Any, now: int | None = None) -> Outcome | None:
        hz = self.hz
        assert hz is not None
        self.before = dict(hz.store.cells)  # the cells as the event found them (the guard's reference)
        saved = hz.now
        if now is not None:
            hz.now = now
        try:
            out = hz.apply(event)
        except CoordinatorError as e:
            counted["refused"] += 1
            counted[f"refused:{type(event).__name__}:{type(e).__name__}"] += 1
            return None
        finally:
            counted["events"] += 1
            hz.now = max(saved, hz.now) if now is None else saved
        self._check_outcome(out)
        return out

    def _check_outcome(self, out: Outcome) -> None:
        hz = self.hz
        assert hz is not None
        banned = {w for w, r in hz.store.workers.items() if r.state is WorkerState.BANNED}
        if out.instruction is not None:
            self._check_instruction(out.instruction, banned)
        rounds = {e.key: e for e in out.effects if isinstance(e, RoundRecord)}
        counted["guard refusals"] += sum(
            1 for e in rounds.values() if e.state is RoundState.ABORTED and e.reason.startswith("commit guard")
        )
        for e in out.effects:
            if isinstance(e, CommitRecord):
                self._check_commit(e, rounds.get((e.cell_id, e.round, e.attempt)))
        self.rounds_monotonic()  # per event: one step may commit several rounds

    def _check_instruction(self, ins: Instruction, banned: set[str]) -> None:
        names = {m.worker_id for m in ins.contributors}
        if ins.plan is not None:
            names |= {m.worker_id for m in ins.plan.members}
        if ins.order is Order.TRAIN and names & banned:
            # the plan's member list fixes shard positions, so a member banned mid-round keeps
            # its place in it; it must be dropped from the round, never told to train
            hz = self.hz
            assert hz is not None
            rnd = hz.st.cell_view(ins.cell_id)[1]
            assert rnd is not None and names & banned <= set(rnd.dropped), f"TRAIN names banned {names & banned}"
        if ins.order is Order.REDUCE:
            assert not ({m.worker_id for m in ins.contributors} & banned), "REDUCE names a banned contributor"
        if ins.donor is not None and ins.donor.worker_id:
            assert ins.donor.worker_id not in banned, "a banned worker is offered as a donor"

    def _check_commit(self, commit: CommitRecord, rec: RoundRecord | None) -> None:
        """No commit below quorum, samples as the reports and plans say, round = committed + 1."""
        counted["commits"] += 1
        assert rec is not None and rec.state is RoundState.COMMITTED, f"commit {commit} without its round record"
        prev_round, _ = self.last_committed[commit.cell_id]
        assert commit.round == rec.round
        catch = set(rec.catch_up)
        weighted = [x for x in rec.contributors if x not in catch]
        agree = [
            x
            for x in weighted
            if x in rec.reports and not rec.reports[x].failed and rec.reports[x].state_hash == commit.state_hash
        ]
        assert len(agree) > self.quorum * len(weighted), (
            f"{commit.cell_id} round {commit.round} committed with {len(agree)} of {len(weighted)} weighted"
        )
        assert set(commit.agreeing) == {
            x for x, e in rec.reports.items() if not e.failed and e.state_hash == commit.state_hash
        }
        # the commit guard: a committed measurement never jumps past the bound of [guard]
        agreeing_losses = [
            e.heldout_loss for e in rec.reports.values() if not e.failed and e.state_hash == commit.state_hash
        ]
        hz = self.hz
        assert hz is not None
        g, before = hz.spec.guard, self.before[commit.cell_id]
        if commit.heldout_loss >= 0:
            assert commit.heldout_loss == median([x for x in agreeing_losses if x >= 0])
            if before.heldout_loss >= 0 and before.rollbacks == hz.store.cells[commit.cell_id].rollbacks:
                bound = g.max_loss_ratio * before.heldout_loss + g.abs_slack
                assert commit.heldout_loss <= bound, f"guard let {commit.heldout_loss} past {bound}"
                counted["guarded commits"] += 1
        plans = {p.worker_id: p.max_samples for p in (*rec.members, *rec.late)}  # late joiners too
        # a weighted contributor counts what it reported, at most its budget: the samples the
        # core credited it at the freeze (`RoundRecord.ready`, from the time it observed),
        # never above its plan's
        budget = {x: max(1, min(plans[x], rec.ready.get(x, plans[x]))) for x in plans}
        expect = sum(min(rec.reports[x].samples, budget[x]) for x in agree)
        assert commit.samples == expect, f"commit samples {commit.samples} != {expect} from its reports"
        assert all(x in rec.contributors for x in commit.agreeing)
        # a commit is always of the round after the cell's last committed one (rollbacks included)
        cell = hz.store.cells[commit.cell_id]
        prev_rb = self.last_committed[commit.cell_id][1]
        if cell.rollbacks == prev_rb:
            assert cell.committed_round == commit.round, "the cell holds the round it just committed"
            assert commit.round == prev_round + 1, f"{commit.cell_id} committed {commit.round} after {prev_round}"
        else:
            # a rollback in the same transition: before the commit (then the commit is of the
            # checkpoint's next round), or right after it (its holders were lost: the cell
            # falls back to its checkpoint, as it would at the next event that needs the state)
            assert commit.round <= prev_round + 1
            assert cell.committed_round in (commit.round, max(cell.checkpoint_round, 0))

    # ------------------------------------------------------------------ random events

    @rule(
        wid=st.sampled_from(IDS),
        kind=st.sampled_from(("ok", "ok", "ok", "small", "fast", "neg_vram", "nan_bw", "neg_rate", "inf_rate")),
        local=st.sampled_from(("none", "committed", "stale", "garbage", "negative")),
        cell_ix=st.integers(0, 1),
    )
    def register(self, wid: str, kind: str, local: str, cell_ix: int) -> None:
        prof = self._profile(kind)
        self._apply(
            Register(wid, prof, PeerAddress(f"peer-{wid}", ("/ip4/127.0.0.1/tcp/1",)), self._local(local, cell_ix))
        )

    def _profile(self, kind: str) -> Profile:
        rates = {c: 100.0 for c in self.cells}
        vram, bw = 24 * GB, 50e6
        if kind == "small":
            vram = 2 * GB  # fits no expert cell: standby
        elif kind == "fast":
            rates = {c: 1e9 for c in self.cells}
        elif kind == "neg_vram":
            vram = -1
        elif kind == "nan_bw":
            bw = math.nan
        elif kind == "neg_rate":
            rates[self.cells[0]] = -1.0
        elif kind == "inf_rate":
            rates[self.cells[0]] = math.inf
        return Profile(
            name="f", device_kind="cuda", vram_bytes=vram, link_bandwidth_bytes_per_s=bw, samples_per_s=rates
        )

    @rule(wid=st.sampled_from(IDS[:-1]))
    def join(self, wid: str) -> None:
        """A valid registration (the common case, so cells fill and rounds run)."""
        self.register(wid, "ok", "none", 0)

    def _local(self, kind: str, cell_ix: int) -> LocalState:
        hz = self.hz
        assert hz is not None
        cid = self.cells[cell_ix % len(self.cells)]
        c = hz.store.cells[cid]
        if kind == "committed":
            return LocalState(cid, c.committed_round, c.committed_hash)
        if kind == "stale":
            return LocalState(cid, max(0, c.committed_round - 1), h(99))
        if kind == "garbage":
            return LocalState("no-such-cell", 7, h(7))
        if kind == "negative":
            return LocalState(cid, -1, "")
        return LocalState()

    @rule(
        wid=st.sampled_from(IDS),
        phase=st.sampled_from((0, 1, 2, 3, 4, 5, 99)),
        cell_ix=st.integers(0, 2),
        round_delta=st.integers(-2, 2),
        attempt=st.integers(-1, 4),
        samples=st.sampled_from((0, 1, 640, 10**12, -5)),
        local=st.sampled_from(("same", "none", "committed", "stale", "garbage", "negative")),
    )
    def heartbeat_any(
        self, wid: str, phase: int, cell_ix: int, round_delta: int, attempt: int, samples: int, local: str
    ) -> None:
        hz = self.hz
        assert hz is not None
        cid = self.cells[cell_ix] if cell_ix < len(self.cells) else "bogus"
        committed = hz.store.cells[cid].committed_round if cid in hz.store.cells else 0
        rec = hz.store.workers.get(wid)
        loc = (rec.local if rec is not None else LocalState()) if local == "same" else self._local(local, cell_ix)
        self._apply(
            Heartbeat(
                wid,
                phase,  # type: ignore[arg-type]  # an unknown phase number must be refused
                cid,
                committed + 1 + round_delta,
                inner_step=3,
                loss=1.0,
                samples=samples,
                local=loc,
                reduce_attempt=max(attempt, -1),
                round_attempt=attempt,
            )
        )

    @rule(
        wid=st.sampled_from(IDS),
        cell_ix=st.integers(0, 2),
        round_delta=st.integers(-2, 2),
        attempt_delta=st.integers(-2, 2),
        hash_kind=st.sampled_from(("honest", "honest", "other", "empty", "pool")),
        pool_ix=st.integers(0, len(HASHES) - 1),
        failed=st.booleans(),
        samples=st.sampled_from((0, 1, 640, 10**12, -1)),
        compute_ms=st.sampled_from((0, 1, 6_400, -3)),
        loss=st.sampled_from((0.5, math.nan, math.inf, -1.0)),
        heldout=st.sampled_from((None, None, 0.0, 0.7, 1e9, math.nan, -1.0)),
    )
    def report_any(
        self,
        wid: str,
        cell_ix: int,
        round_delta: int,
        attempt_delta: int,
        hash_kind: str,
        pool_ix: int,
        failed: bool,
        samples: int,
        compute_ms: int,
        loss: float,
        heldout: float | None,
    ) -> None:
        hz = self.hz
        assert hz is not None
        cid = self.cells[cell_ix] if cell_ix < len(self.cells) else "bogus"
        cell = hz.store.cells.get(cid)
        committed = cell.committed_round if cell is not None else 0
        ra = (cell.reduce_attempt if cell is not None else 0) + attempt_delta
        rnd = committed + 1 + round_delta
        state_hash = {
            "honest": honest_hash(cid, rnd, ra),
            "other": h(12345),
            "empty": "",
            "pool": HASHES[pool_ix],
        }[hash_kind]
        self._apply(
            ReportRound(
                wid,
                cid,
                rnd,
                state_hash=state_hash,
                samples=samples,
                loss=loss,
                compute_ms=compute_ms,
                failed=failed,
                reason="fuzz" if failed else "",
                reduce_attempt=ra,
                heldout_loss=heldout,
                heldout_loss_base=heldout,
            )
        )

    @rule(wid=st.sampled_from(IDS), offer=st.booleans())
    def leave(self, wid: str, offer: bool) -> None:
        self._apply(Leave(wid, "fuzz", offer_checkpoint=offer))

    @rule(wid=st.sampled_from(IDS))
    def lease_expired(self, wid: str) -> None:
        self._apply(LeaseExpired(wid))

    @rule(ms=st.sampled_from((0, 500, 1_000, 2_000, 2_000, 5_000, 10_001, 60_000)))
    def tick(self, ms: int) -> None:
        hz = self.hz
        assert hz is not None
        hz.advance(ms)
        self._apply(Tick())

    @rule(back_ms=st.sampled_from((1, 1_000, 5_000)), wid=st.sampled_from(IDS))
    def late_clock(self, back_ms: int, wid: str) -> None:
        """An event stamped earlier than the last one (a wall clock stepped back)."""
        hz = self.hz
        assert hz is not None
        self._apply(Heartbeat(wid, Phase.IDLE), now=hz.now - back_ms)
        self._apply(Tick(), now=hz.now - back_ms)

    @rule(cell_ix=st.integers(0, 2), round_delta=st.integers(-3, 1), right=st.booleans())
    def checkpoint_stored(self, cell_ix: int, round_delta: int, right: bool) -> None:
        hz = self.hz
        assert hz is not None
        cid = self.cells[cell_ix] if cell_ix < len(self.cells) else "bogus"
        cell = hz.store.cells.get(cid)
        rnd = (cell.committed_round if cell is not None else 0) + round_delta
        real = hz.st.committed_hash_of(cid, rnd) if cell is not None else None
        self._apply(CheckpointStored(cid, rnd, real if (right and real) else h(777)))

    @rule(seed=st.integers(0, 2**16), roll=st.integers(0, 2))
    def restart(self, seed: int, roll: int) -> None:
        """The daemon restarts (one draw in three): a new core from exactly what the store holds."""
        hz = self.hz
        assert hz is not None
        if roll:
            return
        hz.advance(1_000)
        # every open exchange's REDUCE (its part weights included) must survive, as a live
        # contributor is told it (a lost or departed one stays listed until the exchange ends)
        reduce = {}
        for c in hz.store.cells:
            r = hz.st.cell_view(c)[1]
            if r is not None and r.state is RoundState.REDUCING:
                for wid in r.contributors:
                    try:
                        ins = hz.st.instruction_for(wid)
                    except UnknownWorker:
                        continue
                    if ins.order is Order.REDUCE:
                        reduce[wid] = ins.contributors
                        break
        hz.st = hz.store.restore(
            hz.spec, hz.cells, hz.now, policy=hz.st.policy, rng=random.Random(seed), max_workers=hz.st.max_workers
        )
        counted["restarts"] += 1
        hz.store.check(hz.st)
        for wid, before in reduce.items():
            after = hz.st.instruction_for(wid)
            assert after.order is Order.REDUCE and after.contributors == before, (wid, before, after)
            counted["weighted exchanges kept by a restart"] += any(m.part_weight != 1 for m in before)

    # ------------------------------------------------------------------ cooperative progress

    @rule(moves=MOVES)
    def cooperate(self, moves: list[tuple[str, str]]) -> None:
        """A few workers, in a drawn order, do what they were told (some lie, fail or fall short);
        then every other id does what it was told honestly (registering again if it is not
        active), and two seconds pass."""
        for wid, how in moves:
            self._follow(wid, how)
        hz = self.hz
        assert hz is not None
        drawn = {wid for wid, _ in moves}
        for wid in IDS[:-1]:  # the rest of the swarm: honest, and an id not active registers again
            if wid not in drawn:
                self._follow(wid, "honest")
        hz.advance(2_000)
        self._apply(Tick())

    # the same under two more names: hypothesis draws rules uniformly, and progress needs
    # cooperation more often than any one kind of noise
    @rule(moves=MOVES)
    def cooperate_more(self, moves: list[tuple[str, str]]) -> None:
        self.cooperate(moves)

    @rule(moves=MOVES)
    def cooperate_again(self, moves: list[tuple[str, str]]) -> None:
        self.cooperate(moves)

    def _heldout(self, cid: str) -> float:
        """The held-out loss honest members measure for the cell's committed state."""
        hz = self.hz
        assert hz is not None
        ref = hz.store.cells[cid].heldout_loss
        return ref if ref > 0 else 1.0

    def _follow(self, wid: str, how: str) -> None:
        """The worker does what it was told ("lie": another hash, "fail": a failed exchange,
        "short": half its planned samples)."""
        lie, short = how == "lie", how == "short"
        hz = self.hz
        assert hz is not None
        try:
            ins = hz.st.instruction_for(wid)
        except UnknownWorker:  # never registered, lost or left: a real worker registers again
            # with the committed state it kept on disk, if it ever held one
            rec0 = hz.store.workers.get(wid)
            local = rec0.local if rec0 is not None else LocalState()
            self._apply(
                Register(wid, self._profile("ok"), PeerAddress(f"peer-{wid}", ("/ip4/127.0.0.1/tcp/1",)), local)
            )
            return
        except CoordinatorError:
            return
        rec = hz.store.workers[wid]
        if ins.upload_checkpoint and ins.committed_round > 0:
            self._apply(CheckpointStored(ins.cell_id, ins.committed_round, ins.committed_hash))
        if ins.order is Order.TRAIN and ins.plan is not None:
            full = ins.plan.micro_batch * ins.plan.grad_accum * ins.plan.inner_steps
            self._apply(
                Heartbeat(
                    wid,
                    Phase.READY,
                    ins.cell_id,
                    ins.round,
                    samples=full // 2 if short else full + 7,  # more than planned: capped
                    local=rec.local,
                    round_attempt=ins.round_attempt,
                )
            )
        elif ins.order is Order.REDUCE:
            good = honest_hash(ins.cell_id, ins.round, ins.reduce_attempt)
            # the held-out loss of the new state: honest members agree on it; "jump" says it
            # blew up (one member's report among honest ones, or all of a one-member cell's)
            base = self._heldout(ins.cell_id)
            heldout = None if how == "unmeasured" else base * (10.0 if how == "jump" else 0.9)
            self._apply(
                ReportRound(
                    wid,
                    ins.cell_id,
                    ins.round,
                    state_hash="" if how == "fail" else h(4242) if lie else good,
                    failed=how == "fail",
                    reason="exchange failed" if how == "fail" else "",
                    samples=640,
                    loss=0.5,
                    compute_ms=6_400,
                    reduce_attempt=ins.reduce_attempt,
                    heldout_loss=heldout,
                    heldout_loss_base=None if heldout is None else base,
                    # what it timed of each sender, a different link per sender: later freezes
                    # give unequal part weights, which restarts must keep
                    peer_rates=PeerRates.of(
                        (m.worker_id, 8 << 20, 250 + 50 * (hashlib.sha256(m.worker_id.encode()).digest()[0] % 40))
                        for m in ins.contributors
                        if m.worker_id != wid
                    ),
                )
            )
            if how == "honest":  # a retry of the same report, as a worker whose answer was lost sends
                self._apply(
                    ReportRound(
                        wid, ins.cell_id, ins.round, state_hash=good, samples=640, reduce_attempt=ins.reduce_attempt
                    )
                )
        elif ins.order is Order.SYNC:
            local = LocalState(ins.cell_id, ins.committed_round, ins.committed_hash)
            self._apply(Heartbeat(wid, Phase.IDLE, ins.cell_id, ins.round, local=local))
        elif ins.order is Order.WAIT:
            self._apply(Heartbeat(wid, Phase.IDLE, ins.cell_id, ins.round, local=rec.local))

    # ------------------------------------------------------------------ invariants

    @invariant()
    def rounds_monotonic(self) -> None:
        hz = self.hz
        if hz is None:
            return
        for cid, rec in hz.store.cells.items():
            prev_round, prev_rb = self.last_committed[cid]
            if rec.committed_round < prev_round:
                assert rec.rollbacks > prev_rb, f"{cid} went back from {prev_round} to {rec.committed_round}"
                assert rec.committed_round == max(rec.checkpoint_round, 0), "a rollback lands on the checkpoint"
            self.last_committed[cid] = (rec.committed_round, rec.rollbacks)

    @invariant()
    def samples_counted_once(self) -> None:
        hz = self.hz
        if hz is None:
            return
        per_cell = Counter[str]()
        for m in hz.store.commits:
            per_cell[m.cell_id] += m.samples
        for cid, rec in hz.store.cells.items():
            assert rec.samples_committed == per_cell[cid], f"{cid}: {rec.samples_committed} != {per_cell[cid]}"

    @invariant()
    def banned_never_assigned(self) -> None:
        hz = self.hz
        if hz is None:
            return
        banned = {w for w, r in hz.store.workers.items() if r.state is WorkerState.BANNED}
        counted["banned (worker x step)"] += len(banned)
        for wid in banned:
            assert hz.store.workers[wid].cell_id == "", f"banned {wid} is assigned"
            assert hz.st.instruction_for(wid).order is Order.LEAVE
        for cid in self.cells:
            _, rnd, members = hz.st.cell_view(cid)
            assert not (set(members) & banned), f"banned workers in {cid}"
            if rnd is not None:
                live = (set(p.worker_id for p in (*rnd.members, *rnd.late)) | set(rnd.contributors)) - set(rnd.dropped)
                assert not (live & banned), f"banned {live & banned} live in {cid} round {rnd.round}"

    @invariant()
    def core_alive(self) -> None:
        counted["steps"] += 1  # invariants run once per step
        hz = self.hz
        if hz is not None:
            assert hz.st.fault is None


def test_core_fuzz() -> None:
    """The state machine above, EXAMPLES x STEPS; prints the number of events applied."""
    before = counted["events"]
    run_state_machine_as_test(
        CoreMachine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            derandomize=os.environ.get("BAGEL_FUZZ_RANDOM", "") == "",
            # shrinking a long failing run can take minutes: BAGEL_FUZZ_SHRINK=0 reports it as found
            phases=tuple(HPhase) if os.environ.get("BAGEL_FUZZ_SHRINK", "1") != "0" else (HPhase.generate,),
        ),
    )
    events = counted["events"] - before
    print(
        f"\ncore fuzz: {events} events ({counted['refused']} refused), {counted['commits']} commits "
        f"({counted['guarded commits']} guarded), {counted['guard refusals']} guard refusals, "
        f"{counted['restarts']} restarts ({counted['weighted exchanges kept by a restart']} kept a weighted "
        f"exchange), {counted['steps']} steps"
    )
    if os.environ.get("BAGEL_FUZZ_VERBOSE"):
        for k, v in sorted(counted.items()):
            print(f"  {k}: {v}")
    assert events > 0 and counted["commits"] > 0, "the fuzz never reached a commit: it tests nothing"


pytestmark = pytest.mark.timeout(int(os.environ.get("BAGEL_FUZZ_TIMEOUT_S", "120")))


# ---------------------------------------------------------------------- regressions the fuzz found


def _reducing_three(ban_reputation: float) -> Harness:
    """Three members of one cell, all ready: round 1 REDUCING over (a, b, c)."""
    hz = Harness(spec=make_spec(ban_reputation=ban_reputation, quorum=0.5))
    for w in "abc":
        hz.reg(w)
    hz.hb("a")
    for w in "abc":
        hz.ready(w)
    rnd = hz.round()
    assert rnd is not None and rnd.state is RoundState.REDUCING and rnd.contributors == ("a", "b", "c")
    return hz


@pytest.mark.parametrize("a_reported_first", [False, True])
def test_a_contributor_banned_while_reducing_is_taken_out_of_the_exchange(a_reported_first: bool) -> None:
    """A failed report that bans its sender (reputation past the bar) used to leave the
    banned worker in the frozen contributor set: the survivors went on exchanging with it
    and the round could commit with its bytes, and REDUCE instructions kept naming it.
    Now a ban re-freezes the survivors without it (here 2 of 3 still make the quorum)."""
    hz = _reducing_three(ban_reputation=-0.4)  # one failed report (-0.5) bans
    first = hz.st.instruction_for("a").reduce_attempt
    if a_reported_first:
        assert hz.report("a", h(1)).verdict is not None
    out = hz.report("c", "", failed=True, reason="exchange failed")
    assert hz.store.workers["c"].state is WorkerState.BANNED
    assert out.instruction is not None and out.instruction.order is Order.LEAVE
    rnd = hz.round()
    assert rnd is not None and rnd.state is RoundState.REDUCING
    assert rnd.reduce_attempt == first + 1 and set(rnd.contributors) == {"a", "b"}
    for w in "ab":
        ins = hz.st.instruction_for(w)
        assert ins.order is Order.REDUCE and {m.worker_id for m in ins.contributors} == {"a", "b"}
    hz.report("a", h(2))
    hz.report("b", h(2))
    commit = hz.store.commits[-1]
    assert commit.round == 1 and commit.contributors == ("a", "b") and commit.state_hash == h(2)


def test_a_ban_that_leaves_too_few_contributors_aborts_the_attempt() -> None:
    """quorum 1.0: with one of three banned the survivors cannot make a freeze quorum, so
    the attempt aborts (and is re-run by the two) instead of going on with the banned one."""
    hz = Harness(spec=make_spec(ban_reputation=-0.4, quorum=1.0))
    for w in "abc":
        hz.reg(w)
    hz.hb("a")
    for w in "abc":
        hz.ready(w)
    hz.report("c", "", failed=True, reason="exchange failed")
    assert hz.store.workers["c"].state is WorkerState.BANNED
    rnd = hz.round()
    assert rnd is not None and rnd.state is RoundState.OPEN and rnd.attempt == 2
    assert {p.worker_id for p in rnd.members} == {"a", "b"}
