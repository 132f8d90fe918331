"""A real worker's wall time in the goodput buckets, read from its own `--log-json` events.

The simulator's ledger hands every interval of every online worker to one bucket
(`protocol/goodput.py`); this module does the same for a real worker, from the events it
already logs, so `make demo` can report per-worker utilisation (training time / wall time)
and goodput (committed training time / wall time) in the simulator's terms. Pure: events
in, seconds out; no clock, no files.

The wall time runs from the worker's first event to its last. The events, in log order,
move the worker between states, and each interval goes to its state's bucket:

- `train` (cell, round, attempt) starts training for that round attempt, `ready` ends it.
  Training time is held per (cell, round, attempt) until its fate is known, as the
  ledger does: a `committed` event of that round with samples makes it `committed`; a
  `verdict` of aborted makes it `aborted`, of resync `rejected` (the `committed` event is
  written once the state is saved, which may be after the next round's `train`); a `dropped` event while
  leaving makes it `preempted`, and a drop because the round committed with another hash
  `rejected`. Any other drop (ordered to wait, a new round, a resync) is settled at the
  end with what the whole swarm logged (`SwarmFacts`): `straggler` when that round
  committed at that attempt (the member sat a committed round out), else `aborted` (that
  attempt never committed: a later attempt was trained, or the round never committed).
  Training still pending when the log ends is `unresolved`. Throttle sleeps are inside
  the training interval: a throttled worker plays a slower GPU, whose slow steps are
  training too.
- `ready` (and a failed exchange) until `exchange`: `barrier` (waiting for the freeze);
  `exchange` until `exchanged` (or `exchange-failed`): `comm` (a zero-weight catch-up
  exchange included, as in the simulator); `exchanged` until the `verdict`, and a pending
  verdict until the commit shows: `barrier` (the guard's held-out measurement and the
  wait for the verdict).
- `sync` until `synced`, `sync-failed` or `sync-cancelled`: `resync`.
- Training ahead (`[diloco] overlap = "delayed"`): from `ahead` until `ahead-done` the GPU
  trains the next round while the worker otherwise waits (the exchange, the verdict, the
  next round's opening), so that time is training, held apart. The `train` event of the
  round it guessed says how many steps it carried (`ahead_steps`): if any, the held time
  joins that round's training and shares its fate; an `ahead-dropped` event (the guess
  was wrong, or its base was never held) makes it `aborted`.
- Everything else is `idle`: start-up (identity, profiling, registration), building a
  cell's model and fetching its data, waiting for the next round or an instruction,
  saving the local checkpoint, leaving.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bagel.protocol.goodput import BUCKETS, TRAINING

RoundKey = tuple[str, int, int]  # (cell, round, attempt)

# worker states -> the bucket their time goes to; "train" is held per round key instead
_STATE_BUCKET = {"idle": "idle", "resync": "resync", "comm": "comm", "barrier": "barrier"}


@dataclass(frozen=True)
class SwarmFacts:
    """What the whole swarm's logs say about rounds: which committed, and the highest attempt
    anyone trained of each, to settle a dropped round's fate."""

    committed: frozenset[tuple[str, int]] = frozenset()
    max_attempt: Mapping[tuple[str, int], int] = field(default_factory=dict)

    @classmethod
    def of(cls, logs: Iterable[Sequence[Mapping[str, Any]]]) -> SwarmFacts:
        committed: set[tuple[str, int]] = set()
        attempts: dict[tuple[str, int], int] = {}
        for events in logs:
            for e in events:
                kind = e.get("event")
                if kind == "committed" and "cell" in e and "round" in e:
                    committed.add((str(e["cell"]), int(e["round"])))
                elif kind == "train" and "cell" in e and "round" in e:
                    k = (str(e["cell"]), int(e["round"]))
                    attempts[k] = max(attempts.get(k, 0), int(e.get("attempt", 0)))
        return cls(frozenset(committed), attempts)

    def fate_of_dropped(self, key: RoundKey) -> str:
        cell, rnd, attempt = key
        if (cell, rnd) in self.committed and self.max_attempt.get((cell, rnd), attempt) <= attempt:
            return "straggler"
        return "aborted"


@dataclass(frozen=True)
class WorkerAccount:
    """One worker's wall time split into the goodput buckets (seconds)."""

    wall_s: float
    buckets: Mapping[str, float]

    @property
    def training_s(self) -> float:
        return sum(self.buckets[b] for b in TRAINING)

    @property
    def utilisation(self) -> float:
        """Training time (committed or wasted) / wall time."""
        return self.training_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def goodput(self) -> float:
        """Committed training time / wall time."""
        return self.buckets["committed"] / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "wall_s": round(self.wall_s, 3),
            "training_s": round(self.training_s, 3),
            "utilisation": round(self.utilisation, 4),
            "goodput": round(self.goodput, 4),
            "buckets_s": {b: round(self.buckets[b], 3) for b in BUCKETS},
        }


