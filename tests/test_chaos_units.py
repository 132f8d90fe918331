"""Units of `bagel-sim chaos` that need no daemon: scenario parsing, the runner's own checks,
process supervision (groups, pids, ports), the Byzantine-effect measure, the CLI's refusals."""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import textwrap
from pathlib import Path

import pytest

from bagel.coordinator.core.records import CommitRecord
from bagel.sim.chaos import invariants as inv
from bagel.sim.chaos.command import main as chaos_main
from bagel.sim.chaos.driver import ChaosRun
from bagel.sim.chaos.evidence import FiredFault, runner_checks
from bagel.sim.chaos.invariants import InvariantResult
from bagel.sim.chaos.report import byzantine_effect, loss_by_cell, markdown
from bagel.sim.chaos.scenario import ChaosScenarioError, load_chaos_scenario, parse_chaos_scenario
from bagel.sim.chaos.supervisor import Supervisor, listening_ports, pid_alive, pids_in_groups, port_owners
from bagel.sim.faults import Fault, FaultKind

ROOT = Path(__file__).resolve().parents[1]
SPEC = """
[run]
id = "unit"
[data]
clusters = 1
[cells]
timestep_ranges = 1
router = false
"""


def scenario(extra: str = "", chaos: str = "", workers: str = "count = 3") -> str:
    return f"[chaos]\nrun_spec = '''{SPEC}'''\n{chaos}\n[workers]\n{workers}\n{textwrap.dedent(extra)}"


# ---------------------------------------------------------------------------- scenarios


def test_parse_minimal_and_faults_sorted():
    sc = parse_chaos_scenario(
        scenario("""
        [[faults]]
        kind = "coordinator-kill"
        at_s = 20
        duration_s = 2
        [[faults]]
        kind = "kill"
        at_s = 5
        workers = [2]
        """)
    )
    assert sc.workers == 3 and sc.spec.cell_ids == ("k0.r0",)
    assert [f.kind for f in sc.faults] == [FaultKind.KILL, FaultKind.COORDINATOR_KILL]
    assert sc.last_fault_end_s == 22


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (scenario(chaos="bogus = 1"), "unknown key chaos.bogus"),
        (scenario(workers="count = 3\nspeed = 2"), "unknown key workers.speed"),
        (scenario() + "\n[extra]\n", "unknown key extra"),
        ("[chaos]\nname = 'x'\n", "chaos.run_spec: required"),
        (scenario().replace('id = "unit"', 'id = "unit"\nbogus = 1'), r"chaos.run_spec: unknown key run.bogus"),
        (scenario(workers="count = 0"), "workers.count"),
        (scenario(workers="count = 3\nthrottle = 0.5"), "throttle"),
        (scenario(workers='count = 3\n[workers.byzantine]\n3 = "sign-flip"'), "workers.byzantine.3"),
        (scenario(workers='count = 3\n[workers.byzantine]\n1 = "evil"'), "not one of"),
        (
            scenario('[[faults]]\nkind = "partition"\nat_s = 1\nduration_s = 5\ncount = 1'),
            "partition needs chaos.bed = true",
        ),
        (scenario('[[faults]]\nkind = "hang"\nat_s = 1\nduration_s = 5', chaos="proxy = false"), "needs chaos.proxy"),
        (scenario('[[faults]]\nkind = "reset"\nat_s = 1\nworkers = [0]'), "proxy faults apply"),
        (scenario('[[faults]]\nkind = "kill"\nat_s = 1\nworkers = [7]'), "indices must be < workers.count"),
        (scenario('[[faults]]\nkind = "kill"\nat_s = 1'), "needs fraction, count or workers"),
        (
            scenario('[[faults]]\nkind = "stop"\nat_s = 500\nduration_s = 5\ncount = 1', chaos="max_duration_s = 100"),
            "ends before the last fault",
        ),
        ("not toml [", "not valid TOML"),
    ],
)
def test_parse_refuses_with_the_key_named(text, match):
    with pytest.raises(ChaosScenarioError, match=match):
        parse_chaos_scenario(text)


