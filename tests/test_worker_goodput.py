"""The real worker's time accounting (`worker/goodput.py`): the simulator's buckets, every
second of the wall time in exactly one of them, and round fates settled as the ledger does."""

from __future__ import annotations

from typing import Any

import pytest

from bagel.protocol import goodput
from bagel.sim.discrete import ledger
from bagel.worker.demo import _markdown, time_accounts, time_markdown
from bagel.worker.goodput import SwarmFacts, account, total


def ev(ts: float, event: str, **fields: Any) -> dict[str, Any]:
    return {"ts": ts, "event": event, "level": "info", **fields}


def test_the_worker_and_the_simulator_share_one_set_of_buckets() -> None:
    assert ledger.BUCKETS is goodput.BUCKETS  # one definition, not two copies kept in step
    assert set(goodput.TRAINING) | set(goodput.WASTE) == set(goodput.BUCKETS)
    assert set(goodput.BUCKET_DEFINITIONS) == set(goodput.BUCKETS)


# One worker's life, second by second (the expected bucket of each interval on the right).
LIFE = [
    ev(0, "identity"),  # 0-2 idle: start-up
    ev(2, "sync", cell="c", round=3),  # 2-5 resync
    ev(5, "synced", cell="c", round=3),  # 5-6 idle
    ev(6, "train", cell="c", round=4, attempt=1),  # 6-16 training, committed
    ev(8, "step", step=1),
    ev(16, "ready", cell="c", round=4),  # 16-18 barrier (waiting for the freeze)
    ev(18, "exchange", cell="c", round=4, reduce_attempt=1),  # 18-21 comm
    ev(21, "exchanged", cell="c", round=4),  # 21-22 barrier (measure, verdict)
    ev(22, "verdict", cell="c", round=4, round_attempt=1, verdict="committed"),  # 22-23 barrier (saving)
    ev(23, "committed", cell="c", round=4, samples=64),  # 23-24 idle
    ev(24, "train", cell="c", round=5, attempt=1),  # 24-28 training, aborted (a later attempt ran)
    ev(28, "dropped", cell="c", round=5, attempt=1, why="a new round"),  # 28-29 idle
    ev(29, "train", cell="c", round=5, attempt=2),  # 29-33 training, straggler (round 5 committed at 2)
    ev(33, "dropped", cell="c", round=5, attempt=2, why="ordered to wait"),  # 33-34 idle
    ev(34, "catch-up", cell="c", round=5),  # 34-34 barrier
    ev(34, "exchange", cell="c", round=5, reduce_attempt=1, catch_up=True),  # 34-36 comm
    ev(36, "exchanged", cell="c", round=5),  # 36-37 barrier
    ev(37, "verdict", cell="c", round=5, round_attempt=2, verdict="committed"),  # 37-38 barrier
    ev(38, "committed", cell="c", round=5, samples=0, catch_up=True),  # 38-39 idle
    ev(39, "train", cell="c", round=6, attempt=1),  # 39-41 training, rejected (bad hash)
    ev(41, "ready", cell="c", round=6),  # 41-42 barrier
    ev(42, "exchange", cell="c", round=6, reduce_attempt=1),  # 42-44 comm
    ev(44, "exchanged", cell="c", round=6),  # 44-45 barrier
    ev(45, "verdict", cell="c", round=6, round_attempt=1, verdict="resync"),  # 45-46 idle
    ev(46, "dropped", cell="c", round=6, attempt=1, why="VERDICT_RESYNC"),  # already settled
    ev(46, "train", cell="c", round=7, attempt=1),  # 46-49 training, aborted by verdict
    ev(49, "ready", cell="c", round=7),  # 49-50 barrier
    ev(50, "exchange", cell="c", round=7, reduce_attempt=1),  # 50-51 comm
    ev(51, "exchange-failed", round=7),  # 51-52 barrier
    ev(52, "verdict", cell="c", round=7, round_attempt=1, verdict="aborted", failed=True),  # 52-53 idle
    ev(53, "train", cell="c", round=8, attempt=1),  # 53-57 training, preempted (left mid-round)
    ev(57, "stopping", message="SIGTERM"),  # still training
    ev(58, "dropped", cell="c", round=8, attempt=1, why="leaving"),  # 58-59 idle
    ev(59, "train", cell="c", round=9, attempt=1),  # 59-60 training, unresolved (the log ends)
    ev(60, "left"),
]
OTHER = [ev(30, "train", cell="c", round=5, attempt=2), ev(40, "committed", cell="c", round=5, samples=32)]
EXPECTED = {
    "committed": 10.0,
    "aborted": 4.0 + 3.0,
    "straggler": 4.0,
    "preempted": 5.0,
    "rejected": 2.0,
    "resync": 3.0,
    "comm": 3.0 + 2.0 + 2.0 + 1.0,
    "barrier": 2.0 + 1.0 + 1.0 + 1.0 + 1.0 + 1.0 + 1.0 + 1.0 + 1.0,
    "idle": 2.0 + 1.0 + 1.0 + 1.0 + 1.0 + 1.0 + 1.0 + 1.0 + 1.0,
    "unresolved": 1.0,
}


