"""The discrete-event engine: determinism, the daemon's own core, conservation, scenarios."""

from __future__ import annotations

import inspect
import json
from dataclasses import replace
from pathlib import Path

import pytest

import bagel.coordinator.core.policy as core_policy
import bagel.coordinator.core.rounds as core_rounds
import bagel.coordinator.core.state as core_state
from bagel.coordinator import app, daemon
from bagel.coordinator.core import scheduler
from bagel.protocol.goodput import BUCKET_DEFINITIONS, BUCKETS
from bagel.sim.cli import main
from bagel.sim.discrete import policies
from bagel.sim.discrete.engine import Engine, EngineResult
from bagel.sim.discrete.report import PLOTS, summarize
from bagel.sim.discrete.runner import run_policies
from bagel.sim.discrete.scenario import load_sim_scenario

SCENARIOS = Path(__file__).resolve().parent.parent / "sim" / "scenarios"
# 120 workers in 45 virtual minutes: about 1,700 committed rounds of small groups for bagel,
# plenty to tell two runs apart, at about 4 s a run
SMALL = {"workers": 120, "hours": 0.75}


def _het():
    return load_sim_scenario(SCENARIOS / "heterogeneity-10x.toml")


def _summary(sc, names, seed, *, jobs=1, **kw):
    res = run_policies(sc, [policies.get(n) for n in names], seed=seed, jobs=jobs, **kw)
    return summarize(res, target_samples=sc.scenario.target_samples_per_cell)


def assert_every_flop_in_one_bucket(res: EngineResult) -> None:
    """Conservation: every offered FLOP of the run lands in exactly one bucket."""
    L = res.ledger
    assert set(L.buckets) == set(BUCKETS)
    assert all(v >= 0 for v in L.buckets.values())
    assert sum(L.buckets.values()) == pytest.approx(L.offered, rel=1e-9)
    assert L.offered > 0


@pytest.mark.timeout(300)
def test_same_seed_same_summary_other_seed_differs():
    sc = _het()
    names = ["bagel", "diloco_wait_all"]
    res = run_policies(sc, [policies.get(n) for n in names], seed=11, **SMALL)
    for r in res:
        assert_every_flop_in_one_bucket(r)
    a = summarize(res, target_samples=sc.scenario.target_samples_per_cell)
    # the policies in parallel processes give exactly what one process gives
    b = _summary(sc, names, 11, jobs=2, **SMALL)
    assert a == b
    assert a["policies"]["bagel"]["committed_rounds"] > 0
    c = _summary(sc, ["bagel"], 12, **SMALL)
    assert c["policies"]["bagel"] != a["policies"]["bagel"]


def test_a_policy_that_fails_in_its_process_fails_the_run(monkeypatch):
    from bagel.sim.discrete import runner

    class Broken(Engine):
        def run(self, progress=None):
            raise ValueError("boom")

    monkeypatch.setattr(runner, "Engine", Broken)  # (fork: the child sees the patch)
    with pytest.raises(RuntimeError, match="ValueError: boom"):
        run_policies(_het(), [policies.get("bagel"), policies.get("sync_dp")], workers=20, hours=0.1, jobs=2)


def test_the_simulator_drives_the_daemons_core_and_scheduler(monkeypatch):
    sc = _het()
    eng = Engine(sc, policies.get("bagel"), workers=40, hours=0.5)
    # the one state machine the daemon's shell drives, by identity
    assert type(eng.core) is core_state.CoordinatorState
    assert app.CoordinatorState is core_state.CoordinatorState
    assert daemon.CoordinatorState is core_state.CoordinatorState
    # the scheduler objects the core calls are the scheduler module's own
    assert isinstance(eng.core.balance, scheduler.Balance)
    assert core_rounds.plan_round is scheduler.plan_round
    # bagel runs with the daemon's default policy object itself
    assert eng.core.policy is core_policy.BAGEL
    default = inspect.signature(core_state.CoordinatorState.__init__).parameters["policy"].default
    assert default is core_policy.BAGEL
    assert policies.get("diloco_wait_all").core is core_policy.DILOCO_WAIT_ALL
    # and it really plans its rounds through scheduler.plan_round (as the core references it)
    calls = []
    real = core_rounds.plan_round

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(core_rounds, "plan_round", counting)
    res = Engine(sc, policies.get("bagel"), workers=40, hours=0.5).run()
    assert calls and res.core_calls > len(calls)


