"""The simulator's overlap of the exchange with compute (`[diloco] overlap = "delayed"`):
synthetic workers train the next round ahead while their weighted exchange runs, as the
real worker does, and the ledger books that time as training."""

from __future__ import annotations

from dataclasses import replace

import pytest
from simscenario import two_cell_scenario_text

from bagel.protocol.messages import Instruction, LocalState, Member, Order, PeerAddress, RoundPlan
from bagel.sim.discrete import policies
from bagel.sim.discrete.engine import Engine
from bagel.sim.discrete.report import markdown, run_meta, summarize
from bagel.sim.discrete.scenario import Scenario, parse_sim_scenario
from bagel.sim.discrete.workers import IDLE, READY, REDUCE, TRAIN, WAITV, W

# Two cells of eight equal RTX 4090s on 20 Mbit/s home links that stay online: an int4
# exchange of a 675M-parameter expert takes about as long as a round's training (~5 min).
_SMALL = two_cell_scenario_text("overlap-small", seed=3, home_mbit=20.0, diloco='overlap = "delayed"\n')

# The same run with churn, mixed GPUs and a late crowd: plans change between rounds, members
# leave mid-exchange, so steps trained ahead are carried, mismatched and lost to departures.
_CHURN = (
    _SMALL.replace("workers = 16", "workers = 40")
    .replace("gpu_mix = { rtx4090 = 1.0 }", "gpu_mix = { rtx3090 = 0.5, rtx4090 = 0.3, a100-80gb = 0.2 }")
    .replace("throughput_jitter = 0.0", "throughput_jitter = 0.15")
    .replace("session_weibull_scale_h = 10000.0", "session_weibull_scale_h = 1.0")
    .replace("initial_online_fraction = 1.0", "initial_online_fraction = 0.6\noffline_mean_h = 0.3")
)


def _scenario(text: str = _SMALL, overlap: str = "delayed") -> Scenario:
    sc = parse_sim_scenario(text)
    return replace(sc, run_spec_toml=sc.run_spec_toml.replace('overlap = "delayed"', f'overlap = "{overlap}"'))


def _run(sc: Scenario, policy: str = "bagel"):
    return Engine(sc, policies.get(policy)).run()


def _identity(res) -> None:
    L = res.ledger
    assert all(v >= 0 for v in L.buckets.values())
    assert sum(L.buckets.values()) == pytest.approx(L.offered, rel=1e-9)
    assert L.offered > 0


# ---------------------------------------------------------------- whole runs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("text", [_SMALL, _CHURN], ids=["steady", "churn"])
def test_every_offered_flop_lands_in_exactly_one_bucket_with_overlap(text):
    res = _run(_scenario(text))
    assert res.overlap == "delayed"
    _identity(res)
    L = res.ledger
    assert L.ahead_kept > 0 and 0 < L.ahead_carried <= L.ahead_trained
    dropped = sum(fl for _n, fl in L.ahead_dropped.values())
    # every FLOP trained ahead was carried, thrown away, or (a step begun) wasted on carrying
    assert L.ahead_carried + dropped <= L.ahead_trained * (1 + 1e-9)
    if text is _CHURN:
        assert "departed" in L.ahead_dropped
        assert not {"members changed", "member index changed"} & set(L.ahead_dropped)
        assert L.buckets["preempted"] > 0


@pytest.mark.timeout(60)
def test_overlap_raises_the_committed_share_when_the_exchange_is_long():
    on, off = _run(_scenario()), _run(_scenario(overlap="off"))
    assert off.overlap == "off" and off.ledger.ahead_rounds == 0
    g_on = on.ledger.buckets["committed"] / on.ledger.offered
    g_off = off.ledger.buckets["committed"] / off.ledger.offered
    assert g_on > g_off + 0.2
    assert on.ledger.committed_rounds > off.ledger.committed_rounds
    # the exchange takes as long either way: the GPU, not the link, stops waiting for it
    comm_off = off.ledger.buckets["comm"] / off.ledger.offered
    assert comm_off > 0.3
    assert on.ledger.buckets["comm"] / on.ledger.offered < 0.05 * comm_off
    # the utilisation curve counts the GPUs training ahead (their TRAIN jobs are short)
    assert on.util_timeline[1:].mean() > off.util_timeline[1:].mean() + 0.2


@pytest.mark.timeout(60)
def test_the_baselines_never_train_ahead():
    sc = _scenario()
    for name in ("diloco_wait_all", "sync_dp"):
        res = _run(sc, name)
        assert res.overlap == "off" and res.ledger.ahead_rounds == 0 and res.ledger.ahead_trained == 0
        _identity(res)


