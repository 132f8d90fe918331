"""A bug in the coordinator core is fatal: the daemon stops instead of serving from memory
that SQLite does not hold, and a restart on the same data dir serves the durable state.

The unit tests inject a non-`CoordinatorError` into a transition of the pure core. The
process test runs the real daemon through a launcher script that patches
`Rounds.commit` to raise *after* it has mutated the state (the worst case: memory holds a
commit the store never saw), drives it with simulated workers over real gRPC, and checks
the exit status, the log line naming the event, and what the restarted daemon serves.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import grpc
import pytest

from bagel.coordinator.core.errors import CoreFault
from bagel.coordinator.core.events import Heartbeat, Register, Tick
from bagel.coordinator.core.records import RoundState
from bagel.coordinator.core.rounds import IllegalTransition
from bagel.coordinator.core.state import CoordinatorState
from bagel.coordinator.store import Store
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import bagel_pb2_grpc as pb_grpc
from bagel.protocol.messages import LocalState, PeerAddress, Phase, Profile
from bagel.protocol.runspec import parse_spec

from daemonproc import DaemonProcess, free_port
from simworkers import cluster_spec_text, start_workers, stop_workers, uniform_cells

T0 = 1_700_000_000_000


def _state() -> CoordinatorState:
    spec = parse_spec(cluster_spec_text("faultrun", min_replicas=1))
    return CoordinatorState(spec, uniform_cells(spec.cell_ids), rng=random.Random(0), now_ms=T0)


def _register(st: CoordinatorState, wid: str, now: int) -> None:
    prof = Profile(
        name=wid, device_kind="cuda", vram_bytes=24 << 30, samples_per_s={c: 100.0 for c in st.spec.cell_ids}
    )
    st.apply(now, Register(wid, prof, PeerAddress(f"peer-{wid}"), LocalState()))


def test_a_non_coordinator_error_in_a_transition_is_a_core_fault_and_poisons_the_state(monkeypatch) -> None:
    st = _state()
    _register(st, "a", T0)

    def broken(*args: object, **kwargs: object) -> str:
        raise ZeroDivisionError("injected")

    monkeypatch.setattr(st.balance, "best_cell", broken)
    with pytest.raises(CoreFault, match=r"ZeroDivisionError: injected while applying Register\(worker_id='b'"):
        _register(st, "b", T0 + 1)
    monkeypatch.undo()
    # memory may hold half a transition: nothing more is served from it, not even a tick
    with pytest.raises(CoreFault, match="failed earlier"):
        st.apply(T0 + 2, Tick())
    with pytest.raises(CoreFault):
        st.apply(T0 + 3, Heartbeat("a", Phase.IDLE))


def test_an_illegal_round_transition_is_a_core_fault() -> None:
    st = _state()
    _register(st, "a", T0)
    st.apply(T0 + 1, Heartbeat("a", Phase.IDLE))
    cell = next(c for c in st.spec.cell_ids if st.cell_view(c)[1] is not None)
    c = st.rounds.cells[cell]
    assert c.round is not None and c.round.state is RoundState.OPEN
    with pytest.raises(IllegalTransition, match="open -> committed"):
        st.rounds.change_state(c, c.round, RoundState.COMMITTED, T0 + 2)
    assert c.round.state is RoundState.OPEN  # refused before anything changed


LAUNCHER = """
import sys
from bagel.coordinator.core import rounds

original = rounds.Rounds.commit
seen = {"commits": 0}


def commit(self, c, r, state_hash, now):
    original(self, c, r, state_hash, now)  # memory now holds the commit; the store does not
    seen["commits"] += 1
    if seen["commits"] == FAIL_AT:
        raise ZeroDivisionError("injected core bug")


rounds.Rounds.commit = commit
from bagel.coordinator.cli import main

sys.exit(main(sys.argv[1:]))
"""


async def _status(target: str) -> pb.StatusResponse:
    async with grpc.aio.insecure_channel(target) as ch:
        return await pb_grpc.CoordinatorStub(ch).GetStatus(pb.GetStatusRequest(), timeout=5)


def _durable_commits(data_dir: Path) -> dict[str, int]:
    store = Store.open_readonly(data_dir)
    try:
        out: dict[str, int] = {}
        for cell, rnd, _h in store.commits():
            out[cell] = max(out.get(cell, 0), rnd)
        return out
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_daemon_exits_non_zero_on_a_core_bug_and_restarts_from_sqlite(tmp_path: Path) -> None:
    fail_at = 5
    spec_path = tmp_path / "fault.toml"
    spec_path.write_text(cluster_spec_text("faultrun", lease_s=6.0, heartbeat_s=0.3, min_replicas=2, max_replicas=4))
    launcher = tmp_path / "buggy_coordinator.py"
    launcher.write_text(LAUNCHER.replace("FAIL_AT", str(fail_at)))
    data = tmp_path / "data"
    target = f"127.0.0.1:{free_port()}"
    args = ("--listen", target, "--no-dht", "--insecure", "--tick-ms", "50", "--log-level", "WARNING")
    buggy = DaemonProcess(spec_path, data, *args, launcher=(str(launcher),))
    cells = parse_spec(spec_path.read_text()).cell_ids  # each worker claims a speed on every cell
    healthy: DaemonProcess | None = None
    workers = []
    try:
        buggy.wait_line("listening:", timeout_s=120)
        workers = await start_workers(target, "faultrun", 6, cells=cells, samples_per_s=16.0)
        code = await asyncio.to_thread(buggy.wait, 120.0)
        assert code == 1, f"the daemon exited with {code}"
        log = "\n".join(buggy.stderr)
        assert "the coordinator core failed" in log and "ZeroDivisionError: injected core bug" in log, log[-2000:]
        assert "while applying ReportRound(" in log, "the log must name the offending event"
        assert "Traceback" not in log
        durable = _durable_commits(data)
        assert sum(durable.values()) == fail_at - 1, durable  # the faulted commit never reached disk

        # The workers are stopped across the restart: left running, they would re-report the
        # lost round and could commit it before the first status call reads what was restored.
        await stop_workers(workers)
        workers = []
        healthy = DaemonProcess(spec_path, data, *args)
        healthy.wait_line("listening:", timeout_s=120)
        st = await _status(target)
        served = {c.cell_id: c.committed_round for c in st.cells if c.committed_round}
        assert served == durable, (served, durable)
        # and the run goes on from there: workers attach and commit again
        workers = await start_workers(target, "faultrun", 6, cells=cells, samples_per_s=16.0)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            st = await _status(target)
            if sum(c.committed_round for c in st.cells) > sum(durable.values()):
                break
            await asyncio.sleep(0.2)
        else:
            raise AssertionError(f"no commit after the restart: {st}")
    finally:
        await stop_workers(workers)
        buggy.close()
        if healthy is not None:
            healthy.close()
