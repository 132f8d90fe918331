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

Times (`at_s`) count from the first committed round, so faults hit a run that is training,
whatever the start-up took on a loaded machine.

Chaos meaning of each kind (`sim/faults.py` has the vocabulary):
`kill` SIGKILL (restart after `duration_s` if > 0), `leave` SIGTERM (graceful Leave),
`stop` SIGSTOP for `duration_s` then SIGCONT, `coordinator-kill` SIGKILL the coordinator
and restart it on the same data dir after `duration_s`, and the proxy faults `latency`,
`bandwidth` (for `duration_s`, 0 = the rest of the run), `reset`, `hang` (for `duration_s`).
`partition` is refused: the coordinator proxy is shared by all workers, so one worker
cannot be cut off alone (see the chaos report's requests).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bagel.protocol.runspec import RunSpec, SpecError, parse_spec
from bagel.protocol.typedtoml import TomlTableError, convert, from_table, load_document, toml_field
from bagel.sim.faults import ByzantineMode, Fault, FaultError, FaultKind, parse_faults

PROXY_KINDS = frozenset({FaultKind.LATENCY, FaultKind.BANDWIDTH, FaultKind.RESET, FaultKind.HANG})
WORKER_KINDS = frozenset({FaultKind.KILL, FaultKind.LEAVE, FaultKind.STOP})


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


@dataclass(frozen=True)
class WorkersSection:
    """`[workers]` as written; the worker indices of `byzantine` are checked against count."""

    count: int = toml_field(3, check=_count)
    throttle: tuple[float, ...] = toml_field((1.0,), parse=_throttle)
    byzantine: tuple[tuple[str, Any], ...] = toml_field((), parse=_byzantine_table)  # (index, mode) pairs
    reduce_timeout_s: float = toml_field(20.0, check=_positive)
    extra_args: tuple[str, ...] = toml_field((), parse=_strings)


_TOP_KEYS = {"chaos", "workers", "faults"}


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
        unknown=lambda key: f"unknown key {key} (expected [chaos], [workers], [[faults]])",
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

    try:
        faults = parse_faults(data.get("faults", []), for_sim=False)
    except FaultError as e:
        raise ChaosScenarioError(str(e)) from None
    for i, f in enumerate(faults):
        where = f"faults[{i}] ({f.kind.value} at {f.at_s:g}s)"
        if f.kind is FaultKind.PARTITION:
            raise ChaosScenarioError(
                f"{where}: partition is not supported by bagel-sim chaos: all workers share the "
                "coordinator proxy, so one worker cannot be cut off alone"
            )
        if f.kind in PROXY_KINDS and not chaos.proxy:
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
        source=text,
    )
    if sc.max_duration_s < sc.last_fault_end_s:
        raise ChaosScenarioError(
            f"chaos.max_duration_s: {sc.max_duration_s:g}s ends before the last fault ({sc.last_fault_end_s:g}s)"
        )
    return sc


def load_chaos_scenario(path: str | Path) -> ChaosScenario:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ChaosScenarioError(f"{p}: {e.strerror or e}") from None
    return parse_chaos_scenario(text)


__all__ = [
    "PROXY_KINDS",
    "WORKER_KINDS",
    "ChaosScenario",
    "ChaosScenarioError",
    "ChaosSection",
    "WorkersSection",
    "load_chaos_scenario",
    "parse_chaos_scenario",
]
