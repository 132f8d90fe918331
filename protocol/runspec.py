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
import dataclasses
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
MAX_SYNC_DONORS = 16  # the most donors one sync may name (`[sync] max_donors`)
MAX_CATCH_UP_ROUNDS = 8  # the most committed updates one catch-up may apply (`[sync] catch_up_rounds`)
# `[sync] state_dtype`: the committed state's dtype, and its bytes per value (no torch here)
STATE_DTYPE_NBYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}


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
    # start every matching cell from these weights: a `bagel-coordinator export` folder
    # (either format) or one .safetensors file; relative to the spec file's folder. The
    # weights' sha256 (`weights_digest`) is part of the spec hash.
    init_from: str = ""


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
    # what a member's GPU does while its exchange runs: "off" waits for the outcome;
    # "delayed" trains the next round's inner steps ahead from its own trained weights and,
    # once the round commits, moves them onto the committed weights (a one-step-delayed
    # outer update: those steps' gradients are taken one outer step late). The committed
    # states are the same bytes on every member either way.
    overlap: Literal["off", "delayed"] = "off"
    # how the reducer of each part of a group exchange screens and combines the contributions:
    # "centered_clip[:tau=T | rel=R][,iters=L]" (the default), "trimmed_mean[:trim=F]" or
    # "mean" (weighted by samples, not robust), each with the group screen's
    # ",max_norm=F,min_norm=E,min_cosine=C" (grammar, defaults and breakdown points: reducerspec.py)
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
    # the fewest workers a round opens and freezes with (1: any holder trains alone). An open
    # run sets it to keep a lone or small group, possibly hostile, from deciding a round: with
    # at most f hostile workers, 2f + 1 keeps the honest ones a majority of every group.
    min_contributors: int = 1
    # after a commit, the next round opens once every contributor of the committed round has
    # reported (so one that reports a moment after the quorum trains it too), or after this
    # many seconds, whichever is first; 0 opens it at once with the holders so far.
    next_round_grace_s: float = 30.0
    # a cell whose last holder of the committed state lost its lease (a network cut, a
    # reboot) waits this long for a holder to come back before it falls back to its
    # checkpoint; 0 falls back at once. A holder that left or was banned is not waited for.
    orphan_grace_s: float = 20.0
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
    # the loss audit (worker/heldout.py): a reducer applies each sender's slice of the update to
    # the committed state and measures the loss on up to this many of the sender's assigned
    # samples, and on as many random training samples (0 turns it off)
    loss_samples: int = 32
    # a sender whose slice raises the loss on its own samples by more than this fraction of
    # the median gain of the part's other senders is flagged ("loss")
    loss_rel: float = 0.25


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
class SloSection:
    """The run's objectives, for the coordinator's error-budget metrics and `status`.

    `round_success`: the fraction of round attempts that should commit (an attempt ends
    committed or aborted); over the last `window_rounds` attempts of a cell the coordinator
    exports the committed / attempted ratio and the burn rate, (1 - ratio) / (1 -
    round_success): 1 spends the error budget exactly at the allowed pace, above 1 faster.
    `cell_sample_target`: committed samples each cell should reach; `status` shows the ETA
    to it at the recent commit rate (0 = no target).
    """

    round_success: float = 0.9
    window_rounds: int = 100
    cell_sample_target: int = 0


@dataclass(frozen=True)
class CostSection:
    """Prices for the coordinator's cost metrics: per device-hour, by worker class.

    `gpu_hour`: a table of class name = price of one GPU for one hour. A CUDA worker
    belongs to the first class whose name appears, case-insensitively, in its device name
    (e.g. `"H100" = 2.5` matches "NVIDIA H100 80GB HBM3"), else to class "other" at
    `other_gpu_hour`; a CPU worker is class "cpu" at `cpu_hour`. The classes are the
    metrics' `worker_class` label, so its values are bounded by this table.
    """

    currency: str = "USD"
    gpu_hour: tuple[tuple[str, float], ...] = ()
    other_gpu_hour: float = 0.0
    cpu_hour: float = 0.0