@pytest.mark.timeout(300)
def test_every_offered_flop_lands_in_exactly_one_bucket():
    """sync_dp here; bagel and diloco_wait_all on every run of the other tests of this module
    (`assert_every_flop_in_one_bucket`), which would otherwise run them again."""
    assert_every_flop_in_one_bucket(Engine(_het(), policies.get("sync_dp"), **SMALL).run())


@pytest.mark.timeout(300)
def test_heartbeat_lease_mode_drives_the_core_lease_timer():
    """Faithful lease mode: workers renew leases with heartbeats, the core's Tick expires
    the dead ones. It must make progress like the declared mode does."""
    sc = _het()
    hb = replace(sc, engine=replace(sc.engine, lease_mode="heartbeat"))
    res = Engine(hb, policies.get("bagel"), **SMALL).run()
    assert_every_flop_in_one_bucket(res)
    assert res.ledger.committed_rounds > 0
    # nobody alive was expired by mistake: refused heartbeats of unknown workers are rare
    assert res.ledger.core_errors.get("UnknownWorker", 0) <= 2


@pytest.mark.timeout(120)
def test_spot_storm_kills_the_stated_fraction():
    sc = load_sim_scenario(SCENARIOS / "spot-storm.toml")
    storm = replace(sc, faults=(replace(sc.faults[0], at_s=1800.0),))
    res = Engine(storm, policies.get("bagel"), workers=150, hours=1.0).run()
    assert_every_flop_in_one_bucket(res)
    ((t, kind, hit),) = res.ledger.faults
    assert kind == "kill" and t == 1800.0
    online = res.online_timeline
    assert hit == pytest.approx(0.3 * online[len(online) // 2], rel=0.2)
    assert online[-1] < online[len(online) // 2]


@pytest.mark.timeout(120)
def test_byzantine_workers_are_rejected_and_waste_is_counted():
    sc = load_sim_scenario(SCENARIOS / "byzantine-10pct.toml")
    res = Engine(sc, policies.get("bagel"), workers=150, hours=1.5).run()
    assert_every_flop_in_one_bucket(res)
    assert res.ledger.buckets["rejected"] > 0
    assert res.ledger.committed_rounds > 0


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["steady", "churn", "spot-storm", "heterogeneity-10x", "byzantine-10pct", "partition"])
def test_each_scenario_runs_small_and_writes_the_report(name, tmp_path):
    # half an hour: every scenario's faults come hours later (the fault tests above move
    # them earlier), so a longer smoke run adds only more of the same rounds
    out = tmp_path / name
    argv = ["run", str(SCENARIOS / f"{name}.toml"), "--out", str(out), "--workers", "100", "--hours", "0.5"]
    assert main([*argv, "--no-progress"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert set(s) == {"policies", "wall_s", "workers", "virtual_hours"}
    assert json.loads((out / "run.json").read_text())["scenario"] == name
    assert s["workers"] == 100 and s["virtual_hours"] == 0.5
    assert set(s["policies"]) == {"sync_dp", "diloco_wait_all", "bagel"}
    for p in s["policies"].values():
        assert {"goodput", "utilization", "committed_rounds"} <= set(p)
        assert 0.0 <= p["goodput"] <= p["utilization"] <= 1.0 + 1e-9
    for png in ("committed_compute_per_cell.png", "committed_compute.png", "wasted_work.png", "utilization.png"):
        assert (out / png).stat().st_size > 1000
    md = (out / "summary.md").read_text()
    assert "| bagel |" in md
    for png in PLOTS:  # summary.md links every plot and defines every bucket
        assert f"]({png})" in md and (out / png).exists()
    for bucket in BUCKETS:
        assert f"| {bucket} | {BUCKET_DEFINITIONS[bucket]} |" in md


def test_cli_rejects_bad_input(tmp_path, capsys):
    sc = str(SCENARIOS / "steady.toml")
    assert main(["run", sc, "--out", str(tmp_path), "--policies", "bagel,nope"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err
    assert main(["run", str(tmp_path / "missing.toml"), "--out", str(tmp_path)]) == 2
    assert main(["run", sc, "--out", str(tmp_path), "--workers", "0"]) == 2


@pytest.mark.timeout(120)
def test_partitioned_workers_lose_their_lease_and_reattach_after_the_heal():
    sc = load_sim_scenario(SCENARIOS / "partition.toml")
    cut = replace(sc, faults=(replace(sc.faults[0], at_s=900.0, duration_s=900.0, fraction=0.5),))
    res = Engine(cut, policies.get("bagel"), workers=150, hours=1.0).run()
    assert_every_flop_in_one_bucket(res)
    ((_, kind, hit),) = res.ledger.faults
    assert kind == "partition" and hit > 20
    # the coordinator expired them (60 s lease), so after the heal they are unknown and
    # re-register; and cells keep committing after the heal
    assert res.ledger.core_errors.get("UnknownWorker", 0) >= hit // 2
    assert any(ts > 1800.0 for ts, _c, _s in res.ledger.commits)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["heterogeneity-10x", "churn"])
def test_a_repeated_ready_answered_by_a_query_changes_nothing(name, monkeypatch):
    """A member polled after its round froze repeats its READY; the engine answers it with a
    core query instead of a heartbeat (`Engine._repeat_ready`). The run is the same as with
    every such poll sent as a heartbeat, to the last FLOP and commit, with that many fewer
    core calls."""
    sc = load_sim_scenario(SCENARIOS / f"{name}.toml")
    fast = Engine(sc, policies.get("bagel"), workers=240, hours=0.75)
    a = fast.run()
    slow = Engine(sc, policies.get("bagel"), workers=240, hours=0.75)
    monkeypatch.setattr(slow, "_repeat_ready", lambda w, key: None)
    b = slow.run()
    assert fast.core_queries > 100 and slow.core_queries == 0
    assert_every_flop_in_one_bucket(a)
    assert b.core_calls - a.core_calls == fast.core_queries
    assert a.ledger.buckets == b.ledger.buckets and a.ledger.offered == b.ledger.offered
    assert a.ledger.commits == b.ledger.commits and a.ledger.committed_rounds > 0
    assert a.ledger.aborts == b.ledger.aborts and a.events == b.events


@pytest.mark.timeout(300)
def test_home_cards_without_the_ram_for_an_experts_host_share_train_only_the_router(monkeypatch):
    """`home-ram-32`: a DiT-XL/2 expert keeps 37.7 GiB on the host, more than 80% of the 32
    GiB every home machine declares, so the daemon's core gives the home cards only the
    router (or nothing), and the datacenter cards the experts. With 64 GiB declared the run
    is heterogeneity-10x's to the last figure: the host is checked, and passes."""
    from bagel.coordinator.core.roster import Roster

    sc = load_sim_scenario(SCENARIOS / "home-ram-32.toml")
    gib = 1 << 30
    given: list[tuple[int, str]] = []
    real = Roster.assign

    def assign(self, w, cid, now, **kw):
        given.append((w.budget.host_bytes, cid))
        return real(self, w, cid, now, **kw)

    monkeypatch.setattr(Roster, "assign", assign)
    res = Engine(sc, policies.get("bagel"), **SMALL).run()
    assert_every_flop_in_one_bucket(res)
    home = {c for host, c in given if host == 32 * gib}
    datacenter = {c for host, c in given if host == 512 * gib}
    assert home == {"router"}
    assert len(datacenter - {"router"}) > 10
    assert {host for host, _ in given} == {32 * gib, 512 * gib}  # every worker declared its RAM
    monkeypatch.setattr(Roster, "assign", real)
    roomy = replace(
        sc, population=replace(sc.population, host_ram_gb_home=(("64", 1.0),), host_ram_gb_datacenter=(("64", 1.0),))
    )
    a = summarize([Engine(roomy, policies.get("bagel"), seed=5, **SMALL).run()], target_samples=1e8)
    b = summarize([Engine(_het(), policies.get("bagel"), seed=5, **SMALL).run()], target_samples=1e8)
    assert a["policies"] == b["policies"] and a["policies"]["bagel"]["committed_rounds"] > 0
