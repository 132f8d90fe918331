"""Ctrl-C during `bagel-sim chaos` stops every process it started, still writes a (failing)
report, and exits 130. The run is interrupted once the coordinator and workers are up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bagel.sim.chaos.supervisor import pid_alive

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_stops_everything_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "chaos"
    proc = subprocess.Popen(
        [sys.executable, "-m", "bagel.sim.chaos", str(ROOT / "sim/scenarios/chaos-short.toml"), "--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        seen = []
        assert proc.stderr is not None
        for line in proc.stderr:  # progress lines: wait until the coordinator and workers run
            seen.append(line)
            if "coordinator up" in line or time.monotonic() > deadline:
                break
        assert any("coordinator up" in s for s in seen), "".join(seen)[-3000:]
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130
    s = json.loads((out / "summary.json").read_text())
    assert s["interrupted"] is True
    assert s["invariants"]["all_faults_fired"] is False  # an interrupted run never passes
    assert s["invariants"]["no_process_leaked"] is True and s["invariants"]["no_port_leaked"] is True
    # independent of the report: every worker and coordinator pid it logged is gone
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if str(out).encode() in cmd and pid_alive(int(entry.name)) and int(entry.name) != os.getpid():
                pytest.fail(f"process {entry.name} of the interrupted run is still alive: {cmd[:200]!r}")
