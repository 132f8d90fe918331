"""The goodput buckets: where a worker's offered compute went, one name and one definition each.

The simulator's ledger (`sim/discrete/ledger.py`) and the real worker's accounting
(`worker/goodput.py`, which the demo's report uses) hand every second of every online worker
to exactly one of these buckets, so the buckets add up to the offered compute. Goodput is
`committed / offered`; utilisation is all training (wasted or not) over offered. The names
and definitions are the simulator's, word for word; `tests/test_worker_goodput.py` checks
that every bucket here is one of the simulator's, defined the same way.
"""

from __future__ import annotations

BUCKETS: tuple[str, ...] = (
    "committed",
    "aborted",
    "straggler",
    "preempted",
    "rejected",
    "resync",
    "comm",
    "barrier",
    "idle",
    "unresolved",
)
BUCKET_DEFINITIONS: dict[str, str] = {
    "committed": "training in rounds that committed, by contributors whose hash agreed",
    "aborted": "training in rounds that were aborted (no quorum, timeout, orphaned)",
    "straggler": "training by members cut off at the freeze, or who sat a committed round out",
    "preempted": "training by a worker that died or was cut off before its contribution counted",
    "rejected": "training whose reported hash disagreed with the committed one",
    "resync": "state downloads (joins, moves, resyncs after a bad hash)",
    "comm": "the pseudo-gradient exchange while the GPU idles (with overlap: what training ahead leaves)",
    "barrier": "trained and waiting: for slower members, for the verdict, at a lock-step barrier",
    "idle": "no work: standby, waiting for the next round or for an instruction",
    "unresolved": "training in rounds still open when the simulation ended (neither committed nor wasted yet)",
}
WASTE: tuple[str, ...] = ("aborted", "straggler", "preempted", "rejected", "resync", "comm", "barrier", "idle")
TRAINING: tuple[str, ...] = ("committed", "aborted", "straggler", "preempted", "rejected", "unresolved")
