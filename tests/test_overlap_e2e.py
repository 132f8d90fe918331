"""End to end: overlapped rounds (`[diloco] overlap = "delayed"`) between real processes.

A real coordinator daemon and three real `bagel-worker` processes on loopback, the harness
of tests/test_e2e.py, with the run spec's overlap on: while a member's exchange of round n
runs, its GPU trains round n + 1's first inner steps from its own trained weights, and
once round n commits those steps are moved onto the committed outcome. The committed
states must stay the same bytes on every member, whatever happens in the middle:

- rounds commit with steps carried from the overlap (`train` events with `ahead_steps`),
  and the replicas are bit-identical, their averages (`ema.*`) included;
- a member SIGKILLed while its exchange runs (and it trains ahead): the others commit
  without it (or its round is re-frozen without it), bit-identical;
- the coordinator SIGKILLed and restarted on its data dir: the members re-attach, go on
  overlapping, and every round committed before or after is the same bytes everywhere.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bagel.worker.swarm import Managed, cleanup

from test_e2e import SLOW, SPEC, Swarm, assert_replicas_identical, committed_by_all

pytestmark = pytest.mark.slow

OVERLAP_SPEC = SPEC.replace("error_feedback = true\n", 'error_feedback = true\noverlap = "delayed"\n')


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[Swarm]:
    procs: list[Managed] = []
    with cleanup(procs):
        s = Swarm(tmp_path, procs)
        assert OVERLAP_SPEC != SPEC
        s.spec_path.write_text(OVERLAP_SPEC)
        yield s


def carried(s: Swarm, name: str) -> set[int]:
    """Rounds `name` committed with samples, having trained some of their steps ahead."""
    rounds = {e["round"] for e in s.events(name, "train") if e.get("ahead_steps", 0) > 0}
    return {r for r, c in s.commits(name).items() if r in rounds and c["samples"] > 0}


@pytest.mark.timeout(420)
def test_overlapped_rounds_stay_bit_identical_across_a_death_mid_exchange_and_a_coordinator_restart(
    swarm: Swarm,
) -> None:
    s = swarm
    s.start_coordinator()
    names = ["a", "b", "c"]
    for n in names:
        s.start_worker(n, throttle=SLOW)

    # rounds that all three committed, with steps trained ahead carried into them
    def overlapped() -> list[int]:
        both = set(committed_by_all(s, names))
        return sorted(both & carried(s, "a") & carried(s, "b") & carried(s, "c"))

    rounds = s.wait("a round all 3 committed with steps trained ahead", overlapped, timeout_s=200)
    for r in rounds:
        assert_replicas_identical(s, names, r)
    ahead = [e for e in s.events("a", "train") if e.get("ahead_steps", 0) > 0]
    assert all(0 < e["ahead_steps"] <= 10 for e in ahead), ahead  # at most the round's inner steps

    # SIGKILL c while its exchange runs: its last `exchange` has no `exchanged` yet
    def c_exchanging() -> int | None:
        ex = s.events("c", "exchange")
        done = s.events("c", "exchanged") + s.events("c", "exchange-failed")
        if ex and not ex[-1].get("catch_up") and len(ex) > len(done):
            return int(ex[-1]["round"])
        return None

    deadline = time.monotonic() + 90
    killed_round = None
    while killed_round is None and time.monotonic() < deadline:
        killed_round = c_exchanging()
        if killed_round is None:
            time.sleep(0.05)
    assert killed_round is not None, "c never seen mid-exchange"
    s.workers["c"].kill()
    # its log lags the process: the kill can land just after that exchange ended, and then
    # c committed it; either way c is dead, and the rounds after it are a's and b's alone
    last_c = max(s.commits("c"), default=0)
    assert last_c <= killed_round
    after_kill = s.wait(
        "a and b commit a round after c's last",
        lambda: [r for r in committed_by_all(s, ["a", "b"]) if r > last_c],
        timeout_s=90,
    )
    assert after_kill[0] not in s.commits("c")
    assert_replicas_identical(s, ["a", "b"], after_kill[0])
    if killed_round in s.commits("c"):
        assert_replicas_identical(s, names, killed_round)

    # SIGKILL the coordinator mid-round, restart it on the same data dir
    before = s.committed_round()
    assert s.coordinator is not None
    killed = s.coordinator
    os.kill(killed.pid, signal.SIGKILL)
    assert killed.proc is not None and killed.proc.wait(timeout=10) == -signal.SIGKILL
    seen = {n: dict(s.commits(n)) for n in ("a", "b")}
    killed.kill()
    time.sleep(1.0)
    s.start_coordinator()

    def overlapped_after() -> list[int]:
        rounds = sorted(r for r in carried(s, "a") & carried(s, "b") if r > before)
        return rounds if len(rounds) >= 2 else []

    later = s.wait("a and b commit 2 overlapped rounds after the restart", overlapped_after, timeout_s=150)
    for n in ("a", "b"):  # nothing committed before the crash was lost or changed
        commits = s.commits(n)
        for r, c in seen[n].items():
            assert commits[r]["hash"] == c["hash"], (n, r)
    for r in set(s.commits("a")) & set(s.commits("b")):
        assert s.commits("a")[r]["hash"] == s.commits("b")[r]["hash"], r
    for r in later:
        assert_replicas_identical(s, ["a", "b"], r)