@dataclass(frozen=True)
class EmaSection:
    """An exponential moving average of the committed weights, for sampling and export.

    `decay`: 0 turns it off (the committed state then holds weights and outer momentum
    only). Above 0, every cell's committed state also holds `ema.<param>`, updated by every
    member after each round's outer step, from the new committed weights, in float32 on the
    CPU, in one fixed order of single IEEE operations, so the replicas stay bit-identical and
    the average is part of the hashed, synced and checkpointed state. The decay applies per
    committed round (not per inner step) and warms up as min(decay, (1 + r) / (10 + r)) at
    round r, so a short run does not sample weights still near the initialisation. `sample`,
    `export` and the demo use the average when the state holds one.
    """

    decay: float = 0.0


@dataclass(frozen=True)
class SyncSection:
    """How a joiner fetches a cell's committed state from its peers.

    `max_donors`: the coordinator names up to this many live holders of the committed round
    (ranked by expected bandwidth: each one's uplink divided among the syncs it already
    serves), and the joiner fetches byte ranges of the state from all of them at once, in
    shares proportional to those figures (`worker/statesync.py`). 1 is the single-donor sync.

    `catch_up_rounds`: a worker keeps the committed updates of its cell's last this many
    rounds (the encoded averaged parts every member applied, about 1/12 of an fp32 state with
    int8, 1/24 with int4) and serves them to peers; a joiner that holds the same cell's
    committed state of round j, told to sync to round R with 1 <= R - j <= this, first
    fetches the updates of rounds j+1..R from its donors and applies them itself (the result
    must have the committed hash, as a download's must), and downloads the whole state only
    if that fails (`worker/catchup.py`). 0 to 8; 0 turns it off.

    `state_dtype`: the dtype of every cell's committed state (weights, outer momentum, the
    average): "fp32" (the default), "bf16" or "fp16". With a half dtype every member rounds
    the state onto that grid (to nearest, ties to even, on the CPU) where committed state is
    made: the initial state of round 0 and the end of every outer step, which computes in
    fp32 (`worker/diloco.py`). The replicas stay bit-identical, and the hash, the download,
    a catch-up and the checkpoints are all over the same exact bytes, half as many: a
    download is lossless. Inner training runs in fp32 from the exact upcast. The price is
    the grid itself: an outer step changes a value only by more than half the grid's spacing
    there (2^-9 to 2^-8 of the value for bf16, 2^-12 to 2^-11 for fp16; fp16 also loses
    precision below 6e-5 and rounds values under 3e-8 to zero).
    """

    max_donors: int = 4
    catch_up_rounds: int = 2
    state_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"


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
    slo: SloSection = field(default_factory=SloSection)
    cost: CostSection = field(default_factory=CostSection)
    ema: EmaSection = field(default_factory=EmaSection)
    sync: SyncSection = field(default_factory=SyncSection)
    # the exact source text; hashed, and handed to workers so they build the same run.
    source: str = field(default="", compare=False, repr=False)
    # `model.init_from` resolved: the weights' path and their `weights_digest` (set by
    # `load_spec`, or from what the coordinator says when the spec comes over the wire).
    init_path: str = field(default="", compare=False, repr=False)
    init_sha256: str = field(default="", compare=False, repr=False)

    @property
    def spec_hash(self) -> str:
        """sha256 of the source, the resolved aggregation rule and, with `model.init_from`, the
        initial weights' digest (see the module docstring)."""
        resolved = parse_reducer_spec(self.diloco.aggregation).text()
        text = self.source.encode() + b"\n\x00diloco.aggregation=" + resolved.encode()
        if self.model.init_from:
            text += b"\n\x00model.init_from.sha256=" + self.init_sha256.encode()
        return hashlib.sha256(text).hexdigest()

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
    "slo": SloSection,
    "cost": CostSection,
    "ema": EmaSection,
    "sync": SyncSection,
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
    need(
        1 <= spec.schedule.min_contributors <= spec.schedule.max_replicas,
        "schedule.min_contributors: between 1 and max_replicas",
    )
    need(0.0 < spec.schedule.quorum <= 1.0, "schedule.quorum: in (0, 1]")
    need(0.0 <= spec.schedule.next_round_grace_s <= 3600.0, "schedule.next_round_grace_s: in [0, 3600]")
    need(0.0 <= spec.schedule.orphan_grace_s <= 3600.0, "schedule.orphan_grace_s: in [0, 3600]")
    need(1.0 <= spec.guard.max_loss_ratio <= 1e6, "guard.max_loss_ratio: in [1, 1e6]")
    need(0.0 <= spec.guard.abs_slack <= 1e6, "guard.abs_slack: in [0, 1e6]")
    need(1 <= spec.guard.eval_samples <= 4096, "guard.eval_samples: between 1 and 4096")
    need(0.0 <= spec.schedule.vram_headroom < 1.0, "schedule.vram_headroom: in [0, 1)")
    need(0.0 <= spec.ema.decay < 1.0, "ema.decay: in [0, 1) (0 = off)")
    need(1 <= spec.sync.max_donors <= MAX_SYNC_DONORS, f"sync.max_donors: between 1 and {MAX_SYNC_DONORS}")
    need(
        0 <= spec.sync.catch_up_rounds <= MAX_CATCH_UP_ROUNDS,
        f"sync.catch_up_rounds: between 0 and {MAX_CATCH_UP_ROUNDS} (0 = off)",
    )
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
    need(0 <= a.loss_samples <= 1024, "audit.loss_samples: between 0 and 1024")
    need(0.0 < a.loss_rel <= 100.0, "audit.loss_rel: in (0, 100]")
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
    need(0.0 < spec.slo.round_success < 1.0, "slo.round_success: in (0, 1)")
    need(1 <= spec.slo.window_rounds <= 10_000, "slo.window_rounds: between 1 and 10000")
    need(spec.slo.cell_sample_target >= 0, "slo.cell_sample_target: zero (none) or more")
    cost = spec.cost
    need(bool(re.fullmatch(r"[A-Za-z]{1,8}", cost.currency)), "cost.currency: 1 to 8 letters")
    need(len(cost.gpu_hour) <= 32, "cost.gpu_hour: at most 32 classes")
    for name, price in cost.gpu_hour:
        need(bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9 ._-]{0,31}", name)), f"cost.gpu_hour.{name}: a short name")
        need(name.lower() not in ("cpu", "other"), f"cost.gpu_hour.{name}: 'cpu' and 'other' are reserved")
        need(0.0 <= price <= 1e6, f"cost.gpu_hour.{name}: a price in [0, 1e6]")
    need(len({n.lower() for n, _ in cost.gpu_hour}) == len(cost.gpu_hour), "cost.gpu_hour: names differ only in case")
    for key in ("other_gpu_hour", "cpu_hour"):
        need(0.0 <= getattr(cost, key) <= 1e6, f"cost.{key}: a price in [0, 1e6]")


