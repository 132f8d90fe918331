"""The coordinator's story: `EventFeed` derives joins, moves, leaves, lost leases, bans,
commits, aborts and cells without members from the core's records and logs them within a
bound; `RunHistory` keeps the dashboard's series bounded; the dashboard's address rule;
the dashboard's files are package data. All in-process, from real core records."""

from __future__ import annotations

import fnmatch
import logging
import tomllib
from pathlib import Path
from typing import Any

import pytest

from bagel.coordinator import cli
from bagel.coordinator.core.events import ReportRound, Tick
from bagel.coordinator.core.records import (
    CommitRecord,
    RoundRecord,
    RoundState,
    WorkerRecord,
    WorkerState,
)
from bagel.coordinator.dashboard import DashboardAddressError, parse_listen
from bagel.coordinator.eventfeed import LOG_BURST, EventFeed
from bagel.coordinator.runhistory import RunHistory
from bagel.protocol.messages import LocalState, PeerAddress, Profile

ROOT = Path(__file__).resolve().parent.parent
CELLS = ("k0.r0", "k0.r1", "router")


def worker(wid: str, state: WorkerState, cell: str = "", reason: str = "", name: str = "") -> WorkerRecord:
    return WorkerRecord(
        worker_id=wid,
        profile=Profile(name=name or wid),
        peer=PeerAddress(),
        state=state,
        cell_id=cell,
        local=LocalState(),
        reputation=0.0,
        throughput={},
        rounds_contributed=0,
        registered_ms=0,
        reason=reason,
    )


def commit(cell: str, rnd: int, at: int = 0, samples: int = 32, heldout: float = -1.0) -> CommitRecord:
    return CommitRecord(cell, rnd, 1, f"h{rnd}", at, ("a", "b"), ("a", "b"), samples, 0.5, heldout)


def aborted(cell: str, rnd: int, attempt: int, reason: str) -> RoundRecord:
    return RoundRecord(cell, rnd, attempt, RoundState.ABORTED, 0, 0, 2, (), reason=reason)


def test_feed_tells_what_happened_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.feed.story")
    feed = EventFeed(CELLS, logger=log)
    caplog.set_level(logging.DEBUG, logger="test.feed.story")
    feed.record([worker("wa", WorkerState.ACTIVE, "k0.r0", name="alice")], 1)
    feed.record([worker("wa", WorkerState.ACTIVE, "k0.r0", name="alice")], 2)  # unchanged: nothing
    feed.record([worker("wb", WorkerState.ACTIVE, "")], 3)  # standby
    feed.record([worker("wb", WorkerState.ACTIVE, "k0.r1")], 4)
    feed.record([commit("k0.r0", 1, heldout=0.25), commit("k0.r0", 1)], 5)  # the same commit twice: once
    feed.record([aborted("k0.r1", 1, 1, "deadline without a quorum")], 6)
    feed.record([aborted("k0.r1", 1, 1, "deadline without a quorum")], 6)
    feed.record([worker("wb", WorkerState.LOST, "k0.r1", reason="lease expired")], 7)
    feed.record([worker("wb", WorkerState.ACTIVE, "k0.r1")], 8)
    feed.record([worker("wb", WorkerState.BANNED, "", reason="convicted: lied as a reducer")], 9)
    feed.record([worker("wa", WorkerState.LEFT, "", reason="operator stopped it")], 10)
    kinds = [(e.kind, e.cell_id) for e in feed.recent()]
    assert kinds == [
        ("join", "k0.r0"),
        ("join", ""),
        ("move", "k0.r1"),
        ("commit", "k0.r0"),
        ("abort", "k0.r1"),
        ("lost", "k0.r1"),
        ("unstaffed", "k0.r1"),
        ("rejoin", "k0.r1"),
        ("staffed", "k0.r1"),
        ("ban", "k0.r1"),
        ("unstaffed", "k0.r1"),
        ("leave", "k0.r0"),
        ("unstaffed", "k0.r0"),
    ]
    texts = [e.text for e in feed.recent()]
    assert "wa (alice) joined -> cell k0.r0" in texts
    assert any("held-out 0.2500" in t for t in texts)
    assert any("aborted: deadline without a quorum" in t for t in texts)
    assert any("banned: convicted: lied as a reducer" in t for t in texts)
    assert any("left: operator stopped it" in t for t in texts)
    assert [e.seq for e in feed.recent()] == list(range(1, 14))
    # every event reached the log, at its level
    logged = {(r.levelno, r.getMessage()) for r in caplog.records}
    assert (logging.WARNING, "wb (wb) banned: convicted: lied as a reducer") in logged
    assert (logging.INFO, "wa (alice) joined -> cell k0.r0") in logged
    assert len(caplog.records) == 13
    # the once-a-minute line: commits per cell, aborts with their reason
    line = feed.summary_line(60)
    assert line.startswith("commits in the last 60 s: k0.r0 1 (round 1, loss 0.5000)")
    assert "nothing committed: k0.r1, router" in line
    assert "aborts: k0.r1 1 (deadline without a quorum)" in line