def test_shipped_scenarios_have_what_the_issue_asks():
    assert len(load_chaos_scenario(ROOT / "sim" / "scenarios" / "chaos-network.toml").faults) == 5
    short = load_chaos_scenario(ROOT / "sim" / "scenarios" / "chaos-short.toml")
    assert [f.kind for f in short.faults] == [FaultKind.KILL, FaultKind.COORDINATOR_KILL]
    default = load_chaos_scenario(ROOT / "sim" / "scenarios" / "chaos-default.toml")
    kinds = [f.kind for f in default.faults]
    assert default.workers == 6
    assert kinds.count(FaultKind.COORDINATOR_KILL) >= 1
    assert sum(len(f.workers) or f.count for f in default.faults if f.kind is FaultKind.KILL) >= 2
    assert any(f.kind is FaultKind.LATENCY and f.latency_ms == 200 for f in default.faults)
    assert list(default.byzantine.values()).count("sign-flip") == 1


# ---------------------------------------------------------------------------- runner checks


def test_runner_checks_fail_when_a_fault_did_not_fire_or_a_process_died():
    fired = FiredFault(0, Fault(FaultKind.KILL, 1.0, workers=(0,)), fired_s=10.0, ended_s=10.5)
    missed = FiredFault(1, Fault(FaultKind.COORDINATOR_KILL, 5.0, duration_s=1.0))
    broken = FiredFault(2, Fault(FaultKind.RESET, 6.0), fired_s=11.0, error="RuntimeError: boom")
    ok = runner_checks([fired], [], "")
    assert all(r.ok for r in ok.values())
    r = runner_checks([fired, missed, broken], [], "")["all_faults_fired"]
    assert not r.ok and len(r.violations) == 2 and "did not fire" in r.violations[0] and "boom" in r.violations[1]
    assert not runner_checks([fired], [], "interrupted")["all_faults_fired"].ok
    died = runner_checks([fired], ["w2-1 exited on its own with code 1"], "")["no_unexpected_exit"]
    assert not died.ok and "w2-1" in died.violations[0]


def test_markdown_says_fail_and_why():
    results = {
        "progress_resumes": InvariantResult(
            "progress_resumes", False, ("kill at 3.0s: next commit after 80.0s > bound 60.0s",)
        ),
        "no_process_leaked": InvariantResult("no_process_leaked", True),
    }
    summary = {
        "scenario": "x",
        "invariants": {k: r.ok for k, r in results.items()},
        "committed_rounds": 3,
        "stop_reason": "cap",
        "progress_bound_s": 60.0,
        "faults": [],
        "committed_rounds_per_cell": {},
        "workers": [],
        "byzantine": {},
        "notes": {},
        "commit_log_reads": [],
    }
    md = markdown(summary, results)
    assert "**FAIL**" in md and "next commit after 80.0s" in md and "| `no_process_leaked` | yes |" in md


def test_byzantine_effect_compares_loss_after_its_rounds(tmp_path):
    sc = parse_chaos_scenario(scenario(workers='count = 2\n[workers.byzantine]\n1 = "sign-flip"'))
    run = ChaosRun(sc, tmp_path, echo=False)
    run.workers[0].worker_id, run.workers[1].worker_id = "honest", "byz"

    def rec(r: int, loss: float, contributors: tuple[str, ...]) -> CommitRecord:
        return CommitRecord("k0.r0", r, 1, f"{r:064x}", 1000 * r, contributors, contributors, 10, loss)

    # rounds 1 and 3 include the Byzantine worker: the loss went up after them
    run.commit_records = (
        rec(1, 1.0, ("byz", "honest")),
        rec(2, 1.5, ("honest",)),
        rec(3, 1.2, ("byz", "honest")),
        rec(4, 1.6, ("honest",)),
        rec(5, 1.4, ("honest",)),
    )
    eff = byzantine_effect(run)["w1"]
    assert eff["mode"] == "sign-flip" and eff["rounds_contributed"] == 2
    assert eff["mean_loss_change_after_its_rounds"] == pytest.approx(0.45)
    assert eff["mean_loss_change_after_other_rounds"] == pytest.approx(-0.25)
    assert eff["rounds_compared"] == [2, 2]
    cells = loss_by_cell(run)["k0.r0"]
    assert cells == {
        "rounds": 5,
        "rounds_with_byzantine_contributor": 2,
        "first_loss": 1.0,
        "best_loss": 1.0,
        "worst_loss": 1.6,
        "last_loss": 1.4,
    }


