"""The latest committed state of every cell of a run, read from a data dir without disturbing its daemon.

`sample` and `export` start here. The SQLite store is opened read-only (WAL readers never
block the daemon's writer), read once and closed; checkpoint files are read, never
written, and the checkpoint store's own constructor (which creates folders and sweeps
half-written uploads) is not used. Nothing read is trusted: for each cell the newest
checkpoint whose round is a committed round of the cell's current epoch is taken, its bytes
must match the sha256 the index recorded, and the canonical state hash of its tensors
(`protocol/statehash.py`) must equal the hash the commit log holds for that round. A cell
with no committed round, or with no checkpoint that passes, is reported missing with the
reason.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as st_load
from torch import nn

from bagel.coordinator.checkpoints import CheckpointMeta
from bagel.coordinator.store import Store, StoreError
from bagel.models.experts import EMA_PREFIX, MOMENTUM_PREFIX, WEIGHT_PREFIX, ModelConfig, build, cell_config
from bagel.protocol.runspec import RunSpec, SpecError, parse_spec
from bagel.protocol.statehash import state_hash


class CommittedStateError(Exception):
    """The data dir cannot be read as a run (no store, no spec, a spec that does not parse)."""


@dataclass(frozen=True)
class CellWeights:
    """One cell's verified committed weights (the outer momentum left out): the average of the
    committed weights when the state keeps one (`[ema]`, then `ema` is True), else the weights."""

    cell_id: str
    round: int  # the checkpoint's round, a committed round
    committed_round: int  # the cell's latest committed round (the checkpoint may lag it)
    state_hash: str  # verified against the commit log
    sha256: str  # of the stored file, verified
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    ema: bool = False  # `weights` are the state's average of the committed weights

    def model(self) -> nn.Module:
        """The cell's model with these weights, in eval mode."""
        with torch.random.fork_rng(devices=[]):
            model = build(self.config)
        missing, unexpected = model.load_state_dict(self.weights, strict=False)
        buffers = {n for n, _ in model.named_buffers()}
        if unexpected or set(missing) - buffers:
            raise CommittedStateError(f"{self.cell_id}: weights do not fit the model ({missing[:3]}, {unexpected[:3]})")
        return model.eval()

    def manifest(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "committed_round": self.committed_round,
            "state_hash": self.state_hash,
            "sha256": self.sha256,
            "weights": "ema" if self.ema else "committed",
        }


@dataclass(frozen=True)
class CommittedRun:
    """What a data dir holds: the spec, the verified cells, and why the others are missing."""

    spec: RunSpec
    spec_hash: str
    cells: dict[str, CellWeights]
    missing: dict[str, str]  # cell id -> reason


def load_committed(data_dir: str | Path) -> CommittedRun:
    """Read the run in `data_dir` (see the module docstring); CommittedStateError if it is not one."""
    data_dir = Path(data_dir)
    try:
        store = Store.open_readonly(data_dir)
    except StoreError as e:
        raise CommittedStateError(str(e)) from None
    try:
        stored = store.spec()
        commits = store.commits()
        metas = store.list_checkpoints()
    finally:
        store.close()
    if stored is None:
        raise CommittedStateError(f"{data_dir} holds no run spec yet")
    try:
        spec = parse_spec(stored.spec_toml)
    except SpecError as e:
        raise CommittedStateError(f"the stored run spec does not parse: {e}") from None
    committed: dict[str, dict[int, str]] = {}
    for cell_id, rnd, h in commits:
        committed.setdefault(cell_id, {})[rnd] = h
    by_cell: dict[str, list[CheckpointMeta]] = {}
    for m in metas:
        by_cell.setdefault(m.cell_id, []).append(m)
    cells: dict[str, CellWeights] = {}
    missing: dict[str, str] = {}
    root = data_dir / "checkpoints"
    for cell_id in spec.cell_ids:
        rounds = committed.get(cell_id, {})
        if not rounds:
            missing[cell_id] = "never trained (no committed round)"
            continue
        reasons: list[str] = []
        for meta in sorted(by_cell.get(cell_id, []), key=lambda m: -m.round):
            if rounds.get(meta.round) != meta.state_hash:
                reasons.append(f"checkpoint of round {meta.round} is not a committed state")
                continue
            try:
                cells[cell_id] = _verified(spec, root, meta, max(rounds))
                break
            except CommittedStateError as e:
                reasons.append(str(e))
        else:
            why = "; ".join(reasons) if reasons else "no stored checkpoint"
            missing[cell_id] = f"committed to round {max(rounds)}, but {why}"
    return CommittedRun(spec, stored.spec_hash, cells, missing)


def _verified(spec: RunSpec, root: Path, meta: CheckpointMeta, committed_round: int) -> CellWeights:
    path = (root / meta.path).resolve()
    if root.resolve() not in path.parents:
        raise CommittedStateError(f"checkpoint path {meta.path!r} leaves the checkpoint folder")
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise CommittedStateError(f"checkpoint {meta.path} unreadable: {e.strerror}") from None
    if len(blob) != meta.total_bytes or hashlib.sha256(blob).hexdigest() != meta.sha256:
        raise CommittedStateError(f"checkpoint {meta.path} does not match its recorded sha256")
    try:
        flat = st_load(blob)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for corrupt headers
        raise CommittedStateError(f"checkpoint {meta.path}: unreadable safetensors: {e}") from None
    if state_hash(flat) != meta.state_hash:
        raise CommittedStateError(f"checkpoint {meta.path}: tensors do not hash to the committed state")
    cfg = cell_config(spec, meta.cell_id)
    weights = {k[len(WEIGHT_PREFIX) :]: v for k, v in flat.items() if k.startswith(WEIGHT_PREFIX)}
    average = {k[len(EMA_PREFIX) :]: v for k, v in flat.items() if k.startswith(EMA_PREFIX)}
    allowed = {p + k for k in weights for p in (WEIGHT_PREFIX, MOMENTUM_PREFIX, EMA_PREFIX)}
    if set(flat) - allowed:
        raise CommittedStateError(f"checkpoint {meta.path}: tensors other than weights, momentum and average")
    if average and set(average) != set(weights):
        raise CommittedStateError(f"checkpoint {meta.path}: the average does not cover every weight")
    chosen = average or weights  # sample and export the average when the run keeps one
    return CellWeights(
        meta.cell_id, meta.round, committed_round, meta.state_hash, meta.sha256, cfg, chosen, ema=bool(average)
    )
