"""The simulator's catch-up by committed updates (`[sync] catch_up_rounds`): a synthetic
worker holding its cell's committed state a round or two behind fetches only the missing
rounds' updates from a donor that holds them, as the real worker's `Orders._sync` does, and
downloads the whole state otherwise (another cell, too far behind, or no donor holding
them)."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import pytest
from simscenario import two_cell_scenario_text

from bagel.protocol.messages import Donor, DonorRate, Instruction, LocalState, Order, PeerAddress
from bagel.sim.discrete import costmodel as cm
from bagel.sim.discrete import policies
from bagel.sim.discrete.engine import WATCHING_ACTS, Engine
from bagel.sim.discrete.report import markdown, run_meta, summarize
from bagel.sim.discrete.scenario import Scenario, parse_sim_scenario
from bagel.sim.discrete.workers import IDLE, SYNC, W

# Two cells of equal RTX 4090s on 100 Mbit/s links that stay online: one int4 update of a
# 675M-parameter expert (~350 MB) takes ~28 s, the whole state (5.4 GB) ~7 minutes.
_SMALL = two_cell_scenario_text(
    "catch-up-small", seed=5, home_mbit=100.0, extra="\n[run_spec.sync]\ncatch_up_rounds = 2\n"
)

# The same with churn: workers leave and come back a round or two behind, and catch up.
_CHURN = (
    _SMALL.replace("workers = 16", "workers = 40")
    .replace("session_weibull_scale_h = 10000.0", "session_weibull_scale_h = 0.5")
    .replace("initial_online_fraction = 1.0", "initial_online_fraction = 0.6\noffline_mean_h = 0.1")
    .replace('name = "catch-up-small"', 'name = "catch-up-churn"')
    .replace("hours = 2.0", "hours = 3.0")
)

CELL = "k0.r0"


def _scenario(text: str = _SMALL, rounds: int = 2) -> Scenario:
    sc = parse_sim_scenario(text)
    return replace(sc, run_spec_toml=sc.run_spec_toml.replace("catch_up_rounds = 2", f"catch_up_rounds = {rounds}"))


class _Bench:
    """An engine that is not run: a joiner and a donor set up by hand, the joiner driven
    through a SYNC with the reconciler's real decisions (`_react`)."""

    def __init__(self, sc: Scenario | None = None, policy: str = "bagel") -> None:
        self.eng = Engine(sc or _scenario(), policies.get(policy))
        self.w, self.d = self.eng.ws[0], self.eng.ws[1]
        for x in (self.w, self.d):
            x.online = True
            x.act = IDLE
            x.since = 0
        self.eng.commit_hashes[CELL] = {r: f"h{r}" for r in range(1, 6)}

    def donor_holds(self, first: int, last: int, cell: str = CELL) -> None:
        self.d.local = LocalState(cell, last, f"h{last}")
        self.d.upd = (cell, first, last)

    def sync(self, held: LocalState, rnd: int) -> float:
        """The joiner holding `held` is told to sync to (CELL, rnd): the job's seconds."""
        eng, w = self.eng, self.w
        w.local = held
        ins = Instruction(
            Order.SYNC,
            CELL,
            rnd + 1,
            rnd,
            f"h{rnd}",
            donor=Donor(self.d.wid, PeerAddress(peer_id=self.d.wid)),
            donors=(Donor(self.d.wid, PeerAddress(peer_id=self.d.wid)),),
        )
        eng._react(w, ins)
        assert w.act == SYNC and w.sync_target == (CELL, rnd, f"h{rnd}")
        return (w.job_due - eng.now) / 1000.0

    def update_s(self, rounds: int) -> float:
        w = self.w
        return cm.download_s(rounds * self.eng.payload[CELL], w.bw, self.d.bw, w.lat)

    def download_s(self) -> float:
        w = self.w
        return cm.multi_donor_download_s(cm.cell_state_bytes(self.eng.work, CELL), w.bw, [self.d.bw], w.lat)


def test_one_update_is_a_small_fraction_of_a_download():
    b = _Bench()
    assert b.eng.payload[CELL] < 0.1 * cm.cell_state_bytes(b.eng.work, CELL)
    assert b.update_s(2) < 0.15 * b.download_s()


