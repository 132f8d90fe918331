"""Population, cost model, faults and scenario parsing of the simulator (no core needed)."""

from __future__ import annotations

import glob
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bagel.compression import get_codec
from bagel.sim.discrete import costmodel as cm
from bagel.sim.discrete import policies
from bagel.sim.discrete.population import (
    GPU_CLASSES,
    AvailabilitySpec,
    PopulationSpec,
    diurnal_acceptance,
    draw_offline_s,
    draw_session_s,
    sample_population,
)
from bagel.sim.discrete.scenario import SimScenarioError, load_sim_scenario, parse_sim_scenario
from bagel.sim.faults import FaultError, FaultKind, parse_fault

SCENARIOS = Path(__file__).resolve().parent.parent / "sim" / "scenarios"


# ---------------------------------------------------------------- population


def test_gpu_table_has_the_required_classes_with_sources():
    for name in ("rtx3060", "rtx3090", "rtx4090", "a100-40gb", "a100-80gb", "h100-80gb"):
        g = GPU_CLASSES[name]
        assert g.tflops > 0 and g.vram_bytes > 0 and g.source
    assert GPU_CLASSES["rtx3060"].vram_bytes < GPU_CLASSES["rtx3090"].vram_bytes
    assert GPU_CLASSES["h100-80gb"].tflops > GPU_CLASSES["a100-80gb"].tflops > GPU_CLASSES["rtx3090"].tflops


def test_population_is_deterministic_and_follows_the_mix():
    spec = PopulationSpec(gpu_mix=(("rtx3090", 0.75), ("h100-80gb", 0.25)), byzantine_fraction=0.1)
    a = sample_population(spec, 4000, np.random.default_rng(7))
    b = sample_population(spec, 4000, np.random.default_rng(7))
    assert a.gpu == b.gpu and np.array_equal(a.bandwidth_bytes_per_s, b.bandwidth_bytes_per_s)
    share = a.gpu.count("h100-80gb") / len(a)
    assert 0.22 < share < 0.28
    assert 0.08 < a.byzantine.mean() < 0.12
    home = np.array([not GPU_CLASSES[g].datacenter for g in a.gpu])
    # home uplinks stay within 10..100 Mbit/s, datacenter links are faster
    assert a.bandwidth_bytes_per_s[home].min() >= 10e6 / 8 - 1e-6
    assert a.bandwidth_bytes_per_s[home].max() <= 100e6 / 8 + 1e-6
    assert a.bandwidth_bytes_per_s[~home].min() >= 1e9 / 8 - 1e-6


def test_host_ram_is_drawn_per_machine_kind_and_only_when_declared():
    mix = (("rtx3090", 0.75), ("h100-80gb", 0.25))
    plain = sample_population(PopulationSpec(gpu_mix=mix), 4000, np.random.default_rng(7))
    spec = PopulationSpec(
        gpu_mix=mix, host_ram_gb_home=(("32", 3.0), ("64", 1.0)), host_ram_gb_datacenter=(("512", 1.0),)
    )
    a = sample_population(spec, 4000, np.random.default_rng(7))
    assert plain.host_bytes is None and a.host_bytes is not None
    # drawn after everything else: the same workers as without it
    assert a.gpu == plain.gpu and np.array_equal(a.bandwidth_bytes_per_s, plain.bandwidth_bytes_per_s)
    assert np.array_equal(a.byzantine, plain.byzantine) and np.array_equal(a.spot, plain.spot)
    home = np.array([not GPU_CLASSES[g].datacenter for g in a.gpu])
    gib = 1 << 30
    assert set(a.host_bytes[~home].tolist()) == {512 * gib}
    assert set(a.host_bytes[home].tolist()) == {32 * gib, 64 * gib}
    assert 0.70 < (a.host_bytes[home] == 32 * gib).mean() < 0.80
    # one kind declared, the other not (0)
    only_home = sample_population(replace(spec, host_ram_gb_datacenter=()), 400, np.random.default_rng(7))
    dc = np.array([GPU_CLASSES[g].datacenter for g in only_home.gpu])
    assert only_home.host_bytes is not None and set(only_home.host_bytes[dc].tolist()) == {0}
    assert set(only_home.host_bytes[~dc].tolist()) == {32 * gib, 64 * gib}


