"""Content-addressed data shards: the run's dataset cut into the pieces one cell needs.

A worker with no local copy of a folder or `.npy` dataset gets the samples its cell trains
on from the coordinator (`coordinator/datashards.py` serves them, `worker/datafetch.py`
fetches them). What travels is exactly what `models/data.py` would have produced locally:
the normalised, resized float32 images of the training split and of the held-out split,
so a worker that fetched its data and one that loaded it itself train bit-identically.

- A shard is a safetensors file of one split and one cluster: `x` float32 [n, C, H, W] in
  [-1, 1], `y` int64 class labels, `cluster` int64 cluster labels and `index` int64, the
  samples' positions in their split (ascending). Its name is the sha256 of its bytes.
- Training shards: each cluster's training samples in ascending order, cut into shards of
  at most `MAX_SHARD_BYTES`. An expert cell `k{c}.r{r}` needs cluster c's shards only; the
  router classifies among all clusters, so it needs every cluster's (the whole training
  split: that is what it trains on).
- Held-out shards: the commit guard (`worker/heldout.py`) measures on the first
  `guard.eval_samples` held-out samples of the cell's selection, and nothing else of the
  held-out split is used by a worker; so there is one held-out shard per cluster with its
  first `eval_samples` samples, and one (cluster -1) with the first `eval_samples` of the
  whole split for the router.

`decode_shard` trusts nothing: the bytes must hash to the name, parse as safetensors
(no pickle), hold exactly the four tensors with the declared count, dtype and shape, finite
images in [-1, 1], and labels in range. `assemble` checks that the shards of a cell fit
together (ascending unique indices, the counts the manifest announced) before the cell's
task (`models/experts.py`) uses them through `install` / `installed`.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from bagel.models.data import DataError, Dataset

if TYPE_CHECKING:
    from bagel.protocol.runspec import RunSpec

MAX_SHARD_BYTES = 8 << 20  # one shard file; a stream of it fits the coordinator's bounds
MAX_SHARDS_PER_CELL = 4096
ROUTER_CLUSTER = -1  # the cluster of the router's held-out shard (samples of every cluster)
SPLITS = ("train", "heldout")
TENSORS = ("x", "y", "cluster", "index")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class ShardError(DataError):
    """A shard's bytes or a manifest are not what they claim to be (the message says how)."""


class ShardTampered(ShardError):
    """The bytes do not hash to the shard's name: corrupted or tampered, refused."""


@dataclass(frozen=True)
class ShardRef:
    """What a manifest says about one shard."""

    sha256: str
    nbytes: int
    split: str
    cluster: int
    count: int


@dataclass(frozen=True)
class ShardData:
    """The decoded tensors of one verified shard."""

    ref: ShardRef
    x: torch.Tensor
    y: torch.Tensor
    cluster: torch.Tensor
    index: torch.Tensor


