"""An exchange's deadline follows what the cell's exchanges really take, and the workers
follow the coordinator's deadline instead of a fixed timeout of their own.

The coordinator predicts an exchange from the links alone; the members' CPUs (encoding,
the robust reduction in float64, the outer step) can make it take longer. Before, such a
cell aborted every attempt at the same deadline and never committed (a 32.5 M-parameter
cell on two CPU workers, `bench/worker_memory.py`), and a worker gave up any exchange
after 60 s, which a large model over home uplinks never fits. Now the deadline doubles
after each attempt that ran past it, is at least twice the last committed exchange, and
travels with the REDUCE order (`Instruction.reduce_deadline_unix_ms`), which the worker's
data plane follows (`roundwork.exchange_timeout_s`).
"""

from __future__ import annotations

import pytest

from bagel.coordinator.core.records import RoundState
from bagel.coordinator.core.rounds import EXCHANGE_MARGIN, MAX_OVERRUN_DOUBLINGS
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.convert import instruction_from_pb, instruction_to_pb
from bagel.protocol.messages import Instruction, Order, Phase
from bagel.worker.roundwork import (
    DEFAULT_REDUCE_TIMEOUT_S,
    MAX_REDUCE_TIMEOUT_S,
    MIN_REDUCE_TIMEOUT_S,
    REDUCE_DEADLINE_GRACE_S,
    exchange_timeout_s,
)

from test_state_harness import Harness, h, make_spec, restored

MEMBERS = "abc"


def frozen(hz: Harness) -> tuple[int, int]:
    """Every member trains and says READY; the round freezes. (freeze time, its span)."""
    for w in MEMBERS:
        hz.ready(w)
    r = hz.round()
    assert r is not None and r.state is RoundState.REDUCING
    ins = hz.st.instruction_for("a")
    assert ins.order is Order.REDUCE
    # every contributor is told when the coordinator gives up on the attempt
    assert ins.reduce_deadline_unix_ms == r.reduce_deadline_ms > r.frozen_ms
    assert all(hz.st.instruction_for(w).reduce_deadline_unix_ms == r.reduce_deadline_ms for w in MEMBERS)
    return r.frozen_ms, r.reduce_deadline_ms - r.frozen_ms


def overrun(hz: Harness) -> None:
    """Nobody reports: the reduce deadline passes and the attempt aborts, then re-opens."""
    r = hz.round()
    assert r is not None
    attempt = r.attempt
    hz.keepalive(r.reduce_deadline_ms + 1, *MEMBERS)
    hz.tick()
    nxt = hz.round()
    assert nxt is not None and nxt.attempt == attempt + 1 and hz.cell().committed_round == 0
    for w in MEMBERS:  # the members hear the re-run
        hz.hb(w, Phase.IDLE)


def test_an_exchange_slower_than_its_prediction_gets_more_time_until_it_commits_and_then_keeps_it() -> None:
    hz = Harness(spec=make_spec(quorum=0.5))
    for w in MEMBERS:
        hz.reg(w)
    hz.hb("a")
    _, span0 = frozen(hz)
    sched = hz.spec.schedule
    # the prediction: the links' transfer with slack, at least min_round_s, plus a lease
    assert span0 >= sched.min_round_s * 1000 + sched.lease_s * 1000
    spans = [span0]
    for _ in range(MAX_OVERRUN_DOUBLINGS + 1):
        overrun(hz)
        spans.append(frozen(hz)[1])
    # each attempt in a row that ran past its deadline doubles the next one's, up to a cap
    assert spans == [span0 << min(k, MAX_OVERRUN_DOUBLINGS) for k in range(len(spans))]
    # this attempt's exchange takes 3 x the prediction, within its deadline: it commits
    took = 3 * span0
    t0 = hz.round().frozen_ms  # type: ignore[union-attr]
    hz.keepalive(t0 + took - 1, *MEMBERS)
    hz.now = t0 + took
    ra = hz.st.instruction_for("a").reduce_attempt
    for w in MEMBERS:  # (the quorum commits it before the last report, which comes late)
        hz.report(w, h(1), round=1, reduce_attempt=ra)
    assert hz.cell().committed_round == 1
    # the next round's exchange gets twice what the last one took, not the prediction that
    # failed five times (so it does not fail once more before it learns again)
    for w in MEMBERS:
        hz.hb(w, Phase.IDLE)
    _, span = frozen(hz)
    assert span == EXCHANGE_MARGIN * took > span0


def test_a_restarted_coordinator_tells_the_members_the_deadline_it_recorded() -> None:
    """The deadline is part of the round's record: a coordinator restarted mid-exchange
    gives its members the same one (it waits a lease's time longer itself, for them to
    re-attach)."""
    hz = Harness(spec=make_spec(quorum=0.5))
    for w in MEMBERS:
        hz.reg(w)
    hz.hb("a")
    frozen(hz)
    before = hz.round()
    assert before is not None
    hz.advance(1_000)
    hz.st = restored(hz)
    r = hz.round()
    assert r is not None and r.state is RoundState.REDUCING
    assert r.reduce_deadline_ms == before.reduce_deadline_ms
    assert hz.st.instruction_for("a").reduce_deadline_unix_ms == before.reduce_deadline_ms


def test_the_reduce_deadline_travels_on_the_wire() -> None:
    ins = Instruction(Order.REDUCE, "k0.r0", 3, 2, h(2), reduce_attempt=1, round_attempt=1, reduce_deadline_unix_ms=7)
    assert instruction_from_pb(instruction_to_pb(ins)) == ins
    old = pb.Instruction(order=pb.ORDER_REDUCE, cell_id="k0.r0", round=3)  # from a coordinator without the field
    assert instruction_from_pb(old).reduce_deadline_unix_ms == 0
    # a different deadline is a different instruction to a held watch
    other = Instruction(Order.REDUCE, "k0.r0", 3, 2, h(2), reduce_attempt=1, round_attempt=1, reduce_deadline_unix_ms=8)
    assert instruction_to_pb(ins).tag != instruction_to_pb(other).tag


@pytest.mark.parametrize(
    ("deadline_s", "now_s", "cap_s", "want"),
    [
        (1_000.0, 400.0, None, 600.0 + REDUCE_DEADLINE_GRACE_S),  # a ten-minute exchange is waited for
        (1_000.0, 400.0, 120.0, 120.0),  # --reduce-timeout-s bounds it
        (1_000.0, 1_000.0 + 10 * REDUCE_DEADLINE_GRACE_S, None, MIN_REDUCE_TIMEOUT_S),  # long over: give up at once
        (0.0, 400.0, None, DEFAULT_REDUCE_TIMEOUT_S),  # an older coordinator names no deadline
        (0.0, 400.0, 20.0, 20.0),
        (1e12, 400.0, None, MAX_REDUCE_TIMEOUT_S),  # whatever a coordinator says, at most a day
    ],
)
def test_the_worker_gives_up_an_exchange_at_the_coordinators_deadline(
    deadline_s: float, now_s: float, cap_s: float | None, want: float
) -> None:
    ins = Instruction(Order.REDUCE, "k0.r0", 1, reduce_deadline_unix_ms=int(deadline_s * 1000))
    assert exchange_timeout_s(ins, now_s, cap_s) == pytest.approx(want)
