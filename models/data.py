"""Training data of a run: sources, normalisation, the held-out split, clusters and shards.

- Sources: scikit-learn's bundled 8x8 digits (default, offline), a folder of PNG/JPEG
  images (one sub-folder per class, or flat = unlabelled), or `.npy` arrays.
  Images become float32 [N, C, H, W] in [-1, 1], resized to the spec's image size.
- Split: a deterministic train / held-out split from (run seed, holdout_fraction).
- Clusters: K clusters by k-means on features, PCA of pixels by default or a
  user-supplied `.npy` feature array (Decentralized Diffusion Models, McAllister et al.
  2025, partition the data by k-means on image features and train one expert per
  cluster). The k-means here is our own small float64 numpy Lloyd loop, not sklearn's:
  sklearn's OpenMP reduction order depends on the thread count, and every worker, whatever
  its core count, must derive the same manifest. Features are rounded before clustering so
  ulp-level BLAS differences between machines cannot flip an assignment in practice; the
  manifest's sha256 lets a worker check it derived the coordinator's partition.
  With `whole_classes` (class-conditional runs), every class then moves, whole, to the
  cluster that holds most of its samples: p(k | y) becomes one-hot, so the composed
  sampler's top-1 routing, which at t = 1 sees only noise and therefore the prior p(k | y),
  can no longer send every sample of a class that k-means split (digits' 5 and 8 split
  47/53 and 43/57 on PCA features) to one cluster and drop the other cluster's modes of it
  (bench/experts_vs_monolith.py measures both partitions).
- Shards: `shard(...)` gives the members of a round disjoint sample indices, a pure
  function of (run, cell, round, member, members), so a re-run round sees the same data.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from bagel.protocol.runspec import RunSpec

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
PCA_COMPONENTS = 16
KMEANS_RESTARTS = 4
KMEANS_MAX_ITER = 100


class DataError(ValueError):
    """The data source is missing or malformed; the message names the file or field."""


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from any tuple of parts (sha256 of their repr), stable across processes."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# --- sources ------------------------------------------------------------------------------


def normalise(images: np.ndarray) -> np.ndarray:
    """Map images to float32 in [-1, 1]: integers as 0..255 (uint8) or their dtype's range
    when it is wider than a byte; floats in [0, 1] or already in [-1, 1]."""
    a = np.asarray(images)
    if a.dtype == np.uint8:
        return (a.astype(np.float32) / 127.5 - 1.0).astype(np.float32)
    if np.issubdtype(a.dtype, np.integer):
        hi = float(np.iinfo(a.dtype).max) if a.dtype.itemsize > 1 else 255.0
        if a.min() < 0:
            raise DataError("integer images must be non-negative")
        return (a.astype(np.float64) / hi * 2.0 - 1.0).astype(np.float32)
    if np.issubdtype(a.dtype, np.floating):
        if not np.isfinite(a).all():
            raise DataError("images contain NaN or infinity")
        lo, hi = float(a.min()), float(a.max())
        if lo >= 0.0 and hi <= 1.0:
            return (a * 2.0 - 1.0).astype(np.float32)
        if lo >= -1.0 and hi <= 1.0:
            return a.astype(np.float32)
        raise DataError(f"float images must lie in [0, 1] or [-1, 1], found [{lo:.3g}, {hi:.3g}]")
    raise DataError(f"unsupported image dtype {a.dtype}")


def _to_nchw(a: np.ndarray, channels: int) -> np.ndarray:
    """[N,H,W] / [N,H,W,C] / [N,C,H,W] -> [N,C,H,W] with the requested channel count."""
    if a.ndim == 3:
        a = a[:, None]
    elif a.ndim == 4:
        if a.shape[1] not in (1, 3) and a.shape[3] in (1, 3):
            a = a.transpose(0, 3, 1, 2)
    else:
        raise DataError(f"images must be [N,H,W], [N,H,W,C] or [N,C,H,W], got shape {a.shape}")
    if a.shape[1] == channels:
        return a
    if a.shape[1] == 3 and channels == 1:  # ITU-R 601 luma
        return (0.299 * a[:, 0:1] + 0.587 * a[:, 1:2] + 0.114 * a[:, 2:3]).astype(a.dtype)
    if a.shape[1] == 1 and channels == 3:
        return np.repeat(a, 3, axis=1)
    raise DataError(f"cannot convert {a.shape[1]} channels to {channels}")


def resize(x: torch.Tensor, size: int) -> torch.Tensor:
    """Resize [N,C,H,W] to [N,C,size,size] (area when shrinking, bilinear when growing)."""
    if x.shape[-1] == size and x.shape[-2] == size:
        return x
    mode = "area" if size < min(x.shape[-2:]) else "bilinear"
    kw = {} if mode == "area" else {"align_corners": False}
    return F.interpolate(x, size=(size, size), mode=mode, **kw).clamp(-1.0, 1.0)


def load_digits_source() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits: values 0..16 -> [-1, 1], labels 0..9."""
    images, target = _bundled_digits()
    x = (images.astype(np.float32) / 8.0 - 1.0)[:, None]
    return x.astype(np.float32), target.astype(np.int64)