# ---------------------------------------------------------------------------- supervision

CHILD = r"""
import os, socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
pid = os.fork()
if pid == 0:
    time.sleep(600)
    os._exit(0)
print(f"port {s.getsockname()[1]} child {pid}", flush=True)
time.sleep(600)
"""


async def test_supervisor_tracks_group_pids_and_ports_and_kills_the_group(tmp_path):
    sup = Supervisor(tmp_path)
    lines: list[str] = []
    proc = await sup.spawn("sleeper", [sys.executable, "-c", CHILD], on_line=lambda p, line: lines.append(line))
    try:
        line = await proc.wait_line(lambda s: s.startswith("port "), 60)
        port, child = int(line.split()[1]), int(line.split()[3])
        sup.sample()
        assert {proc.pid, child} <= sup.seen_pids
        assert port in sup.seen_ports and port in listening_ports([proc.pid])
        assert port_owners([port])[port] >= {proc.pid}
        assert pids_in_groups([proc.pgid]) >= {proc.pid, child}

        sup.signal(proc, signal.SIGSTOP)
        await asyncio.sleep(0.3)
        assert Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"  # the whole group stopped
        sup.signal(proc, signal.SIGCONT)

        await sup.kill(proc)
        for _ in range(50):  # the forked child is reparented, then reaped by init
            if not pid_alive(child):
                break
            await asyncio.sleep(0.1)
        assert not pid_alive(proc.pid) and not pid_alive(child)
        assert sup.alive_pids() == set()
        assert port not in listening_ports(None)
        assert lines and lines[0].startswith("port ")
        assert (tmp_path / "sleeper.log").read_text().startswith("port ")
    finally:
        await sup.shutdown(grace_s=1.0)


async def test_shutdown_is_graceful_first_and_wait_line_reports_exit(tmp_path):
    sup = Supervisor(tmp_path)
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('bye', flush=True), sys.exit(0)))\n"
        "print('up', flush=True)\ntime.sleep(600)"
    )
    proc = await sup.spawn("polite", [sys.executable, "-c", code])
    await proc.wait_line(lambda s: s == "up", 60)
    await sup.shutdown(grace_s=30.0)
    assert proc.returncode == 0  # SIGTERM handled, not SIGKILLed
    assert "bye" in (tmp_path / "polite.log").read_text()

    quick = await sup.spawn("quick", [sys.executable, "-c", "print('x')"])
    from bagel.sim.chaos.supervisor import ProcessExited

    with pytest.raises(ProcessExited):
        await quick.wait_line(lambda s: s == "never", 60)
    await sup.shutdown()


# ---------------------------------------------------------------------------- CLI


def test_cli_refuses_bad_scenario_and_non_empty_out(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[chaos]\n")
    assert chaos_main([str(bad), "--out", str(tmp_path / "o1")]) == 2
    assert "run_spec" in capsys.readouterr().err
    good = ROOT / "sim" / "scenarios" / "chaos-short.toml"
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "precious.txt").write_text("keep me")
    assert chaos_main([str(good), "--out", str(busy)]) == 2
    assert chaos_main([str(good), "--out", str(busy), "--force"]) == 2  # not a chaos output dir: never deleted
    assert (busy / "precious.txt").read_text() == "keep me"
    assert chaos_main([str(good), "--out", str(tmp_path / "o2"), "--workers", "1"]) == 2  # fault names worker 1
    assert not (tmp_path / "o2").exists()


