"""Late join: a worker that comes to hold a round's base state while the round trains is
admitted into it with a share of the time left (`Rounds.admit_late`), under fake time.

Checked against the fake store fed only by `Outcome.effects` (tests/test_state_harness.py),
so the admission is also proven durable.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from bagel.coordinator.core.policy import BAGEL, DILOCO_WAIT_ALL
from bagel.coordinator.core.records import MemberPlan, RoundState, WorkerState
from bagel.coordinator.core.scheduler import LATE_JOIN_MARGIN, plan_late_member
from bagel.models.data import shard
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.convert import instruction_from_pb, instruction_to_pb
from bagel.protocol.messages import Instruction, Member, Order, PeerAddress, RoundPlan, Verdict

from test_state_harness import Harness, h, make_spec, restored

CELL = "k0.r0"


def _round_one(hz: Harness) -> None:
    """a and b register, train and commit round 1; round 2 opens with them."""
    for w in ("a", "b"):
        hz.reg(w)
    hz.hb("a")
    for w in ("a", "b"):
        hz.ready(w)
    hz.report("a", h(1))
    assert hz.report("b", h(1)).verdict is Verdict.COMMITTED


def _round_two_with_joiner(hz: Harness, after_ms: int = 0) -> None:
    """a and b commit round 1 and train round 2; j registers and fetches round 1 `after_ms`
    into round 2."""
    _round_one(hz)
    r = hz.round()
    assert r is not None and r.round == 2
    hz.reg("j")
    hz.advance(after_ms)
    hz.sync("j")


def test_a_joiner_that_syncs_while_the_round_trains_is_admitted_with_a_share_of_the_time_left() -> None:
    hz = Harness()
    _round_two_with_joiner(hz, after_ms=100)
    ins = hz.st.instruction_for("j")
    assert ins.order is Order.TRAIN and ins.round == 2 and ins.plan is not None
    plan = ins.plan
    # after the opening members, late_from = 2: its shard is position 2 of a group of 3
    assert [m.worker_id for m in plan.members] == ["a", "b", "j"] and plan.late_from == 2
    assert plan.shard_members(2) == 3 and plan.shard_members(0) == plan.shard_members(1) == 2
    rec = hz.round()
    assert rec is not None and [m.worker_id for m in rec.late] == ["j"]
    opening = {m.worker_id: m for m in rec.members}
    # the same H steps, a smaller batch: it has less time than the opening members
    mine = rec.late[0]
    assert plan.inner_steps == rec.inner_steps
    assert 0 < mine.max_samples < min(m.max_samples for m in opening.values())
    # nobody else's plan changed under them while the round trains
    for w in ("a", "b"):
        p = hz.st.instruction_for(w).plan
        assert p is not None and [m.worker_id for m in p.members] == ["a", "b"] and p.late_from == 0


def test_the_late_joiner_trains_commits_and_counts_with_the_samples_it_is_credited() -> None:
    hz = Harness()
    _round_two_with_joiner(hz, after_ms=100)
    for w in ("a", "b", "j"):
        hz.ready(w)
    r = hz.round()
    assert r is not None and r.state is RoundState.REDUCING
    assert r.contributors == ("a", "b", "j") and r.catch_up == ()
    # from the freeze on, every plan lists all members, so reducers can audit the late one
    for w in ("a", "b", "j"):
        ins = hz.st.instruction_for(w)
        assert ins.order is Order.REDUCE and ins.plan is not None
        assert [m.worker_id for m in ins.plan.members] == ["a", "b", "j"] and ins.plan.late_from == 2
    wire = {m.worker_id: m.max_samples for m in hz.st.instruction_for("a").contributors}
    # credited by the span since its own TRAIN, not the round's opening
    assert 0 < wire["j"] <= r.late[0].max_samples
    hz.report("j", h(2))
    assert hz.report("a", h(2)).verdict is Verdict.COMMITTED
    assert hz.store.commits[-1].round == 2 and "j" in hz.store.commits[-1].contributors
    assert hz.store.workers["j"].rounds_contributed == 1


def test_too_little_time_left_means_waiting_and_catching_up_as_before() -> None:
    hz = Harness()
    _round_one(hz)
    r = hz.round()
    assert r is not None
    hz.reg("j")
    # past the last late_join_min_share of the expected training time
    span = r.predicted_compute_ms
    hz.advance(int(span * (1 - BAGEL.late_join_min_share)) + 10)
    hz.sync("j")
    assert hz.st.instruction_for("j").order is Order.WAIT
    rr = hz.round()
    assert rr is not None and rr.late == ()
    for w in ("a", "b"):
        hz.ready(w)
    rr = hz.round()
    assert rr is not None and rr.catch_up == ("j",)


def test_the_baselines_do_not_late_join() -> None:
    hz = Harness(policy=DILOCO_WAIT_ALL)
    _round_two_with_joiner(hz, after_ms=100)
    assert hz.st.instruction_for("j").order is Order.WAIT


def test_a_restarted_core_keeps_the_late_joiner_and_its_shard() -> None:
    hz = Harness()
    _round_two_with_joiner(hz, after_ms=100)
    before = hz.st.instruction_for("j").plan
    st = restored(hz)
    after = st.instruction_for("j")
    assert after.order is Order.TRAIN and after.plan == before
    assert st.instruction_for("a").plan == hz.st.instruction_for("a").plan


def test_plan_late_member_sizes_the_share_to_the_time_left() -> None:
    spec = make_spec()
    peer = PeerAddress("p")
    h_steps = 10
    p = plan_late_member(100.0, [100.0, 100.0], h_steps, 5_000, 10_000, "j", peer, spec, BAGEL)
    assert isinstance(p, MemberPlan)
    # 100 samples/s x 5 s x the margin, over H steps (then rounded up to a batch shape)
    want = int(100.0 * 5.0 * LATE_JOIN_MARGIN / h_steps)
    assert p.micro_batch * p.grad_accum >= want and p.max_samples == p.micro_batch * p.grad_accum * h_steps
    # a claimed speed far above the members' is clamped as theirs are
    fast = plan_late_member(1e9, [100.0, 100.0], h_steps, 5_000, 10_000, "j", peer, spec, BAGEL)
    assert fast is not None and fast.max_samples <= 100.0 * spec.audit.max_speedup * 5.0 + fast.micro_batch * h_steps
    # too little time left, not even a sample per step, or off
    assert plan_late_member(100.0, [100.0], h_steps, 1_000, 10_000, "j", peer, spec, BAGEL) is None
    assert plan_late_member(0.5, [100.0], h_steps, 9_000, 10_000, "j", peer, spec, BAGEL) is None
    off = replace(BAGEL, late_join=False)
    assert plan_late_member(100.0, [100.0], h_steps, 9_000, 10_000, "j", peer, spec, off) is None
    with pytest.raises(ValueError, match="late_join_min_share"):
        replace(BAGEL, late_join_min_share=1.0)


def test_a_late_joiners_shard_is_the_next_stride_and_moves_no_opening_members_data() -> None:
    members = tuple(Member(x, PeerAddress(x), 8) for x in ("a", "b", "c", "j1", "j2"))
    plan = RoundPlan(4, 2, 1, 0, members, late_from=3)
    assert [plan.shard_members(k) for k in range(5)] == [3, 3, 3, 4, 5]
    assert RoundPlan(4, 2, 1, 0, members).shard_members(4) == 5
    n = 600
    opening = [set(shard("run", CELL, 2, k, 3, n, 200).tolist()) for k in range(3)]
    assert set().union(*opening) == set(range(n))  # the opening members own every sample
    late = shard("run", CELL, 2, 3, plan.shard_members(3), n, 50)
    assert len(set(late.tolist())) == 50 and np.all((late >= 0) & (late < n))


def test_late_from_crosses_the_wire_and_a_bad_one_reads_as_none() -> None:
    members = tuple(Member(x, PeerAddress(x), 8) for x in ("a", "b", "j"))
    ins = Instruction(Order.TRAIN, CELL, 2, 1, h(1), plan=RoundPlan(4, 2, 1, 0, members, late_from=2))
    assert instruction_from_pb(instruction_to_pb(ins)) == ins
    for bad in (-1, 3, 99):
        p = instruction_to_pb(ins)
        p.plan.late_from = bad
        got = instruction_from_pb(pb.Instruction.FromString(p.SerializeToString()))
        assert got.plan is not None and got.plan.late_from == 0


def test_a_worker_that_claims_no_throughput_waits_on_standby_and_sets_no_pace() -> None:
    """A worker's first Register carries no throughput: it needs the run spec to measure,
    which takes seconds to minutes, then registers again. Placed, it would be an opening
    member of its cell's next round while it measures: planned at the default 1 sample/s,
    it made the round's estimate minutes long, and a late joiner sized to that estimate
    kept the round waiting (seen in `make demo`: 148 s of a round whose other member
    trained 6 s); and the round waited for it until its lease ran out. It waits on
    standby instead, and its second Register places it."""
    hz = Harness()
    hz.reg("a")
    first = hz.reg("p", speed=0.0)  # a first contact: no throughput yet
    assert first.instruction is not None and first.instruction.order is Order.WAIT
    assert first.instruction.cell_id == "" and "not measured" in first.instruction.reason
    hz.hb("a")
    r = hz.round()
    assert r is not None and r.round == 1 and [m.worker_id for m in r.members] == ["a"]
    hz.reg("j")  # as fast as a, and holding the base state (the initial one)
    hz.advance(100)
    hz.hb("j")
    r = hz.round()
    assert r is not None and [m.worker_id for m in r.late] == ["j"]
    opening = {m.worker_id: m for m in r.members}
    # a trains its budget in a few seconds; j, as fast and later, gets no more than that
    assert 0 < r.late[0].max_samples <= opening["a"].max_samples
    assert hz.st.roster.workers["p"].cell == ""  # a rebalance did not place it either
    # silent while it measures, it is not lost when an ordinary lease would have run out
    hz.advance(int(hz.spec.schedule.lease_s * 1000) * 3)
    hz.tick()
    assert hz.st.roster.workers["p"].state is WorkerState.ACTIVE
    again = hz.reg("p")  # measured: placed
    assert again.instruction is not None and again.instruction.cell_id != ""
    # and from then on its lease is an ordinary one: silent past it, it is lost
    hz.advance(int(hz.spec.schedule.lease_s * 1000) + 1)
    hz.tick()
    assert hz.st.roster.workers["p"].state is WorkerState.LOST


def test_a_measuring_worker_that_heartbeats_holds_the_runs_lease_from_then_on() -> None:
    """The measuring lease covers a worker that sends nothing while it measures. Any
    message renews the run's lease instead, which ends sooner: once such a worker has sent
    one and then falls silent, it is lost one ordinary lease later, not at the end of the
    measuring lease."""
    hz = Harness()
    hz.reg("a")
    hz.reg("p", speed=0.0)
    lease_ms = int(hz.spec.schedule.lease_s * 1000)
    hz.advance(2 * lease_ms)  # silent past an ordinary lease: still active, measuring
    hz.tick()
    assert hz.st.roster.workers["p"].state is WorkerState.ACTIVE
    hz.hb("p")
    hz.advance(lease_ms + 1)
    hz.tick()
    assert hz.st.roster.workers["p"].state is WorkerState.LOST
