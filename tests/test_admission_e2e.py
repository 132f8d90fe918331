"""A permissioned run end to end: a real coordinator process, a token made with
`bagel-coordinator token create` on its live data dir, and real `bagel-worker join`
processes: the one with `--token` registers (and the token is bound to its key), the one
without is refused UNAUTHENTICATED and keeps retrying, never admitted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bagel.worker.swarm import CoordinatorProc, WorkerProc, cleanup

from simworkers import cluster_spec_text


def coordinator_cli(*argv: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "bagel.coordinator", *argv], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def wait(pred, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_joins_a_permissioned_run_with_its_token(tmp_path: Path) -> None:
    data = tmp_path / "coordinator"
    public = coordinator_cli("token", "keygen", "--data-dir", str(data))
    spec = tmp_path / "spec.toml"
    spec.write_text(
        cluster_spec_text(
            "permrun",
            lease_s=10.0,
            heartbeat_s=1.0,
            extra=f'[security]\nmode = "permissioned"\noperator_public_key = "{public}"\npow_bits = 8\n',
        )
    )
    with cleanup([]) as procs:
        coord = CoordinatorProc.make(spec, data, tmp_path / "coordinator.log")
        procs.append(coord)
        coord.start_and_wait(timeout_s=120)
        token = coordinator_cli(
            "token", "create", "--data-dir", str(data), "--expires-s", "600", "--uses", "1", "--name", "alice"
        )
        alice = WorkerProc.make(
            coord.join, tmp_path / "alice", tmp_path / "alice.log", name="alice", extra=["--token", token]
        )
        mallory = WorkerProc.make(coord.join, tmp_path / "mallory", tmp_path / "mallory.log", name="mallory")
        procs += [alice, mallory]
        alice.start()
        mallory.start()
        wait(lambda: alice.events("registered"), 180, "alice registered")
        listed = {t["name"]: t for t in json.loads(coordinator_cli("token", "list", "--data-dir", str(data), "--json"))}
        assert listed["alice"]["bound_worker"] == alice.events("registered")[0]["worker_id"]
        assert listed["alice"]["uses_left"] == 0
        wait(lambda: mallory.events("register-refused"), 180, "mallory refused")
        refusal = mallory.events("register-refused")[0]["message"]
        assert refusal.startswith("UNAUTHENTICATED") and "join token" in refusal, refusal
        assert not mallory.events("registered")
        assert mallory.alive()  # refused, retrying; never admitted