def test_health_line_and_cells_left_without_members() -> None:
    feed = EventFeed(CELLS, [worker("wa", WorkerState.ACTIVE, "k0.r0")], logger=logging.getLogger("test.feed.h"))
    feed.record([worker("wb", WorkerState.ACTIVE, "k0.r0"), commit("k0.r0", 1)], 1)
    line = feed.health_line({"active": 2, "lost": 1, "standby": 0}, 30)
    assert line == (
        "[2/3 workers healthy]; 1/3 cells with members; no members: k0.r1, router; standby 0; "
        "last 30 s: 1 commits, 0 aborts"
    )
    assert feed.health_line({"active": 2}, 30).endswith("last 30 s: 0 commits, 0 aborts")
    # cells that never had a member are reported once they stayed empty for the grace time
    feed.check_unstaffed(2, 1_000, grace_ms=10_000)
    assert not [e for e in feed.recent() if e.kind == "unstaffed"]
    feed.check_unstaffed(2, 11_000, grace_ms=10_000)
    feed.check_unstaffed(2, 12_000, grace_ms=10_000)  # once per streak
    said = [e.cell_id for e in feed.recent() if e.kind == "unstaffed"]
    assert said == ["k0.r1", "router"]
    assert "has had no members for 10 s while 2 workers are active" in feed.recent()[-1].text