@pytest.mark.timeout(60)
def test_the_report_names_the_overlap_and_what_was_trained_ahead():
    sc = _scenario()
    results = [_run(sc), _run(sc, "diloco_wait_all")]
    s = summarize(results, target_samples=0)
    bagel, wait_all = s["policies"]["bagel"], s["policies"]["diloco_wait_all"]
    assert bagel["overlap"] == "delayed" and wait_all["overlap"] == "off"
    a = bagel["ahead"]
    assert 0 < a["carried"] <= a["trained"] <= bagel["utilization"]
    assert 0 < a["carried_rounds"] <= a["rounds"]
    assert wait_all["ahead"]["rounds"] == 0
    md = markdown(s, run_meta(results, scenario="overlap-small", seed=3, lease_mode="declared"))
    assert "overlap of the exchange with compute: bagel delayed, diloco_wait_all off" in md
    assert "- bagel: " in md and "- diloco_wait_all: " not in md


# ---------------------------------------------------------------- one worker, step by step

CELL = "k0.r0"
IDS = tuple(f"w{i:05d}" for i in range(8))  # the first eight workers: w00000 is member 0
H = 500


def _plan(ids: tuple[str, ...], micro: int = 32, accum: int = 3) -> RoundPlan:
    return RoundPlan(H, micro, accum, 0, tuple(Member(x, PeerAddress(peer_id=x), micro * accum * H) for x in ids))


def _train(rnd: int, committed_hash: str, plan: RoundPlan) -> Instruction:
    return Instruction(Order.TRAIN, CELL, rnd, rnd - 1, committed_hash, plan, round_attempt=1)


class _Bench:
    """An engine that is not run: one worker is driven through a round by hand, with the
    reconciler's real decisions (`_react`) and the engine's real accounting."""

    def __init__(self) -> None:
        self.eng = Engine(_scenario(), policies.get("bagel"))
        self.w: W = self.eng.ws[0]
        w = self.w
        w.online = True
        w.act = IDLE
        w.since = 0
        w.local = LocalState(CELL, 0, "")
        self.own = 0.0
        self.start_ms = 0

    def after(self, rounds: float) -> None:
        """The clock `rounds` rounds' training time after the exchange started."""
        self.eng.now = self.start_ms + round(rounds * self.own * 1000)

    def trained_round_one_and_exchanges(self) -> None:
        """Train round 1 as member 0 of IDS, then start its exchange."""
        eng, w = self.eng, self.w
        plan = _plan(IDS)
        eng._react(w, _train(1, "", plan))
        assert w.act == TRAIN and w.h0 == 0
        self.own = w.own_s
        self.start_ms = eng.now = round(w.own_s * 1000)
        eng._set_act(w, READY)  # (TRAIN_DONE would heartbeat the core, which never met this worker)
        reduce = Instruction(
            Order.REDUCE, CELL, 1, 0, "", plan, contributors=plan.members, reduce_attempt=1, round_attempt=1
        )
        eng._react(w, reduce)
        assert w.act == REDUCE and w.ahead_key == (CELL, 1, 1)

    def reported(self, rounds: float, h: str = "h1") -> None:
        """The exchange ended `rounds` after it started: the outcome awaits the commit."""
        w = self.w
        self.after(rounds)
        w.prev_local, w.local, w.pending = w.local, LocalState(CELL, 1, h), h
        self.eng._set_act(w, WAITV)

    def trained_ahead(self, rounds: float) -> float:
        return self.w.flops * self.own * rounds


def test_steps_trained_ahead_are_carried_when_the_plan_repeats_and_are_training_not_comm():
    b = _Bench()
    eng, w, L = b.eng, b.w, b.eng.ledger
    b.trained_round_one_and_exchanges()
    b.after(0.305)
    view = eng._view(w)
    assert view.ahead is not None and view.ahead.steps == int(0.305 * H)
    assert (view.ahead.cell_id, view.ahead.base_round, view.ahead.member_index, view.ahead.members) == (CELL, 1, 0, 8)
    b.reported(0.405)
    b.after(0.555)
    eng._react(w, _train(2, "h1", _plan(IDS)))  # commits round 1 (our hash), opens round 2 alike
    assert w.act == TRAIN and w.local == LocalState(CELL, 1, "h1")
    k = int(0.555 * H)
    assert w.h0 == k and w.ahead_key is None
    assert w.dur_s == pytest.approx(b.own * (H - k) / H)
    # the exchange, the wait for the verdict and the idle wait were all training ahead:
    # none of it is comm, barrier or idle; the carried steps are round 2's training
    assert L.buckets["comm"] == 0.0 and L.buckets["barrier"] == 0.0 and L.buckets["idle"] == 0.0
    carried = w.flops * b.own * k / H
    assert L.pending[(CELL, 2, 1)][w.i][0] == pytest.approx(carried)
    assert L.ahead_carried == pytest.approx(carried) and L.ahead_kept == 1 == L.ahead_rounds
    # what was trained past the last whole step is wasted
    assert L.buckets["aborted"] == pytest.approx(b.trained_ahead(0.555) - carried, rel=1e-3)
    assert L.offered == pytest.approx(b.trained_ahead(1.555), rel=1e-4)