@dataclass(frozen=True)
class CellData:
    """What a cell's task trains and is measured on, as `CellTask._select` would return it:
    (images, labels) of the training split and of the guard's held-out batch. Labels are the
    class for an expert and the cluster for the router."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_heldout: torch.Tensor
    y_heldout: torch.Tensor


def is_sha256(text: str) -> bool:
    return bool(_HEX64.fullmatch(text))


def cell_cluster(cell_id: str) -> int:
    """The cluster an expert cell trains on; ROUTER_CLUSTER for the router."""
    from bagel.protocol.runspec import parse_cell

    parsed = parse_cell(cell_id)
    return ROUTER_CLUSTER if parsed is None else parsed[0]


# --- encoding (the coordinator) ----------------------------------------------------------


def encode_shard(x: torch.Tensor, y: torch.Tensor, cluster: torch.Tensor, index: torch.Tensor) -> bytes:
    from safetensors.torch import save

    tensors = {
        "x": x.to(torch.float32).contiguous(),
        "y": y.to(torch.int64).contiguous(),
        "cluster": cluster.to(torch.int64).contiguous(),
        "index": index.to(torch.int64).contiguous(),
    }
    return save(tensors)


def _chunks(idx: np.ndarray, per_shard: int) -> list[np.ndarray]:
    return [idx[i : i + per_shard] for i in range(0, len(idx), per_shard)] or [idx]


def build_shards(ds: Dataset, eval_samples: int) -> Iterator[tuple[ShardRef, bytes]]:
    """Every shard of a dataset, one at a time (so a large dataset is not held twice):
    training shards per cluster, held-out shards per cluster and the router's;
    deterministic (the same dataset gives the same bytes and names)."""
    m = ds.manifest
    per_sample = int(ds.x_train[0].numel()) * 4 + 3 * 8 if len(ds.x_train) else 1
    per_shard = max(1, (MAX_SHARD_BYTES - (1 << 12)) // per_sample)
    train_labels = torch.from_numpy(np.asarray(m.train_labels, dtype=np.int64))
    held_labels = torch.from_numpy(np.asarray(m.heldout_labels, dtype=np.int64))

    def shard(split: str, cluster: int, idx: np.ndarray) -> tuple[ShardRef, bytes]:
        t = torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64))
        if split == "train":
            x, y, c = ds.x_train[t], ds.y_train[t], train_labels[t]
        else:
            x, y, c = ds.x_heldout[t], ds.y_heldout[t], held_labels[t]
        blob = encode_shard(x, y, c, t)
        return ShardRef(hashlib.sha256(blob).hexdigest(), len(blob), split, cluster, len(idx)), blob

    for c in range(m.k):
        for part in _chunks(m.members(c), per_shard):
            yield shard("train", c, part)
    n = max(0, int(eval_samples))
    for c in range(m.k):
        yield shard("heldout", c, np.flatnonzero(m.heldout_labels == c)[:n])
    yield shard("heldout", ROUTER_CLUSTER, np.arange(min(n, len(m.heldout_labels))))


def cell_shards(refs: list[ShardRef], cell_id: str) -> list[ShardRef]:
    """The shards `cell_id` needs, nothing more (see the module docstring)."""
    c = cell_cluster(cell_id)
    train = [r for r in refs if r.split == "train" and (c == ROUTER_CLUSTER or r.cluster == c)]
    held = [r for r in refs if r.split == "heldout" and r.cluster == c]
    return train + held


# --- decoding and assembly (the worker) --------------------------------------------------


def decode_shard(blob: bytes, ref: ShardRef, *, channels: int, image_size: int, clusters: int) -> ShardData:
    """The verified tensors of one shard (ShardTampered / ShardError otherwise)."""
    if len(blob) != ref.nbytes:
        raise ShardError(f"shard {ref.sha256[:12]}: {len(blob)} bytes, the manifest says {ref.nbytes}")
    if hashlib.sha256(blob).hexdigest() != ref.sha256:
        raise ShardTampered(f"shard {ref.sha256[:12]}: the bytes do not hash to its name (corrupt or tampered)")
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        t = load(blob)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise ShardError(f"shard {ref.sha256[:12]} is not a safetensors file: {e}") from None
    if sorted(t) != sorted(TENSORS):
        raise ShardError(f"shard {ref.sha256[:12]} holds {sorted(t)}, expected {sorted(TENSORS)}")
    n = ref.count
    x, y, c, idx = t["x"], t["y"], t["cluster"], t["index"]
    if x.dtype != torch.float32 or tuple(x.shape) != (n, channels, image_size, image_size):
        raise ShardError(f"shard {ref.sha256[:12]}: x is {x.dtype} {tuple(x.shape)}, expected float32 [{n}, ...]")
    for name, v in (("y", y), ("cluster", c), ("index", idx)):
        if v.dtype != torch.int64 or tuple(v.shape) != (n,):
            raise ShardError(f"shard {ref.sha256[:12]}: {name} is {v.dtype} {tuple(v.shape)}, expected int64 [{n}]")
    if n and (not torch.isfinite(x).all() or float(x.abs().max()) > 1.0):
        raise ShardError(f"shard {ref.sha256[:12]}: images must be finite and in [-1, 1]")
    if n and (int(y.min()) < 0 or int(c.min()) < 0 or int(c.max()) >= clusters or int(idx.min()) < 0):
        raise ShardError(f"shard {ref.sha256[:12]}: labels or indices out of range")
    if n > 1 and not bool((idx[1:] > idx[:-1]).all()):
        raise ShardError(f"shard {ref.sha256[:12]}: indices are not ascending")
    if ref.cluster != ROUTER_CLUSTER and n and not bool((c == ref.cluster).all()):
        raise ShardError(f"shard {ref.sha256[:12]}: samples of other clusters than {ref.cluster}")
    return ShardData(ref, x, y, c, idx)


def assemble(cell_id: str, shards: list[ShardData], *, train_count: int, heldout_count: int) -> CellData:
    """The cell's data from its verified shards, in the order `models/data.py` gives."""
    router = cell_cluster(cell_id) == ROUTER_CLUSTER

    def join(split: str, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [s for s in shards if s.ref.split == split]
        if not parts:
            raise ShardError(f"{cell_id}: no {split} shard")
        idx = torch.cat([s.index for s in parts])
        order = torch.argsort(idx)
        idx = idx[order]
        if len(idx) != count or (len(idx) > 1 and not bool((idx[1:] > idx[:-1]).all())):
            raise ShardError(f"{cell_id}: {split} shards hold {len(idx)} distinct-ascending samples, expected {count}")
        if router and split == "train" and not torch.equal(idx, torch.arange(count)):
            raise ShardError(f"{cell_id}: the router's training shards must cover the whole training split")
        x = torch.cat([s.x for s in parts])[order].contiguous()
        labels = torch.cat([s.cluster if router else s.y for s in parts])[order].contiguous()
        return x, labels

    xt, yt = join("train", train_count)
    xh, yh = join("heldout", heldout_count) if heldout_count else (xt[:0], yt[:0])
    return CellData(xt, yt, xh, yh)


# --- the process's fetched data (what CellTask._select reads first) ----------------------

_INSTALLED: dict[tuple[str, str], CellData] = {}
_LOCK = threading.Lock()
_KEEP = 4  # cells remembered (a worker trains one cell at a time; moves are rare)


def install(spec: RunSpec, cell_id: str, data: CellData) -> None:
    """Make `data` the cell's data in this process (instead of loading the dataset)."""
    with _LOCK:
        _INSTALLED.pop((spec.spec_hash, cell_id), None)
        _INSTALLED[(spec.spec_hash, cell_id)] = data
        while len(_INSTALLED) > _KEEP:
            _INSTALLED.pop(next(iter(_INSTALLED)))


def installed(spec: RunSpec, cell_id: str) -> CellData | None:
    with _LOCK:
        return _INSTALLED.get((spec.spec_hash, cell_id))


def uninstall_all() -> None:
    with _LOCK:
        _INSTALLED.clear()


__all__ = [
    "MAX_SHARD_BYTES",
    "CellData",
    "ShardData",
    "ShardError",
    "ShardRef",
    "ShardTampered",
    "assemble",
    "build_shards",
    "cell_shards",
    "decode_shard",
    "install",
    "installed",
]
