"""The chaos invariant checker: a clean history passes, and each doctored one is caught."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bagel.sim.chaos.invariants import (
    NAMES,
    CommitEntry,
    CommitLogRead,
    FaultRecord,
    HashObservation,
    History,
    check_history,
    summary,
)


def _h(cell: str, r: int) -> str:
    return f"{cell}-{r}".encode().hex().ljust(64, "0")


def _log(t: float, label: str, upto: dict[str, int]) -> CommitLogRead:
    return CommitLogRead(
        t,
        label,
        tuple(CommitEntry(c, r, _h(c, r), committed_s=10.0 * r) for c, n in upto.items() for r in range(1, n + 1)),
    )


def clean() -> History:
    before = _log(25.0, "before coordinator kill", {"k0.r0": 2, "router": 2})
    after = _log(40.0, "after restart", {"k0.r0": 2, "router": 2})
    end = _log(80.0, "end", {"k0.r0": 6, "router": 5})
    hashes = tuple(
        HashObservation(10.0 * r + 1, w, c, r, _h(c, r))
        for c, n in (("k0.r0", 6), ("router", 5))
        for r in range(1, n + 1)
        for w in ("a", "b")
    )
    return History(
        commit_logs=(before, after, end),
        acknowledged=(CommitEntry("k0.r0", 2, _h("k0.r0", 2)), CommitEntry("router", 5, _h("router", 5))),
        hashes=hashes,
        faults=(FaultRecord(22.0, "worker-kill"), FaultRecord(26.0, "coordinator-kill", end_s=30.0)),
        end_s=80.0,
        progress_bound_s=15.0,
        byzantine_workers=frozenset({"evil"}),
        started_pids=(101, 102, 103),
        alive_pids_at_end=(1, 55),
        bound_ports=(40001, 40002),
        listening_ports_at_end=(22,),
    )


def failing(h: History) -> set[str]:
    return {name for name, ok in summary(check_history(h)).items() if not ok}


def test_clean_history_passes():
    res = check_history(clean())
    assert set(res) == set(NAMES)
    assert all(r.ok for r in res.values()), {n: r.violations for n, r in res.items() if not r.ok}


def test_commit_missing_after_restart_is_lost():
    h = clean()
    after = h.commit_logs[1]
    doctored = replace(after, commits=tuple(c for c in after.commits if not (c.cell_id == "router" and c.round == 2)))
    # the later log re-commits round 2 so the end log is contiguous: only the restart lost it
    bad = replace(h, commit_logs=(h.commit_logs[0], doctored, h.commit_logs[2]))
    assert failing(bad) == {"no_committed_round_lost"}
    msgs = check_history(bad)["no_committed_round_lost"].violations
    assert any("router round 2" in m and "missing at 'after restart'" in m for m in msgs)


def test_commit_rewritten_with_other_hash_is_lost():
    h = clean()
    end = h.commit_logs[2]
    doctored = replace(
        end,
        commits=tuple(
            replace(c, state_hash="f" * 64) if (c.cell_id, c.round) == ("k0.r0", 1) else c for c in end.commits
        ),
    )
    bad = replace(h, commit_logs=(h.commit_logs[0], h.commit_logs[1], doctored), hashes=())
    assert failing(bad) == {"no_committed_round_lost"}
    assert any("became" in m for m in check_history(bad)["no_committed_round_lost"].violations)


def test_acknowledged_commit_missing_from_final_log():
    h = clean()
    bad = replace(h, acknowledged=h.acknowledged + (CommitEntry("k0.r0", 7, "e" * 64),))
    assert failing(bad) == {"no_committed_round_lost"}


def test_round_applied_twice():
    h = clean()
    end = h.commit_logs[2]
    dup = replace(end, commits=end.commits + (CommitEntry("k0.r0", 3, _h("k0.r0", 3), 31.0),))
    bad = replace(h, commit_logs=(h.commit_logs[0], h.commit_logs[1], dup))
    assert failing(bad) == {"no_round_applied_twice"}
    assert any("appears twice" in m for m in check_history(bad)["no_round_applied_twice"].violations)


def test_round_gap_detected():
    h = clean()
    end = h.commit_logs[2]
    gap = replace(end, commits=tuple(c for c in end.commits if (c.cell_id, c.round) != ("k0.r0", 4)))
    bad = replace(h, commit_logs=(h.commit_logs[0], h.commit_logs[1], gap), hashes=())
    assert "no_round_applied_twice" in failing(bad)
    assert any("[4] missing" in m for m in check_history(bad)["no_round_applied_twice"].violations)


def test_honest_replica_divergence_caught_byzantine_only_noted():
    h = clean()
    honest = replace(h, hashes=h.hashes + (HashObservation(33.0, "b", "k0.r0", 3, "d" * 64),))
    assert failing(honest) == {"replicas_bit_identical"}
    byz = replace(h, hashes=h.hashes + (HashObservation(33.0, "evil", "k0.r0", 3, "d" * 64),))
    res = check_history(byz)["replicas_bit_identical"]
    assert res.ok and len(res.notes) == 1 and "evil" in res.notes[0]


def test_no_progress_after_fault():
    h = clean()
    # a fault after the last commit: the run never shows recovery
    bad = replace(h, faults=h.faults + (FaultRecord(70.0, "worker-kill"),))
    assert failing(bad) == {"progress_resumes"}
    # progress that comes too late
    slow = replace(h, progress_bound_s=5.0)
    assert failing(slow) == {"progress_resumes"}
    assert any("> bound" in m for m in check_history(slow)["progress_resumes"].violations)


def test_leaked_process_and_port():
    h = clean()
    assert failing(replace(h, alive_pids_at_end=(1, 102))) == {"no_process_leaked"}
    assert failing(replace(h, listening_ports_at_end=(22, 40002))) == {"no_port_leaked"}


@pytest.mark.parametrize("name", NAMES)
def test_every_invariant_has_a_failing_history(name):
    """Each check can fail: the doctored histories above cover all of NAMES."""
    h = clean()
    doctored = {
        "no_committed_round_lost": replace(h, acknowledged=(CommitEntry("x", 1, "0" * 64),)),
        "no_round_applied_twice": replace(
            h, commit_logs=h.commit_logs + (replace(h.commit_logs[2], t_s=90.0, commits=h.commit_logs[2].commits * 2),)
        ),
        "replicas_bit_identical": replace(h, hashes=(HashObservation(1.0, "a", "router", 1, "1" * 64),)),
        "progress_resumes": replace(h, faults=(FaultRecord(79.0, "hang"),)),
        "no_process_leaked": replace(h, alive_pids_at_end=(101,)),
        "no_port_leaked": replace(h, listening_ports_at_end=(40001,)),
    }[name]
    assert name in failing(doctored)


def _rollback_history(max_rollback: int) -> History:
    """k0.r0 commits 1..4 in epoch 0, is orphaned, falls back to its round-2 checkpoint and
    re-commits 3..5 in epoch 1 (the store reads back the current epoch only)."""
    h = clean()
    before = CommitLogRead(
        30.0, "before orphan", tuple(CommitEntry("k0.r0", r, _h("k0.r0", r), 5.0 * r) for r in range(1, 5))
    )
    after = CommitLogRead(
        60.0,
        "after rollback",
        tuple(CommitEntry("k0.r0", r, f"e1-{r}".ljust(64, "0"), 40.0 + r, epoch=1) for r in range(3, 6)),
    )
    # members applied and were told of rounds 3 and 4 of epoch 0, then of epoch 1's 3..5
    applied = tuple(
        HashObservation(t, w, "k0.r0", r, hsh, "applied")
        for w in ("a", "b")
        for r, hsh, t in [(r, _h("k0.r0", r), 5.0 * r) for r in (3, 4)]
        + [(r, f"e1-{r}".ljust(64, "0"), 40.0 + r) for r in (3, 4, 5)]
    )
    acked = tuple(CommitEntry("k0.r0", o.round, o.state_hash) for o in applied if o.worker_id == "a")
    return replace(
        h,
        commit_logs=(before, after),
        acknowledged=acked,
        hashes=applied,
        faults=(),
        max_rollback_rounds=max_rollback,
    )


def test_rollback_within_the_checkpoint_interval_is_allowed_and_noted():
    h = _rollback_history(max_rollback=2)
    res = check_history(h)
    assert all(r.ok for r in res.values()), {n: r.violations for n, r in res.items() if not r.ok}
    assert any("rounds 3..4 rolled back" in n for n in res["no_committed_round_lost"].notes)
    # a replica that held a round-4 hash no epoch committed still diverged
    odd = HashObservation(50.0, "b", "k0.r0", 4, "9" * 64, "local")
    assert failing(replace(h, hashes=(*h.hashes, odd))) == {"replicas_bit_identical"}


def test_rollback_beyond_the_bound_or_without_epochs_is_a_lost_commit():
    assert failing(_rollback_history(max_rollback=1)) == {"no_committed_round_lost"}
    h = _rollback_history(max_rollback=2)
    # the same history read without epochs: rounds rewritten and rounds 1-2 missing
    flat = tuple(replace(r, commits=tuple(replace(c, epoch=0) for c in r.commits)) for r in h.commit_logs)
    assert failing(replace(h, commit_logs=flat)) == {"no_committed_round_lost", "no_round_applied_twice"}


def test_lineage_keeps_the_older_epochs_rows_below_each_rollback_point():
    from bagel.sim.chaos.evidence import lineage

    def rows(epoch: int, rounds: range, tag: str) -> list[tuple[str, int, int, str, int]]:
        return [("k0.r0", epoch, r, f"{tag}{r}", 1000 * r) for r in rounds]

    # epoch 0 committed 1..4; back to the round-2 checkpoint; epoch 1 committed 3..5
    got = lineage(rows(0, range(1, 5), "a") + rows(1, range(3, 6), "b"), {"k0.r0": (1, 5)})
    assert [(e, r) for _, e, r, _, _ in got] == [(0, 1), (0, 2), (1, 3), (1, 4), (1, 5)]
    # the fallback happened but the new epoch has not committed yet: the cell's round says where
    got = lineage(rows(0, range(1, 5), "a"), {"k0.r0": (1, 2)})
    assert [(e, r) for _, e, r, _, _ in got] == [(0, 1), (0, 2)]
    # two rollbacks: the lower point bounds every older epoch; back to round 0 drops them all
    got = lineage(rows(0, range(1, 6), "a") + rows(1, range(4, 7), "b") + rows(2, range(2, 4), "c"), {"k0.r0": (2, 3)})
    assert [(e, r) for _, e, r, _, _ in got] == [(0, 1), (2, 2), (2, 3)]
    assert lineage(rows(0, range(1, 3), "a"), {"k0.r0": (1, 0)}) == []
    assert lineage(rows(0, range(1, 3), "a"), {"k0.r0": (0, 2)}) == rows(0, range(1, 3), "a")


def test_a_rollback_read_from_a_real_store_names_only_the_lost_round(tmp_path):
    """The store reads back the current epoch only; the chaos reader must put the older
    epoch's kept rounds back with their epochs, or the checker reports every round below
    the rollback point lost and the re-committed round as a changed hash."""
    from bagel.coordinator.core.records import CellRecord, CommitRecord
    from bagel.coordinator.store import Store
    from bagel.sim.chaos.evidence import read_commit_log

    def commit(rnd: int, h: str, ms: int) -> CommitRecord:
        return CommitRecord("k0.r0", rnd, 1, h, ms, ("w1",), ("w1",), 40, 0.25)

    h = {r: _h("k0.r0", r) for r in range(1, 4)}
    redo = "f" * 64
    store = Store.open(tmp_path)
    for r in (1, 2, 3):
        store.write([CellRecord("k0.r0", r, h[r]), commit(r, h[r], 1000 * r)], now_ms=1000 * r)
    before, _ = read_commit_log(tmp_path, "before the cut", 3.5, 0.0)
    store.write([CellRecord("k0.r0", 2, h[2], rollbacks=1)], now_ms=4000)  # back to the round-2 checkpoint
    store.write([CellRecord("k0.r0", 3, redo, rollbacks=1), commit(3, redo, 5000)], now_ms=5000)
    store.close()
    after, records = read_commit_log(tmp_path, "end", 6.0, 0.0)
    assert [(c.epoch, c.round) for c in after.commits] == [(0, 1), (0, 2), (1, 3)]
    assert [c.committed_s for c in after.commits] == [1.0, 2.0, 5.0]
    assert [(r.round, r.state_hash) for r in records] == [(3, redo)]  # the report's records: current epoch
    acked = tuple(CommitEntry("k0.r0", r, h[r]) for r in (1, 2, 3))
    hist = replace(clean(), commit_logs=(before, after), acknowledged=acked, hashes=(), faults=())
    res = check_history(hist)
    assert res["no_round_applied_twice"].ok
    assert sorted(res["no_committed_round_lost"].violations) == [
        "k0.r0 round 3: acknowledged as committed but not in the final log",
        "k0.r0: rounds 3..3 rolled back to the checkpoint (epoch 1) by 'end': 1 > 0 allowed",
    ]