DIGITS_FILE = ("datasets", "data", "digits.csv.gz")  # in the sklearn package: 64 pixels, then the label


def _bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """(images [N, 8, 8], labels [N]) as `sklearn.datasets.load_digits` gives them, read from
    the CSV file scikit-learn ships, without importing scikit-learn (which costs every
    worker and coordinator start about 1.4 s of CPU for one 500 KB file). Where the file is
    not where this scikit-learn keeps it, scikit-learn's loader is used."""
    import gzip
    import importlib.util

    spec = importlib.util.find_spec("sklearn")  # finds the package without running its __init__
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(roots[0], *DIGITS_FILE) if roots else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits

        d = load_digits()
        return d.images, d.target
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def load_folder_source(path: str | Path, channels: int, image_size: int) -> tuple[np.ndarray, np.ndarray]:
    """PNG/JPEG images; sub-folders (sorted by name) are classes, loose files get label 0."""
    from PIL import Image

    root = Path(path)
    if not root.is_dir():
        raise DataError(f"data.path {str(root)!r} is not a directory")
    classes = sorted(p for p in root.iterdir() if p.is_dir())
    files: list[tuple[Path, int]] = []
    for label, folder in enumerate(classes):
        files += [(f, label) for f in sorted(folder.iterdir()) if f.suffix.lower() in IMAGE_SUFFIXES]
    files += [(f, 0) for f in sorted(root.iterdir()) if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES]
    if not files:
        raise DataError(f"no PNG/JPEG images under {str(root)!r}")
    mode = "L" if channels == 1 else "RGB"
    arrays = []
    for f, _ in files:
        try:
            with Image.open(f) as im:
                img = im.convert(mode).resize((image_size, image_size), Image.Resampling.BICUBIC)
                arrays.append(np.asarray(img, dtype=np.uint8))
        except OSError as e:
            raise DataError(f"cannot read image {str(f)!r}: {e}") from None
    x = np.stack(arrays)
    return _to_nchw(normalise(x), channels), np.array([lbl for _, lbl in files], dtype=np.int64)


