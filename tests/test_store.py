"""SQLite store: schema, spec binding, effects round-trip through JSON, commit uniqueness,
read-only access while a writer holds the database, and the async writer's ordering."""

from __future__ import annotations

import asyncio
import os
import sqlite3

import pytest

from bagel.coordinator.checkpoints import CheckpointMeta
from bagel.coordinator.core.records import (
    CellRecord,
    CommitRecord,
    MemberPlan,
    ReportEntry,
    RoundRecord,
    RoundState,
    WorkerRecord,
    WorkerState,
)
from bagel.coordinator.store import (
    DB_NAME,
    SCHEMA_VERSION,
    SpecMismatchError,
    Store,
    StoreError,
    from_json,
    to_json,
)
from bagel.coordinator.writer import AsyncWriter
from bagel.protocol.messages import LocalState, PeerAddress, Profile

H1, H2 = "a" * 64, "b" * 64


def worker(wid: str = "w1", cell: str = "k0.r0", state: WorkerState = WorkerState.ACTIVE) -> WorkerRecord:
    return WorkerRecord(
        worker_id=wid,
        profile=Profile(name="n", vram_bytes=8 << 30, samples_per_s={"k0.r0": 12.5}),
        peer=PeerAddress("QmPeer", ("/ip4/127.0.0.1/tcp/1",)),
        state=state,
        cell_id=cell,
        local=LocalState(cell, 3, H1),
        reputation=0.5,
        throughput={"k0.r0": 11.0},
        rounds_contributed=2,
        registered_ms=1000,
    )


def round_rec(state: RoundState = RoundState.REDUCING, attempt: int = 1) -> RoundRecord:
    return RoundRecord(
        cell_id="k0.r0",
        round=4,
        attempt=attempt,
        state=state,
        opened_ms=10,
        deadline_ms=20,
        inner_steps=5,
        members=(MemberPlan("w1", PeerAddress("QmPeer", ()), 4, 2, 40),),
        ready={"w1": 40},
        contributors=("w1",),
        reduce_attempt=1,
        reports={"w1": ReportEntry(H1, False, 40, 1)},
    )


def commit(rnd: int = 4, h: str = H1) -> CommitRecord:
    return CommitRecord("k0.r0", rnd, 1, h, 99, ("w1",), ("w1",), 40, 0.25)


def test_records_round_trip_through_json() -> None:
    for rec, tp in [
        (worker(), WorkerRecord),
        (CellRecord("k0.r0", 3, H1, 100, 0.5), CellRecord),
        (round_rec(), RoundRecord),
        (commit(), CommitRecord),
    ]:
        assert from_json(tp, to_json(rec)) == rec


def test_write_and_load_restore_records(tmp_path) -> None:
    store = Store.open(tmp_path)
    assert store.schema_version() == SCHEMA_VERSION
    store.write([worker(), CellRecord("k0.r0", 3, H1), round_rec(), commit(3)], now_ms=5)
    store.write([round_rec(RoundState.COMMITTED), commit(4), round_rec(RoundState.OPEN, attempt=1)], now_ms=6)
    snap = store.load()
    assert snap.workers == (worker(),)
    assert snap.cells == (CellRecord("k0.r0", 3, H1),)
    assert snap.rounds == (round_rec(RoundState.OPEN),)
    assert [c.round for c in snap.commits] == [3, 4]
    assert store.commits() == [("k0.r0", 3, H1), ("k0.r0", 4, H1)]
    # assignments mirror the worker's cell; unassigning removes the row
    assert store.dump()["assignments"][0][:2] == ("w1", "k0.r0")
    store.write([worker(cell="")], now_ms=7)
    assert store.dump()["assignments"] == []
    store.close()


def test_commit_is_recorded_once(tmp_path) -> None:
    store = Store.open(tmp_path)
    store.write([commit(4)], now_ms=1)
    store.write([commit(4)], now_ms=2)  # the same commit again: idempotent
    with pytest.raises(StoreError, match="already committed with another hash"):
        store.write([worker("w9"), commit(4, H2)], now_ms=3)
    # the failed batch is rolled back as a whole
    assert [w.worker_id for w in store.load().workers] == []
    assert store.commits() == [("k0.r0", 4, H1)]
    # the primary key itself refuses a second row even without the helper
    with pytest.raises(sqlite3.IntegrityError):
        store._conn.execute(
            "INSERT INTO commits (cell_id, epoch, round, state_hash, record, committed_unix_ms)"
            " VALUES ('k0.r0', 0, 4, ?, '{}', 0)",
            (H2,),
        )


