"""`WatchInstruction`: a held long poll answers as soon as the worker's instruction changes.

A real coordinator on port 0 and raw signed clients (no worker loop: the test decides
every message). Each watch asks for a hold of a minute, longer than a test may run, so a
watch that answers during the test was woken (or answered at once), never timed out;
nothing asserts how long anything took.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from bagel.coordinator.core.events import Convicted
from bagel.coordinator.core.records import CellRecord, WorkerRecord, WorkerState
from bagel.coordinator.daemon import CoordinatorHandle
from bagel.coordinator.watchers import InstructionWatchers
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.client import CoordinatorClient
from bagel.protocol.identity import Identity
from bagel.protocol.messages import LocalState
from bagel.protocol.validation import MAX_WATCH_WAIT_MS

from simworkers import sim_peer, sim_profile
from test_cluster import one_cell_spec, start

pytestmark = pytest.mark.timeout(60)

HOLD_MS = 60_000  # a minute: the lease below lets the coordinator hold it that long
ANSWER_S = 20.0  # a woken watch answers well within this


async def _members(tmp_path: Path, n: int = 2) -> tuple[CoordinatorHandle, list[CoordinatorClient], str]:
    """A one-cell run with a lease of a minute and `n` registered workers, each told to
    train round 1 (one IDLE heartbeat each)."""
    h = await start(tmp_path, one_cell_spec(min_replicas=1, heartbeat_s=30.0, lease_s=60.0))
    cell = h.spec.cell_ids[0]
    profile = sim_profile([cell])
    clients = []
    for _ in range(n):
        c = CoordinatorClient(f"127.0.0.1:{h.port}", Identity.generate(), h.spec.run.id, timeout_s=5.0)
        await c.register(profile, sim_peer(c.worker_id))
        clients.append(c)
    for c in clients:
        r = await c.heartbeat(pb.PHASE_IDLE)
        assert r.instruction.order == pb.ORDER_TRAIN and r.instruction.round == 1
    return h, clients, cell


async def _ready(c: CoordinatorClient, cell: str) -> pb.Instruction:
    ins = (await c.heartbeat(pb.PHASE_IDLE)).instruction
    r = await c.heartbeat(
        pb.PHASE_READY,
        cell_id=cell,
        round=1,
        samples=16,
        round_attempt=ins.round_attempt,
        inner_step=ins.plan.inner_steps,
    )
    return r.instruction


async def _held(c: CoordinatorClient, cell: str) -> tuple[pb.Instruction, asyncio.Task[pb.WatchInstructionResponse]]:
    """`c` READY in round 1, and a watch of its current instruction, held (checked)."""
    current = await _ready(c, cell)
    watch = asyncio.create_task(c.watch_instruction(current.tag, HOLD_MS))
    await asyncio.sleep(0.3)
    assert not watch.done(), "nothing changed: the watch is held"
    return current, watch


async def _close(h: CoordinatorHandle, clients: list[CoordinatorClient]) -> None:
    for c in clients:
        await c.close()
    await h.stop()


async def test_a_held_watch_answers_the_freeze_another_member_causes(tmp_path: Path) -> None:
    h, (a, b), cell = await _members(tmp_path)
    try:
        held, watch = await _held(a, cell)
        assert held.order == pb.ORDER_TRAIN, "one of two members ready: the round waits for the other"
        assert (await _ready(b, cell)).order == pb.ORDER_REDUCE  # the last READY freezes the round
        got = await asyncio.wait_for(watch, ANSWER_S)
        assert got.changed and got.instruction.order == pb.ORDER_REDUCE and got.instruction.round == 1
        assert got.instruction.tag != held.tag
        # the very instruction a heartbeat now answers, tag included
        again = (await a.heartbeat(pb.PHASE_READY, cell_id=cell, round=1, samples=16)).instruction
        assert again == got.instruction
    finally:
        await _close(h, [a, b])


async def test_a_watch_whose_tag_is_not_the_current_one_answers_at_once(tmp_path: Path) -> None:
    h, (a, b), cell = await _members(tmp_path)
    try:
        current = await _ready(a, cell)
        before = h.state.snapshot()
        got = await asyncio.wait_for(a.watch_instruction(current.tag ^ 1, HOLD_MS), ANSWER_S)
        assert got.changed and got.instruction == current
        assert h.state.snapshot() == before, "a watch is a read"
    finally:
        await _close(h, [a, b])


async def test_a_newer_watch_of_the_same_worker_answers_the_older_one(tmp_path: Path) -> None:
    h, (a, b), cell = await _members(tmp_path)
    try:
        current = await _ready(a, cell)
        first = asyncio.create_task(a.watch_instruction(current.tag, HOLD_MS))
        await asyncio.sleep(0.3)
        second = asyncio.create_task(a.watch_instruction(current.tag, HOLD_MS))
        got = await asyncio.wait_for(first, ANSWER_S)
        assert not got.changed and got.instruction == current
        await asyncio.sleep(0.3)
        assert not second.done() and len(h.app.watchers) == 1, "one held watch per worker"
        assert "bagel_watches_held 1.0" in h.metrics.text().splitlines()
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        for _ in range(100):  # the client's cancel reaches the handler, which lets go
            if not len(h.app.watchers):
                break
            await asyncio.sleep(0.05)
        assert len(h.app.watchers) == 0 and "bagel_watches_held 0.0" in h.metrics.text().splitlines()
    finally:
        await _close(h, [a, b])


async def test_stopping_the_coordinator_answers_held_watches(tmp_path: Path) -> None:
    h, (a, b), cell = await _members(tmp_path)
    try:
        current, watch = await _held(a, cell)
        stopping = asyncio.create_task(h.stop(grace_s=ANSWER_S))
        got = await asyncio.wait_for(watch, ANSWER_S)
        assert not got.changed and got.instruction == current
        await stopping
    finally:
        await _close(h, [a, b])


async def test_a_worker_banned_while_its_watch_is_held_is_refused_as_its_heartbeat_would_be(tmp_path: Path) -> None:
    """A banned worker hears PERMISSION_DENIED (final), whichever call asks: the watch
    must not hand it a LEAVE instead, which a worker would take for an ordinary goodbye."""
    h, (a, b), cell = await _members(tmp_path)
    try:
        current, watch = await _held(a, cell)
        await h.app.apply(Convicted(a.worker_id, b.worker_id, cell, 1, current.round_attempt, 0, "test: convicted"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(watch, ANSWER_S)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await a.heartbeat(pb.PHASE_READY, cell_id=cell, round=1, samples=16)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await _close(h, [a, b])


async def test_watch_refusals(tmp_path: Path) -> None:
    h, (a, b), cell = await _members(tmp_path)
    stranger = CoordinatorClient(f"127.0.0.1:{h.port}", Identity.generate(), h.spec.run.id, timeout_s=5.0)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stranger.watch_instruction(0, 1000)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        for wait_ms in (-1, MAX_WATCH_WAIT_MS + 1):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await a.watch_instruction(0, wait_ms, timeout_s=5.0)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, wait_ms
        assert len(h.app.watchers) == 0
    finally:
        await stranger.close()
        await _close(h, [a, b])


def test_a_record_of_no_cell_wakes_only_its_own_worker() -> None:
    """The bookkeeping alone: a registration into standby (a record of no cell) must not wake
    every standby worker's call (that made a registration storm quadratic); a cell's record
    wakes that cell's calls and no other's."""

    def record(wid: str, cell: str) -> WorkerRecord:
        return WorkerRecord(
            wid, sim_profile(["c"]), sim_peer(wid), WorkerState.ACTIVE, cell, LocalState(), 0.0, {}, 0, 0
        )

    ws = InstructionWatchers()
    standby = [ws.arm(f"s{i}", "") for i in range(3)]
    member = ws.arm("m", "c")
    other = ws.arm("o", "d")
    assert ws.notify([record("new", "")]) == 0  # another worker registered into standby
    assert not any(w.event.is_set() for w in [*standby, member, other])
    assert ws.notify([record("s1", "")]) == 1 and standby[1].event.is_set()  # its own record
    assert not standby[0].event.is_set() and not standby[2].event.is_set()
    assert ws.notify([CellRecord("c", committed_round=1)]) == 1 and member.event.is_set()
    assert not other.event.is_set()
    assert ws.notify([record("x", "d")]) == 1 and other.event.is_set()  # a worker moved into d