def parse_spec(text: str) -> RunSpec:
    """Parse and validate a run spec; raises SpecError naming the bad key."""
    data = load_document(text, allowed=_SECTIONS, unknown=lambda name: f"unknown section [{name}]", error=SpecError)
    if "run" not in data:
        raise SpecError("missing section [run]")
    sections = {name: _section(name, table) for name, table in data.items()}
    spec = RunSpec(**sections, source=text)
    _validate(spec)
    return spec


def spec_source_hash(text: str, init_sha256: str = "") -> str:
    """The hash of the run a spec source describes (`RunSpec.spec_hash`), with the initial
    weights' digest the coordinator announces; SpecError if it does not parse."""
    return dataclasses.replace(parse_spec(text), init_sha256=init_sha256).spec_hash


def weights_digest(path: str | Path) -> str:
    """sha256 of a weights file, or of a folder's `*.safetensors` files (each file's relative
    name and sha256, sorted): what `model.init_from` contributes to the spec hash."""
    p = Path(path)
    if p.is_file():
        return hashlib.sha256(p.read_bytes()).hexdigest()
    files = sorted(f for f in p.rglob("*.safetensors") if f.is_file())
    if not files:
        raise SpecError(f"model.init_from: {p} is neither a .safetensors file nor a folder holding one")
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relative_to(p).as_posix()}\0{hashlib.sha256(f.read_bytes()).hexdigest()}\n".encode())
    return h.hexdigest()


def load_spec(path: str | Path) -> RunSpec:
    """Parse a spec file; a `model.init_from` is resolved against the file's folder and digested."""
    spec = parse_spec(Path(path).read_text())
    if spec.model.init_from:
        init = Path(spec.model.init_from)
        init = init if init.is_absolute() else Path(path).resolve().parent / init
        if not init.exists():
            raise SpecError(f"model.init_from: {init} does not exist")
        spec = dataclasses.replace(spec, init_path=str(init), init_sha256=weights_digest(init))
    return spec
