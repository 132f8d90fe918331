"""Simulation scenarios: TOML files parsed into frozen dataclasses.

A scenario says who the volunteers are (`[population]`), what one cell costs
(`[workload]`), what goes wrong and when (`[[faults]]`), which policies to compare, and
which run the coordinator core runs: `run_spec` is either a path (relative to the
scenario file) to a run-spec TOML, or an inline table with the run spec's sections. The
core always gets a real `RunSpec` from `bagel.protocol.runspec.parse_spec`.

Parsing is a pure function of the text, like the run spec's: an unknown key or a wrong
type is a `SimScenarioError` that names the key (the shared builder,
`bagel.protocol.typedtoml`, checks the tables against the dataclasses' field types).
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bagel.protocol.cellmemory import host_bytes_per_param
from bagel.protocol.runspec import STATE_DTYPE_NBYTES, RunSpec, SpecError, parse_spec
from bagel.protocol.typedtoml import TomlTableError, from_table, load_document
from bagel.sim.discrete.costmodel import WorkloadSpec, state_bytes_per_param
from bagel.sim.discrete.population import AvailabilitySpec, LinkSpec, PopulationSpec
from bagel.sim.faults import Fault, FaultError, parse_faults


class SimScenarioError(TomlTableError):
    """The simulation scenario is malformed; the message names the offending key."""


@dataclass(frozen=True)
class ScenarioSection:
    name: str
    description: str = ""
    workers: int = 1000
    hours: float = 24.0
    seed: int = 0
    policies: tuple[str, ...] = ("sync_dp", "diloco_wait_all", "bagel")
    # time-to-target metric: committed samples per expert cell (the router's target is
    # scaled by its compute share); 0 = no target
    target_samples_per_cell: float = 0.0


@dataclass(frozen=True)
class EngineSection:
    # coarse safety tick of the core (timers the engine does not predict still fire)
    tick_s: float = 60.0
    # sync_dp: synchronous steps folded into one core round (see policies.py); 0 = enough
    # steps of a typical group to last sync_dp_min_round_s (engine.sync_steps_per_round)
    sync_dp_steps_per_round: int = 0
    sync_dp_min_round_s: float = 300.0
    # points on the committed-rounds-over-time curves
    timeline_points: int = 97
    # "declared": live workers send no lease-only heartbeats and the engine declares a
    # dead/cut-off worker's expiry (LeaseExpired) when the daemon's lease would run out;
    # "heartbeat": workers renew their leases with heartbeats and the core's timer expires
    # them (faithful to the wire, but one event per worker per lease period).
    lease_mode: str = "declared"
    # when --workers differs from scenario.workers, scale diloco.group_batch by the same
    # factor, so a member's per-step batch (and the round's length) stays as intended
    scale_batch_with_workers: bool = True


@dataclass(frozen=True)
class Scenario:
    scenario: ScenarioSection
    run_spec_toml: str  # canonical TOML text of the run spec (before policy overrides)
    population: PopulationSpec = field(default_factory=PopulationSpec)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    engine: EngineSection = field(default_factory=EngineSection)
    faults: tuple[Fault, ...] = ()
    path: str = field(default="", compare=False)

    def run_spec(self, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> RunSpec:
        """The run spec with a policy's section overrides applied, parsed by the real parser."""
        table = tomllib.loads(self.run_spec_toml)
        for section, values in (overrides or {}).items():
            table.setdefault(section, {}).update(values)
        return parse_spec(dump_toml(table))


# ---------------------------------------------------------------- TOML text


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise SimScenarioError(f"cannot write {type(v).__name__} to TOML")


def dump_toml(table: Mapping[str, Mapping[str, Any]]) -> str:
    """Sections of scalars -> TOML text (all a run spec needs; tomllib has no writer)."""
    out = []
    for section, values in table.items():
        if not isinstance(values, Mapping):
            raise SimScenarioError(f"run_spec.{section}: must be a table")
        out.append(f"[{section}]")
        for k, v in values.items():
            if isinstance(v, Mapping):
                raise SimScenarioError(f"run_spec.{section}.{k}: nested tables are not part of a run spec")
            out.append(f"{k} = {_toml_value(v)}")
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------- typed tables


def _build(cls: Any, table: Any, where: str) -> Any:
    return from_table(cls, table, where, error=SimScenarioError)


_TOP = {"scenario", "run_spec", "population", "workload", "engine", "faults"}


def _workload(table: Any, spec: RunSpec) -> WorkloadSpec:
    """The `[workload]` table; the state's and the host's bytes per parameter follow the run
    spec (its `[sync] state_dtype` and `[ema]`) unless the table sets them."""
    work: WorkloadSpec = _build(WorkloadSpec, table, "workload")
    given = table if isinstance(table, Mapping) else {}
    ema = spec.ema.decay > 0
    if "state_bytes_per_param" not in given:
        work = dataclasses.replace(work, state_bytes_per_param=state_bytes_per_param(spec.sync.state_dtype, ema))
    if "host_bytes_per_param" not in given:
        per_param = host_bytes_per_param(STATE_DTYPE_NBYTES[spec.sync.state_dtype], ema)
        work = dataclasses.replace(work, host_bytes_per_param=float(per_param))
    return work