@pytest.mark.parametrize("behind", [1, 2])
def test_a_worker_a_round_or_two_behind_fetches_only_the_missing_updates(behind):
    b = _Bench()
    b.donor_holds(3, 4)
    recv = b.w.recv
    took = b.sync(LocalState(CELL, 4 - behind, f"h{4 - behind}"), 4)
    assert took == pytest.approx(b.update_s(behind), abs=2e-3)
    assert b.w.recv - recv == behind * b.eng.payload[CELL]
    # it reports what it measured of the donor, as after a download
    assert b.w.sync_rates == (DonorRate(b.d.wid, behind * b.eng.payload[CELL], int(b.update_s(behind) * 1000)),)
    L = b.eng.ledger
    assert L.catch_up["tried"] == L.catch_up["caught up"] == 1 and L.catch_up["rounds"] == behind


def test_sync_done_after_a_catch_up_serves_the_updates_it_applied_and_a_download_none():
    b = _Bench()
    b.eng._heartbeat = lambda w: None  # type: ignore[method-assign]  (the core never met these workers)
    b.donor_holds(3, 4)
    b.sync(LocalState(CELL, 2, "h2"), 4)
    b.eng.now = b.w.job_due
    b.eng._on_sync_done(b.w, b.w.job)
    assert b.w.local == LocalState(CELL, 4, "h4") and b.w.upd == (CELL, 3, 4) and b.w.act == IDLE
    # a download: the state server serves no updates
    b = _Bench()
    b.eng._heartbeat = lambda w: None  # type: ignore[method-assign]
    b.donor_holds(3, 4)
    b.w.upd = (CELL, 1, 1)
    b.sync(LocalState("k1.r0", 1, "x"), 4)
    b.eng.now = b.w.job_due
    b.eng._on_sync_done(b.w, b.w.job)
    assert b.w.local == LocalState(CELL, 4, "h4") and b.w.upd is None


@pytest.mark.parametrize(
    "held",
    [
        LocalState(),  # holds nothing: a first download
        LocalState("k1.r0", 3, "h3"),  # another cell's state
        LocalState(CELL, 1, "h1"),  # three rounds behind, more than catch_up_rounds
    ],
    ids=["nothing", "other-cell", "too-far"],
)
def test_any_other_worker_downloads_the_whole_state(held):
    b = _Bench()
    b.donor_holds(3, 4)
    took = b.sync(held, 4)
    assert took == pytest.approx(b.download_s(), abs=2e-3)
    assert b.eng.ledger.catch_up["tried"] == 0


def test_a_state_that_is_not_the_committed_one_is_refused_then_downloaded():
    b = _Bench()
    b.donor_holds(3, 4)
    took = b.sync(LocalState(CELL, 3, "not-committed"), 4)  # the update of round 4 applies to h3
    assert took == pytest.approx(b.download_s() + 2 * b.w.lat, abs=2e-3)
    assert b.eng.ledger.catch_up["no donor held them"] == 1


def test_a_donor_that_does_not_hold_every_update_refuses_then_the_state_is_downloaded():
    b = _Bench()
    b.donor_holds(4, 4)  # it downloaded round 3 and committed 4: it has no update of round 3
    took = b.sync(LocalState(CELL, 2, "h2"), 4)
    assert took == pytest.approx(b.download_s() + 2 * b.w.lat, abs=2e-3)
    L = b.eng.ledger
    assert L.catch_up["tried"] == L.catch_up["no donor held them"] == 1 and L.catch_up["caught up"] == 0


def test_catch_up_rounds_zero_and_the_baselines_always_download():
    for sc, policy in ((_scenario(rounds=0), "bagel"), (_scenario(), "diloco_wait_all"), (_scenario(), "sync_dp")):
        b = _Bench(sc, policy)
        assert b.eng.catch_up_rounds == 0
        b.donor_holds(3, 4)
        assert b.sync(LocalState(CELL, 3, "h3"), 4) == pytest.approx(b.download_s(), abs=2e-3)