def test_free_port_is_bindable():
    from bagel.sim.chaos.supervisor import free_port

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", free_port()))


def test_add_chaos_parser_registers_the_subcommand(tmp_path):
    import argparse

    from bagel.sim.chaos.command import add_chaos_parser, run_chaos

    parser = argparse.ArgumentParser(prog="bagel-sim")
    add_chaos_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["chaos", "s.toml", "--out", str(tmp_path / "o"), "--workers", "4", "--quiet"])
    assert args.func is run_chaos and args.workers == 4 and args.quiet and args.scenario == Path("s.toml")


# ---------------------------------------------------------------------------- evidence


def test_local_checkpoints_are_rehashed_and_a_corrupt_one_breaks_the_replica_invariant(tmp_path):
    """The chain a chaos run relies on: the workers' kept checkpoints -> observations ->
    sim/invariants.py. A flipped byte in one replica's file must fail `replicas_bit_identical`."""
    import torch

    from bagel.sim.chaos.evidence import local_hashes
    from bagel.worker.diloco import CellState
    from bagel.worker.localstate import LocalCheckpoint, LocalStore

    sc = parse_chaos_scenario(scenario())
    spec = sc.spec
    torch.manual_seed(0)
    state = CellState.from_model(torch.nn.Linear(4, 3))
    h = state.state_hash()
    dirs = []
    for i in range(2):
        d = tmp_path / f"w{i}"
        store = LocalStore(d, spec.run.id, spec.spec_hash)
        store.save(LocalCheckpoint("k0.r0", 3, state, h, {}))
        hist = store.path.parent / "history" / "k0.r0.r3.safetensors"
        hist.parent.mkdir(parents=True)
        hist.write_bytes(store.path.read_bytes())
        dirs.append(d)
    obs = local_hashes([("wa", dirs[0]), ("wb", dirs[1])], spec, t=9.0)
    assert sorted((o.worker_id, o.cell_id, o.round, o.state_hash) for o in obs) == [
        ("wa", "k0.r0", 3, h),
        ("wa", "k0.r0", 3, h),
        ("wb", "k0.r0", 3, h),
        ("wb", "k0.r0", 3, h),
    ]
    log = inv.CommitLogRead(
        10.0,
        "final",
        (inv.CommitEntry("k0.r0", 1, "a" * 64), inv.CommitEntry("k0.r0", 2, "b" * 64), inv.CommitEntry("k0.r0", 3, h)),
    )
    assert inv.check_replicas_bit_identical(inv.History(commit_logs=(log,), hashes=tuple(obs))).ok

    hist = dirs[1] / "runs" / spec.run.id / "history" / "k0.r0.r3.safetensors"
    raw = bytearray(hist.read_bytes())
    raw[-1] ^= 0x01  # one bit of one weight
    hist.write_bytes(bytes(raw))
    obs = local_hashes([("wa", dirs[0]), ("wb", dirs[1])], spec, t=9.0)
    bad = [o for o in obs if o.state_hash != h]
    assert len(bad) == 1 and bad[0].worker_id == "wb" and (bad[0].cell_id, bad[0].round) == ("k0.r0", 3)
    result = inv.check_replicas_bit_identical(inv.History(commit_logs=(log,), hashes=tuple(obs)))
    assert not result.ok and "wb" in result.violations[0]


