"""Data: normalisation, the held-out split, deterministic k-means and manifest, shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bagel.models import data
from bagel.protocol.runspec import parse_spec

SPEC = """
[run]
id = "t"
seed = {seed}
[data]
clusters = {k}
holdout_fraction = 0.1
"""


def spec(seed: int = 0, k: int = 2):
    return parse_spec(SPEC.format(seed=seed, k=k))


def test_digits_normalised_split_and_shapes():
    ds = data.load_dataset(spec())
    assert ds.x_train.shape[1:] == (1, 8, 8) and ds.x_train.dtype == torch.float32
    assert len(ds.x_train) + len(ds.x_heldout) == 1797
    assert len(ds.x_heldout) == round(1797 * 0.1)
    assert float(ds.x_train.min()) == -1.0 and float(ds.x_train.max()) == 1.0
    # the split is a function of the seed
    a_tr, a_he = data.split_indices(1797, 0.1, 0)
    b_tr, b_he = data.split_indices(1797, 0.1, 0)
    c_tr, _ = data.split_indices(1797, 0.1, 1)
    assert np.array_equal(a_tr, b_tr) and np.array_equal(a_he, b_he)
    assert not np.array_equal(a_tr, c_tr)
    assert len(np.intersect1d(a_tr, a_he)) == 0 and len(a_tr) + len(a_he) == 1797


def test_kmeans_is_deterministic_for_a_seed_and_canonical():
    rng = np.random.default_rng(5)
    f = np.concatenate([rng.normal(0, 1, (60, 4)), rng.normal(6, 1, (40, 4)), rng.normal(-6, 1, (50, 4))])
    l1, c1 = data.kmeans(f, 3, seed=7)
    l2, c2 = data.kmeans(f.copy(), 3, seed=7)
    assert np.array_equal(l1, l2) and np.array_equal(c1, c2)
    # well-separated blobs are recovered, numbered by their smallest member index
    assert set(l1[:60]) == {0} and set(l1[60:100]) == {1} and set(l1[100:]) == {2}


def test_manifest_is_deterministic_and_seed_dependent():
    data._load_cached.cache_clear()
    m1 = data.cluster_manifest(spec(seed=0))
    data._load_cached.cache_clear()
    m2 = data.cluster_manifest(spec(seed=0))
    m3 = data.cluster_manifest(spec(seed=3, k=3))
    assert m1.sha256 == m2.sha256
    assert m1.sha256 != m3.sha256
    members = [m1.members(k) for k in range(m1.k)]
    assert sum(len(m) for m in members) == len(m1.train_labels)
    assert all(len(m) > 0 for m in members)
    js = m1.to_json()
    assert js["seed"] == 0 and js["k"] == 2 and len(js["centroids"]) == 2


def test_whole_class_clusters_majority_and_no_empty_cluster():
    # class 0: 9 in cluster 0, 1 in cluster 1; class 1: 2 / 8; class 2: 5 / 5 (tie -> 0)
    labels = np.array([0] * 9 + [1] + [0] * 2 + [1] * 8 + [0] * 5 + [1] * 5)
    classes = np.array([0] * 10 + [1] * 10 + [2] * 10)
    assert data.whole_class_clusters(labels, classes, 2).tolist() == [0, 1, 0]
    # every class's majority is cluster 0: cluster 1 takes the class with the largest share
    # of its samples there (class 1: 4/10), not the first class
    labels = np.array([0] * 8 + [1] * 2 + [0] * 6 + [1] * 4 + [0] * 7 + [1] * 3)
    assert data.whole_class_clusters(labels, classes, 2).tolist() == [0, 1, 0]
    # a class with no samples gets -1 and is not given a cluster
    assert data.whole_class_clusters(np.array([0, 1]), np.array([0, 2]), 2).tolist() == [0, -1, 1]
    with pytest.raises(data.DataError, match="whole-class clusters"):
        data.whole_class_clusters(np.array([0, 1, 1]), np.array([0, 0, 0]), 2)


def test_whole_classes_put_every_class_in_one_cluster():
    x, y = data.load_digits_source()
    plain = data.build_dataset(x, y, clusters=2, holdout_fraction=0.1, seed=0)
    whole = data.build_dataset(x, y, clusters=2, holdout_fraction=0.1, seed=0, whole_classes=True)
    again = data.build_dataset(x, y, clusters=2, holdout_fraction=0.1, seed=0, whole_classes=True)
    assert whole.manifest.sha256 == again.manifest.sha256 != plain.manifest.sha256
    assert whole.manifest.to_json()["whole_classes"] is True

    def classes_of(ds, k, heldout=False):
        lab = ds.manifest.heldout_labels if heldout else ds.manifest.train_labels
        return set((ds.y_heldout if heldout else ds.y_train).numpy()[lab == k].tolist())

    # k-means on pixels splits some digits between the clusters; whole_classes does not
    assert classes_of(plain, 0) & classes_of(plain, 1)
    assert not classes_of(whole, 0) & classes_of(whole, 1)
    assert classes_of(whole, 0) | classes_of(whole, 1) == set(range(10))
    for k in range(2):  # held-out samples follow their class
        assert classes_of(whole, k, heldout=True) <= classes_of(whole, k)
    # each class went to the cluster that held most of it before
    for c in range(10):
        in_c = plain.y_train.numpy() == c
        majority = np.bincount(plain.manifest.train_labels[in_c], minlength=2).argmax()
        assert set(whole.manifest.train_labels[in_c].tolist()) == {majority}
    with pytest.raises(Exception, match="whole_classes"):
        parse_spec(SPEC.format(seed=0, k=3) + "whole_classes = true\n[model]\nnum_classes = 2\n")


def test_user_features_drive_the_clusters():
    x = np.zeros((40, 1, 4, 4), dtype=np.float32)
    y = np.zeros(40, dtype=np.int64)
    feats = np.concatenate([np.zeros((20, 2)), np.full((20, 2), 10.0)])
    ds = data.build_dataset(x, y, clusters=2, holdout_fraction=0.1, seed=0, features=feats)
    assert ds.manifest.features == "file"
    # the held-out samples go to the centroid of their own feature group
    _, held = data.split_indices(40, 0.1, 0)
    expect = (held >= 20).astype(int)
    train_first = ds.manifest.train_labels[0]
    assert np.array_equal(ds.manifest.heldout_labels == train_first, expect == 0)
    with pytest.raises(data.DataError):
        data.build_dataset(x, y, clusters=2, holdout_fraction=0.1, seed=0, features=feats[:10])


def test_shards_are_disjoint_deterministic_and_cover():
    n = 100
    parts = [data.shard("run", "k0.r1", 3, m, 4, n, 25) for m in range(4)]
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == n  # disjoint, and together they cover the data
    again = [data.shard("run", "k0.r1", 3, m, 4, n, 25) for m in range(4)]
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))  # a re-run round sees the same data
    other = data.shard("run", "k0.r1", 4, 0, 4, n, 25)
    assert not np.array_equal(parts[0], other)  # the next round is reshuffled
    assert not np.array_equal(parts[0], data.shard("run", "k1.r1", 3, 0, 4, n, 25))


def test_shards_with_unequal_counts_and_cycling_stay_disjoint():
    n = 50
    a = data.shard("run", "router", 1, 0, 2, n, 7)
    b = data.shard("run", "router", 1, 1, 2, n, 120)  # more than its 25 samples: cycles its own
    assert len(a) == 7 and len(b) == 120
    assert not set(a.tolist()) & set(b.tolist())
    assert len(set(b.tolist())) == 25
    assert b.min() >= 0 and b.max() < n


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(member=2, members=2),
        dict(member=-1, members=2),
        dict(members=0, member=0),
        dict(count=-1),
        dict(round=-1),
        dict(n=1, members=2),
    ],
)
def test_shard_rejects_bad_arguments(kwargs):
    args = dict(run_id="r", cell_id="k0.r0", round=0, member=0, members=2, n=10, count=3)
    args.update(kwargs)
    with pytest.raises(ValueError):
        data.shard(**args)


def test_normalise_ranges():
    assert np.allclose(data.normalise(np.array([0, 255], dtype=np.uint8)), [-1, 1])
    assert np.allclose(data.normalise(np.array([0.0, 0.5, 1.0])), [-1, 0, 1])
    assert np.allclose(data.normalise(np.array([-1.0, 0.25])), [-1, 0.25])
    with pytest.raises(data.DataError):
        data.normalise(np.array([0.0, 3.0]))
    with pytest.raises(data.DataError):
        data.normalise(np.array([np.nan]))


def _folder_spec(path, source: str, size: int = 8, channels: int = 1, clusters: int = 2) -> object:
    return parse_spec(
        f'[run]\nid = "f"\n[model]\nimage_size = {size}\nchannels = {channels}\nnum_classes = 3\n'
        f'[data]\nsource = "{source}"\npath = "{path}"\nclusters = {clusters}\nholdout_fraction = 0.2\n'
    )


def test_image_folder_source_with_class_subfolders(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for label in ("a_cats", "b_dogs", "c_owls"):
        (tmp_path / label).mkdir()
        for i in range(6):
            arr = rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)
            Image.fromarray(arr).save(tmp_path / label / f"{i}.png" if i % 2 else tmp_path / label / f"{i}.jpg")
    (tmp_path / "notes.txt").write_text("not an image")
    ds = data.load_dataset(_folder_spec(tmp_path, "folder", size=8, channels=3))
    assert ds.x_train.shape[1:] == (3, 8, 8)
    assert float(ds.x_train.min()) >= -1.0 and float(ds.x_train.max()) <= 1.0
    labels = sorted(torch.cat([ds.y_train, ds.y_heldout]).tolist())
    assert labels == [0] * 6 + [1] * 6 + [2] * 6
    gray = data.load_dataset(_folder_spec(tmp_path, "folder", size=4, channels=1))
    assert gray.x_train.shape[1:] == (1, 4, 4)


def test_image_folder_errors(tmp_path):
    with pytest.raises(data.DataError, match="not a directory"):
        data.load_dataset(_folder_spec(tmp_path / "absent", "folder"))
    with pytest.raises(data.DataError, match="no PNG/JPEG"):
        data.load_dataset(_folder_spec(tmp_path, "folder"))
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    with pytest.raises(data.DataError, match="cannot read image"):
        data.load_dataset(_folder_spec(tmp_path, "folder"))


def test_npy_source_file_and_directory_with_resizing(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.random((30, 16, 16)).astype(np.float32)  # floats in [0, 1], [N, H, W]
    y = np.arange(30) % 3
    np.save(tmp_path / "images.npy", x)
    np.save(tmp_path / "labels.npy", y)
    ds = data.load_dataset(_folder_spec(tmp_path, "npy", size=8))
    assert ds.x_train.shape == (24, 1, 8, 8) and len(ds.x_heldout) == 6
    assert sorted(torch.cat([ds.y_train, ds.y_heldout]).tolist()) == sorted(y.tolist())
    # a single file, channels-last uint8, no labels file: labels default to 0
    np.save(tmp_path / "rgb.npy", rng.integers(0, 256, (20, 8, 8, 3), dtype=np.uint8))
    ds2 = data.load_dataset(_folder_spec(tmp_path / "rgb.npy", "npy", channels=3))
    assert ds2.x_train.shape[1:] == (3, 8, 8) and int(ds2.y_train.max()) == 0


def test_npy_source_refuses_pickles_and_bad_labels(tmp_path):
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}] * 4, dtype=object), allow_pickle=True)
    with pytest.raises(data.DataError, match="cannot load"):
        data.load_dataset(_folder_spec(tmp_path / "obj.npy", "npy"))
    np.save(tmp_path / "x.npy", np.zeros((10, 8, 8), dtype=np.uint8))
    np.save(tmp_path / "x.labels.npy", np.zeros(9, dtype=np.int64))
    with pytest.raises(data.DataError, match="labels must be"):
        data.load_dataset(_folder_spec(tmp_path / "x.npy", "npy"))


def test_bundled_digits_are_exactly_what_sklearn_loads(monkeypatch) -> None:
    """The CSV read without importing scikit-learn gives its load_digits bit for bit, and
    where the file is not found, scikit-learn's own loader is used."""
    from sklearn.datasets import load_digits

    want = load_digits()
    images, target = data._bundled_digits()
    assert images.dtype == want.images.dtype and np.array_equal(images, want.images)
    assert target.dtype == want.target.dtype and np.array_equal(target, want.target)
    monkeypatch.setattr(data, "DIGITS_FILE", ("datasets", "data", "no-such-file.csv.gz"))
    images, target = data._bundled_digits()
    assert np.array_equal(images, want.images) and np.array_equal(target, want.target)
