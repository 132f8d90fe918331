"""`ChaosBed`: a chaos run on the network test bed (sim/netlab/), and its link faults.

With `chaos.bed = true` the driver builds a `NetLab` from the scenario's `BedPlan`: the
coordinator runs in the public segment's `coord` namespace and each worker in a namespace
of its own, behind a home router's NAT or on the public segment (`placement`). Processes
are started by the driver's supervisor through `NetLab.exec_argv` (`ip netns exec` execs in
place, so the supervisor's process groups, pids and signals work as on loopback).

The link faults have their bed meanings:

- `partition`: every IP packet of `link` dropped both ways (a home's uplink: all its
  workers lose the coordinator and their peers), for `duration_s`;
- `bandwidth`: tbf caps `link` at `bandwidth_bytes_per_s` (as Mbit/s) in `direction`;
- `loss`: `loss_pct` % of the packets of `link` dropped in `direction` (netem where the
  kernel has it, else an nftables `numgen random` drop rule).

Faults overlap freely: each link's applied shape is recomputed from the faults active on it
(the tightest cap; independent losses combine as 1 - prod(1 - p)), so undoing one fault
never undoes another. Every change is read back from the kernel (`NetLab.link_state`) and
compared with what it should be, and that reading is the fault's evidence in the report:
`applied` when it started, `undone` when it ended. A fault still active when the run
stops is undone at teardown (evidence too), and teardown then deletes the bed's namespaces
whatever happened (it is also registered with atexit by the driver, and idempotent).
Changes are serialised by a lock: a fault's undo may run in a cancelled task's cleanup
while another fault's change runs in a worker thread.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any

from bagel.sim.chaos.scenario import BedPlan
from bagel.sim.faults import Fault, FaultKind
from bagel.sim.netlab.bed import LinkState, NetLab, NetLabError, Shape, bed_namespaces

COORD_NODE = "coord"
COORD_GRPC_PORT = 7070
COORD_DHT_PORT = 7071
RATE_TOLERANCE = 0.01  # tc stores the rate in bytes/s, rounded from the kbit asked for


@dataclass
class LinkFaultRecord:
    """One link fault as the bed saw it: what was asked, and the link read back from the
    kernel when it was applied and when it was undone."""

    index: int
    kind: str
    link: str
    direction: str
    want: str
    applied: dict[str, Any] | None = None
    undone: dict[str, Any] | None = None
    undone_by: str = ""  # "end" (its duration ran out) or "teardown"
    error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "link": self.link,
            "direction": self.direction or "both",
            "want": self.want,
            "applied": self.applied,
            "undone": self.undone,
            "undone_by": self.undone_by,
            "error": self.error,
        }


@dataclass
class _Active:
    fault: Fault
    record: LinkFaultRecord


@dataclass
class ChaosBed:
    """The bed under one chaos run: build, place processes, apply and undo link faults, tear down."""

    plan: BedPlan
    lab: NetLab = field(init=False)
    records: list[LinkFaultRecord] = field(default_factory=list)
    namespaces_left: list[str] | None = None  # after teardown: the tag's namespaces still there
    torn_down: bool = False
    _active: dict[int, _Active] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.lab = NetLab(
            tag=self.plan.tag, homes=self.plan.homes, per_home=self.plan.per_home, public=self.plan.public
        )

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Build the bed (its own leftovers of a killed run first); NetLabError says why not.
        Under the lock, so a teardown that comes meanwhile (Ctrl-C) waits and then removes it."""
        with self._lock:
            if self.torn_down:
                raise NetLabError("the run stopped before its bed was built")
            self.lab.setup()

    def teardown(self) -> None:
        """Undo every active link fault (read back), then delete the bed. Safe to repeat."""
        with self._lock:
            if self.torn_down:
                return
            for index in sorted(self._active):
                # a failed undo is on its record; deleting the namespaces below removes it anyway
                with contextlib.suppress(NetLabError):
                    self._undo_locked(index, "teardown")
            self._active.clear()
            self.torn_down = True
            self.lab.teardown()
            self.namespaces_left = bed_namespaces(self.lab.topology.prefix)

    # ------------------------------------------------------------------ placement

    def worker_node(self, worker: int) -> str:
        return self.plan.node_of(worker)

    def workers_behind(self, link: str) -> list[int]:
        """The workers a fault on `link` reaches: all for the coordinator's link, those of a
        home for its uplink, the one on a host's own link."""
        n = len(self.plan.placement)
        if link == COORD_NODE:
            return list(range(n))
        return [i for i in range(n) if self.worker_node(i) == link or self.worker_node(i).startswith(link + "-")]

    def argv(self, node: str, argv: list[str]) -> list[str]:
        return self.lab.exec_argv(node, argv)

    def coordinator_addr(self) -> tuple[str, int, int]:
        """(address, gRPC port, DHT port) of the coordinator on the public segment."""
        return self.lab.ip(COORD_NODE), COORD_GRPC_PORT, COORD_DHT_PORT

    # ------------------------------------------------------------------ link faults

    def apply(self, index: int, fault: Fault) -> LinkFaultRecord:
        """Apply link fault `index` and verify it on the kernel; raises NetLabError if the
        link does not read back as it should (the record keeps what was seen)."""
        rec = LinkFaultRecord(index, fault.kind.value, fault.link, fault.direction, _want(fault))
        with self._lock:
            if self.torn_down:
                raise NetLabError("the bed is already torn down")
            self.records.append(rec)
            self._active[index] = _Active(fault, rec)
            try:
                seen = self._sync(fault.link)
            except NetLabError as e:
                rec.error = f"apply: {e}"
                raise
            rec.applied = seen.as_dict()
            problem = _mismatch(seen, self._expected(fault.link))
            if problem:
                rec.error = f"applied, but the link reads back {problem}"
                raise NetLabError(f"{fault.kind.value} on {fault.link}: {rec.error}")
        return rec

    def undo(self, index: int) -> LinkFaultRecord | None:
        """Undo link fault `index` (its duration ended) and verify; None if it is not active."""
        with self._lock:
            return self._undo_locked(index, "end")

    def _undo_locked(self, index: int, by: str) -> LinkFaultRecord | None:
        act = self._active.pop(index, None)
        if act is None:
            return None
        rec = act.record
        link = act.fault.link
        try:
            seen = self._sync(link)
        except NetLabError as e:
            rec.error = rec.error or f"undo ({by}): {e}"
            raise
        rec.undone = seen.as_dict()
        rec.undone_by = by
        problem = _mismatch(seen, self._expected(link))
        if problem:
            rec.error = rec.error or f"undone, but the link reads back {problem}"
            raise NetLabError(f"{rec.kind} on {link}: {rec.error}")
        return rec

    def active_on(self, link: str) -> list[Fault]:
        return [a.fault for a in self._active.values() if a.fault.link == link]

    def _expected(self, link: str) -> LinkState:
        """What `link` must hold given the faults active on it now."""
        faults = self.active_on(link)

        def direction(d: str) -> Shape:
            mine = [f for f in faults if f.direction in ("", d)]
            caps = [f.bandwidth_bytes_per_s * 8 / 1e6 for f in mine if f.kind is FaultKind.BANDWIDTH]
            keep = 1.0
            for f in mine:
                if f.kind is FaultKind.LOSS:
                    keep *= 1.0 - f.loss_pct / 100.0
            return Shape(min(caps) if caps else None, 0.0, round((1.0 - keep) * 100.0, 4))

        partitioned = any(f.kind is FaultKind.PARTITION for f in faults)
        return LinkState(link, partitioned, direction("up"), direction("down"))

    def _sync(self, link: str) -> LinkState:
        """Make the kernel hold `_expected(link)`, then read the link back."""
        want = self._expected(link)
        self.lab.shape_link(link, up=want.up, down=want.down)
        if want.partitioned:
            self.lab.partition(link)
        else:
            self.lab.heal(link)
        return self.lab.link_state(link)

    # ------------------------------------------------------------------ report

    def as_dict(self) -> dict[str, Any]:
        return {
            "tag": self.plan.tag,
            "namespaces": [n.ns for n in self.lab.topology.nodes],
            "coordinator": f"{COORD_NODE} ({self.lab.ip(COORD_NODE)})",
            "placement": {f"w{i}": self.worker_node(i) for i in range(len(self.plan.placement))},
            "netem": self.lab.has_netem,
            "link_faults": [r.as_dict() for r in sorted(self.records, key=lambda r: r.index)],
            "torn_down": self.torn_down,
            "namespaces_left": self.namespaces_left,
        }


