"""The freeze's patience (`Policy.patience_share`, `Rounds.check_freeze`): once most of a
round's members are ready, the last ones get only as long as waiting for them costs the
ready ones what the late ones' own work is worth; then the round freezes without them.
Under fake time, checked against the fake store fed only by `Outcome.effects`."""

from __future__ import annotations

from dataclasses import replace

from bagel.coordinator.core.policy import BAGEL, DILOCO_WAIT_ALL
from bagel.coordinator.core.records import RoundState
from bagel.coordinator.core.rounds import PATIENCE_DEADLINE
from bagel.protocol.messages import Order

from test_state_harness import Harness, h, make_spec, restored

CELL = "k0.r0"
IDS = ("a", "b", "c", "d")
SPEC = make_spec(min_round_s=60.0)  # a deadline far beyond the waits below


def _three_ready(hz: Harness, after_ms: int) -> int:
    """Round 1 of a, b, c, d opens; a, b and c are ready `after_ms` later (3 of 4 is the
    patience share): returns the time the third one said READY."""
    for w in IDS:
        hz.reg(w)
    for w in IDS:
        hz.hb(w)  # the round opens; everyone is told to train at once
    hz.advance(after_ms)
    for w in ("a", "b", "c"):
        hz.ready(w)
    return hz.now


def test_the_last_member_gets_the_wait_its_work_is_worth_then_the_round_freezes_without_it() -> None:
    hz = Harness(SPEC)
    t3 = _three_ready(hz, 30_000)
    r = hz.round()
    assert r is not None and r.state is not RoundState.REDUCING
    # 3 ready, 1 not: waiting t costs 3 t, dropping d costs its ~(t3 - open): t = 1/3 of that
    span = t3 - r.opened_ms
    assert r.freeze_by_ms == t3 + span // 3
    before = hz.store.workers["d"]
    hz.keepalive(r.freeze_by_ms, *IDS)  # everyone heartbeats; the coordinator ticks
    r = hz.round()
    assert r is not None and r.state is RoundState.REDUCING
    assert r.catch_up == ("d",) and r.contributors == IDS  # it still ends the round holding the new state
    assert hz.st.instruction_for("d").order is Order.REDUCE
    after = hz.store.workers["d"]
    assert after.reputation == before.reputation  # not charged: it did not miss the deadline
    # it has not trained its budget in the time since its TRAIN, so its speed is at most that
    budget = next(m.max_samples for m in r.members if m.worker_id == "d")
    bound = budget / ((hz.now - r.opened_ms) / 1000.0)
    a = BAGEL.throughput_ema
    assert bound < before.throughput[CELL]
    assert abs(after.throughput[CELL] - ((1 - a) * before.throughput[CELL] + a * bound)) < 1e-6
    hz.report("a", h(1))
    hz.report("b", h(1))  # 2 of the 3 weighted: the quorum
    assert hz.store.commits[-1].round == 1 and "d" not in hz.store.commits[-1].agreeing


def test_a_member_ready_within_the_wait_is_waited_for() -> None:
    hz = Harness(SPEC)
    _three_ready(hz, 30_000)
    r = hz.round()
    assert r is not None and r.freeze_by_ms
    hz.keepalive(r.freeze_by_ms - 100, *IDS)
    hz.ready("d")  # (Harness.ready advances 50 ms)
    r = hz.round()
    assert r is not None and r.state is RoundState.REDUCING and r.catch_up == () and r.contributors == IDS
    hz.keepalive(r.freeze_by_ms + 10, *IDS)  # the wait's end finds the round frozen: nothing happens
    r2 = hz.round()
    assert r2 is not None and r2.reduce_attempt == r.reduce_attempt and r2.catch_up == ()


def test_the_wait_survives_a_restart_and_the_baselines_wait_for_all() -> None:
    hz = Harness(SPEC)
    _three_ready(hz, 30_000)
    r = hz.round()
    assert r is not None and r.freeze_by_ms
    st = restored(hz)
    # readiness is volatile but the wait is not: the restarted core still ends it (after the
    # time it gives workers to re-attach)
    pending = [d for d in st.rounds.deadlines if d[5] == PATIENCE_DEADLINE]
    assert pending and pending[0][0] >= r.freeze_by_ms
    wait_all = Harness(SPEC, policy=DILOCO_WAIT_ALL)
    _three_ready(wait_all, 30_000)
    r = wait_all.round()
    assert r is not None and r.freeze_by_ms == 0
    off = Harness(SPEC, policy=replace(BAGEL, patience_share=0.0))
    _three_ready(off, 30_000)
    r = off.round()
    assert r is not None and r.freeze_by_ms == 0