def test_every_second_goes_to_one_bucket_and_fates_follow_the_ledger() -> None:
    a = account(LIFE, SwarmFacts.of([LIFE, OTHER]))
    assert a.wall_s == 60.0
    assert dict(a.buckets) == pytest.approx(EXPECTED)
    assert sum(a.buckets.values()) == pytest.approx(a.wall_s)
    training = sum(EXPECTED[b] for b in goodput.TRAINING)
    assert a.training_s == pytest.approx(training)
    assert a.utilisation == pytest.approx(training / 60.0)
    assert a.goodput == pytest.approx(10.0 / 60.0)


def test_a_dropped_round_is_a_straggler_only_when_its_attempt_committed() -> None:
    life = [
        ev(0, "train", cell="c", round=1, attempt=1),
        ev(4, "dropped", cell="c", round=1, attempt=1, why="ordered to wait"),
        ev(5, "left"),
    ]
    # the round never committed (as far as anyone logged): the attempt was aborted
    assert account(life).buckets["aborted"] == 4.0
    committed = [ev(3, "committed", cell="c", round=1, samples=8)]
    assert account(life, SwarmFacts.of([life, committed])).buckets["straggler"] == 4.0
    later = [ev(3, "train", cell="c", round=1, attempt=2), *committed]
    assert account(life, SwarmFacts.of([life, later])).buckets["aborted"] == 4.0
    # dropped because the round committed with another hash: our update did not count
    other_hash = [life[0], ev(4, "dropped", cell="c", round=1, attempt=1, why="round 1 committed with another hash")]
    assert account(other_hash).buckets["rejected"] == 4.0


def test_a_commit_announced_after_the_next_round_started_keeps_that_round_training() -> None:
    life = [
        ev(0, "train", cell="c", round=1, attempt=1),
        ev(4, "ready", cell="c", round=1),
        ev(5, "exchange", cell="c", round=1, reduce_attempt=1),
        ev(6, "exchanged", cell="c", round=1),
        ev(7, "verdict", cell="c", round=1, round_attempt=1, verdict="committed"),
        ev(8, "train", cell="c", round=2, attempt=1),  # the next round starts while round 1 is saved
        ev(9, "committed", cell="c", round=1, samples=16),
        ev(12, "ready", cell="c", round=2),
        ev(13, "left"),
    ]
    a = account(life)
    assert a.buckets["committed"] == 4.0 and a.buckets["unresolved"] == 4.0  # 8-12, round 2 open at the end
    assert a.buckets["barrier"] == 1.0 + 1.0 + 1.0 + 1.0 and a.buckets["comm"] == 1.0 and a.buckets["idle"] == 0.0


def test_odd_logs_give_a_consistent_account() -> None:
    assert account([]).wall_s == 0.0 and account([]).utilisation == 0.0
    # a clock that steps back never makes negative time; untimed records are skipped
    odd = [ev(10, "identity"), {"event": "train"}, ev(9, "train", cell="c", round=1), ev(12, "left")]
    a = account(odd)
    assert a.wall_s == 2.0 and all(v >= 0 for v in a.buckets.values())
    assert sum(a.buckets.values()) == pytest.approx(a.wall_s)
    assert a.buckets["unresolved"] == 2.0


