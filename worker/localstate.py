"""The worker's local checkpoint: the last committed state of its cell, to resume after a crash.

After every committed round (and after a sync) the worker writes the cell state it holds
(weights `w.<param>`, outer momentum `m.<param>` and the average `ema.<param>` where the run
keeps one: `diloco.CellState.to_flat()`, exactly the tensors `protocol.statehash` hashes)
plus its error-feedback residuals (`e.<name>`, local to this worker and not part of the
hash) to one safetensors file. The write is
atomic: a temp file in the same directory, fsync, `os.replace`, fsync of the directory
, so a SIGKILL at any instant leaves either the previous or the new
checkpoint, never a torn one. On restart the worker re-hashes what it loaded and registers
with that `LocalState`; the coordinator then says whether it is current or must resync.
safetensors, never pickle (house rule).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save_file as st_save_file

from bagel.protocol.atomicfile import atomic_write_with
from bagel.worker.diloco import STATE_DTYPES, CellState, StateFormatError

_FORMAT = "bagel-local-v1"
MAX_LOCAL_BYTES = 8 << 30


class LocalStateError(ValueError):
    """The local checkpoint is unreadable, for another run, or does not match its hash."""


@dataclass
class LocalCheckpoint:
    """A committed cell state as the worker holds it, plus its error-feedback residuals."""

    cell_id: str
    committed_round: int
    state: CellState  # weights + outer momentum
    state_hash: str  # of `state` (also for round 0, whose committed hash is "" on the wire)
    residuals: dict[str, torch.Tensor]  # by tensor name; local to this worker, not hashed


class LocalStore:
    """One checkpoint file per run under the worker's data dir."""

    def __init__(self, data_dir: str | Path, run_id: str, spec_hash: str) -> None:
        self.path = Path(data_dir) / "runs" / run_id / "local.safetensors"
        self.run_id = run_id
        self.spec_hash = spec_hash

    def save(self, cp: LocalCheckpoint) -> None:
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in cp.state.to_flat().items()}
        for k, v in cp.residuals.items():
            # views of one vector (`parts.Contribution`): safetensors writes tensors that share
            # a storage without overlapping (tests/test_contribution.py saves and loads them)
            tensors[f"e.{k}"] = v.detach().to("cpu", torch.float32).contiguous()
        meta = {
            "format": _FORMAT,
            "run_id": self.run_id,
            "spec_hash": self.spec_hash,
            "cell_id": cp.cell_id,
            "committed_round": str(cp.committed_round),
            "state_hash": cp.state_hash,
        }
        # safetensors' save_file writes from the tensors' own memory: no serialised copy of the
        # whole state is built next to the one held
        atomic_write_with(self.path, lambda tmp: st_save_file(tensors, tmp, metadata=meta))

    def load(self) -> LocalCheckpoint | None:
        """The saved state, or None if there is none. Raises LocalStateError if unusable."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return None
        if size > MAX_LOCAL_BYTES:
            raise LocalStateError(f"{self.path}: {size} bytes exceeds the {MAX_LOCAL_BYTES}-byte limit")
        raw = self.path.read_bytes()
        try:
            meta = _metadata(raw)
            tensors = st_load(raw)
        except (SafetensorError, ValueError) as e:
            raise LocalStateError(f"{self.path}: not a valid safetensors file: {e}") from None
        if meta.get("format") != _FORMAT:
            raise LocalStateError(f"{self.path}: unknown format {meta.get('format')!r}")
        if meta.get("run_id") != self.run_id or meta.get("spec_hash") != self.spec_hash:
            raise LocalStateError(f"{self.path}: belongs to another run or spec")
        residuals = {k[2:]: v for k, v in tensors.items() if k.startswith("e.")}
        flat = {k: v for k, v in tensors.items() if not k.startswith("e.")}
        # the state dtype the run's spec gave it (the spec hash above binds the file to that
        # spec): the first tensor's, which every other tensor of the state must share
        dtype = next(iter(flat.values())).dtype if flat else torch.float32
        if dtype not in STATE_DTYPES.values():
            raise LocalStateError(f"{self.path}: a state in {dtype}, not one of the state dtypes")
        try:
            state = CellState.from_flat(flat, dtype=dtype)
        except StateFormatError as e:
            raise LocalStateError(f"{self.path}: {e}") from None
        h = state.state_hash()
        if h != meta.get("state_hash"):
            raise LocalStateError(f"{self.path}: state hash {h[:12]} does not match the recorded one")
        try:
            rnd = int(meta.get("committed_round", ""))
        except ValueError:
            raise LocalStateError(f"{self.path}: bad committed_round") from None
        return LocalCheckpoint(meta.get("cell_id", ""), rnd, state, h, residuals)

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)


def _metadata(raw: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors buffer (header: u64 little-endian length + JSON)."""
    if len(raw) < 8:
        raise ValueError("truncated header")
    n = int.from_bytes(raw[:8], "little")
    if n > len(raw) - 8 or n > 100 << 20:
        raise ValueError("header length out of range")
    header = json.loads(raw[8 : 8 + n])
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict):
        raise ValueError("metadata is not a table")
    return {str(k): str(v) for k, v in meta.items()}
