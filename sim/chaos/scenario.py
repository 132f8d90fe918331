"""Chaos scenario files: which run, how many real workers, and which faults when.

A chaos scenario is a TOML file (`sim/scenarios/chaos-*.toml`), parsed by a pure function
into a frozen `ChaosScenario`; unknown keys and wrong types are errors that name the key
(`[chaos]` and `[workers]` go through the run spec's builder, `bagel.protocol.typedtoml`).
Faults are the shared `[[faults]]` tables of `sim/faults.py`. Layout:

    [chaos]
    name = "chaos-short"
    seed = 0                    # picks the victims of count/fraction faults
    progress_bound_s = 60.0     # invariant `progress_resumes`: a commit within this after each fault
    startup_timeout_s = 240.0   # until the first round commits (t = 0 of the fault schedule)
    max_duration_s = 300.0      # hard cap on the run after t = 0
    settle_commits = 2          # after the last fault ended, stop once this many rounds committed
    proxy = true                # put the TCP fault proxy in front of the coordinator
    tick_ms = 100               # coordinator --tick-ms
    run_spec = '''...'''        # the run spec (TOML text) the coordinator serves

    [workers]
    count = 3
    throttle = 1.0              # or a list, one per worker
    reduce_timeout_s = 20.0
    extra_args = []             # appended to every `bagel-worker join`
    [workers.byzantine]
    5 = "sign-flip"             # worker index -> --byzantine mode

    [[faults]]
    kind = "kill"               # SIGKILL worker 1's process group at t = 10 s;
    at_s = 10.0                 # duration_s > 0 restarts it (same data dir) after that long
    workers = [1]

On the network test bed (`chaos.bed = true`, root only; sim/chaos/bed.py runs it):

    [chaos]
    bed = true
    proxy = false               # the fault proxy cannot reach into the bed's namespaces
    [bed]
    tag = "chaos"               # NetLab tag: namespaces bagelnl-<tag>-* (`--bed-tag` overrides)
    placement = ["home1", "home1", "home2", "public"]   # one per worker: behind a NAT or public

    [[faults]]
    kind = "partition"          # cut home1's uplink: its workers lose coordinator and peers
    at_s = 5.0
    duration_s = 8.0
    link = "home1"
    [[faults]]
    kind = "loss"               # drop 5 % of the packets pub1 sends, for 8 s
    at_s = 20.0
    duration_s = 8.0
    link = "pub1"
    loss_pct = 5.0
    direction = "up"

Times (`at_s`) count from the first committed round, so faults hit a run that is training,
whatever the start-up took on a loaded machine.

Chaos meaning of each kind (`sim/faults.py` has the vocabulary):
`kill` SIGKILL (restart after `duration_s` if > 0), `leave` SIGTERM (graceful Leave),
`stop` SIGSTOP for `duration_s` then SIGCONT, `coordinator-kill` SIGKILL the coordinator
and restart it on the same data dir after `duration_s`, and the proxy faults `latency`,
`bandwidth` (for `duration_s`, 0 = the rest of the run), `reset`, `hang` (for `duration_s`).
On loopback `partition` is refused: the coordinator proxy is shared by all workers, so one
worker cannot be cut off alone. On the bed the coordinator runs in the public segment and
each worker in its own namespace (`placement`), and `partition`, `bandwidth` (tbf) and `loss`
act on the bed's `link` (a home's uplink, or one host's link) for `duration_s`; the proxy
faults (`latency`, `reset`, `hang`) are refused there (this kernel may have no netem).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bagel.protocol.runspec import RunSpec, SpecError, parse_spec
from bagel.protocol.typedtoml import TomlTableError, convert, from_table, load_document, toml_field
from bagel.sim.faults import ByzantineMode, Fault, FaultError, FaultKind, parse_faults
from bagel.sim.netlab.topology import MAX_HOMES, MAX_PER_HOME, MAX_PUBLIC, Topology, TopologyError, check_tag, plan

PROXY_KINDS = frozenset({FaultKind.LATENCY, FaultKind.BANDWIDTH, FaultKind.RESET, FaultKind.HANG})
WORKER_KINDS = frozenset({FaultKind.KILL, FaultKind.LEAVE, FaultKind.STOP})
LINK_KINDS = frozenset({FaultKind.PARTITION, FaultKind.BANDWIDTH, FaultKind.LOSS})
PUBLIC = "public"


@dataclass(frozen=True)
class BedPlan:
    """Where a bed run puts its processes: the coordinator on `coord`, and worker i behind
    the NAT of `placement[i]` (`home<h>`) or on the public segment (`public`), each on a host
    of its own (`home<h>-<j>`, `pub<k>`, numbered in worker order)."""

    tag: str
    placement: tuple[str, ...]

    @property
    def homes(self) -> int:
        return max((int(p.removeprefix("home")) for p in self.placement if p != PUBLIC), default=0)

    @property
    def per_home(self) -> int:
        counts = [self.placement.count(p) for p in set(self.placement) if p != PUBLIC]
        return max(counts, default=0)

    @property
    def public(self) -> int:
        return self.placement.count(PUBLIC)

    def topology(self) -> Topology:
        return plan(self.tag, self.homes, self.per_home, self.public)

    def node_of(self, worker: int) -> str:
        where = self.placement[worker]
        nth = self.placement[: worker + 1].count(where)
        return f"pub{nth}" if where == PUBLIC else f"{where}-{nth}"

    def with_tag(self, tag: str) -> BedPlan:
        check_tag(tag)
        return BedPlan(tag, self.placement)


def default_placement(workers: int) -> tuple[str, ...]:
    """Round-robin over home1, home2 and the public segment."""
    cycle = ("home1", "home2", PUBLIC)
    return tuple(cycle[i % len(cycle)] for i in range(workers))


class ChaosScenarioError(TomlTableError):
    """The chaos scenario is malformed; the message names the offending key."""


@dataclass(frozen=True)
class ChaosScenario:
    name: str
    run_spec_text: str
    spec: RunSpec = field(compare=False, repr=False)
    workers: int = 3
    throttle: tuple[float, ...] = (1.0,)  # per worker (the last value repeats)
    byzantine: Mapping[int, str] = field(default_factory=dict)
    reduce_timeout_s: float = 20.0
    extra_worker_args: tuple[str, ...] = ()
    faults: tuple[Fault, ...] = ()
    seed: int = 0
    progress_bound_s: float = 60.0
    startup_timeout_s: float = 240.0
    max_duration_s: float = 300.0
    settle_commits: int = 2
    proxy: bool = True
    tick_ms: int = 100
    bed: BedPlan | None = None  # chaos.bed = true: run on the network test bed
    source: str = field(default="", compare=False, repr=False)

    def throttle_of(self, index: int) -> float:
        return self.throttle[min(index, len(self.throttle) - 1)]

    @property
    def last_fault_end_s(self) -> float:
        return max((f.end_s for f in self.faults), default=0.0)


# ---------------------------------------------------------------- the file's tables


def _positive(where: str, v: float) -> None:
    if v <= 0:
        raise ChaosScenarioError(f"{where}: must be > 0")


def _non_negative(where: str, v: float) -> None:
    if v < 0:
        raise ChaosScenarioError(f"{where}: must be >= 0")


def _name(where: str, v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ChaosScenarioError(f"{where}: a non-empty string")
    return v


def _spec_text(where: str, v: Any) -> str:
    if not isinstance(v, str):
        raise ChaosScenarioError(f"{where}: required, the run spec's TOML text")
    return v


def _flag(where: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ChaosScenarioError(f"{where}: true or false")
    return v


def _count(where: str, v: int) -> None:
    _positive(where, v)
    if v > 64:
        raise ChaosScenarioError(f"{where}: at most 64 real workers on one machine")


def _throttle(where: str, v: Any) -> tuple[float, ...]:
    items = v if isinstance(v, list) else [v]
    if not items:
        raise ChaosScenarioError(f"{where}: a number >= 1 or a non-empty list of them")
    out = []
    for i, x in enumerate(items):
        x = convert(f"{where}[{i}]", x, float, error=ChaosScenarioError)
        _non_negative(f"{where}[{i}]", x)
        out.append(x)
    if any(x < 1.0 for x in out):
        raise ChaosScenarioError(f"{where}: every value must be >= 1 (1 = full speed)")
    return tuple(out)


def _byzantine_table(where: str, v: Any) -> tuple[tuple[str, Any], ...]:
    if not isinstance(v, dict):
        raise ChaosScenarioError(f"[{where}] must be a table of worker index = mode")
    return tuple(v.items())


def _strings(where: str, v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(a, str) for a in v):
        raise ChaosScenarioError(f"{where}: a list of strings")
    return tuple(v)


@dataclass(frozen=True)
class ChaosSection:
    """`[chaos]` as written (the module docstring has the layout)."""

    run_spec: str = toml_field(parse=_spec_text, required="required, the run spec's TOML text")
    name: str = toml_field("chaos", parse=_name)
    seed: int = toml_field(0, check=_non_negative)
    progress_bound_s: float = toml_field(60.0, check=_positive)
    startup_timeout_s: float = toml_field(240.0, check=_positive)
    max_duration_s: float = toml_field(300.0, check=_positive)
    settle_commits: int = toml_field(2, check=_non_negative)
    proxy: bool = toml_field(True, parse=_flag)
    tick_ms: int = toml_field(100, check=_positive)
    bed: bool = toml_field(False, parse=_flag)


def _tag(where: str, v: Any) -> str:
    if not isinstance(v, str):
        raise ChaosScenarioError(f"{where}: a string")
    try:
        return check_tag(v)
    except TopologyError as e:
        raise ChaosScenarioError(f"{where}: {e}") from None


def _placement(where: str, v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not v:
        raise ChaosScenarioError(f"{where}: a non-empty list, one of 'home1'..'home{MAX_HOMES}' or 'public' per worker")
    for i, p in enumerate(v):
        home = isinstance(p, str) and p.startswith("home") and p[4:].isdigit() and 1 <= int(p[4:]) <= MAX_HOMES
        if not (home or p == PUBLIC):
            raise ChaosScenarioError(f"{where}[{i}]: {p!r} is not one of 'home1'..'home{MAX_HOMES}' or 'public'")
    return tuple(v)


@dataclass(frozen=True)
class BedSection:
    """`[bed]` as written: the NetLab tag and where each worker sits."""

    tag: str = toml_field("chaos", parse=_tag)
    placement: tuple[str, ...] = toml_field((), parse=_placement)


@dataclass(frozen=True)
class WorkersSection:
    """`[workers]` as written; the worker indices of `byzantine` are checked against count."""

    count: int = toml_field(3, check=_count)
    throttle: tuple[float, ...] = toml_field((1.0,), parse=_throttle)
    byzantine: tuple[tuple[str, Any], ...] = toml_field((), parse=_byzantine_table)  # (index, mode) pairs
    reduce_timeout_s: float = toml_field(20.0, check=_positive)
    extra_args: tuple[str, ...] = toml_field((), parse=_strings)


_TOP_KEYS = {"chaos", "workers", "faults", "bed"}


def _byzantine(pairs: tuple[tuple[str, Any], ...], count: int) -> dict[int, str]:
    byzantine: dict[int, str] = {}
    modes = [m.value for m in ByzantineMode]
    for k, mode in pairs:
        if not k.isdigit() or int(k) >= count:
            raise ChaosScenarioError(f"workers.byzantine.{k}: not a worker index in [0, {count})")
        if mode not in modes:
            raise ChaosScenarioError(f"workers.byzantine.{k}: {mode!r} is not one of {modes}")
        byzantine[int(k)] = mode
    return byzantine


def parse_chaos_scenario(text: str) -> ChaosScenario:
    """Parse and validate a chaos scenario (ChaosScenarioError names the bad key)."""
    data = load_document(
        text,
        allowed=_TOP_KEYS,
        unknown=lambda key: f"unknown key {key} (expected [chaos], [workers], [bed], [[faults]])",
        error=ChaosScenarioError,
    )
    chaos = from_table(ChaosSection, data.get("chaos", {}), "chaos", error=ChaosScenarioError)
    try:
        spec = parse_spec(chaos.run_spec)
    except SpecError as e:
        raise ChaosScenarioError(f"chaos.run_spec: {e}") from None
    workers = from_table(WorkersSection, data.get("workers", {}), "workers", error=ChaosScenarioError)
    count = workers.count
    byzantine = _byzantine(workers.byzantine, count)

    bed = _bed_plan(chaos, data, count)
    try:
        faults = parse_faults(data.get("faults", []), for_sim=False)
    except FaultError as e:
        raise ChaosScenarioError(str(e)) from None
    links = {n.name for n in bed.topology().links()} if bed is not None else set()
    for i, f in enumerate(faults):
        where = f"faults[{i}] ({f.kind.value} at {f.at_s:g}s)"
        if bed is not None:
            _check_bed_fault(where, f, links)
        elif f.kind is FaultKind.PARTITION:
            raise ChaosScenarioError(
                f"{where}: partition needs chaos.bed = true (the network test bed): on loopback all workers "
                "share the coordinator proxy, so one worker cannot be cut off alone"
            )
        elif f.link or f.direction or f.kind is FaultKind.LOSS:
            raise ChaosScenarioError(f"{where}: link faults (link, direction, loss) need chaos.bed = true")
        if f.kind in PROXY_KINDS and not chaos.proxy and bed is None:
            raise ChaosScenarioError(f"{where}: needs chaos.proxy = true")
        if f.kind in PROXY_KINDS and (f.workers or f.count or f.fraction):
            raise ChaosScenarioError(
                f"{where}: proxy faults apply to the coordinator link of every worker; drop workers/count/fraction"
            )
        if any(w >= count for w in f.workers):
            raise ChaosScenarioError(f"{where}.workers: indices must be < workers.count = {count}")
    sc = ChaosScenario(
        name=chaos.name,
        run_spec_text=chaos.run_spec,
        spec=spec,
        workers=count,
        throttle=workers.throttle,
        byzantine=byzantine,
        reduce_timeout_s=workers.reduce_timeout_s,
        extra_worker_args=workers.extra_args,
        faults=faults,
        seed=chaos.seed,
        progress_bound_s=chaos.progress_bound_s,
        startup_timeout_s=chaos.startup_timeout_s,
        max_duration_s=chaos.max_duration_s,
        settle_commits=chaos.settle_commits,
        proxy=chaos.proxy,
        tick_ms=chaos.tick_ms,
        bed=bed,
        source=text,
    )
    if sc.max_duration_s < sc.last_fault_end_s:
        raise ChaosScenarioError(
            f"chaos.max_duration_s: {sc.max_duration_s:g}s ends before the last fault ({sc.last_fault_end_s:g}s)"
        )
    return sc


def _bed_plan(chaos: ChaosSection, data: Mapping[str, Any], count: int) -> BedPlan | None:
    if not chaos.bed:
        if "bed" in data:
            raise ChaosScenarioError("[bed]: needs chaos.bed = true")
        return None
    if chaos.proxy:
        raise ChaosScenarioError(
            "chaos.proxy: must be false with chaos.bed = true (the fault proxy runs in the runner's "
            "namespace, out of the bed's reach; link faults act on the bed instead)"
        )
    section = from_table(BedSection, data.get("bed", {}), "bed", error=ChaosScenarioError)
    placement = section.placement or default_placement(count)
    if len(placement) != count:
        raise ChaosScenarioError(f"bed.placement: {len(placement)} entries for workers.count = {count}")
    bed = BedPlan(section.tag, placement)
    if bed.per_home > MAX_PER_HOME or bed.public > MAX_PUBLIC:
        raise ChaosScenarioError(
            f"bed.placement: at most {MAX_PER_HOME} workers behind one home and {MAX_PUBLIC} public ones"
        )
    return bed


def _check_bed_fault(where: str, f: Fault, links: set[str]) -> None:
    """A fault on the bed: link faults name a link of the planned bed, the proxy's are refused."""
    if f.kind in PROXY_KINDS - LINK_KINDS:
        raise ChaosScenarioError(
            f"{where}: needs the fault proxy, which a bed run does not have; on the bed use partition, "
            "bandwidth or loss on a link (latency needs sch_netem, which the bed cannot count on)"
        )
    if f.kind in LINK_KINDS:
        if f.link not in links:
            raise ChaosScenarioError(
                f"{where}.link: {f.link!r} is not a link of this bed (links: {', '.join(sorted(links))})"
            )
        if f.kind is FaultKind.PARTITION and f.direction:
            raise ChaosScenarioError(f"{where}.direction: a partition cuts both directions; drop direction")
        if f.kind is FaultKind.BANDWIDTH and not 0.01 <= f.bandwidth_bytes_per_s * 8 / 1e6 <= 100_000:
            raise ChaosScenarioError(f"{where}.bandwidth_bytes_per_s: the bed caps between 1250 and 1.25e10 B/s")
    elif f.link or f.direction:
        raise ChaosScenarioError(f"{where}: link and direction belong to partition, bandwidth and loss faults")


def load_chaos_scenario(path: str | Path) -> ChaosScenario:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ChaosScenarioError(f"{p}: {e.strerror or e}") from None
    return parse_chaos_scenario(text)


__all__ = [
    "LINK_KINDS",
    "PROXY_KINDS",
    "PUBLIC",
    "BedPlan",
    "BedSection",
    "default_placement",
    "WORKER_KINDS",
    "ChaosScenario",
    "ChaosScenarioError",
    "ChaosSection",
    "WorkersSection",
    "load_chaos_scenario",
    "parse_chaos_scenario",
]
