"""Run spec: the TOML file that describes one training run, parsed into frozen dataclasses
(by `typedtoml.from_table`, the builder the simulator's scenario files share).

The spec is immutable once a run starts; its hash (`RunSpec.spec_hash`) is part of every
signed message and of the coordinator's DHT record, so a worker can tell it trains the
run it thinks it trains. The hash covers the source text and the resolved aggregation rule
with every parameter explicit (`ReducerSpec.text`), so a spec that leaves the rule to its
default hashes differently under a release whose default rule differs. Parsing is a pure
function of the text: unknown keys and wrong types are errors that name the key (nanoGPT's
configurator refuses unknown keys the same way), so a typo never silently falls back to a
default.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from bagel.protocol.reducerspec import DEFAULT_RULE, ReducerSpecError, parse_reducer_spec
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
    # how the reducer of each part of a group exchange screens and combines the contributions:
    # "centered_clip[:tau=T | rel=R][,iters=L]" (the default), "trimmed_mean[:trim=F]" or
    # "mean" (weighted by samples, not robust), each with the group screen's
    # ",max_norm=F,min_norm=E" (grammar, defaults and breakdown points: reducerspec.py)
    aggregation: str = toml_field(DEFAULT_RULE, check=_aggregation_rule)


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
    """Admission and abuse limits (the coordinator's `admission.py` enforces them).

    pow_bits: leading zero bits of the per-registration proof of work (`protocol/pow.py`);
    2^16 sha256 are ~60 ms of one core in Python, 0 turns it off.
    Rate limits are token buckets (rate per second, burst), per worker key on every signed
    RPC and per client address on every RPC; `status_*` is GetStatus's own per-address
    bucket, and its answer is recomputed at most every `status_cache_ms`; `register_*` is
    Register's own per-address bucket (new identities per address, on top of the work).
    Streams: an upload that sends nothing for `upload_idle_s` is closed; at most
    `max_uploads` uploads (one per uploader) and `max_downloads` downloads run at once.
    """

    mode: Literal["open", "permissioned"] = "open"
    max_clock_skew_s: float = 30.0
    operator_public_key: str = ""  # base64 Ed25519, permissioned runs only
    pow_bits: int = 16
    key_rate_per_s: float = 20.0
    key_burst: int = 60
    ip_rate_per_s: float = 1000.0
    ip_burst: int = 2000
    register_rate_per_s: float = 2.0
    register_burst: int = 30
    status_rate_per_s: float = 20.0
    status_burst: int = 100
    status_cache_ms: int = 500
    upload_idle_s: float = 30.0
    max_uploads: int = 8
    max_downloads: int = 8


@dataclass(frozen=True)
class AuditSection:
    """What the coordinator trusts of a worker's own figures, and how it audits contributions.

    Budgets and weights come from what the coordinator observed: a member's throughput is
    the samples it was credited over the wall time the coordinator measured between its
    TRAIN instruction and its READY, never the `compute_ms` it reports.
    """

    # a member is planned and credited at most this many times the median throughput of
    # the cell's other members (a liar's claim cannot take the round's whole budget)
    max_speedup: float = 8.0
    # no worker is planned or credited above this many samples/s in one cell: the only
    # bound when a member has nobody to be compared with (a lone member, a first round).
    # The tiny digits model trains at about 550 samples/s on one CPU core; raise it to the
    # fastest honest card's rate for the run's model (a GPU run of a tiny model may need more)
    max_samples_per_s: float = 5000.0
    # reducers' findings about a sender count only when at least this many distinct other
    # reducers, and more than half of the round's other reducers, agree
    min_agreeing: int = 2
    # a contribution whose norm is below this fraction of the median of the part's other
    # contributions is a zero update
    zero_rel: float = 0.01
    # two senders whose contributions to a part have at least this cosine are copies
    copy_cosine: float = 0.999
    # sketch blocks over the flattened pseudo-gradient (64 sign bits each), compared with
    # the sender's previous rounds: at most `replay_bits` differing bits is a replay
    sketch_blocks: int = 32
    replay_bits: int = 4
    replay_history: int = 3
    # reputation charged for a confirmed finding (zero, replay, copy, exclusion, a lie): with
    # the default ban at -5 and +0.25 per commit, the second one bans
    rep_finding: float = -3.0


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
    audit: AuditSection = field(default_factory=AuditSection)
    guard: GuardSection = field(default_factory=GuardSection)
    # the exact source text; hashed, and handed to workers so they build the same run.
    source: str = field(default="", compare=False, repr=False)

    @property
    def spec_hash(self) -> str:
        """sha256 of the source and the resolved aggregation rule (see the module docstring)."""
        resolved = parse_reducer_spec(self.diloco.aggregation).text()
        return hashlib.sha256(self.source.encode() + b"\n\x00diloco.aggregation=" + resolved.encode()).hexdigest()

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
    "audit": AuditSection,
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
    a = spec.audit
    need(a.max_speedup >= 1.0, "audit.max_speedup: at least 1")
    need(a.max_samples_per_s > 0, "audit.max_samples_per_s: positive")
    need(a.min_agreeing >= 1, "audit.min_agreeing: at least 1")
    need(0.0 <= a.zero_rel < 1.0, "audit.zero_rel: in [0, 1)")
    need(0.0 < a.copy_cosine <= 1.0, "audit.copy_cosine: in (0, 1]")
    need(1 <= a.sketch_blocks <= 256, "audit.sketch_blocks: between 1 and 256")
    need(0 <= a.replay_bits < 32, "audit.replay_bits: in [0, 32)")
    need(1 <= a.replay_history <= 16, "audit.replay_history: between 1 and 16")
    need(a.rep_finding <= 0, "audit.rep_finding: zero or negative")
    need(
        spec.security.mode == "open" or bool(spec.security.operator_public_key),
        "security.operator_public_key: required in permissioned mode",
    )
    sec = spec.security
    if sec.operator_public_key:
        try:
            raw = base64.b64decode(sec.operator_public_key, validate=True)
        except ValueError:
            raw = b""
        need(len(raw) == 32, "security.operator_public_key: base64 of a 32-byte Ed25519 public key")
    need(0 <= sec.pow_bits <= 32, "security.pow_bits: between 0 and 32")
    for key in ("key_rate_per_s", "ip_rate_per_s", "register_rate_per_s", "status_rate_per_s", "upload_idle_s"):
        need(getattr(sec, key) > 0, f"security.{key}: positive")
    for key in ("key_burst", "ip_burst", "register_burst", "status_burst", "max_uploads", "max_downloads"):
        need(getattr(sec, key) >= 1, f"security.{key}: at least 1")
    need(0 <= sec.status_cache_ms <= 60_000, "security.status_cache_ms: between 0 and 60000")


def parse_spec(text: str) -> RunSpec:
    """Parse and validate a run spec; raises SpecError naming the bad key."""
    data = load_document(text, allowed=_SECTIONS, unknown=lambda name: f"unknown section [{name}]", error=SpecError)
    if "run" not in data:
        raise SpecError("missing section [run]")
    sections = {name: _section(name, table) for name, table in data.items()}
    spec = RunSpec(**sections, source=text)
    _validate(spec)
    return spec


def spec_source_hash(text: str) -> str:
    """The hash of the run a spec source describes (`RunSpec.spec_hash`); SpecError if it does not parse."""
    return parse_spec(text).spec_hash


def load_spec(path: str | Path) -> RunSpec:
    return parse_spec(Path(path).read_text())