def test_the_log_is_bounded_and_counts_what_it_left_out(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.feed.burst")
    caplog.set_level(logging.INFO, logger="test.feed.burst")
    feed = EventFeed(CELLS, logger=log, capacity=50)
    feed.record([worker(f"w{i:03d}", WorkerState.ACTIVE, "k0.r0") for i in range(100)], 1)
    assert len([r for r in caplog.records if "joined" in r.getMessage()]) == LOG_BURST
    assert len(feed.events) == 50 and feed.recent()[-1].seq == 100  # the feed keeps the last 50
    assert feed.summary_line(60).endswith(f"not logged: {100 - LOG_BURST} join")
    feed.record([worker("wnew", WorkerState.ACTIVE, "k0.r1")], 2)  # a new window logs again
    assert "wnew (wnew) joined -> cell k0.r1" in caplog.text


def test_history_counts_each_report_once_and_stays_bounded() -> None:
    h = RunHistory(CELLS, bucket_ms=1000, max_points=16, start_ms=0)
    rep = ReportRound("wa", "k0.r0", 1, state_hash="x", samples=32, bytes_sent=1000, reduce_attempt=1)
    h.record(rep, (), 500)
    h.record(rep, (), 600)  # the same report again (a re-report): counted once
    h.record(ReportRound("wb", "k0.r0", 1, samples=32, bytes_sent=500, failed=True, reduce_attempt=1), (), 700)
    h.record(Tick(), [commit("k0.r0", 1, at=900, samples=32)], 900)
    assert (h.trained_total, h.committed_total) == (32, 32)
    [point] = h.curve("k0.r0")
    assert (point.round, point.bytes_sent, point.committed_ms) == (1, 1500, 900)
    s = h.series(2500)
    assert s["t_ms"] == [0.0, 1000.0] and s["throughput"] == [32.0, 0.0] and s["goodput"] == [32.0, 0.0]
    # a report's samples are spread over the time it says it trained (which ended comm_ms
    # before it reported), a commit's over its round's life
    h.record(ReportRound("wa", "k0.r0", 2, samples=40, compute_ms=4000, comm_ms=1000, reduce_attempt=1), (), 10_000)
    opened = RoundRecord("k0.r0", 2, 1, RoundState.COMMITTED, 6000, 0, 2, ())
    h.record(Tick(), [opened, commit("k0.r0", 2, at=10_000, samples=40)], 10_000)
    s = h.series(11_000)
    assert s["t_ms"][4:] == [4000.0, 5000.0, 6000.0, 7000.0, 8000.0, 9000.0, 10000.0]
    assert [round(x, 6) for x in s["throughput"][4:]] == [0.0, 10.0, 10.0, 10.0, 10.0, 0.0, 0.0]
    assert [round(x, 6) for x in s["goodput"][4:]] == [0.0, 0.0, 10.0, 10.0, 10.0, 10.0, 0.0]
    # an hour later: still at most max_points buckets, coarser, the totals kept
    h.record(ReportRound("wa", "k0.r0", 3, samples=64, reduce_attempt=1), (), 3_600_000)
    assert len(h.buckets) <= 16 and h.bucket_ms > 1000
    s = h.series(3_600_000)
    assert round(sum(s["throughput"]) * h.bucket_ms / 1000, 6) == 72  # the current bucket (64) is still filling
    assert h.trained_total == 136
    # work from before the history began (a restart) stays out of the series, not piled up at its start
    late = RunHistory(CELLS, bucket_ms=1000, start_ms=10_000)
    late.record(ReportRound("wa", "k0.r0", 1, samples=30, compute_ms=3000, reduce_attempt=1), (), 11_000)
    assert late.series(12_000)["throughput"] == [10.0, 0.0] and late.trained_total == 30


def test_dashboard_address_rule() -> None:
    assert parse_listen("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert parse_listen("localhost:0") == ("localhost", 0)
    assert parse_listen("[::1]:9000") == ("::1", 9000)
    assert parse_listen("0.0.0.0:8080", public=True) == ("0.0.0.0", 8080)
    for bad, says in [
        ("0.0.0.0:8080", "not loopback"),
        ("192.0.2.7:8080", "not loopback"),
        (":8080", "give a host"),
        ("127.0.0.1", "expected HOST:PORT"),
        ("127.0.0.1:99999", "expected HOST:PORT"),
        ("example.org:80", "IP address or localhost"),
    ]:
        with pytest.raises(DashboardAddressError, match=says):
            parse_listen(bad)


def test_serve_refuses_a_public_dashboard_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--run", str(tmp_path / "none.toml"), "--data-dir", str(tmp_path / "d")]
    assert cli.main([*argv, "--dashboard-listen", "0.0.0.0:8080"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not loopback" in err[0] and "--dashboard-public" in err[0]
    assert cli.main([*argv, "--health-log-s", "-1"]) == cli.EXIT_USAGE
    assert not (tmp_path / "d").exists()


def test_the_dashboard_files_are_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["bagel.coordinator"]
    files = sorted(p.relative_to(ROOT / "coordinator").as_posix() for p in (ROOT / "coordinator" / "static").iterdir())
    assert {"static/dashboard.html", "static/dashboard.js", "static/dashboard.css"} <= set(files)
    assert all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in files), (files, patterns)


def test_a_rollback_is_told_and_the_rounds_committed_again_are_news_again(caplog: pytest.LogCaptureFixture) -> None:
    """From a real core: two holders leave without offering their state, a joiner needs it,
    and the cell falls back to its round-2 checkpoint; the feed warns, and round 3, committed
    again, is a commit event again. A feed built after a restart does not repeat it."""
    from bagel.coordinator.core.events import Leave

    from test_orphan_grace import commit_three_rounds
    from test_state_harness import Harness, make_spec

    log = logging.getLogger("test.feed.rollback")
    caplog.set_level(logging.INFO, logger="test.feed.rollback")
    hz = Harness(make_spec(every_rounds=2))
    feed = EventFeed(hz.spec.cell_ids, logger=log)
    apply = hz.apply

    def told(event: Any) -> Any:
        out = apply(event)
        feed.record(out.effects, hz.now)
        return out

    hz.apply = told  # every transition's effects go to the feed too
    commit_three_rounds(hz)
    hz.apply(Leave("a"))
    hz.apply(Leave("b"))
    assert not [e for e in feed.recent() if e.kind == "rollback"]
    hz.reg("z")
    (rb,) = [e for e in feed.recent() if e.kind == "rollback"]
    assert (rb.cell_id, rb.round) == ("k0.r0", 2)
    assert rb.text == (
        "cell k0.r0 fell back to round 2, its checkpoint: no live worker held its committed state; rounds 3..3 are lost"
    )
    assert any(r.levelno == logging.WARNING and r.getMessage() == rb.text for r in caplog.records)
    hz.sync("z")
    hz.hb("z")
    hz.ready("z")
    hz.report("z", "e" * 64)
    commits = [e.round for e in feed.recent() if e.kind == "commit"]
    assert commits == [1, 2, 3, 3]  # round 3 again, in the new epoch
    # a restarted daemon's feed starts from the stored cells: nothing to tell
    again = EventFeed(hz.spec.cell_ids, (), hz.store.cells.values(), logger=log)
    again.record(hz.store.cells.values(), hz.now)
    assert not again.recent()