def test_unknown_gpu_class_is_named():
    with pytest.raises(ValueError, match="rtx9090"):
        sample_population(PopulationSpec(gpu_mix=(("rtx9090", 1.0),)), 10, np.random.default_rng(0))


def test_availability_draws():
    rng = np.random.default_rng(0)
    av = AvailabilitySpec(session_weibull_shape=1.0, session_weibull_scale_h=4.48, spot_preemption_per_h=2.0)
    s = np.array([draw_session_s(av, False, rng)[0] for _ in range(4000)]) / 3600
    # exponential sessions with scale 4.48 h: about 20% leave within an hour
    assert 0.17 < (s < 1.0).mean() < 0.23
    pre = [draw_session_s(av, True, rng) for _ in range(2000)]
    assert np.mean([p for _, p in pre]) > 0.8  # a 2/h hazard preempts most 4.5 h sessions
    assert diurnal_acceptance(AvailabilitySpec(diurnal_amplitude=0.4, diurnal_peak_h=20), 20 * 3600) == pytest.approx(
        1.0
    )
    assert diurnal_acceptance(AvailabilitySpec(diurnal_amplitude=0.4, diurnal_peak_h=20), 8 * 3600) == pytest.approx(
        0.6
    )
    assert draw_offline_s(av, 0.0, rng) > 0


# ---------------------------------------------------------------- cost model


def test_codec_bytes_come_from_the_real_codecs():
    for codec in ("fp32", "fp16", "int8", "int4", "topk:0.01"):
        assert cm.encoded_nbytes(codec, 1_000_003) == get_codec(codec).encoded_nbytes(1_000_003)
    assert cm.encoded_nbytes("fp32", 1000) > 3 * cm.encoded_nbytes("int8", 1000)


def test_allreduce_is_bounded_by_the_slowest_link():
    S = 100_000_000
    fast = cm.allreduce_s(S, [1e9] * 8, [0.0] * 8)
    one_slow = cm.allreduce_s(S, [1e9] * 7 + [1e6], [0.0] * 8)
    assert one_slow > 100 * fast
    assert one_slow == pytest.approx(2 * S * 7 / 8 / 1e6)
    assert cm.allreduce_s(S, [1e6], [0.1]) == 0.0  # alone: nothing to exchange
    assert cm.allreduce_s(S, [1e9, 1e9], [0.05, 0.01]) == pytest.approx(S / 1e9 + 0.1)


def test_weighted_parts_follow_the_real_split_and_relieve_a_slow_uplink():
    """Equal weights are exactly the equal-part model; a slow member with a small part moves
    fewer bytes, and the exchange is the longest of each member's moved bytes over its link."""
    S = 100_000_000
    bws = [1e9] * 7 + [1e6]
    lats = [0.01] * 8
    assert cm.weighted_allreduce_s(S, [1] * 8, bws, bws, lats) == pytest.approx(cm.allreduce_s(S, bws, lats))
    assert cm.weighted_allreduce_bytes(S, [3] * 8) == [cm.allreduce_bytes_per_member(S, 8)] * 8
    light = [16] * 7 + [4]  # the slow member's part clamped to 1/4 of the others'
    parts = cm.part_nbytes(S, light)
    assert sum(parts) == pytest.approx(S) and parts[7] == pytest.approx(parts[0] / 4)
    moved = cm.weighted_allreduce_bytes(S, light)
    assert moved[7] == int(S - parts[7] + 7 * parts[7]) < moved[0]
    t = cm.weighted_allreduce_s(S, light, bws, bws, lats)
    assert t == pytest.approx(moved[7] / 1e6 + 0.02, rel=1e-6)
    assert t < 0.75 * cm.allreduce_s(S, bws, lats)
    slow_down = [1e9] * 7 + [1e5]  # a member's downlink counts too
    assert cm.weighted_allreduce_s(S, light, bws, slow_down, lats) > 9 * t


