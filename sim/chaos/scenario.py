"""Chaos scenario files: which run, how many real workers, and which faults when.

A chaos scenario is a TOML file (`sim/scenarios/chaos-*.toml`), parsed by a pure function
into a frozen `ChaosScenario`; unknown keys are errors that name the key (as the run spec
does). Faults are the shared `[[faults]]` tables of `sim/faults.py`. Layout:

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

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Mapping

from bagel.protocol.runspec import RunSpec, SpecError, parse_spec
from bagel.sim.faults import ByzantineMode, Fault, FaultError, FaultKind, parse_faults

PROXY_KINDS = frozenset({FaultKind.LATENCY, FaultKind.BANDWIDTH, FaultKind.RESET, FaultKind.HANG})
WORKER_KINDS = frozenset({FaultKind.KILL, FaultKind.LEAVE, FaultKind.STOP})


class ScenarioError(ValueError):
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


_CHAOS_KEYS = {
    "name", "seed", "progress_bound_s", "startup_timeout_s", "max_duration_s", "settle_commits",
    "proxy", "tick_ms", "run_spec",
}
_WORKER_KEYS = {"count", "throttle", "byzantine", "reduce_timeout_s", "extra_args"}
_TOP_KEYS = {"chaos", "workers", "faults"}


def _num(where: str, v: Any, *, positive: bool = False, integer: bool = False) -> Any:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise ScenarioError(f"{where}: expected {'an integer' if integer else 'a number'}, got {type(v).__name__}")
    if v < 0 or (positive and v == 0):
        raise ScenarioError(f"{where}: must be {'> 0' if positive else '>= 0'}")
    return v


def _table(where: str, v: Any, known: set[str]) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ScenarioError(f"[{where}] must be a table")
    for key in v:
        if key not in known:
            raise ScenarioError(f"unknown key {where}.{key}")
    return v


def parse_scenario(text: str) -> ChaosScenario:
    """Parse and validate a chaos scenario (ScenarioError names the bad key)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"not valid TOML: {e}") from None
    for key in data:
        if key not in _TOP_KEYS:
            raise ScenarioError(f"unknown key {key} (expected [chaos], [workers], [[faults]])")
    chaos = _table("chaos", data.get("chaos", {}), _CHAOS_KEYS)
    workers = _table("workers", data.get("workers", {}), _WORKER_KEYS)

    name = chaos.get("name", "chaos")
    if not isinstance(name, str) or not name:
        raise ScenarioError("chaos.name: a non-empty string")
    if "run_spec" not in chaos or not isinstance(chaos["run_spec"], str):
        raise ScenarioError("chaos.run_spec: required, the run spec's TOML text")
    try:
        spec = parse_spec(chaos["run_spec"])
    except SpecError as e:
        raise ScenarioError(f"chaos.run_spec: {e}") from None

    count = _num("workers.count", workers.get("count", 3), positive=True, integer=True)
    if count > 64:
        raise ScenarioError("workers.count: at most 64 real workers on one machine")
    throttle_raw = workers.get("throttle", 1.0)
    throttle_list = throttle_raw if isinstance(throttle_raw, list) else [throttle_raw]
    if not throttle_list:
        raise ScenarioError("workers.throttle: a number >= 1 or a non-empty list of them")
    throttle = tuple(float(_num(f"workers.throttle[{i}]", t)) for i, t in enumerate(throttle_list))
    if any(t < 1.0 for t in throttle):
        raise ScenarioError("workers.throttle: every value must be >= 1 (1 = full speed)")
    byz_raw = workers.get("byzantine", {})
    if not isinstance(byz_raw, dict):
        raise ScenarioError("[workers.byzantine] must be a table of worker index = mode")
    byzantine: dict[int, str] = {}
    modes = [m.value for m in ByzantineMode]
    for k, mode in byz_raw.items():
        if not k.isdigit() or int(k) >= count:
            raise ScenarioError(f"workers.byzantine.{k}: not a worker index in [0, {count})")
        if mode not in modes:
            raise ScenarioError(f"workers.byzantine.{k}: {mode!r} is not one of {modes}")
        byzantine[int(k)] = mode
    extra = workers.get("extra_args", [])
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise ScenarioError("workers.extra_args: a list of strings")

    try:
        faults = parse_faults(data.get("faults", []), for_sim=False)
    except FaultError as e:
        raise ScenarioError(str(e)) from None
    proxy = chaos.get("proxy", True)
    if not isinstance(proxy, bool):
        raise ScenarioError("chaos.proxy: true or false")
    for i, f in enumerate(faults):
        where = f"faults[{i}] ({f.kind.value} at {f.at_s:g}s)"
        if f.kind is FaultKind.PARTITION:
            raise ScenarioError(
                f"{where}: partition is not supported by bagel-sim chaos: all workers share the "
                "coordinator proxy, so one worker cannot be cut off alone"
            )
        if f.kind in PROXY_KINDS and not proxy:
            raise ScenarioError(f"{where}: needs chaos.proxy = true")
        if f.kind in PROXY_KINDS and (f.workers or f.count or f.fraction):
            raise ScenarioError(f"{where}: proxy faults apply to the coordinator link of every worker; drop workers/count/fraction")
        if any(w >= count for w in f.workers):
            raise ScenarioError(f"{where}.workers: indices must be < workers.count = {count}")
    bound = float(_num("chaos.progress_bound_s", chaos.get("progress_bound_s", 60.0), positive=True))
    sc = ChaosScenario(
        name=name,
        run_spec_text=chaos["run_spec"],
        spec=spec,
        workers=count,
        throttle=throttle,
        byzantine=byzantine,
        reduce_timeout_s=float(_num("workers.reduce_timeout_s", workers.get("reduce_timeout_s", 20.0), positive=True)),
        extra_worker_args=tuple(extra),
        faults=faults,
        seed=_num("chaos.seed", chaos.get("seed", 0), integer=True),
        progress_bound_s=bound,
        startup_timeout_s=float(_num("chaos.startup_timeout_s", chaos.get("startup_timeout_s", 240.0), positive=True)),
        max_duration_s=float(_num("chaos.max_duration_s", chaos.get("max_duration_s", 300.0), positive=True)),
        settle_commits=_num("chaos.settle_commits", chaos.get("settle_commits", 2), integer=True),
        proxy=proxy,
        tick_ms=_num("chaos.tick_ms", chaos.get("tick_ms", 100), positive=True, integer=True),
        source=text,
    )
    if sc.max_duration_s < sc.last_fault_end_s:
        raise ScenarioError(
            f"chaos.max_duration_s: {sc.max_duration_s:g}s ends before the last fault ({sc.last_fault_end_s:g}s)"
        )
    return sc


def load_scenario(path: str | Path) -> ChaosScenario:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ScenarioError(f"{p}: {e.strerror or e}") from None
    return parse_scenario(text)


__all__ = ["ChaosScenario", "PROXY_KINDS", "ScenarioError", "WORKER_KINDS", "load_scenario", "parse_scenario"]
