"""Coordinator crash: SIGKILL the daemon process while 20 simulated
workers are mid-round, restart it on the same data dir, and check from SQLite that no
committed round was lost or counted twice, that every commit a worker was told about
before the crash survived it, that the workers re-attach and that the next rounds commit.

The daemon is a real process (`python -m bagel.coordinator serve`); the 20 workers are
asyncio clients in the test process speaking real gRPC, retrying through the outage.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from bagel.coordinator.store import Store
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import bagel_pb2_grpc as pb_grpc
from bagel.protocol.envelope import sign_request
from bagel.protocol.identity import Identity
from bagel.protocol.runspec import parse_spec

from daemonproc import DaemonProcess, free_port
from simworkers import cluster_spec_text, start_workers, stop_workers


def read_commits(data_dir: Path) -> tuple[list[tuple[str, int, str]], list[tuple[str, int, int, str]]]:
    """(current-lineage commits, full commit history incl. any rolled-back lineage)."""
    store = Store.open_readonly(data_dir)
    try:
        return store.commits(), store.commit_history()
    finally:
        store.close()


async def status(target: str, key: Path | None = None) -> pb.StatusResponse:
    """GetStatus: signed with `key` (the daemon's own) it lists every worker, else the aggregate view."""
    req = pb.GetStatusRequest()
    if key is not None:
        req.auth.CopyFrom(
            sign_request(Identity.load(key), pb.StatusAuthRequest(), run_id="crashrun", method="GetStatus")
        )
    async with grpc.aio.insecure_channel(target) as ch:
        return await pb_grpc.CoordinatorStub(ch).GetStatus(req, timeout=5)


async def wait_status(target: str, pred, timeout_s: float, what: str, key: Path | None = None) -> pb.StatusResponse:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = await status(target, key)
            if pred(last):
                return last
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last status: {last}")


@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_sigkill_mid_round_loses_no_commit_and_rounds_continue(tmp_path: Path) -> None:
    spec_path = tmp_path / "crash.toml"
    spec_path.write_text(
        cluster_spec_text(
            "crashrun",
            lease_s=6.0,
            heartbeat_s=0.3,
            min_replicas=2,
            max_replicas=4,
            deadline_slack=4.0,
            min_round_s=3.0,
        )
    )
    data = tmp_path / "data"
    port = free_port()
    target = f"127.0.0.1:{port}"
    args = ("--listen", target, "--no-dht", "--insecure", "--tick-ms", "50", "--log-level", "WARNING")
    first = DaemonProcess(spec_path, data, *args)
    second: DaemonProcess | None = None
    workers = []
    try:
        first.wait_line("listening:", timeout_s=120)
        # ~0.5 s of "training" per round, so rounds are open most of the time
        cells = parse_spec(spec_path.read_text()).cell_ids  # each worker claims a speed on every cell
        workers = await start_workers(target, "crashrun", 20, cells=cells, samples_per_s=16.0)
        st = await wait_status(
            target, lambda s: sum(c.committed_round for c in s.cells) >= 8, 90, "8 commits before the crash"
        )
        st = await wait_status(
            target, lambda s: any(c.round_state in ("training", "reducing") for c in s.cells), 30, "a round in flight"
        )
        told = {(c, r) for w in workers for c, r, v in list(w.stats.verdicts) if v == pb.VERDICT_COMMITTED}
        first.kill9()
        in_flight = {(c.cell_id, c.round) for c in st.cells if c.round_state in ("training", "reducing")}
        before, history_before = read_commits(data)
        committed_before = {(c, r) for c, r, _h in before}
        assert told <= committed_before, f"acknowledged commits missing after the crash: {told - committed_before}"
        per_cell_before = {}
        for c, r, _h in before:
            per_cell_before[c] = max(per_cell_before.get(c, 0), r)

        await asyncio.sleep(1.0)  # workers keep trying (and failing) meanwhile
        second = DaemonProcess(spec_path, data, *args)
        second.wait_line("listening:", timeout_s=120)

        # the workers re-attach and every cell that was committing commits again. (On a
        # heavily loaded machine a worker may miss enough deadlines to be banned: that is
        # the scheduler's reputation rule, not a lost worker, so banned ones are allowed.)
        def recovered(s: pb.StatusResponse) -> bool:
            states = [w.state for w in s.workers]
            return (
                len(states) == 20
                and all(x in ("active", "banned") for x in states)
                and states.count("active") >= 16
                and all(
                    c.committed_round > per_cell_before.get(c.cell_id, 0)
                    for c in s.cells
                    if c.cell_id in per_cell_before
                )
            )

        await wait_status(
            target, recovered, 90, "the workers re-attached and a new commit in every cell", data / "coordinator.key"
        )
    finally:
        await stop_workers(workers)
        first.close()
        if second is not None:
            second.close()
    after, history_after = read_commits(data)
    # nothing lost: every commit from before the crash is still there, with the same hash
    # (and no rollback happened: the workers kept their state through the outage)
    assert set(before) <= set(after)
    assert set(history_before) <= set(history_after)
    assert {e for _c, e, _r, _h in history_after} == {0}
    # nothing counted twice: one row per (cell, round), rounds consecutive per cell
    keys = [(c, r) for c, r, _h in after]
    assert len(keys) == len(set(keys))
    by_cell: dict[str, list[int]] = {}
    for c, r, _h in after:
        by_cell.setdefault(c, []).append(r)
    for c, rounds in by_cell.items():
        assert rounds == list(range(1, len(rounds) + 1)), (c, rounds)
    assert len(after) > len(before)
    assert in_flight, "the crash did not happen mid-round"