def test_the_swarm_total_and_the_demo_table() -> None:
    per, swarm = time_accounts({"w1": LIFE, "w2": OTHER})
    assert per["w1"]["buckets_s"] == pytest.approx(EXPECTED)
    assert swarm["wall_s"] == pytest.approx(60.0 + 10.0)
    assert total([account(LIFE), account(OTHER)]).wall_s == pytest.approx(70.0)
    text = "\n".join(time_markdown(per, swarm))
    assert "| w1 | 60 | 29 | 0.483 | 0.167 |" in text
    assert "| **swarm** |" in text
    assert f"| committed | {20.0 / 70.0:.3f} |" in text  # w2 committed round 5 for 10 s


def test_the_demo_report_carries_the_section() -> None:
    per, swarm = time_accounts({"w1": LIFE})
    worker = {
        "throttle": 1.0, "cells": ["c"], "rounds_committed": 2, "rounds_contributed": 1, "samples": 64,
        "bytes_sent_exchange": 1000, "ddp_fp32_bytes_same_work": 400000, "reduction_vs_ddp": 400.0, "time": per["w1"],
    }  # fmt: skip
    report = {
        "run_id": "r", "wall_s": 60.0, "cells": {}, "workers": {"w1": worker}, "swarm_time": swarm,
        "samples_png": None, "loss_fell_in_every_cell": True,
    }  # fmt: skip
    text = _markdown(report)
    assert "## Utilisation and goodput" in text and "| w1 | 60 | 29 | 0.483 | 0.167 |" in text


def test_time_trained_ahead_is_training_that_shares_the_fate_of_the_round_it_carried_into() -> None:
    life = [
        ev(0, "train", cell="c", round=4, attempt=1),  # 0-10 training, committed
        ev(10, "ready", cell="c", round=4),  # 10-11 barrier
        ev(11, "exchange", cell="c", round=4, reduce_attempt=1),
        ev(11, "ahead", cell="c", round=5, base_round=4),  # 11-17 training ahead, not comm
        ev(15, "exchanged", cell="c", round=4),
        ev(16, "verdict", cell="c", round=4, round_attempt=1, verdict="committed"),
        ev(16.5, "committed", cell="c", round=4, samples=64),
        ev(17, "ahead-done", cell="c", round=5, steps=6),  # 17-18 idle: out of steps
        ev(18, "train", cell="c", round=5, attempt=1, ahead_steps=6),  # 18-20 the rest of round 5
        ev(20, "ready", cell="c", round=5),  # 20-21 barrier
        ev(21, "exchange", cell="c", round=5, reduce_attempt=1),
        ev(21, "ahead", cell="c", round=6, base_round=5),  # 21-24 ahead, then dropped: aborted
        ev(24, "ahead-dropped", cell="c", round=6, steps=3, why="resync"),  # 24-25 comm
        ev(25, "exchanged", cell="c", round=5),  # 25-26 barrier
        ev(26, "verdict", cell="c", round=5, round_attempt=1, verdict="committed"),
        ev(26, "committed", cell="c", round=5, samples=64),  # 26-27 idle
        ev(27, "train", cell="c", round=6, attempt=1),  # 27-28 unresolved
        ev(28, "identity"),
    ]
    a = account(life)
    b = a.buckets
    assert b["committed"] == pytest.approx(10 + 6 + 2)
    assert b["aborted"] == pytest.approx(3)
    assert b["comm"] == pytest.approx(1)  # only the exchange time no step overlapped
    assert b["barrier"] == pytest.approx(1 + 1 + 1)
    assert b["idle"] == pytest.approx(1 + 1)
    assert b["unresolved"] == pytest.approx(1)
    assert a.wall_s == pytest.approx(sum(b.values()))
    # the same steps, discarded by the round's plan: aborted, not committed
    wrong = [dict(e, ahead_steps=0) if e["event"] == "train" and e["round"] == 5 else e for e in life]
    assert account(wrong).buckets["committed"] == pytest.approx(10 + 2)
    assert account(wrong).buckets["aborted"] == pytest.approx(3 + 6)