def _want(f: Fault) -> str:
    side = {"": "both directions", "up": "up", "down": "down"}[f.direction]
    if f.kind is FaultKind.PARTITION:
        return f"cut {f.link} for {f.duration_s:g}s"
    if f.kind is FaultKind.BANDWIDTH:
        return f"cap {f.link} at {f.bandwidth_bytes_per_s * 8 / 1e6:g} Mbit/s ({side})" + _for(f)
    return f"drop {f.loss_pct:g} % on {f.link} ({side})" + _for(f)


def _for(f: Fault) -> str:
    return f" for {f.duration_s:g}s" if f.duration_s > 0 else " until the end"


def _mismatch(seen: LinkState, want: LinkState) -> str:
    """'' when the link holds what it should, else what differs."""
    out = []
    if seen.partitioned != want.partitioned:
        out.append(f"partitioned={seen.partitioned} (want {want.partitioned})")
    for name, s, w in (("up", seen.up, want.up), ("down", seen.down, want.down)):
        if (s.rate_mbit is None) != (w.rate_mbit is None) or (
            s.rate_mbit is not None
            and w.rate_mbit is not None
            and abs(s.rate_mbit - w.rate_mbit) > RATE_TOLERANCE * w.rate_mbit
        ):
            out.append(f"{name} rate {s.rate_mbit} Mbit/s (want {w.rate_mbit})")
        if abs(s.loss_pct - w.loss_pct) > 0.01:
            out.append(f"{name} loss {s.loss_pct:g} % (want {w.loss_pct:g})")
    return ", ".join(out)


__all__ = ["COORD_NODE", "ChaosBed", "LinkFaultRecord"]