def test_simulated_reducers_measure_what_the_core_turns_back_into_the_link():
    """A simulated reducer times each payload-sending peer over a stream that shares both ends'
    links with the k - 1 others; the core's scaling (rate x (k - 1)) gives back the slower
    end. A catch-up contributor sends nothing and is not timed, nor is a reducer of nothing."""
    from bagel.sim.discrete.workers import Exchange, W

    ws = [W(i) for i in range(4)]
    for w, bw in zip(ws, (1e9, 1e9, 5e6, 1e9), strict=True):
        w.bw, w.lat = bw, 0.0
    parts = {ws[0].wid: 40e6, ws[1].wid: 40e6, ws[2].wid: 10e6, ws[3].wid: 0.0}
    senders = frozenset(w.wid for w in ws[:3])  # ws[3]: catch-up
    ex = Exchange(("c", 1, 1), tuple(w.wid for w in ws), 1, "h", {}, parts, tuple(ws), senders)
    got = {r.worker_id: r.nbytes * 1000 / r.ms * 3 for r in ex.peer_rates(ws[0])}
    assert set(got) == {ws[1].wid, ws[2].wid}
    assert got[ws[1].wid] == pytest.approx(1e9, rel=1e-3) and got[ws[2].wid] == pytest.approx(5e6, rel=1e-3)
    seen_by_slow = {r.worker_id: r.nbytes * 1000 / r.ms * 3 for r in ex.peer_rates(ws[2])}
    assert seen_by_slow[ws[0].wid] == pytest.approx(5e6, rel=1e-3)  # its own downlink bounds it
    assert len(ex.peer_rates(ws[3])) == 0


def test_compute_scales_with_throughput():
    w = cm.WorkloadSpec()
    assert cm.samples_per_s(w, 200.0, "k0.r0") == pytest.approx(2 * cm.samples_per_s(w, 100.0, "k0.r0"))
    assert cm.samples_per_s(w, 100.0, "router") > cm.samples_per_s(w, 100.0, "k0.r0")
    # a DiT-XL-class expert does not fit a 12 GB card with 20% headroom, the router does
    assert cm.cell_memory_bytes(w, "k0.r0") > 0.8 * GPU_CLASSES["rtx3060"].vram_bytes
    assert cm.cell_memory_bytes(w, "router") < 0.8 * GPU_CLASSES["rtx3060"].vram_bytes
    assert cm.download_s(1e9, 1e7, 1e6, 0.0) == pytest.approx(1000.0)
    # k donors in bandwidth-proportional shares: their summed uplinks, or the joiner's downlink
    assert cm.multi_donor_download_s(1e9, 1e8, [1e6, 3e6], 0.0) == pytest.approx(250.0)
    assert cm.multi_donor_download_s(1e9, 1e7, [1e7, 3e7], 0.0) == pytest.approx(100.0)
    assert cm.multi_donor_download_s(1e9, 1e7, [1e6], 0.0) == cm.download_s(1e9, 1e7, 1e6, 0.0)
    assert cm.multi_donor_shares([1e6, 3e6]) == [0.25, 0.75]


# ---------------------------------------------------------------- faults and scenarios


def test_fault_parsing():
    f = parse_fault({"kind": "kill", "at_h": 8, "fraction": 0.3, "within_s": 60})
    assert f.kind is FaultKind.KILL and f.at_s == 8 * 3600 and f.end_s == 8 * 3600 + 60
    with pytest.raises(FaultError, match=r"faults\[0\]\.bogus"):
        parse_fault({"kind": "kill", "at_s": 1, "fraction": 0.1, "bogus": 1})
    with pytest.raises(FaultError, match="needs fraction, count or workers"):
        parse_fault({"kind": "kill", "at_s": 1})
    with pytest.raises(FaultError, match="positive duration"):
        parse_fault({"kind": "partition", "at_s": 1, "fraction": 0.1})
    with pytest.raises(FaultError, match="not one of"):
        parse_fault({"kind": "meteor", "at_s": 1})