def test_ahead_training_stops_at_the_guessed_rounds_length_then_the_wait_is_comm_again():
    b = _Bench()
    eng, w, L = b.eng, b.w, b.eng.ledger
    b.trained_round_one_and_exchanges()
    b.after(1.5)  # an exchange 1.5 rounds' training long
    eng._set_act(w, REDUCE)  # book so far
    assert w.ahead_room == 0.0 and w.ahead_fl == pytest.approx(b.trained_ahead(1.0))
    assert L.buckets["comm"] == pytest.approx(b.trained_ahead(0.5), rel=1e-4)
    assert eng._view(w).ahead.steps == H
    b.reported(1.5)
    b.after(2.0)
    eng._react(w, _train(2, "h1", _plan(IDS)))
    # the whole round was trained ahead: it is READY as soon as its (empty) job ends
    assert w.h0 == H and w.dur_s == 0.0
    assert L.pending[(CELL, 2, 1)][w.i][0] == pytest.approx(b.trained_ahead(1.0))
    assert L.buckets["barrier"] == pytest.approx(b.trained_ahead(0.5), rel=1e-4)  # the verdict's wait
    assert L.buckets["aborted"] == pytest.approx(0.0, abs=1e-9 * L.offered)
    held = sum(sum(e[0] for e in per.values()) for per in L.pending.values())
    assert sum(L.buckets.values()) + held == pytest.approx(L.offered)


@pytest.mark.parametrize(
    "ids",
    [
        ("a0000",) + IDS,  # a newcomer sorts first: index and group size change
        ("a0000",) + IDS[:1] + IDS[2:],  # as many members, but it is member 1
    ],
)
def test_steps_trained_ahead_are_carried_when_the_data_shard_moved(ids):
    """The group changed (a member joined or left), so the plan gives another data shard:
    the steps trained ahead still count, as the real worker carries them (the rest of the
    round trains on the new shard); nothing is thrown away."""
    b = _Bench()
    eng, w, L = b.eng, b.w, b.eng.ledger
    b.trained_round_one_and_exchanges()
    b.reported(0.405)
    b.after(0.505)
    eng._react(w, _train(2, "h1", _plan(ids, 32, 3)))
    k = int(0.505 * H)
    assert w.act == TRAIN and w.h0 == k and w.ahead_key is None
    assert w.dur_s == pytest.approx((H - k) * 32 * 3 / eng.rate(w, CELL))
    assert not L.ahead_dropped and L.ahead_carried > 0
    assert L.buckets["comm"] == 0.0 and L.buckets["barrier"] == 0.0


@pytest.mark.parametrize("accum", [2, 4])
def test_steps_trained_ahead_are_carried_across_a_batch_shape_change(accum):
    """The coordinator's throughput estimates moved the batch shape: the same data shard,
    so the steps count (in the shape they were trained with); the rest of the round takes
    the new shape, and the samples claimed stay within the new budget."""
    b = _Bench()
    eng, w, L = b.eng, b.w, b.eng.ledger
    b.trained_round_one_and_exchanges()
    b.reported(0.405)
    b.after(0.505)
    eng._react(w, _train(2, "h1", _plan(IDS, 32, accum)))
    k = int(0.505 * H)
    assert w.h0 == k and w.ahead_key is None
    assert w.dur_s == pytest.approx((H - k) * 32 * accum / eng.rate(w, CELL))
    assert w.samples == min(H * 32 * accum, k * 32 * 3 + (H - k) * 32 * accum)
    assert L.pending[(CELL, 2, 1)][w.i][0] == pytest.approx(w.flops * b.own * k / H)
    assert L.ahead_dropped == {}


def test_steps_trained_ahead_are_lost_with_the_worker_and_with_its_round():
    # the worker departs mid-exchange: preempted
    b = _Bench()
    b.trained_round_one_and_exchanges()
    b.after(0.205)
    b.eng._depart(b.w, graceful=False, comes_back=False)
    L = b.eng.ledger
    assert L.buckets["preempted"] == pytest.approx(b.trained_ahead(0.205), rel=1e-4)
    assert L.buckets["comm"] == 0.0
    assert list(L.ahead_dropped) == ["departed"] and b.w.ahead_key is None
    # its round commits with another hash: that base is not held, the steps are aborted
    b = _Bench()
    b.trained_round_one_and_exchanges()
    b.reported(0.405, h="ours")
    b.after(0.505)
    b.eng._react(b.w, _train(2, "theirs", _plan(IDS)))
    L = b.eng.ledger
    assert b.w.act == IDLE and b.w.ahead_key is None
    assert list(L.ahead_dropped) == ["work dropped"]
    assert L.buckets["aborted"] == pytest.approx(b.trained_ahead(0.505), rel=1e-4)
