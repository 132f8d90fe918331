"""Fault definitions shared by the simulator (`bagel-sim run`) and the chaos runner.

A fault is a frozen dataclass on a schedule; scenario TOML files list them as
`[[faults]]` tables. Keeping them in the package (not in tests) follows hivemind's
`Fault` enum in tests/test_allreduce_fault_tolerance.py and torchft's `EventInjector`:
the tests, the discrete-event engine and the chaos runner all speak the same vocabulary.

Which runner supports what:

| kind               | sim `run` | chaos | meaning                                                    |
| ------------------ | --------- | ----- | ---------------------------------------------------------- |
| `kill`             | yes       | yes   | SIGKILL `fraction` (or `count`) of live workers within `within_s` |
| `leave`            | yes       | yes   | SIGTERM: graceful Leave of `fraction`/`count` live workers |
| `stop`             | yes       | yes   | SIGSTOP for `duration_s`, then SIGCONT                     |
| `partition`        | yes       | bed   | cut `fraction`/`count` workers off for `duration_s`; bed: cut `link` |
| `coordinator-kill` | no        | yes   | SIGKILL the coordinator, restart it after `duration_s`     |
| `latency`          | no        | yes   | add `latency_ms` in the fault proxy for `duration_s` (0 = rest of the run) |
| `bandwidth`        | no        | yes   | cap the proxy (bed: tbf on `link`) at `bandwidth_bytes_per_s` |
| `loss`             | no        | bed   | drop `loss_pct` % of the packets on `link` for `duration_s` |
| `reset`            | no        | yes   | reset the proxy's open connections                         |
| `hang`             | no        | yes   | the proxy stops forwarding for `duration_s`                |

"bed" means `bagel-sim chaos` with `chaos.bed = true` (sim/chaos/bed.py): the run lives on
the network test bed, and `link` names one of its links (`home1`, `home1-2`, `pub1`, `coord`);
`direction` (`up`, `down`, or empty for both) picks the side a `bandwidth` or `loss` fault
shapes.

Byzantine worker behaviours (`--byzantine MODE` on a worker) are listed in
`ByzantineMode`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any


class FaultError(ValueError):
    """A fault table is malformed; the message names the offending key."""


class FaultKind(str, Enum):
    KILL = "kill"
    LEAVE = "leave"
    STOP = "stop"
    PARTITION = "partition"
    COORDINATOR_KILL = "coordinator-kill"
    LATENCY = "latency"
    BANDWIDTH = "bandwidth"
    RESET = "reset"
    HANG = "hang"
    LOSS = "loss"


class ByzantineMode(str, Enum):
    SIGN_FLIP = "sign-flip"  # send -delta
    SCALE = "scale"  # send delta x a large factor
    NAN = "nan"  # send non-finite values
    ZERO = "zero"  # send zeros (freeload) while claiming samples
    STALE = "stale"  # send the previous round's delta
    ALIE = "alie"  # "A Little Is Enough": delta - z x (an estimate of the honest std), robust/attacks.py
    IPM = "ipm"  # inner-product manipulation: -eps x delta, robust/attacks.py
    FREELOAD_ZERO = "freeload-zero"  # send zeros, claim the full samples
    FREELOAD_REPLAY = "freeload-replay"  # send its first delta again every round
    BUDGET_LIAR = "budget-liar"  # claim 1e9 samples/s, 10x the samples in a tenth of the time
    BAD_REDUCER = "bad-reducer"  # contribute honestly, return a doctored averaged part as a reducer


SIM_KINDS = frozenset({FaultKind.KILL, FaultKind.LEAVE, FaultKind.STOP, FaultKind.PARTITION})
_POPULATION_KINDS = SIM_KINDS


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    at_s: float
    fraction: float = 0.0  # of live workers at `at_s` (population faults)
    count: int = 0  # or an exact number of workers (wins over fraction when > 0)
    within_s: float = 0.0  # spread the hits uniformly over [at_s, at_s + within_s]
    duration_s: float = 0.0  # stop / partition / proxy faults / coordinator downtime
    latency_ms: float = 0.0
    bandwidth_bytes_per_s: float = 0.0
    workers: tuple[int, ...] = ()  # chaos: explicit worker indices instead of fraction/count
    link: str = ""  # chaos bed: the link a partition / bandwidth / loss fault acts on
    loss_pct: float = 0.0  # loss: the share of packets dropped, in percent
    direction: str = ""  # bandwidth / loss on the bed: "up", "down", or "" (both)

    @property
    def end_s(self) -> float:
        return self.at_s + max(self.within_s, self.duration_s)


_NUMERIC = {
    "at_s",
    "at_h",
    "fraction",
    "within_s",
    "duration_s",
    "duration_h",
    "latency_ms",
    "bandwidth_bytes_per_s",
    "loss_pct",
}
_KNOWN = _NUMERIC | {"kind", "count", "workers", "link", "direction"}
DIRECTIONS = ("", "up", "down")


def _num(where: str, key: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise FaultError(f"{where}.{key}: expected a number, got {type(v).__name__}")
    if v < 0:
        raise FaultError(f"{where}.{key}: must be >= 0")
    return float(v)


def _text(where: str, key: str, v: Any) -> str:
    if not isinstance(v, str):
        raise FaultError(f"{where}.{key}: expected a string, got {type(v).__name__}")
    return v


def parse_fault(table: Mapping[str, Any], where: str = "faults[0]") -> Fault:
    """One `[[faults]]` table -> Fault. Times may be given in seconds (`at_s`) or hours (`at_h`)."""
    if not isinstance(table, Mapping):
        raise FaultError(f"{where}: must be a table")
    for key in table:
        if key not in _KNOWN:
            raise FaultError(f"unknown key {where}.{key}")
    if "kind" not in table:
        raise FaultError(f"{where}.kind: required")
    try:
        kind = FaultKind(table["kind"])
    except ValueError:
        raise FaultError(f"{where}.kind: {table['kind']!r} is not one of {[k.value for k in FaultKind]}") from None
    if ("at_s" in table) == ("at_h" in table):
        raise FaultError(f"{where}: give exactly one of at_s, at_h")
    at_s = _num(where, "at_s", table["at_s"]) if "at_s" in table else _num(where, "at_h", table["at_h"]) * 3600.0
    if "duration_s" in table and "duration_h" in table:
        raise FaultError(f"{where}: give at most one of duration_s, duration_h")
    duration_s = (
        _num(where, "duration_h", table["duration_h"]) * 3600.0
        if "duration_h" in table
        else _num(where, "duration_s", table.get("duration_s", 0.0))
    )
    count = table.get("count", 0)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise FaultError(f"{where}.count: expected a non-negative integer")
    workers = table.get("workers", [])
    if not isinstance(workers, list) or not all(
        isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in workers
    ):
        raise FaultError(f"{where}.workers: expected a list of worker indices")
    fraction = _num(where, "fraction", table.get("fraction", 0.0))
    if fraction > 1.0:
        raise FaultError(f"{where}.fraction: must be in [0, 1]")
    fault = Fault(
        kind=kind,
        at_s=at_s,
        fraction=fraction,
        count=count,
        within_s=_num(where, "within_s", table.get("within_s", 0.0)),
        duration_s=duration_s,
        latency_ms=_num(where, "latency_ms", table.get("latency_ms", 0.0)),
        bandwidth_bytes_per_s=_num(where, "bandwidth_bytes_per_s", table.get("bandwidth_bytes_per_s", 0.0)),
        workers=tuple(workers),
        link=_text(where, "link", table.get("link", "")),
        loss_pct=_num(where, "loss_pct", table.get("loss_pct", 0.0)),
        direction=_text(where, "direction", table.get("direction", "")),
    )
    if fault.direction not in DIRECTIONS:
        raise FaultError(f"{where}.direction: {fault.direction!r} is not one of 'up', 'down' ('' or absent: both)")
    if fault.loss_pct > 100:
        raise FaultError(f"{where}.loss_pct: must be in [0, 100]")
    if kind is FaultKind.LOSS and fault.loss_pct <= 0:
        raise FaultError(f"{where}.loss_pct: required for a loss fault")
    if kind is FaultKind.LOSS and not fault.link:
        raise FaultError(f"{where}.link: a loss fault needs the bed link it acts on")
    hits_workers = fault.fraction > 0 or fault.count > 0 or fault.workers
    if kind in _POPULATION_KINDS and not hits_workers and not (kind is FaultKind.PARTITION and fault.link):
        raise FaultError(f"{where}: a {kind.value} fault needs fraction, count or workers")
    if fault.link and hits_workers:
        raise FaultError(
            f"{where}: a fault on link {fault.link!r} hits whoever is behind it; drop workers/count/fraction"
        )
    if kind in (FaultKind.STOP, FaultKind.PARTITION, FaultKind.HANG) and fault.duration_s <= 0:
        raise FaultError(f"{where}.duration_s: a {kind.value} fault needs a positive duration")
    if kind is FaultKind.LATENCY and fault.latency_ms <= 0:
        raise FaultError(f"{where}.latency_ms: required for a latency fault")
    if kind is FaultKind.BANDWIDTH and fault.bandwidth_bytes_per_s <= 0:
        raise FaultError(f"{where}.bandwidth_bytes_per_s: required for a bandwidth fault")
    return fault


def parse_faults(tables: Sequence[Mapping[str, Any]], *, for_sim: bool) -> tuple[Fault, ...]:
    if not isinstance(tables, list):
        raise FaultError("faults: must be an array of tables ([[faults]])")
    out = []
    for i, t in enumerate(tables):
        f = parse_fault(t, f"faults[{i}]")
        if for_sim and f.kind not in SIM_KINDS:
            raise FaultError(f"faults[{i}].kind: {f.kind.value!r} needs real processes; use `bagel-sim chaos`")
        if for_sim and (f.link or f.direction):
            raise FaultError(f"faults[{i}].link: link faults need the network test bed; use `bagel-sim chaos`")
        out.append(f)
    return tuple(sorted(out, key=lambda f: f.at_s))


def fault_as_dict(f: Fault) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for fl in fields(f):
        v = getattr(f, fl.name)
        if fl.name == "kind":
            d["kind"] = f.kind.value
        elif v or fl.name == "at_s":
            d[fl.name] = list(v) if isinstance(v, tuple) else v
    return d