def test_rollback_starts_a_new_epoch_of_commits(tmp_path) -> None:
    """An orphaned cell falls back to its checkpoint and re-commits the
    rounds after it: a new lineage, not a second commit of the same one."""
    store = Store.open(tmp_path)
    store.write([CellRecord("k0.r0", 1, H1), commit(1)], now_ms=1)
    store.write([CellRecord("k0.r0", 2, H1), commit(2)], now_ms=2)
    store.write([CellRecord("k0.r0", 0, "", rollbacks=1)], now_ms=3)  # orphaned: back to round 0
    assert store.commits() == []  # the current lineage has no commit yet
    store.write([CellRecord("k0.r0", 1, H2, rollbacks=1), commit(1, H2)], now_ms=4)
    assert store.commits() == [("k0.r0", 1, H2)]
    assert store.commit_history() == [("k0.r0", 0, 1, H1), ("k0.r0", 0, 2, H1), ("k0.r0", 1, 1, H2)]
    assert [(c.round, c.state_hash) for c in store.load().commits] == [(1, H2)]
    # within the new epoch, the same round with another hash is still refused
    with pytest.raises(StoreError, match="another hash"):
        store.write([commit(1, H1)], now_ms=5)


def test_spec_binding_refuses_another_spec(tmp_path) -> None:
    store = Store.open(tmp_path)
    store.bind_spec("run-a", H1, "[run]\nid='run-a'\n", 1)
    assert store.bind_spec("run-a", H1, "[run]\nid='run-a'\n", 2).created_unix_ms == 1
    with pytest.raises(SpecMismatchError, match="immutable"):
        store.bind_spec("run-a", H2, "other", 3)
    store.close()


def test_wal_and_readonly_view_while_writer_open(tmp_path) -> None:
    store = Store.open(tmp_path)
    assert store._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    store.write([worker()], now_ms=1)
    ro = Store.open_readonly(tmp_path)
    assert [w.worker_id for w in ro.load().workers] == ["w1"]
    with pytest.raises(StoreError, match="read-only"):
        ro.write([worker("w2")], now_ms=2)
    store.write([worker("w2")], now_ms=3)
    assert [w.worker_id for w in ro.load().workers] == ["w1", "w2"]
    ro.close()
    store.close()
    assert (tmp_path / DB_NAME).exists()


def test_schema_version_mismatch_is_refused(tmp_path) -> None:
    Store.open(tmp_path).close()
    conn = sqlite3.connect(tmp_path / DB_NAME)
    conn.execute("UPDATE schema_version SET version = 99")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match="schema version 99"):
        Store.open(tmp_path)


def test_checkpoint_index(tmp_path) -> None:
    store = Store.open(tmp_path)
    meta = CheckpointMeta("k0.r0", 4, H1, H2, 10, "k0.r0/x", 5, "w1")
    store.add_checkpoint(meta)
    assert store.list_checkpoints("k0.r0") == [meta]
    assert store.list_checkpoints("router") == []
    store.remove_checkpoint("k0.r0", 4)
    assert store.list_checkpoints() == []


async def test_async_writer_keeps_order_and_barrier(tmp_path) -> None:
    store = Store.open(tmp_path)
    writer = AsyncWriter(store)
    futs = [writer.submit([CellRecord("k0.r0", i, H1)], now_ms=i) for i in range(1, 21)]
    await writer.barrier()
    assert all(f.done() for f in futs)
    assert store.load().cells[0].committed_round == 20
    await writer.close()
    store.close()
    assert os.path.getsize(tmp_path / DB_NAME) > 0


async def test_async_writer_groups_queued_batches_into_one_transaction(tmp_path) -> None:
    store = Store.open(tmp_path)
    writer = AsyncWriter(store)
    gate = __import__("threading").Event()
    # hold the writer thread, queue 50 batches behind it, then let go: they share transactions
    blocker = asyncio.ensure_future(writer.run(gate.wait))
    futs = [writer.submit([CellRecord("k0.r0", i, H1)], now_ms=i) for i in range(1, 51)]
    await asyncio.sleep(0.05)
    gate.set()
    await blocker
    await asyncio.gather(*futs)
    assert writer.batches == 50 and writer.transactions < 50
    assert store.load().cells[0].committed_round == 50  # applied in order
    await writer.close()
    store.close()


async def test_async_writer_failure_fails_the_batch(tmp_path) -> None:
    store = Store.open(tmp_path)
    writer = AsyncWriter(store)
    store.write([commit(4)], now_ms=1)
    with pytest.raises(StoreError):
        await writer.submit([commit(4, H2)], now_ms=2)
    await writer.submit([commit(5)], now_ms=3)  # the writer keeps working
    assert [r for _c, r, _h in store.commits()] == [4, 5]
    await writer.close()
    store.close()


async def test_cancelled_waiter_does_not_cancel_the_write(tmp_path) -> None:
    store = Store.open(tmp_path)
    writer = AsyncWriter(store)
    gate = __import__("threading").Event()
    blocker = asyncio.ensure_future(writer.run(gate.wait))
    fut = writer.submit([CellRecord("k0.r0", 7, H1)], now_ms=1)
    waiter = asyncio.ensure_future(asyncio.shield(fut))
    await asyncio.sleep(0.01)
    waiter.cancel()  # as a handler whose client hung up
    gate.set()
    await blocker
    await writer.barrier()
    assert not fut.cancelled() and store.load().cells[0].committed_round == 7
    await writer.close()
    store.close()
