"""`bagel-sim chaos` on the network test bed (sim/chaos/bed.py): bed scenarios parse and
refuse what the bed cannot do; on a machine that allows network namespaces, link faults
overlap, read back from the kernel and are undone (at their end and at teardown), and
`sim/scenarios/chaos-netlab.toml` runs end to end with real processes: a coordinator on
the public segment, workers behind two NATs and on the public segment, a home partitioned,
a link capped, a link made lossy, every invariant holding, and the bed gone afterwards;
a Ctrl-C while the coordinator starts inside the bed stops it and removes the bed.

Every bed here has a tag of its own (lfu, lf, lfi), so the tests may run in parallel.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bagel.sim.chaos.bed import ChaosBed
from bagel.sim.chaos.command import main as chaos_main
from bagel.sim.chaos.scenario import BedPlan, ChaosScenarioError, load_chaos_scenario, parse_chaos_scenario
from bagel.sim.chaos.supervisor import listening_ports, pid_alive
from bagel.sim.faults import Fault, FaultError, FaultKind, parse_faults
from bagel.sim.netlab.bed import NetLab, NetLabError, bed_namespaces

from test_chaos_short import EXPECTED
from test_chaos_units import SPEC
from test_netlab import needs_bed, start_sink

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "sim" / "scenarios" / "chaos-netlab.toml"


def bed_scenario(faults: str = "", bed: str = "", chaos: str = "bed = true\nproxy = false", count: int = 3) -> str:
    return (
        f"[chaos]\nrun_spec = '''{SPEC}'''\n{chaos}\n[workers]\ncount = {count}\n"
        f"{textwrap.dedent(bed)}\n{textwrap.dedent(faults)}"
    )


# ---------------------------------------------------------------------------- scenarios (no root)


def test_the_shipped_bed_scenario_places_workers_and_names_its_links() -> None:
    sc = load_chaos_scenario(SCENARIO)
    assert sc.bed is not None and not sc.proxy
    assert [sc.bed.node_of(i) for i in range(sc.workers)] == ["home1-1", "home1-2", "pub1"]
    assert [(f.kind, f.link) for f in sc.faults] == [
        (FaultKind.PARTITION, "home1"),
        (FaultKind.BANDWIDTH, "home1"),
        (FaultKind.LOSS, "pub1"),
    ]
    assert all(f.duration_s > 0 for f in sc.faults)
    # two workers behind one home get a host each, numbered in worker order
    plan = BedPlan("x", ("home2", "public", "home2"))
    assert (plan.homes, plan.per_home, plan.public) == (2, 2, 1)
    assert [plan.node_of(i) for i in range(3)] == ["home2-1", "pub1", "home2-2"]
    assert {n.name for n in plan.topology().links()} >= {"home1", "home2", "home2-2", "pub1", "coord"}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (bed_scenario(chaos="bed = true"), "chaos.proxy: must be false"),
        (bed_scenario(chaos="", bed='[bed]\ntag = "x"'), r"\[bed\]: needs chaos.bed = true"),
        (bed_scenario(bed='[bed]\nplacement = ["home1", "public"]'), "2 entries for workers.count = 3"),
        (bed_scenario(bed='[bed]\nplacement = ["home1", "attic", "public"]'), r"bed.placement\[1\]"),
        (bed_scenario(bed='[bed]\ntag = "Bad-Tag"'), "bed.tag"),
        (bed_scenario('[[faults]]\nkind = "partition"\nat_s = 1\nduration_s = 5\nlink = "home3"'), "not a link"),
        (bed_scenario('[[faults]]\nkind = "latency"\nat_s = 1\nlatency_ms = 40'), "needs the fault proxy"),
        (bed_scenario('[[faults]]\nkind = "hang"\nat_s = 1\nduration_s = 2'), "needs the fault proxy"),
        (
            bed_scenario('[[faults]]\nkind = "partition"\nat_s = 1\nduration_s = 5\nlink = "home1"\ndirection = "up"'),
            "a partition cuts both directions",
        ),
        (
            bed_scenario('[[faults]]\nkind = "bandwidth"\nat_s = 1\nbandwidth_bytes_per_s = 100\nlink = "pub1"'),
            "between 1250 and",
        ),
        (
            bed_scenario('[[faults]]\nkind = "loss"\nat_s = 1\nloss_pct = 5\nlink = "pub1"\ndirection = "sideways"'),
            "direction",
        ),
        (bed_scenario('[[faults]]\nkind = "loss"\nat_s = 1\nloss_pct = 101\nlink = "pub1"'), r"loss_pct: must be in"),
        (bed_scenario('[[faults]]\nkind = "loss"\nat_s = 1\nlink = "pub1"'), "loss_pct: required"),
        (
            bed_scenario('[[faults]]\nkind = "kill"\nat_s = 1\nworkers = [0]\ndirection = "up"'),
            "link and direction belong",
        ),
        (
            bed_scenario('[[faults]]\nkind = "partition"\nat_s = 1\nduration_s = 5\nlink = "home1"\ncount = 1'),
            "hits whoever is behind it",
        ),
        # off the bed: link faults are named as the bed's
        (
            bed_scenario('[[faults]]\nkind = "loss"\nat_s = 1\nloss_pct = 5\nlink = "pub1"', chaos=""),
            "need chaos.bed = true",
        ),
        (
            bed_scenario('[[faults]]\nkind = "partition"\nat_s = 1\nduration_s = 5\nlink = "home1"', chaos=""),
            "partition needs chaos.bed = true",
        ),
    ],
)
def test_bed_scenarios_refuse_with_the_key_named(text: str, match: str) -> None:
    with pytest.raises(ChaosScenarioError, match=match):
        parse_chaos_scenario(text)


def test_the_simulator_refuses_link_faults() -> None:
    with pytest.raises(FaultError, match="needs real processes"):
        parse_faults([{"kind": "loss", "at_s": 1, "loss_pct": 5, "link": "pub1"}], for_sim=True)
    with pytest.raises(FaultError, match="need the network test bed"):
        parse_faults([{"kind": "partition", "at_s": 1, "duration_s": 5, "link": "home1"}], for_sim=True)


def test_a_bed_run_is_refused_in_one_line_without_root(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import bagel.sim.netlab.bed as netlab_bed

    monkeypatch.setattr(netlab_bed.os, "geteuid", lambda: 1000)
    out = tmp_path / "o"
    assert chaos_main([str(SCENARIO), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "bagel-sim chaos: chaos.bed = true, but netlab needs root (network namespaces, nftables and tc)"
    assert not out.exists()
    for argv in (["--bed-tag", "NO"], ["--workers", "2"]):
        assert chaos_main([str(SCENARIO), "--out", str(out), *argv]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
    short = ROOT / "sim" / "scenarios" / "chaos-short.toml"
    assert chaos_main([str(short), "--out", str(out), "--bed-tag", "lf"]) == 2
    assert "does not run on the bed" in capsys.readouterr().err
    assert not out.exists()


# ---------------------------------------------------------------------------- link faults on a real bed (root)


def _fault(kind: FaultKind, link: str, **kw: float | str) -> Fault:
    return Fault(kind=kind, at_s=0.0, link=link, duration_s=5.0, **kw)  # type: ignore[arg-type]


@needs_bed
@pytest.mark.timeout(60)
def test_link_faults_overlap_read_back_and_are_undone_at_their_end_and_at_teardown() -> None:
    bed = ChaosBed(BedPlan("lfu", ("home1", "public")))
    try:
        bed.start()
        cap = _fault(FaultKind.BANDWIDTH, "home1", bandwidth_bytes_per_s=500_000.0, direction="up")
        tighter = _fault(FaultKind.BANDWIDTH, "home1", bandwidth_bytes_per_s=250_000.0)
        loss = _fault(FaultKind.LOSS, "home1", loss_pct=10.0)
        more_loss = _fault(FaultKind.LOSS, "home1", loss_pct=20.0, direction="down")
        cut = _fault(FaultKind.PARTITION, "home1")
        assert bed.apply(0, cap).applied == {
            "partitioned": False,
            "up": {"rate_mbit": 4.0, "loss_pct": 0.0},
            "down": {"rate_mbit": None, "loss_pct": 0.0},
        }
        bed.apply(1, tighter)
        bed.apply(2, loss)
        rec = bed.apply(3, more_loss)
        # the tightest cap wins; independent losses combine: 1 - 0.9 x 0.8
        assert rec.applied == {
            "partitioned": False,
            "up": {"rate_mbit": 2.0, "loss_pct": 10.0},
            "down": {"rate_mbit": 2.0, "loss_pct": 28.0},
        }
        assert bed.apply(4, cut).applied is not None and bed.lab.link_state("home1").partitioned
        # undoing one fault leaves the others in place (read back from tc and nftables)
        assert bed.undo(1) is not None
        state = bed.lab.link_state("home1")
        assert state.partitioned and state.up.rate_mbit == 4.0 and state.down.rate_mbit is None
        assert bed.undo(4) is not None and not bed.lab.link_state("home1").partitioned
        assert bed.undo(4) is None  # not active any more
        assert bed.lab.link_state("pub1").up.rate_mbit is None  # another link is never touched
    finally:
        bed.teardown()
    by = {r.index: r for r in bed.records}
    assert [by[i].undone_by for i in range(5)] == ["teardown", "end", "teardown", "teardown", "end"]
    clear = {
        "partitioned": False,
        "up": {"rate_mbit": None, "loss_pct": 0.0},
        "down": {"rate_mbit": None, "loss_pct": 0.0},
    }
    assert by[3].undone == clear and not any(r.error for r in bed.records)
    assert bed.namespaces_left == [] and bed_namespaces("bagelnl-lfu-") == []
    with pytest.raises(NetLabError, match="torn down"):
        bed.apply(5, cut)
    bed.teardown()  # idempotent


@needs_bed
@pytest.mark.timeout(60)
def test_the_leak_evidence_sees_ports_inside_the_bed() -> None:
    """A process on the bed listens in its own namespace: the supervisor's port sampling reads
    that namespace's table (this process's /proc/net/tcp does not hold the socket)."""
    with NetLab(tag="lfp", homes=0, per_home=0, public=0) as lab:
        sink = start_sink(lab, "coord", 9123)
        assert 9123 in listening_ports([sink.pid])
        assert 9123 not in listening_ports([os.getpid()])  # another namespace: not ours to see
    assert bed_namespaces("bagelnl-lfp-") == []


# ---------------------------------------------------------------------------- the scenario end to end (root)


@needs_bed
@pytest.mark.slow
@pytest.mark.timeout(420)  # ~1.5 min on a calm 2-core machine; generous for a loaded one
def test_chaos_netlab_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "chaos"
    proc = subprocess.run(
        [sys.executable, "-m", "bagel.sim.chaos", str(SCENARIO), "--out", str(out), "--bed-tag", "lf", "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert bed_namespaces("bagelnl-lf-") == []  # the bed is gone, whatever the verdicts
    summary_path = out / "summary.json"
    assert summary_path.exists(), f"no summary (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    s = json.loads(summary_path.read_text())
    detail = json.dumps({k: s.get(k) for k in ("violations", "faults", "stop_reason", "bed")}, indent=1)[:6000]

    assert set(s["invariants"]) == EXPECTED
    assert all(s["invariants"].values()), detail
    assert proc.returncode == 0, proc.stderr[-4000:]

    # each fault fired on its link and reached the worker behind it
    assert [(f["kind"], f["targets"]) for f in s["faults"]] == [
        ("partition", ["link home1 (w0, w1)"]),
        ("bandwidth", ["link home1 (w0, w1)"]),
        ("loss", ["link pub1 (w2)"]),
    ], detail
    assert all(f["fired"] and f["end_s"] > f["at_s"] and not f["error"] for f in s["faults"]), detail

    # ... and the kernel held it while it lasted, and nothing of it afterwards
    bed = s["bed"]
    assert bed["placement"] == {"w0": "home1-1", "w1": "home1-2", "w2": "pub1"}
    clear = {
        "partitioned": False,
        "up": {"rate_mbit": None, "loss_pct": 0.0},
        "down": {"rate_mbit": None, "loss_pct": 0.0},
    }
    applied = {r["kind"]: r["applied"] for r in bed["link_faults"]}
    assert applied["partition"] == {**clear, "partitioned": True}
    assert applied["bandwidth"] == {
        **clear,
        "up": {"rate_mbit": 2.0, "loss_pct": 0.0},
        "down": {"rate_mbit": 2.0, "loss_pct": 0.0},
    }
    assert applied["loss"] == {
        **clear,
        "up": {"rate_mbit": None, "loss_pct": 5.0},
        "down": {"rate_mbit": None, "loss_pct": 5.0},
    }
    assert all(r["undone"] == clear and r["undone_by"] == "end" and not r["error"] for r in bed["link_faults"]), detail
    assert bed["torn_down"] and bed["namespaces_left"] == []

    # the workers joined with the coordinator's printed join string from behind the NAT, and
    # the cut home's workers noticed: they lost the coordinator and came back
    assert len(bed["join_strings"]) == 1
    # (a heartbeat in flight at the cut can outlive it: its 10 s deadline is longer than the
    # 7 s cut, and the coordinator, its 6 s lease gone, answers NOT_FOUND; the worker then
    # re-registers without ever seeing the coordinator unreachable)
    for w in s["workers"][:2]:
        ev = w["events"]
        assert ev.get("coordinator-unreachable", 0) + ev.get("re-register", 0) >= 1, json.dumps(ev)
        if ev.get("coordinator-unreachable", 0):
            assert ev.get("coordinator-back", 0) >= 1, json.dumps(ev)  # every outage it noticed ended
        assert not w["unexpected_exits"], json.dumps(w["unexpected_exits"])
        assert '"reachability": "relayed"' in (out / "logs" / f"w{w['index']}-1.log").read_text()
    # the cell stood still while home1 was cut (its last worker may not train alone) and
    # trained on after the heal. One commit may still fall inside the cut: that of the round
    # in flight when it began, if its exchange had finished (the cut members' parts were
    # delivered, so once their leases run out the remaining report decides:
    # `Rounds.drop_member`). No later round may.
    cut = s["faults"][0]
    commits = s["loss_per_cell"]["k0.r0"]  # (seconds, round, loss)
    before = max((r for t, r, _loss in commits if t <= cut["at_s"] + 1.0), default=0)
    during = [r for t, r, _loss in commits if cut["at_s"] + 1.0 < t < cut["end_s"]]
    assert during in ([], [before + 1]), (cut, commits)
    assert any(t > cut["end_s"] for t, _round, _loss in commits), (cut, commits)
    assert "## Network test bed" in (out / "summary.md").read_text()


@needs_bed
@pytest.mark.timeout(300)
def test_ctrl_c_on_the_bed_stops_everything_and_removes_the_bed(tmp_path: Path) -> None:
    out = tmp_path / "chaos"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bagel.sim.chaos", str(SCENARIO), "--out", str(out), "--bed-tag", "lfi"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # the bed is up: the coordinator is being started inside it
            seen.append(line)
            if "bed 'lfi' up" in line:
                break
        assert any("bed 'lfi' up" in x for x in seen), "".join(seen)[-3000:]
        # interrupt once the coordinator runs in its namespace (long before it is ready)
        deadline = time.monotonic() + 60
        inside: list[str] = []
        while not inside and time.monotonic() < deadline:
            inside = subprocess.run(
                ["ip", "netns", "pids", "bagelnl-lfi-coord"], capture_output=True, text=True, timeout=20
            ).stdout.split()
            time.sleep(0.2)
        assert inside, "no process started in the coordinator's namespace"
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert all(not pid_alive(int(p)) for p in inside)
    assert proc.returncode == 130
    assert bed_namespaces("bagelnl-lfi-") == []
    s = json.loads((out / "summary.json").read_text())
    assert s["interrupted"] is True and s["bed"]["torn_down"] and s["bed"]["namespaces_left"] == []
    assert s["invariants"]["no_process_leaked"] is True
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if str(out).encode() in cmd and pid_alive(int(entry.name)) and int(entry.name) != os.getpid():
                pytest.fail(f"process {entry.name} of the interrupted run is still alive: {cmd[:200]!r}")