def total(accounts: Iterable[WorkerAccount]) -> WorkerAccount:
    """The swarm's account: wall times and buckets summed (every worker's second weighs the same)."""
    acc = list(accounts)
    return WorkerAccount(sum(a.wall_s for a in acc), {b: sum(a.buckets[b] for a in acc) for b in BUCKETS})


def _key(e: Mapping[str, Any], attempt_field: str = "attempt") -> RoundKey | None:
    try:
        return (str(e["cell"]), int(e["round"]), int(e.get(attempt_field, 0)))
    except (KeyError, TypeError, ValueError):
        return None


def account(events: Sequence[Mapping[str, Any]], facts: SwarmFacts | None = None) -> WorkerAccount:
    """Split one worker's wall time into the buckets (see the module docstring). `events`: its
    `--log-json` records in log order, each with `ts` (unix seconds) and `event`; `facts`:
    what the swarm's logs say about rounds (default: this worker's own log)."""
    timed = [e for e in events if isinstance(e.get("ts"), int | float)]
    buckets = dict.fromkeys(BUCKETS, 0.0)
    if not timed:
        return WorkerAccount(0.0, buckets)
    facts = facts if facts is not None else SwarmFacts.of([timed])
    pending: dict[RoundKey, float] = {}  # training seconds held until the round's fate is known
    dropped: set[RoundKey] = set()  # pending keys dropped for a reason settled at the end
    state, work = "idle", None  # work: the round key being trained or exchanged
    ahead_on, ahead_s = False, 0.0  # training ahead now; its seconds, held for the round it guessed
    start = last = float(timed[0]["ts"])

    def settle(key: RoundKey | None, bucket: str) -> None:
        if key is not None and key in pending:
            buckets[bucket] += pending.pop(key)
            dropped.discard(key)

    for e in timed:
        now = max(last, float(e["ts"]))  # never backwards, whatever the clock did
        dt = now - last
        if state == "train" and work is not None:
            pending[work] = pending.get(work, 0.0) + dt
        elif ahead_on:
            ahead_s += dt
        else:
            buckets[_STATE_BUCKET.get(state, "idle")] += dt
        last = now
        kind = e.get("event")
        if kind == "train":
            work = _key(e)
            state = "train" if work is not None else "idle"
            if work is not None:
                pending.setdefault(work, 0.0)
                if ahead_s and int(e.get("ahead_steps", 0) or 0) > 0:
                    pending[work] += ahead_s
                else:
                    buckets["aborted"] += ahead_s
            ahead_on, ahead_s = False, 0.0
        elif kind == "ahead":
            ahead_on, ahead_s = True, 0.0
        elif kind == "ahead-done":
            ahead_on = False
        elif kind == "ahead-dropped":
            buckets["aborted"] += ahead_s
            ahead_on, ahead_s = False, 0.0
        elif kind == "ready":
            state = "barrier"
        elif kind == "catch-up":
            work, state = None, "barrier"
        elif kind == "exchange":
            state = "comm"
        elif kind in ("exchanged", "exchange-failed"):
            state = "barrier"
        elif kind == "verdict":
            verdict = e.get("verdict")
            key = _key(e, "round_attempt")
            current = work is None or key is None or work[:2] == key[:2]
            if verdict in ("aborted", "resync"):
                settle(key, "aborted" if verdict == "aborted" else "rejected")
                if current:
                    state, work = "idle", None
            elif current:  # committed (the `committed` event follows once saved) or pending
                state = "barrier"
        elif kind == "committed":
            cell, rnd = str(e.get("cell")), int(e.get("round", -1))
            if int(e.get("samples", 0) or 0) > 0 and not e.get("catch_up"):
                for key in [k for k in pending if k[0] == cell and k[1] == rnd]:
                    settle(key, "committed")
            # the save that announces a commit runs beside the next round, which may have started
            if work is None or work[:2] == (cell, rnd):
                state, work = "idle", None
        elif kind == "dropped":
            key = _key(e)
            why = str(e.get("why", ""))
            if key is not None and key in pending:
                if why == "leaving":
                    settle(key, "preempted")
                elif why.endswith("committed with another hash"):
                    settle(key, "rejected")
                else:
                    dropped.add(key)
            state, work = "idle", None
        elif kind == "sync":
            state = "resync"
        elif kind in ("synced", "sync-failed", "sync-cancelled"):
            state = "idle" if state == "resync" else state
    buckets["unresolved"] += ahead_s  # trained ahead for a round that never came
    for key in list(pending):
        settle(key, facts.fate_of_dropped(key) if key in dropped else "unresolved")
    return WorkerAccount(last - start, buckets)
