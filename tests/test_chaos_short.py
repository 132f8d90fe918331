"""End to end: `python -m bagel.sim.chaos sim/scenarios/chaos-short.toml`.

A real coordinator, a bootstrap DHT node and 3 real workers on loopback; worker 1 is
SIGKILLed, then the coordinator is SIGKILLed and restarted on its data dir. The run must
pass every invariant, and the faults must really have happened: a chaos run whose faults
did not fire proves nothing, so the test checks the evidence, not only the verdicts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCENARIO = ROOT / "sim" / "scenarios" / "chaos-short.toml"
EXPECTED = {
    "no_committed_round_lost",
    "no_round_applied_twice",
    "replicas_bit_identical",
    "progress_resumes",
    "no_process_leaked",
    "no_port_leaked",
    "all_faults_fired",
    "no_unexpected_exit",
}


@pytest.mark.slow
@pytest.mark.timeout(420)  # the run itself takes ~1-2 min; generous for a loaded 2-core machine
def test_chaos_short_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "chaos"
    proc = subprocess.run(
        [sys.executable, "-m", "bagel.sim.chaos", str(SCENARIO), "--out", str(out), "--quiet"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    summary_path = out / "summary.json"
    assert summary_path.exists(), f"no summary (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    s = json.loads(summary_path.read_text())
    detail = json.dumps({k: s.get(k) for k in ("violations", "faults", "stop_reason")}, indent=1)[:6000]

    # every invariant is reported and holds, and the exit status says so
    assert set(s["invariants"]) == EXPECTED
    assert all(s["invariants"].values()), detail
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["invariants"] == s["invariants"]

    # the faults happened: one worker SIGKILL, one coordinator SIGKILL + restart
    kinds = [f["kind"] for f in s["faults"]]
    assert kinds == ["kill", "coordinator-kill"]
    assert all(f["fired"] and f["at_s"] is not None and not f["error"] for f in s["faults"]), detail
    assert s["faults"][0]["targets"] and s["faults"][0]["targets"][0].startswith("w1 ")
    assert s["coordinator_starts"] == 2
    labels = [r["label"] for r in s["commit_log_reads"]]
    assert "before coordinator kill #1" in labels and "after coordinator restart #1" in labels
    assert labels[-1] == "final (stopped)"
    killed = next(w for w in s["workers"] if w["index"] == 1)
    assert killed["starts"] == 1 and not killed["unexpected_exits"]

    # there was training around the faults: rounds committed before the kill of the
    # coordinator were still in its log after the restart, and more were committed after
    reads = {r["label"]: r["commits"] for r in s["commit_log_reads"]}
    assert reads["before coordinator kill #1"] >= 1
    assert reads["final (stopped)"] > reads["after coordinator restart #1"] >= reads["before coordinator kill #1"]
    assert s["committed_rounds"] == reads["final (stopped)"]

    # the evidence behind the verdicts is not empty
    ev = s["evidence"]
    assert ev["acknowledged_commits"] > 0 and ev["local_checkpoints_rehashed"] > 0
    assert ev["started_pids"] >= 5 and len(ev["bound_ports"]) >= 3  # bootstrap, coordinator x2, workers; proxy + ports
    assert s["proxy"]["connections"] >= 3  # the workers reached the coordinator through the proxy

    assert (out / "timeline.png").stat().st_size > 10_000
    assert "PASS" in (out / "summary.md").read_text()
