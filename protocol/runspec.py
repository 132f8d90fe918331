"""Run spec: the TOML file that describes one training run, parsed into frozen dataclasses
(by `typedtoml.from_table`, the builder the simulator's scenario files share).

The spec is immutable once a run starts; its hash (`RunSpec.spec_hash`) is part of every
signed message and of the coordinator's DHT record, so a worker can tell it trains the
run it thinks it trains. Parsing is a pure function of the text: unknown keys and wrong
types are errors that name the key (nanoGPT's configurator refuses unknown keys the same
way), so a typo never silently falls back to a default.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from bagel.protocol.reducerspec import ReducerSpecError, parse_reducer_spec
from bagel.protocol.typedtoml import TomlTableError, from_table, load_document, toml_field

ROUTER_CELL = "router"
_CELL_RE = re.compile(r"^k(\d{1,4})\.r(\d{1,4})$")
_RUN_ID_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")


class SpecError(TomlTableError):
    """The run spec is malformed; the message names the offending key."""


def _aggregation_rule(where: str, text: str) -> None:
    try:
        parse_reducer_spec(text)
    except ReducerSpecError as e:
        raise SpecError(f"{where}: {e}") from None


@dataclass(frozen=True)
class RunSection:
    id: str
    seed: int = 0
    description: str = ""


@dataclass(frozen=True)
class ModelSection:
    arch: Literal["dit", "unet"] = "dit"
    preset: str = "tiny"
    image_size: int = 8
    channels: int = 1
    num_classes: int = 10  # 0 = unconditional
    router_preset: str = "tiny"


@dataclass(frozen=True)
class DataSection:
    source: Literal["digits", "folder", "npy"] = "digits"
    path: str = ""
    clusters: int = 2
    holdout_fraction: float = 0.1
    features: Literal["pca", "file"] = "pca"
    features_path: str = ""
    # move every class whole to the cluster holding most of it (models/data.py explains why)
    whole_classes: bool = False


@dataclass(frozen=True)
class CellsSection:
    timestep_ranges: int = 2
    overlap: float = 0.05
    router: bool = True
    # logit-normal training t-density (SD3): t = sigmoid(N(mean, std)).
    t_mean: float = 0.0
    t_std: float = 1.0


@dataclass(frozen=True)
class DilocoSection:
    inner_steps: int = 50  # H
    inner_lr: float = 1e-3
    inner_weight_decay: float = 0.0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    # samples per inner step summed over a round's members; split by throughput.
    group_batch: int = 64
    max_micro_batch: int = 64
    codec: str = "int8"
    error_feedback: bool = True
    # how the reducer of each part of a group exchange combines the contributions:
    # "mean" (weighted by samples), "trimmed_mean[:trim=F]" or
    # "centered_clip[:tau=T | rel=R][,iters=L]" (grammar: reducerspec.py)
    aggregation: str = toml_field("mean", check=_aggregation_rule)


@dataclass(frozen=True)
class ScheduleSection:
    min_replicas: int = 2
    max_replicas: int = 8
    lease_s: float = 10.0
    heartbeat_s: float = 2.0
    deadline_slack: float = 2.0
    min_round_s: float = 5.0
    # fraction of a round's contributors that must report the same hash to commit.
    quorum: float = 0.5
    vram_headroom: float = 0.2
    # a worker moves only if it cuts the imbalance by more than this share of compute.
    stickiness: float = 0.1
    ban_reputation: float = -5.0


@dataclass(frozen=True)
class CheckpointSection:
    every_rounds: int = 5
    keep: int = 3
    max_bytes: int = 2 << 30


@dataclass(frozen=True)
class SecuritySection:
    mode: Literal["open", "permissioned"] = "open"
    max_clock_skew_s: float = 30.0
    operator_public_key: str = ""  # base64 Ed25519, permissioned runs only


@dataclass(frozen=True)
class GuardSection:
    """The commit guard: a round whose new state's held-out loss jumps is not committed.

    After the outer step every member computes the held-out loss of the new state on a
    fixed batch (the first `eval_samples` held-out samples of its cell, fixed noise and t
    draws, on the CPU) and reports it with its hash. The coordinator takes the median of
    the reports that agree on the committed hash (a minority cannot move it) and refuses
    the commit (the attempt aborts; no reputation changes) when it exceeds
    `max_loss_ratio` x the cell's last committed held-out loss + `abs_slack` (the slack
    keeps a tiny loss from making noise a jump). With no committed loss yet (round 1, after
    a rollback) the reference is the median of the base-state losses the same members
    report. Defaults: on, ratio 2.0, slack 0.05, 64 samples.
    """

    enabled: bool = True
    max_loss_ratio: float = 2.0
    abs_slack: float = 0.05
    eval_samples: int = 64


@dataclass(frozen=True)
class RunSpec:
    run: RunSection
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    cells: CellsSection = field(default_factory=CellsSection)
    diloco: DilocoSection = field(default_factory=DilocoSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    security: SecuritySection = field(default_factory=SecuritySection)
    guard: GuardSection = field(default_factory=GuardSection)
    # the exact source text; hashed, and handed to workers so they build the same run.
    source: str = field(default="", compare=False, repr=False)

    @property
    def spec_hash(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()

    @property
    def expert_cells(self) -> tuple[str, ...]:
        return tuple(cell_name(k, r) for k in range(self.data.clusters) for r in range(self.cells.timestep_ranges))

    @property
    def cell_ids(self) -> tuple[str, ...]:
        """Every cell of the run, experts first, then the router if the run trains one."""
        return self.expert_cells + ((ROUTER_CELL,) if self.cells.router else ())


def cell_name(cluster: int, trange: int) -> str:
    return f"k{cluster}.r{trange}"


def parse_cell(cell_id: str) -> tuple[int, int] | None:
    """(cluster, range) of an expert cell id, None for the router; ValueError otherwise."""
    if cell_id == ROUTER_CELL:
        return None
    m = _CELL_RE.match(cell_id)
    if not m:
        raise ValueError(f"not a cell id: {cell_id!r}")
    return int(m.group(1)), int(m.group(2))


_SECTIONS: dict[str, type] = {
    "run": RunSection,
    "model": ModelSection,
    "data": DataSection,
    "cells": CellsSection,
    "diloco": DilocoSection,
    "schedule": ScheduleSection,
    "checkpoint": CheckpointSection,
    "security": SecuritySection,
    "guard": GuardSection,
}


def _section(name: str, table: Any) -> Any:
    return from_table(_SECTIONS[name], table, name, error=SpecError)


def _validate(spec: RunSpec) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise SpecError(msg)

    need(bool(_RUN_ID_RE.match(spec.run.id)), "run.id: lowercase letters, digits, '-' and '_', at most 63")
    need(spec.model.image_size >= 4, "model.image_size: at least 4")
    need(spec.model.channels in (1, 3), "model.channels: 1 or 3")
    need(spec.model.num_classes >= 0, "model.num_classes: 0 (unconditional) or more")
    need(1 <= spec.data.clusters <= 64, "data.clusters: between 1 and 64")
    need(0.0 < spec.data.holdout_fraction < 0.5, "data.holdout_fraction: in (0, 0.5)")
    need(
        not spec.data.whole_classes or spec.model.num_classes >= spec.data.clusters,
        "data.whole_classes: needs model.num_classes >= data.clusters",
    )
    need(spec.data.source == "digits" or bool(spec.data.path), "data.path: required for folder and npy sources")
    need(1 <= spec.cells.timestep_ranges <= 16, "cells.timestep_ranges: between 1 and 16")
    need(0.0 <= spec.cells.overlap < 0.5, "cells.overlap: in [0, 0.5)")
    need(spec.cells.t_std > 0, "cells.t_std: positive")
    need(spec.diloco.inner_steps >= 1, "diloco.inner_steps: at least 1")
    need(spec.diloco.inner_lr > 0, "diloco.inner_lr: positive")
    need(spec.diloco.outer_lr > 0, "diloco.outer_lr: positive")
    need(0.0 <= spec.diloco.outer_momentum < 1.0, "diloco.outer_momentum: in [0, 1)")
    need(spec.diloco.group_batch >= 1, "diloco.group_batch: at least 1")
    need(spec.diloco.max_micro_batch >= 1, "diloco.max_micro_batch: at least 1")
    need(
        1 <= spec.schedule.min_replicas <= spec.schedule.max_replicas,
        "schedule.min_replicas: between 1 and max_replicas",
    )
    need(spec.schedule.lease_s > spec.schedule.heartbeat_s > 0, "schedule.lease_s must exceed schedule.heartbeat_s > 0")
    need(spec.schedule.deadline_slack >= 1.0, "schedule.deadline_slack: at least 1")
    need(0.0 < spec.schedule.quorum <= 1.0, "schedule.quorum: in (0, 1]")
    need(1.0 <= spec.guard.max_loss_ratio <= 1e6, "guard.max_loss_ratio: in [1, 1e6]")
    need(0.0 <= spec.guard.abs_slack <= 1e6, "guard.abs_slack: in [0, 1e6]")
    need(1 <= spec.guard.eval_samples <= 4096, "guard.eval_samples: between 1 and 4096")
    need(0.0 <= spec.schedule.vram_headroom < 1.0, "schedule.vram_headroom: in [0, 1)")
    need(spec.checkpoint.every_rounds >= 1, "checkpoint.every_rounds: at least 1")
    need(spec.checkpoint.keep >= 1, "checkpoint.keep: at least 1")
    need(
        spec.security.mode == "open" or bool(spec.security.operator_public_key),
        "security.operator_public_key: required in permissioned mode",
    )


def parse_spec(text: str) -> RunSpec:
    """Parse and validate a run spec; raises SpecError naming the bad key."""
    data = load_document(text, allowed=_SECTIONS, unknown=lambda name: f"unknown section [{name}]", error=SpecError)
    if "run" not in data:
        raise SpecError("missing section [run]")
    sections = {name: _section(name, table) for name, table in data.items()}
    spec = RunSpec(**sections, source=text)
    _validate(spec)
    return spec


def load_spec(path: str | Path) -> RunSpec:
    return parse_spec(Path(path).read_text())