_INLINE = """
[scenario]
name = "inline"
workers = 50
hours = 0.5

[run_spec.run]
id = "inline-run"

[run_spec.schedule]
min_replicas = 1
max_replicas = 8

[population]
gpu_mix = { rtx4090 = 1.0 }
"""


def test_inline_run_spec_and_policy_overrides_give_real_run_specs():
    sc = parse_sim_scenario(_INLINE)
    spec = sc.run_spec()
    assert spec.run.id == "inline-run" and spec.schedule.max_replicas == 8
    fp32 = sc.run_spec(policies.get("sync_dp").spec_overrides)
    assert fp32.diloco.codec == "fp32" and fp32.spec_hash != spec.spec_hash


@pytest.mark.parametrize(
    "text, key",
    [
        (_INLINE + "\n[workload]\nmfu = 0.3\nflops = 1\n", "workload.flops"),
        (_INLINE.replace("hours = 0.5", "hours = 0.5\nhoursz = 1"), "scenario.hoursz"),
        (_INLINE + "\n[population.availability]\nsession_shape = 1.0\n", "population.availability.session_shape"),
        (_INLINE.replace("[run_spec.run]", "[run_spec.runz]"), "runz"),
        (_INLINE + "\n[bogus]\nx = 1\n", "bogus"),
        (_INLINE.replace("workers = 50", 'workers = "50"'), "scenario.workers"),
        (_INLINE + '\n[[faults]]\nkind = "hang"\nat_s = 5\nduration_s = 3\n', "faults[0].kind"),
        (_INLINE + 'host_ram_gb_home = { "lots" = 1.0 }\n', "population.host_ram_gb_home"),
        (_INLINE + 'host_ram_gb_datacenter = { "64" = 0.0 }\n', "population.host_ram_gb_datacenter"),
    ],
)
def test_scenario_errors_name_the_key(text, key):
    with pytest.raises(SimScenarioError, match=key.replace("[", r"\[").replace("]", r"\]")):
        parse_sim_scenario(text)


def test_shipped_scenarios_parse():
    names = {Path(p).name for p in glob.glob(str(SCENARIOS / "*.toml"))}
    for want in ("steady", "churn", "spot-storm", "heterogeneity-10x", "byzantine-10pct", "partition"):
        assert f"{want}.toml" in names
        sc = load_sim_scenario(SCENARIOS / f"{want}.toml")
        assert sc.scenario.name == want
        assert set(sc.scenario.policies) == {"sync_dp", "diloco_wait_all", "bagel"}
        assert len(sc.run_spec().cell_ids) == 257
    assert load_sim_scenario(SCENARIOS / "spot-storm.toml").faults[0].fraction == 0.3
    assert load_sim_scenario(SCENARIOS / "partition.toml").faults[0].kind is FaultKind.PARTITION


def test_policy_registry():
    assert set(policies.names()) >= {"sync_dp", "diloco_wait_all", "bagel"}
    with pytest.raises(ValueError, match="unknown policy"):
        policies.get("nope")
    with pytest.raises(ValueError, match="already registered"):
        policies.register(policies.BAGEL)
    k = policies.get("sync_dp").resolved(7)
    assert k.core.inner_steps == 7 and k.lockstep
    assert policies.get("bagel").resolved(7) is policies.get("bagel")


def test_sync_dp_folds_steps_only_where_steps_are_short():
    from dataclasses import replace

    from bagel.sim.discrete.engine import sync_steps_per_round

    sc = load_sim_scenario(SCENARIOS / "heterogeneity-10x.toml")
    spec = sc.run_spec()
    home = sample_population(sc.population, 10_000, np.random.default_rng(0))
    # groups of ~27 always include a 10-100 Mbit/s uplink: one fp32 all-reduce of a 675M
    # model takes about an hour, so every core round is a single synchronous step
    assert sync_steps_per_round(sc, spec, home, np.random.default_rng(1)) == 1
    dc = replace(sc.population, gpu_mix=(("a100-80gb", 1.0),))
    fast = sample_population(dc, 10_000, np.random.default_rng(0))
    k = sync_steps_per_round(sc, spec, fast, np.random.default_rng(1))
    assert k > 1  # datacenter links: many steps per five-minute round
