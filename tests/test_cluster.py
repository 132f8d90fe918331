"""In-process cluster: a real coordinator on port 0 and
simulated asyncio workers speaking the real protocol over real gRPC.

- 20 workers register, heartbeat, get assignments, report equal hashes: rounds commit,
  and the store holds each committed round exactly once, consecutively per cell;
- a member that reports another hash is told to resync;
- a member that stops heartbeating loses its lease within the lease time, is dropped
  from its open round, and that round commits with the rest;
- heterogeneity over gRPC: VRAM fit and throughput-proportional batches;
- holders cut off past their lease come back and are a joiner's donors: no rollback.

Time-based waits poll the coordinator's state with generous timeouts; nothing asserts
wall-clock durations (the machine is shared).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bagel.coordinator.cli import status_from_store
from bagel.coordinator.core.records import (
    CellConfig,
    CellRecord,
    CommitRecord,
    RoundRecord,
    RoundState,
    WorkerState,
)
from bagel.coordinator.daemon import CoordinatorHandle, start_coordinator
from bagel.coordinator.dashboard import DashboardState
from bagel.coordinator.store import Store
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.runspec import parse_spec

from simworkers import SimWorker, cluster_spec_text, honest_hash, start_workers, stop_workers, uniform_cells


async def wait_for(pred: Callable[[], bool], timeout_s: float, what: str, step_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(step_s)


def commits(data_dir: Path) -> list[tuple[str, int, str]]:
    store = Store.open_readonly(data_dir)
    try:
        return store.commits()
    finally:
        store.close()


def all_rounds(data_dir: Path) -> list[RoundRecord]:
    store = Store.open_readonly(data_dir)
    try:
        return store.round_records()
    finally:
        store.close()


def all_commits(data_dir: Path) -> list[CommitRecord]:
    store = Store.open_readonly(data_dir)
    try:
        return store.commit_records()
    finally:
        store.close()


def assert_commit_history_sane(rows: list[tuple[str, int, str]]) -> None:
    """Per cell, committed rounds are 1, 2, 3, ... with no gap and no repeat."""
    by_cell: dict[str, list[int]] = {}
    for cell, rnd, _h in rows:
        by_cell.setdefault(cell, []).append(rnd)
    for cell, rounds in by_cell.items():
        assert rounds == list(range(1, len(rounds) + 1)), (cell, rounds)


def one_cell_spec(**kw: float) -> str:
    """`cluster_spec_text` with one expert cell and no router, so every worker shares it."""
    return (
        cluster_spec_text(**kw)
        .replace("clusters = 2", "clusters = 1")
        .replace("timestep_ranges = 2", "timestep_ranges = 1")
        .replace("router = true", "router = false")
    )


async def start(tmp_path: Path, spec_text: str, cells: list[CellConfig] | None = None, **kw) -> CoordinatorHandle:
    spec = parse_spec(spec_text)
    return await start_coordinator(
        spec, tmp_path / "coord", listen="127.0.0.1:0", cells=cells or uniform_cells(spec.cell_ids), tick_ms=50, **kw
    )


@pytest.mark.timeout(90)
async def test_twenty_workers_commit_rounds(tmp_path: Path) -> None:
    h = await start(tmp_path, cluster_spec_text())
    spec = h.spec
    workers = await start_workers(f"127.0.0.1:{h.port}", spec.run.id, 20, cells=spec.cell_ids)
    try:
        # every cell commits at least 3 rounds
        def enough() -> bool:
            snap = h.state.snapshot()
            return all(c.committed_round >= 3 for c in snap.cells)

        await wait_for(enough, 60, "3 committed rounds in every cell")
        snap = h.state.snapshot()
        assert sum(1 for w in snap.workers if w.state is WorkerState.ACTIVE) == 20
        assert all(w.cell_id for w in snap.workers), "every worker got a cell"
        status = await workers[0].client.status()
        assert {c.cell_id for c in status.cells} == set(spec.cell_ids)
        assert all(c.committed_round >= 3 for c in status.cells)
        assert sum(1 for w in status.workers if w.state == "active" and w.lease_expires_unix_ms > 0) == 20
        # metrics: commits per cell, round durations, RPC latencies, workers by state
        await asyncio.sleep(1.2)  # worker counts are refreshed by the tick loop, once a second
        text = h.metrics.text()
        for cell in spec.cell_ids:
            line = next(x for x in text.splitlines() if x.startswith(f'bagel_committed_rounds_total{{cell="{cell}"}}'))
            assert float(line.split()[-1]) >= 3
        assert 'bagel_round_duration_seconds_count{cell="k0.r0"}' in text
        assert 'bagel_rpc_latency_seconds_count{method="Heartbeat"}' in text
        assert 'bagel_workers{state="active"} 20.0' in text
    finally:
        await stop_workers(workers)
        await h.stop()
    rows = commits(h.data_dir)
    assert_commit_history_sane(rows)
    # each committed hash is what the honest contributors computed from the previous one
    recs = all_commits(h.data_dir)
    rounds = {(r.cell_id, r.round, r.attempt): r for r in all_rounds(h.data_dir)}
    prev: dict[str, str] = {}
    for c in recs:
        assert c.state_hash == honest_hash(c.cell_id, c.round, prev.get(c.cell_id, ""), c.contributors)
        assert set(c.agreeing) <= set(c.contributors)
        # the quorum counts the weighted contributors (zero-weight catch-up ones excluded)
        catch_up = set(rounds[(c.cell_id, c.round, c.attempt)].catch_up)
        weighted = set(c.contributors) - catch_up
        assert len(set(c.agreeing) - catch_up) > spec.schedule.quorum * len(weighted)
        prev[c.cell_id] = c.state_hash
    # honest workers that took part in the last commit of their cell hold exactly that state
    last = {c.cell_id: c for c in recs}
    for w in workers:
        c = last.get(w.local.cell_id)
        if c is not None and w.worker_id in c.agreeing and w.local.committed_round == c.round:
            assert w.local.state_hash == c.state_hash


@pytest.mark.timeout(90)
async def test_member_with_another_hash_is_resynced(tmp_path: Path) -> None:
    # one cell, so the liar certainly shares a round with honest members
    text = one_cell_spec(min_replicas=1, max_replicas=8)
    h = await start(tmp_path, text)
    target = f"127.0.0.1:{h.port}"
    honest = await start_workers(target, h.spec.run.id, 3, cells=h.spec.cell_ids)
    liar = SimWorker(target, h.spec.run.id, name="liar", cells=h.spec.cell_ids, bad_hash=True, seed=99)
    liar.start()
    try:
        # the liar hears it either as VERDICT_RESYNC (its report came after the commit) or,
        # having got PENDING, as ORDER_SYNC in its next instruction, to a round no older than
        # the one it reported: the sync orders of its join (the same order, to older rounds)
        # say nothing of its lie
        def caught() -> bool:
            reported = [r for _c, r, _v in liar.stats.verdicts]
            if not reported:
                return False
            resynced = any(v == pb.VERDICT_RESYNC for _c, _r, v in liar.stats.verdicts)
            return resynced or any(cr >= min(reported) for _c, cr, _why in liar.stats.sync_orders)

        await wait_for(caught, 45, "the liar reports and is ordered to SYNC after its report")
        print("liar verdicts", liar.stats.verdicts, "syncs", liar.stats.sync_orders)
        assert any(v == pb.VERDICT_COMMITTED for w in honest for _c, _r, v in w.stats.verdicts)
        # the liar's reputation dropped; the honest ones' did not
        recs = {w.worker_id: w for w in h.state.snapshot().workers}
        assert recs[liar.worker_id].reputation < min(recs[w.worker_id].reputation for w in honest)
    finally:
        await stop_workers([*honest, liar])
        await h.stop()
    assert_commit_history_sane(commits(h.data_dir))


@pytest.mark.timeout(90)
async def test_silent_member_loses_lease_and_round_commits_without_it(tmp_path: Path) -> None:
    text = one_cell_spec(min_replicas=1, lease_s=2.0, heartbeat_s=0.3)
    h = await start(tmp_path, text)
    target = f"127.0.0.1:{h.port}"
    # slow workers (a round trains ~2 s, its deadline is ~2x that), so there is time to
    # kill a member while its round is open, and its lease (2 s) runs out before the deadline
    workers = await start_workers(target, h.spec.run.id, 4, cells=h.spec.cell_ids, samples_per_s=4.0)
    try:
        await wait_for(lambda: h.state.snapshot().cells[0].committed_round >= 1, 45, "a first commit")

        def training_round():
            rounds = h.state.snapshot().rounds
            return rounds[0] if rounds and rounds[0].state in (RoundState.OPEN, RoundState.TRAINING) else None

        # (the next round waits for a contributor whose report lands after the quorum, so an
        # open round has all 4 members unless one was cut at a freeze and caught up)
        await wait_for(
            lambda: training_round() is not None and len(training_round().members) >= 3,
            30,
            "a round with at least 3 members open",
        )
        r = training_round()
        victim = next(w for w in workers if w.worker_id == r.members[-1].worker_id)
        await victim.crash()
        killed_at = time.monotonic()
        cell = r.cell_id

        def victim_state() -> WorkerState:
            return next(w.state for w in h.state.snapshot().workers if w.worker_id == victim.worker_id)

        await wait_for(lambda: victim_state() is WorkerState.LOST, 20, "the victim's lease expires")
        lost_after = time.monotonic() - killed_at
        await wait_for(
            lambda: h.state.snapshot().cells[0].committed_round >= r.round,
            30,
            f"round {r.round} commits without the victim",
        )
    finally:
        await stop_workers(workers)
        await h.stop()
    # no wall-clock assert beyond sanity: the lease is 2 s, ticks are 50 ms; a busy box may lag
    assert lost_after < 20
    rounds = all_rounds(h.data_dir)
    commit = next(c for c in all_commits(h.data_dir) if c.cell_id == cell and c.round == r.round)
    # the round the victim belonged to dropped it, and committed with the others
    the_round = [x for x in rounds if x.cell_id == cell and x.round == r.round and x.state is RoundState.COMMITTED]
    assert the_round and victim.worker_id in the_round[0].dropped
    assert victim.worker_id not in commit.contributors
    survivors = {m.worker_id for m in r.members} - {victim.worker_id}
    assert survivors <= set(commit.contributors) and len(commit.agreeing) >= 2


@pytest.mark.timeout(60)
async def test_a_member_that_reports_after_the_quorum_trains_every_round(tmp_path: Path) -> None:
    """One of four members always reports 0.4 s after the others (3 of 4 are the quorum): the
    next round waits for it (`schedule.next_round_grace_s`), so it trains every round instead
    of sitting every other one out."""
    text = one_cell_spec(min_replicas=1, heartbeat_s=0.2)
    h = await start(tmp_path, text)
    target = f"127.0.0.1:{h.port}"
    # A member learns of the freeze from its next heartbeat's answer, and a simulated exchange
    # does not wait for its contributors (a real one waits for every contribution): with the
    # default 20 ms exchange, the other three could commit before the late one had heard of
    # the freeze at all, under load (seen: it then dropped its round and synced, which is
    # another case). So each exchange lasts well over a heartbeat interval (0.2 s); a download
    # stays short, as in a real run, where it takes far less than a round.
    times = {"reduce_s": 0.6, "sync_s": 0.02}
    workers = await start_workers(target, h.spec.run.id, 3, cells=h.spec.cell_ids, **times)
    late = SimWorker(target, h.spec.run.id, name="late", cells=h.spec.cell_ids, seed=9, report_delay_s=0.4, **times)
    late.start()
    try:
        await wait_for(lambda: h.state.snapshot().cells[0].committed_round >= 8, 45, "8 commits")
    finally:
        await stop_workers([*workers, late])
        await h.stop()
    recs = all_commits(h.data_dir)
    rounds = {(r.cell_id, r.round, r.attempt): r for r in all_rounds(h.data_dir)}
    trained = [
        late.worker_id in c.contributors and late.worker_id not in rounds[(c.cell_id, c.round, c.attempt)].catch_up
        for c in recs
    ]
    # from the first round it trained (its registration may come after round 1 or 2 opened)
    first = trained.index(True)
    after = recs[first:]
    # rounds it reported after the quorum (not among the agreeing reports counted at the commit)
    late_rounds = [k for k in range(first, len(recs) - 1) if late.worker_id not in recs[k].agreeing]
    assert len(late_rounds) >= 3, [(c.round, c.agreeing) for c in after]
    # after each of them it trained the next round, and it never sat one out since its first
    seen = [
        (c.round, c.attempt, late.worker_id in c.contributors, late.worker_id in c.agreeing, trained[i])
        for i, c in enumerate(recs)
    ]
    missed = [
        (x.round, x.deadline_ms - x.opened_ms, x.frozen_ms - x.opened_ms, late.worker_id in x.ready, x.catch_up)
        for x in (rounds[(c.cell_id, c.round, c.attempt)] for i, c in enumerate(recs) if not trained[i])
    ]
    # (round, attempt, contributed, agreed, trained); the rounds it did not train; how often
    # each worker registered (more than once: its lease ran out and it came back)
    regs = {w.name: w.stats.registrations for w in (*workers, late)}
    assert all(trained[k + 1] for k in late_rounds), (missed, regs, seen)
    assert all(trained[first:]) and len(after) >= 5, [(c.round, c.contributors, c.agreeing) for c in recs]
    assert not late.stats.errors and all(v == pb.VERDICT_COMMITTED for _, _, v in late.stats.verdicts)


@pytest.mark.timeout(90)
async def test_heterogeneous_workers_fit_and_proportional_batches(tmp_path: Path) -> None:
    text = cluster_spec_text(min_replicas=2, max_replicas=6).replace("group_batch = 16", "group_batch = 512")
    spec = parse_spec(text)
    gib = 1 << 30
    # experts need 20 GiB (with 20% headroom: > 25 GiB of VRAM), the router 2 GiB
    cells = [
        CellConfig(c, 2 * gib if c == "router" else 20 * gib, 0.1 if c == "router" else 0.225, 1 << 20)
        for c in spec.cell_ids
    ]
    h = await start(tmp_path, text, cells=cells)
    target = f"127.0.0.1:{h.port}"
    vram_gb = [6, 8, 12, 16, 24, 32, 40, 48, 48, 64, 80, 80]
    speeds = [10.0 * (1 + 9 * i / 11) for i in range(12)]  # 10x spread
    workers = [
        SimWorker(
            target,
            spec.run.id,
            name=f"het{i}",
            cells=spec.cell_ids,
            vram_bytes=vram_gb[i] * gib,
            samples_per_s=speeds[i],
            seed=i,
        )
        for i in range(12)
    ]
    for w in workers:
        w.start()
    try:
        await wait_for(lambda: sum(c.committed_round for c in h.state.snapshot().cells) >= 5, 60, "some commits")
        by_id = {w.worker_id: w for w in workers}
        for rec in h.state.snapshot().workers:
            w = by_id[rec.worker_id]
            if rec.cell_id and rec.cell_id != "router":
                assert w.vram_bytes * 0.8 >= 20 * gib, f"{w.name} ({w.vram_bytes // gib} GiB) got {rec.cell_id}"
        # the plans of first rounds (built from the profiles' throughput, before any EMA
        # update) give each member a batch proportional to its samples/s
        speed = {w.worker_id: w.samples_per_s for w in workers}
        firsts = [r for r in all_rounds(h.data_dir) if r.round == 1 and r.attempt == 1 and len(r.members) >= 2]
        assert firsts, "no multi-member first round"
        for r in firsts:
            per_speed = [m.max_samples / speed[m.worker_id] for m in r.members]
            assert max(per_speed) <= 1.25 * min(per_speed), (
                r.cell_id,
                [(m.max_samples, speed[m.worker_id]) for m in r.members],
            )
    finally:
        await stop_workers(workers)
        await h.stop()


@pytest.mark.timeout(90)
async def test_a_joiner_that_syncs_while_a_round_trains_is_admitted_into_it_over_grpc(tmp_path: Path) -> None:
    """Late join over real gRPC: a third worker registers while two train 2 s rounds, fetches
    the committed state in 0.3 s, and is admitted into the round in flight
    (`RoundRecord.late`) with a smaller budget than the members; that round commits with its
    samples, and it trains every round after it as an opening member."""
    # a 6 s lease (not 2 s): the test is about admission, and a loaded machine can stall this
    # process's event loop, which runs the coordinator and all three workers, for a second or two
    text = one_cell_spec(min_replicas=1, heartbeat_s=0.2, lease_s=6.0)
    h = await start(tmp_path, text)
    target = f"127.0.0.1:{h.port}"
    # 16 samples each: a 2 s round. A simulated exchange ends after `reduce_s` whether the
    # other contributors have started theirs or not: at 0.1 s a loaded event loop once let
    # the members report round n before the joiner had heard of its freeze, so the joiner,
    # a contributor that never exchanged, fetched the commit and was admitted late into
    # round n+1 (correctly) instead of opening it. A 1 s exchange outlasts such a delay.
    speed = {"samples_per_s": 8.0, "reduce_s": 1.0}
    workers = await start_workers(target, h.spec.run.id, 2, cells=h.spec.cell_ids, sync_s=0.02, **speed)
    joiner = SimWorker(target, h.spec.run.id, name="joiner", cells=h.spec.cell_ids, seed=9, sync_s=0.3, **speed)
    try:
        await wait_for(lambda: h.state.snapshot().cells[0].committed_round >= 2, 30, "2 commits")
        # mid-round: the next round has trained for a moment when it registers
        await wait_for(lambda: h.state.cell_view(h.spec.cell_ids[0])[1] is not None, 10, "a round open")
        await asyncio.sleep(0.2)
        joiner.start()

        def admitted() -> list[RoundRecord]:
            return [r for r in all_rounds(h.data_dir) if joiner.worker_id in {m.worker_id for m in r.late}]

        await wait_for(lambda: bool(admitted()), 30, "the joiner admitted late")
        late_round = admitted()[0]
        await wait_for(
            lambda: any(c.round >= late_round.round + 2 for c in all_commits(h.data_dir)), 30, "two more commits"
        )
    finally:
        await stop_workers([*workers, joiner])
        await h.stop()
    plan = next(m for m in late_round.late if m.worker_id == joiner.worker_id)
    assert 0 < plan.max_samples < min(m.max_samples for m in late_round.members)
    assert joiner.worker_id not in {m.worker_id for m in late_round.members}
    recs = {(c.round, c.attempt): c for c in all_commits(h.data_dir)}
    rounds = {(r.round, r.attempt): r for r in all_rounds(h.data_dir)}
    c = recs.get((late_round.round, late_round.attempt))
    assert c is not None, "the round the joiner was admitted to did not commit"
    assert joiner.worker_id in c.contributors and joiner.worker_id not in rounds[(c.round, c.attempt)].catch_up
    # from the next round on it is an opening member with a full share
    nxt = [r for r in rounds.values() if r.round == late_round.round + 1]
    # what the joiner and that round show, should this ever fail (in full: a string is not shortened)
    why = {
        "next": [
            (
                r.attempt,
                r.state.value,
                [m.worker_id for m in r.members],
                [m.worker_id for m in r.late],
                list(r.catch_up),
            )
            for r in nxt
        ],
        "joiner": joiner.worker_id,
        "registrations": joiner.stats.registrations,
        "verdicts": joiner.stats.verdicts[-4:],
        "sync_orders": joiner.stats.sync_orders,
        "trained": joiner.stats.rounds_trained[-4:],
        "errors": joiner.stats.errors[-4:],
    }
    assert nxt and joiner.worker_id in {m.worker_id for m in nxt[-1].members}, repr(why)
    # never told to resync or that a round aborted (a report before the quorum is PENDING)
    ok = (pb.VERDICT_COMMITTED, pb.VERDICT_PENDING)
    assert not joiner.stats.errors and all(v in ok for _, _, v in joiner.stats.verdicts), joiner.stats.verdicts
    assert_commit_history_sane(commits(h.data_dir))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("grace_s", [10.0, 0.0])
async def test_holders_cut_off_past_their_lease_come_back_and_nothing_is_rolled_back(
    tmp_path: Path, grace_s: float
) -> None:
    """Both holders of a cell's committed state fall silent past their lease (a network cut)
    and a joiner needs the state. While the cell waits for a holder (`orphan_grace_s`) the
    joiner is told to wait, a holder comes back, registers again with the state, and is its donor:
    no round is lost. With no wait (0) the cell falls back at once (no checkpoint: to its
    initial state), the rounds it had committed lost."""
    from bagel.protocol.messages import Order

    text = one_cell_spec(min_replicas=1, lease_s=1.0, heartbeat_s=0.2, every_rounds=1000)
    text = text.replace("quorum = 0.5", f"quorum = 0.5\norphan_grace_s = {grace_s}")
    h = await start(tmp_path, text)
    target, run_id = f"127.0.0.1:{h.port}", h.spec.run.id
    cells = h.spec.cell_ids
    a, b = await start_workers(target, run_id, 2, cells=cells, samples_per_s=8.0)
    z = SimWorker(target, run_id, name="z", cells=cells, seed=9, samples_per_s=8.0)
    try:

        def cell() -> CellRecord:
            return h.state.snapshot().cells[0]

        def training(w: SimWorker) -> bool:
            # trains the next round on the committed state: no report of it can be in flight
            work = w.work
            return (
                work is not None
                and not work.ready
                and work.reduce_task is None
                and w.local.committed_round == cell().committed_round
            )

        await wait_for(lambda: cell().committed_round >= 2 and training(a) and training(b), 45, "2 commits")
        await asyncio.gather(a.crash(), b.crash())  # silent from now on, holding the state
        held = cell().committed_round
        assert a.local.committed_round == held

        def state(w: SimWorker) -> WorkerState:
            return next(x.state for x in h.state.snapshot().workers if x.worker_id == w.worker_id)

        await wait_for(lambda: state(a) is state(b) is WorkerState.LOST, 20, "both leases expire")
        z.start()
        if not grace_s:
            await wait_for(lambda: cell().rollbacks == 1, 20, "the fallback")
            assert cell().committed_round == 0
            # an operator sees it: the status of the live daemon and of its store, the dashboard
            assert [c.rollbacks for c in h.app.status().cells] == [1]
            assert [c["rollbacks"] for c in status_from_store(h.data_dir)["cells"]] == [1]
            dash = DashboardState(h.app, started_ms=0).build()
            assert [c["rollbacks"] for c in dash["cells"]] == [1]
            return
        await wait_for(lambda: z.instruction.order is Order.WAIT and "come back" in z.instruction.reason, 20, "wait")
        assert (cell().committed_round, cell().rollbacks) == (held, 0)
        a.stopped, a.work = False, None  # the cut heals: a's next heartbeat hears NOT_FOUND
        a.start()
        await wait_for(lambda: z.local.committed_round >= held, 30, "z fetches the committed state")
        assert (held, "fetch the committed state") in [(r, why) for _, r, why in z.stats.sync_orders]
        await wait_for(lambda: cell().committed_round > held, 30, "training goes on from it")
        assert cell().rollbacks == 0
    finally:
        await stop_workers([a, b, z])
        await h.stop()
    assert_commit_history_sane(commits(h.data_dir))  # one epoch, rounds 1, 2, ... with no gap