def parse_sim_scenario(text: str, *, base_dir: Path | None = None, path: str = "") -> Scenario:
    data = load_document(text, allowed=_TOP, unknown=lambda key: f"unknown key {key}", error=SimScenarioError)
    if "scenario" not in data:
        raise SimScenarioError("missing section [scenario]")
    if "run_spec" not in data:
        raise SimScenarioError("missing run_spec (a path or an inline table)")
    sc = _build(ScenarioSection, data["scenario"], "scenario")
    raw = data["run_spec"]
    if isinstance(raw, str):
        spec_path = (base_dir or Path(".")) / raw
        try:
            spec_text = spec_path.read_text()
        except OSError as e:
            raise SimScenarioError(f"run_spec: cannot read {spec_path}: {e.strerror}") from None
        try:
            spec_table = tomllib.loads(spec_text)
        except tomllib.TOMLDecodeError as e:
            raise SimScenarioError(f"run_spec: {spec_path} is not valid TOML: {e}") from None
    elif isinstance(raw, dict):
        spec_table = raw
    else:
        raise SimScenarioError("run_spec: expected a path or a table")
    spec_toml = dump_toml(spec_table)
    try:
        spec = parse_spec(spec_toml)
    except SpecError as e:
        raise SimScenarioError(f"run_spec: {e}") from None
    try:
        faults = parse_faults(data.get("faults", []), for_sim=True)
    except FaultError as e:
        raise SimScenarioError(str(e)) from None
    scenario = Scenario(
        scenario=sc,
        run_spec_toml=spec_toml,
        population=_build(PopulationSpec, data.get("population", {}), "population"),
        workload=_workload(data.get("workload", {}), spec),
        engine=_build(EngineSection, data.get("engine", {}), "engine"),
        faults=faults,
        path=path,
    )
    _validate(scenario)
    return scenario


def _validate(s: Scenario) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise SimScenarioError(msg)

    need(s.scenario.workers >= 1, "scenario.workers: at least 1")
    need(s.scenario.hours > 0, "scenario.hours: positive")
    need(len(s.scenario.policies) >= 1, "scenario.policies: at least one")
    need(s.engine.tick_s > 0, "engine.tick_s: positive")
    need(s.engine.sync_dp_steps_per_round >= 0, "engine.sync_dp_steps_per_round: 0 (auto) or more")
    need(s.engine.sync_dp_min_round_s > 0, "engine.sync_dp_min_round_s: positive")
    need(s.engine.timeline_points >= 2, "engine.timeline_points: at least 2")
    need(s.engine.lease_mode in ("declared", "heartbeat"), "engine.lease_mode: 'declared' or 'heartbeat'")
    need(0.0 < s.workload.mfu <= 1.0, "workload.mfu: in (0, 1]")
    need(s.workload.expert_params > 0 and s.workload.router_params > 0, "workload: parameter counts must be positive")
    av = s.population.availability
    need(
        av.session_weibull_shape > 0 and av.session_weibull_scale_h > 0,
        "population.availability: Weibull shape and scale positive",
    )
    need(av.offline_mean_h > 0, "population.availability.offline_mean_h: positive")
    need(0.0 <= av.diurnal_amplitude < 1.0, "population.availability.diurnal_amplitude: in [0, 1)")
    for name in ("spot_fraction", "graceful_leave_fraction", "initial_online_fraction"):
        v = getattr(av, name)
        need(0.0 <= v <= 1.0, f"population.availability.{name}: in [0, 1]")
    need(0.0 <= s.population.byzantine_fraction <= 1.0, "population.byzantine_fraction: in [0, 1]")
    for name in ("host_ram_gb_home", "host_ram_gb_datacenter"):
        mix = getattr(s.population, name)
        need(
            all(_positive_number(k) and v >= 0 for k, v in mix) and (not mix or sum(v for _, v in mix) > 0),
            f"population.{name}: {{ GiB = weight }}, e.g. {{ 32 = 0.5, 64 = 0.5 }}: sizes positive, weights"
            " non-negative with a positive sum",
        )
    _ = LinkSpec, AvailabilitySpec  # re-exported for scenario authors' type hints


def _positive_number(text: str) -> bool:
    try:
        v = float(text)
    except ValueError:
        return False
    return 0 < v < float("inf")


def load_sim_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SimScenarioError(f"cannot read scenario {p}: {e.strerror}") from None
    return parse_sim_scenario(text, base_dir=p.parent, path=str(p))