def load_npy_source(path: str | Path, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """`images.npy` (+ optional `labels.npy`) in a directory, or `X.npy` (+ `X.labels.npy`).

    Loaded with allow_pickle=False: object arrays are refused."""
    p = Path(path)
    if p.is_dir():
        img, lbl = p / "images.npy", p / "labels.npy"
    else:
        img, lbl = p, p.with_suffix(".labels.npy")
    if not img.is_file():
        raise DataError(f"no image array at {str(img)!r}")
    try:
        x = np.load(img, allow_pickle=False)
        y = np.load(lbl, allow_pickle=False) if lbl.is_file() else np.zeros(len(x), dtype=np.int64)
    except ValueError as e:
        raise DataError(f"cannot load {str(img)!r}: {e}") from None
    if y.shape != (len(x),) or not np.issubdtype(y.dtype, np.integer) or (len(y) and y.min() < 0):
        raise DataError(f"labels must be non-negative integers of shape ({len(x)},), got {y.dtype} {y.shape}")
    return _to_nchw(normalise(x), channels), y.astype(np.int64)


# --- split and clusters -------------------------------------------------------------------


def split_indices(n: int, holdout_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, held-out) index arrays; held-out is round(n * fraction), at least 1."""
    if not (0.0 < holdout_fraction < 1.0):
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
    if n < 2:
        raise DataError(f"need at least 2 samples to split, got {n}")
    perm = np.random.Generator(np.random.PCG64(derive_seed("split", seed))).permutation(n)
    n_held = min(n - 1, max(1, int(round(n * holdout_fraction))))
    return np.sort(perm[n_held:]), np.sort(perm[:n_held])


def pca_features(x: np.ndarray, components: int = PCA_COMPONENTS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features, mean, basis) of flattened images; basis rows have a fixed sign (largest
    absolute coefficient positive), so the projection does not depend on the SVD routine."""
    flat = x.reshape(len(x), -1).astype(np.float64)
    mean = flat.mean(axis=0)
    _, _, vt = np.linalg.svd(flat - mean, full_matrices=False)
    basis = vt[: min(components, vt.shape[0])]
    signs = np.sign(basis[np.arange(len(basis)), np.abs(basis).argmax(axis=1)])
    basis = basis * signs[:, None]
    return (flat - mean) @ basis.T, mean, basis


def _sq_dists(f: np.ndarray, c: np.ndarray) -> np.ndarray:
    # explicit broadcast-and-sum (no BLAS gemm): the same summation order on every machine.
    return ((f[:, None, :] - c[None, :, :]) ** 2).sum(axis=2)


def kmeans(features: np.ndarray, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(labels, centroids): k-means++ seeding then Lloyd, best of a few restarts, float64.

    Clusters are renumbered by their smallest member index, so the numbering is canonical."""
    f = np.round(np.asarray(features, dtype=np.float64), 6)
    n = len(f)
    if not (1 <= k <= n):
        raise DataError(f"cannot make {k} clusters of {n} samples")
    rng = np.random.Generator(np.random.PCG64(derive_seed("kmeans", seed, k)))
    best: tuple[float, np.ndarray, np.ndarray] | None = None
    for _ in range(KMEANS_RESTARTS):
        centroids = [f[rng.integers(n)]]
        for _ in range(1, k):  # k-means++ (Arthur & Vassilvitskii 2007)
            d2 = _sq_dists(f, np.array(centroids)).min(axis=1)
            total = d2.sum()
            idx = int(rng.choice(n, p=d2 / total)) if total > 0 else int(rng.integers(n))
            centroids.append(f[idx])
        c = np.array(centroids)
        labels = np.full(n, -1)
        for _ in range(KMEANS_MAX_ITER):
            new = _sq_dists(f, c).argmin(axis=1)
            if np.array_equal(new, labels):
                break
            labels = new
            for j in range(k):
                members = f[labels == j]
                if len(members):
                    c[j] = members.mean(axis=0)
        inertia = float(_sq_dists(f, c).min(axis=1).sum())
        if best is None or inertia < best[0]:
            best = (inertia, labels.copy(), c.copy())
    assert best is not None
    _, labels, c = best
    present = [j for j in range(k) if (labels == j).any()]
    if len(present) < k:
        raise DataError(f"k-means found only {len(present)} non-empty clusters of {k}")
    order = sorted(range(k), key=lambda j: int(np.flatnonzero(labels == j)[0]))
    remap = np.empty(k, dtype=np.int64)
    remap[order] = np.arange(k)
    return remap[labels], c[order]


def whole_class_clusters(labels: np.ndarray, classes: np.ndarray, k: int) -> np.ndarray:
    """[num_classes] cluster of each class: the cluster holding most of its samples (ties:
    the lower index). A cluster left with no class takes the class with the largest share
    of its samples in it, from a cluster that keeps another class; classes absent from
    `classes` get -1. Pure and deterministic."""
    n_classes = int(classes.max()) + 1 if len(classes) else 0
    counts = np.zeros((n_classes, k), dtype=np.int64)
    np.add.at(counts, (classes, labels), 1)
    present = counts.sum(axis=1) > 0
    if int(present.sum()) < k:
        raise DataError(f"cannot make {k} whole-class clusters of {int(present.sum())} classes")
    assign = np.where(present, counts.argmax(axis=1), -1)
    for j in range(k):
        if (assign == j).any():
            continue
        donors = [c for c in range(n_classes) if present[c] and (assign == assign[c]).sum() > 1]
        assign[max(donors, key=lambda c: (counts[c, j] / counts[c].sum(), -c))] = j  # largest share of j
    return assign


@dataclass(frozen=True)
class ClusterManifest:
    """The partition of the training split: which samples belong to which cluster."""

    seed: int
    k: int
    features: str  # "pca" or "file"
    whole_classes: bool  # every class lies in one cluster (see `whole_class_clusters`)
    train_labels: np.ndarray  # [N_train] cluster of each training sample
    # [N_held] nearest centroid of each held-out sample (with whole_classes: its class's cluster)
    heldout_labels: np.ndarray
    centroids: np.ndarray  # [k, F] in feature space

    def members(self, cluster: int) -> np.ndarray:
        """Indices (into the training split) of the cluster's samples, ascending."""
        return np.flatnonzero(self.train_labels == cluster)

    def to_json(self) -> dict[str, object]:
        return {
            "seed": self.seed,
            "k": self.k,
            "features": self.features,
            "whole_classes": self.whole_classes,
            "members": [self.members(j).tolist() for j in range(self.k)],
            "heldout_labels": self.heldout_labels.tolist(),
            "centroids": np.round(self.centroids, 6).tolist(),
        }

    @property
    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Dataset:
    """A run's data: train / held-out images in [-1, 1], labels, and the cluster manifest."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_heldout: torch.Tensor
    y_heldout: torch.Tensor
    manifest: ClusterManifest

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_heldout.max())) + 1


def build_dataset(
    x: np.ndarray,
    y: np.ndarray,
    *,
    clusters: int,
    holdout_fraction: float,
    seed: int,
    image_size: int | None = None,
    features: np.ndarray | None = None,
    whole_classes: bool = False,
) -> Dataset:
    """Split, cluster and package arrays already in [-1, 1] ([N, C, H, W]).

    `features` (one row per sample of x) replaces the PCA features for k-means;
    `whole_classes` then moves every class whole to one cluster (`whole_class_clusters`), and
    held-out samples follow their class (nearest centroid for a class unseen in training)."""
    if x.ndim != 4 or len(x) != len(y):
        raise DataError(f"expected images [N,C,H,W] and N labels, got {x.shape} and {y.shape}")
    train, held = split_indices(len(x), holdout_fraction, seed)
    if features is None:
        f_train, mean, basis = pca_features(x[train])
        flat_held = x[held].reshape(len(held), -1).astype(np.float64)
        f_held = (flat_held - mean) @ basis.T
        kind = "pca"
    else:
        feats = np.asarray(features, dtype=np.float64)
        if feats.ndim != 2 or len(feats) != len(x) or not np.isfinite(feats).all():
            raise DataError(f"features must be a finite [N={len(x)}, F] array, got {feats.shape}")
        f_train, f_held, kind = feats[train], feats[held], "file"
    labels, centroids = kmeans(f_train, clusters, seed)
    held_labels = _sq_dists(np.round(f_held, 6), centroids).argmin(axis=1)
    if whole_classes:
        y_train, y_held = np.asarray(y)[train], np.asarray(y)[held]
        of_class = whole_class_clusters(labels, y_train, clusters)
        labels = of_class[y_train]
        centroids = np.stack([np.round(f_train, 6)[labels == j].mean(axis=0) for j in range(clusters)])
        held_of_class = np.full(len(y_held), -1)
        seen = y_held < len(of_class)
        held_of_class[seen] = of_class[y_held[seen]]
        held_labels = np.where(held_of_class >= 0, held_of_class, held_labels)  # else nearest centroid
    manifest = ClusterManifest(seed, clusters, kind, whole_classes, labels, held_labels, centroids)
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    if image_size is not None:
        xt = resize(xt, image_size)
    yt = torch.from_numpy(np.asarray(y, dtype=np.int64))
    tr, he = torch.from_numpy(train), torch.from_numpy(held)
    return Dataset(xt[tr].contiguous(), yt[tr], xt[he].contiguous(), yt[he], manifest)


@functools.lru_cache(maxsize=8)
def _load_cached(
    source: str,
    path: str,
    channels: int,
    image_size: int,
    clusters: int,
    holdout_fraction: float,
    seed: int,
    features: str,
    features_path: str,
    whole_classes: bool,
) -> Dataset:
    if source == "digits":
        x, y = load_digits_source()
        x = _to_nchw(x, channels)
    elif source == "folder":
        x, y = load_folder_source(path, channels, image_size)
    elif source == "npy":
        x, y = load_npy_source(path, channels)
    else:
        raise DataError(f"unknown data.source {source!r}")
    feats = None
    if features == "file":
        fp = Path(features_path)
        if not fp.is_file():
            raise DataError(f"data.features_path {features_path!r} is not a file")
        feats = np.load(fp, allow_pickle=False)
    return build_dataset(
        x,
        y,
        clusters=clusters,
        holdout_fraction=holdout_fraction,
        seed=seed,
        image_size=image_size,
        features=feats,
        whole_classes=whole_classes,
    )


def load_dataset(spec: RunSpec) -> Dataset:
    """The run's dataset (cached per process; the tensors are shared, do not modify them)."""
    d, m = spec.data, spec.model
    return _load_cached(
        d.source,
        d.path,
        m.channels,
        m.image_size,
        d.clusters,
        d.holdout_fraction,
        spec.run.seed,
        d.features,
        d.features_path,
        d.whole_classes,
    )


def cluster_manifest(spec: RunSpec) -> ClusterManifest:
    return load_dataset(spec).manifest


# --- shards -------------------------------------------------------------------------------


def shard(run_id: str, cell_id: str, round: int, member: int, members: int, n: int, count: int) -> np.ndarray:
    """`count` sample indices out of n for `member` of a round with `members` members.

    The round's permutation of range(n) comes from (run_id, cell_id, round), and member m owns
    its positions m, m + members, m + 2 * members, ... of it, so members are disjoint
    whatever their counts. A member asked for more than it owns cycles through its own
    subset, reshuffled each pass, so it never touches another member's samples. Pure: the
    same arguments give the same indices, so a re-run round sees the same data.
    """
    if members < 1:
        raise ValueError(f"members must be at least 1, got {members}")
    if not (0 <= member < members):
        raise ValueError(f"member must be in [0, {members}), got {member}")
    if round < 0:
        raise ValueError(f"round must be non-negative, got {round}")
    if count < 0:
        raise ValueError(f"count must be non-negative, got {count}")
    if n < members:
        raise ValueError(f"cannot give {members} members disjoint shards of {n} samples")
    perm = np.random.Generator(np.random.PCG64(derive_seed("shard", run_id, cell_id, round))).permutation(n)
    own = perm[member::members]
    if count <= len(own):
        return own[:count].astype(np.int64)
    rng = np.random.Generator(np.random.PCG64(derive_seed("shard-cycle", run_id, cell_id, round, member)))
    parts = [own]
    total = len(own)
    while total < count:
        parts.append(rng.permutation(own))
        total += len(own)
    return np.concatenate(parts)[:count].astype(np.int64)