def test_adopted_rounds_are_kept_as_updates_the_last_catch_up_rounds_of_them():
    b = _Bench()
    w: W = b.w
    for r in (1, 2, 3):
        w.local = LocalState(CELL, r, f"h{r}")
        b.eng._keep_update(w)
    assert w.upd == (CELL, 2, 3)
    w.local = LocalState(CELL, 5, "h5")  # (after a gap: only the new one follows its state)
    b.eng._keep_update(w)
    assert w.upd == (CELL, 5, 5)
    b.eng._depart(w, graceful=False, comes_back=False)
    assert w.upd is None  # a restarted worker's state server holds nothing


def test_the_initial_state_catches_up_by_round_one():
    b = _Bench()
    b.donor_holds(1, 1)
    took = b.sync(LocalState(CELL, 0, ""), 1)
    assert took == pytest.approx(b.update_s(1), abs=2e-3)


# ---------------------------------------------------------------- whole runs


def _run(sc: Scenario, policy: str = "bagel"):
    return Engine(sc, policies.get(policy)).run()


class _Watch(Engine):
    """The engine, noting at every commit how many of the cell's other online workers (not
    its contributors) it had to tell of their new instruction, and how many it did: a
    worker is told when a poll is due by the time a real worker would hear it."""

    def __init__(self, *a, **k) -> None:  # noqa: ANN002, ANN003
        super().__init__(*a, **k)
        self.heard: list[tuple[int, int]] = []

    def _on_commit(self, c):  # noqa: ANN001, ANN202
        others = [
            self.by_id[x]
            for x in self.core.cell_workers(c.cell_id)
            if x in self.by_id and x not in c.contributors and self.by_id[x].online
        ]

        def told(w):  # noqa: ANN001, ANN202
            # by when a real worker hears it: its watch's latency when it waits on the
            # coordinator, else its next periodic heartbeat
            return 0 <= w.poll_at <= self.now + (w.watch_ms if w.act in WATCHING_ACTS else self.hb_ms)

        before = {w.i for w in others if told(w)}
        super()._on_commit(c)
        self.heard.append((len(others) - len(before), sum(1 for w in others if told(w) and w.i not in before)))


@functools.cache
def _churn_run() -> tuple[Any, list[tuple[int, int]]]:
    eng = _Watch(_scenario(_CHURN), policies.get("bagel"))
    return eng.run(), eng.heard


@pytest.mark.timeout(60)
def test_a_commit_reaches_the_cells_other_workers_through_their_watch():
    """A commit changes the instruction of every worker of the cell, not only its
    contributors': one that held (or was fetching) the state before it is a round behind
    now. Real workers hear that through their held watch, or at their next heartbeat while
    they train or download, so the engine must poll them too; it used to poll only members and contributors, and such
    workers sat idle until some unrelated event reached them (in heterogeneity-10x, 0.13
    of offered compute)."""
    res, heard = _churn_run()
    assert res.ledger.committed_rounds > 0
    told = [(n, k) for n, k in heard if n]
    assert told, "no commit left a worker of its cell out (the scenario should churn)"
    assert all(k == n for n, k in told), told


@pytest.mark.timeout(60)
def test_with_churn_workers_catch_up_and_spend_less_on_resync():
    on, off = _churn_run()[0], _run(_scenario(_CHURN, rounds=0))
    for res in (on, off):
        L = res.ledger
        assert sum(L.buckets.values()) == pytest.approx(L.offered, rel=1e-9)
    c = on.ledger.catch_up
    assert c["caught up"] > 0 and c["rounds"] >= c["caught up"]
    assert off.ledger.catch_up["tried"] == 0
    assert on.ledger.buckets["resync"] / on.ledger.offered < off.ledger.buckets["resync"] / off.ledger.offered
    s = summarize([on], target_samples=0)
    assert s["policies"]["bagel"]["catch_up"]["caught up"] == c["caught up"]
    md = markdown(s, run_meta([on], scenario="catch-up-churn", seed=5, lease_mode="declared"))
    assert f"- bagel: {c['caught up']} of {c['tried']} caught up" in md