def test_worker_events_become_observations():
    from bagel.sim.chaos.evidence import Observations

    obs = Observations()
    h = "c" * 64
    assert obs.on_event(0, "wa", {"event": "ready", "cell": "k0.r0", "round": 2, "loss": 1.5}, 1.0) == ""
    obs.on_event(0, "wa", {"event": "verdict", "cell": "k0.r0", "round": 2, "verdict": "resync", "hash": "d" * 64}, 2.0)
    obs.on_event(0, "wa", {"event": "committed", "cell": "k0.r0", "round": 2, "hash": h}, 3.0)
    note = obs.on_event(
        1, "wb", {"event": "heartbeat-refused", "message": "PERMISSION_DENIED: worker wb is banned: reputation"}, 4.0
    )
    obs.on_event(1, "wb", {"event": "error", "message": "reduce: ValueError: boom"}, 5.0)
    assert "banned" in note and 1 in obs.banned and obs.errors[1] == ["reduce: ValueError: boom"]
    assert obs.first_commit_s == 3.0 and obs.acknowledged[0].state_hash == h
    assert [(o.source, o.state_hash[0]) for o in obs.hashes] == [("report", "d"), ("applied", "c")]
    assert obs.ready_loss == [(1.0, 0, "k0.r0", 2, 1.5)] and obs.verdicts[0]["resync"] == 1
    # a ban the worker hears as an order to leave (the instruction carries the ban's reason)
    note = obs.on_event(2, "wc", {"event": "stopping", "message": "ordered to leave: reputation -5.75: lied"}, 6.0)
    assert "banned" in note and 2 in obs.banned
    assert obs.on_event(3, "wd", {"event": "stopping", "message": "ordered to leave: SIGTERM"}, 7.0) == ""
    assert 3 not in obs.banned


def test_tensor_digest_ignores_residuals_but_not_weights():
    import torch
    from safetensors.torch import save

    from bagel.sim.chaos.evidence import hashed_tensor_digest

    meta = {"cell_id": "k0.r0", "committed_round": "3"}
    w, m = torch.arange(6, dtype=torch.float32), torch.zeros(6)
    a = save({"w.x": w, "m.x": m, "e.x": torch.ones(6)}, metadata=meta)
    b = save({"w.x": w, "m.x": m, "e.x": torch.full((6,), 7.0)}, metadata=meta)  # another worker's residual
    w2 = w.clone()
    w2[5] = torch.nextafter(w2[5], torch.tensor(10.0))  # one weight, one ulp
    c = save({"w.x": w2, "m.x": m, "e.x": torch.ones(6)}, metadata=meta)
    d = save({"w.x": w, "m.x": m, "e.x": torch.ones(6)}, metadata={**meta, "committed_round": "4"})
    assert hashed_tensor_digest(a) == hashed_tensor_digest(b)
    assert len({hashed_tensor_digest(x) for x in (a, c, d)}) == 3
    assert hashed_tensor_digest(b"\xff" * 16) is None and hashed_tensor_digest(b"") is None


def test_the_run_stops_on_commit_times_not_on_late_acknowledgements() -> None:
    # a round the coordinator committed at 39.5 s, just before the last fault ended at 39.7 s,
    # and acknowledged by a worker at 39.8 s: it is not progress after the fault
    cap = inv.FaultRecord(33.2, "bandwidth", 39.7)
    early = inv.CommitEntry("k0.r0", 7, "h7", 39.5)
    after, stalled = inv.settled_after([inv.CommitEntry("k0.r0", 6, "h6", 30.0), early], 39.7)
    assert after == set() and stalled == {"k0.r0"}
    log = inv.CommitLogRead(40.4, "end", (early,))
    history = inv.History(
        commit_logs=(log,), acknowledged=(inv.CommitEntry("k0.r0", 7, "h7", 39.8),), faults=(cap,), end_s=40.4
    )
    assert not inv.check_progress_resumes(history).ok  # what stopping on that ack produced

    # one commit after the end settles the cell, and the invariant then holds
    late = inv.CommitEntry("k0.r0", 8, "h8", 40.1)
    after, stalled = inv.settled_after([early, late], 39.7)
    assert after == {("k0.r0", 8)} and stalled == set()
    history = inv.History(commit_logs=(inv.CommitLogRead(40.4, "end", (early, late)),), faults=(cap,), end_s=40.4)
    assert inv.check_progress_resumes(history).ok
