"""Checkpoint store: verified, size-limited streamed uploads, atomic publication, retention,
and sha256 checks on read. Real safetensors files and a real SQLite index."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save as save_np
from safetensors.torch import save as save_pt

from bagel.coordinator.checkpoints import (
    CheckpointCorrupt,
    CheckpointNotFound,
    CheckpointRejected,
    CheckpointStore,
    CheckpointTooLarge,
)
from bagel.coordinator.store import Store
from bagel.protocol.statehash import state_hash


def blob(seed: int) -> tuple[bytes, str]:
    rng = np.random.default_rng(seed)
    tensors = {"w.a": rng.standard_normal((4, 3)).astype(np.float32), "m.a": np.zeros((4, 3), np.float32)}
    return save_np(tensors), state_hash(tensors)


@pytest.fixture
def ckpts(tmp_path):
    store = Store.open(tmp_path)
    yield CheckpointStore(tmp_path / "checkpoints", store, keep=2, max_bytes=1 << 20), store
    store.close()


def upload(cs: CheckpointStore, cell: str, rnd: int, data: bytes, sh: str, *, chunk: int = 7, **kw):
    up = cs.begin_upload(cell, rnd, sh, kw.pop("total", len(data)), kw.pop("sha", hashlib.sha256(data).hexdigest()))
    for i in range(0, len(data), chunk):
        up.write(data[i : i + chunk])
    return up.finish(now_ms=rnd)


def visible_files(cs: CheckpointStore) -> list[str]:
    return sorted(str(p.relative_to(cs.root)) for p in cs.root.rglob("*") if p.is_file())


def test_upload_publish_read_and_retention(ckpts) -> None:
    cs, store = ckpts
    for rnd in (2, 4, 6):
        data, sh = blob(rnd)
        meta = upload(cs, "k0.r1", rnd, data, sh)
        assert meta.state_hash == sh and meta.total_bytes == len(data)
        assert cs.read_verified(meta) == data
        assert json.loads((cs.root / meta.path).with_suffix(".json").read_text())["state_hash"] == sh
    # keep = 2: round 2 is gone from the index and the disk
    assert [m.round for m in store.list_checkpoints("k0.r1")] == [4, 6]
    assert visible_files(cs) == [
        "k0.r1/0000000004.json",
        "k0.r1/0000000004.safetensors",
        "k0.r1/0000000006.json",
        "k0.r1/0000000006.safetensors",
    ]
    assert cs.get("k0.r1").round == 6 and cs.get("k0.r1", 4).round == 4
    with pytest.raises(CheckpointNotFound):
        cs.get("k0.r1", 2)
    with pytest.raises(CheckpointNotFound):
        cs.get("router")
    chunks = list(cs.iter_chunks(cs.get("k0.r1"), chunk_bytes=100))
    assert all(len(c) <= 100 for c in chunks) and b"".join(chunks) == blob(6)[0]


@pytest.mark.parametrize(
    "case",
    ["sha256", "short", "state_hash", "not_safetensors"],
)
def test_rejected_uploads_leave_nothing_visible(ckpts, case) -> None:
    cs, store = ckpts
    data, sh = blob(1)
    kw: dict = {}
    if case == "sha256":
        kw["sha"] = "0" * 64
    elif case == "short":
        kw["total"] = len(data) + 5
    elif case == "state_hash":
        sh = blob(2)[1]
    elif case == "not_safetensors":
        data = b'\x08\x00\x00\x00\x00\x00\x00\x00{"a": 1}' + b"x" * 40
    with pytest.raises(CheckpointRejected):
        upload(cs, "k0.r0", 3, data, sh, **kw)
    assert visible_files(cs) == [] and store.list_checkpoints() == []


def test_size_limits(ckpts) -> None:
    cs, store = ckpts
    with pytest.raises(CheckpointTooLarge, match="max_bytes"):
        cs.begin_upload("k0.r0", 1, "a" * 64, (1 << 20) + 1, "b" * 64)
    data, sh = blob(1)
    up = cs.begin_upload("k0.r0", 1, sh, 10, hashlib.sha256(data).hexdigest())
    with pytest.raises(CheckpointTooLarge, match="declared size"):
        up.write(data)
    assert visible_files(cs) == [] and store.list_checkpoints() == []


def test_bf16_checkpoint_hashes_like_the_worker(ckpts) -> None:
    cs, _ = ckpts
    tensors = {"w.x": torch.randn(5, dtype=torch.bfloat16), "m.x": torch.zeros(5)}
    data = save_pt(tensors)
    meta = upload(cs, "router", 1, data, state_hash(tensors))
    assert meta.state_hash == state_hash(tensors)


def test_corruption_detected_on_read(ckpts) -> None:
    cs, _ = ckpts
    data, sh = blob(3)
    meta = upload(cs, "k1.r0", 2, data, sh)
    path = cs.root / meta.path
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorrupt):
        list(cs.iter_chunks(meta))
    with pytest.raises(CheckpointCorrupt):
        cs.verify(meta)


def test_crash_leftovers_are_swept(tmp_path) -> None:
    store = Store.open(tmp_path)
    root = tmp_path / "checkpoints"
    (root / "k0.r0").mkdir(parents=True)
    (root / "k0.r0" / ".upload-abc.tmp").write_bytes(b"half")
    CheckpointStore(root, store, keep=1, max_bytes=100)
    assert list((root / "k0.r0").iterdir()) == []
    store.close()


def test_path_traversal_cell_refused(ckpts) -> None:
    cs, _ = ckpts
    with pytest.raises(CheckpointRejected):
        cs.begin_upload("../x", 1, "a" * 64, 1, "b" * 64)


@pytest.fixture(scope="module")
def model_state():
    """The real committed state of a cell at round 0, as a worker would upload it."""
    from bagel.models.experts import cell_task
    from bagel.protocol.runspec import parse_spec
    from bagel.worker.diloco import CellState

    spec = parse_spec('[run]\nid = "schema"\n[model]\npreset = "tiny"\n')
    flat = CellState.from_model(cell_task(spec, "k0.r0").build_model()).to_flat()
    return spec, {k: v.numpy() for k, v in flat.items()}


def _schema_store(tmp_path, spec):
    from functools import partial

    from bagel.models.experts import cell_state_schema

    store = Store.open(tmp_path)
    return CheckpointStore(
        tmp_path / "ck", store, keep=2, max_bytes=64 << 20, schema=partial(cell_state_schema, spec)
    ), store


def test_schema_of_the_cell_is_what_a_worker_saves(model_state) -> None:
    from bagel.models.experts import cell_state_schema

    spec, tensors = model_state
    assert cell_state_schema(spec, "k0.r0") == {k: ("F32", v.shape) for k, v in tensors.items()}


@pytest.mark.parametrize("case", ["wrong names", "wrong shape", "extra tensor", "a 2 MiB tensor", "float16"])
def test_an_upload_that_is_not_the_cells_model_is_refused(tmp_path, model_state, case) -> None:
    spec, good = model_state
    cs, store = _schema_store(tmp_path, spec)
    try:
        name = sorted(good)[0]
        bad = dict(good)
        if case == "wrong names":
            bad["w.renamed"] = bad.pop(name)
        elif case == "wrong shape":
            bad[name] = np.zeros((*good[name].shape, 2), np.float32)
        elif case == "extra tensor":
            bad["w.extra"] = np.zeros(3, np.float32)
        elif case == "a 2 MiB tensor":
            bad = {"w.blob": np.ones(512 * 1024, np.float32)}
        else:
            bad[name] = good[name].astype(np.float16)
        data = save_np(bad)
        with pytest.raises(CheckpointRejected, match="not this cell's model|the cell's model has"):
            upload(cs, "k0.r0", 1, data, state_hash(bad), chunk=1 << 20)
        assert visible_files(cs) == [] and store.list_checkpoints() == []
        meta = upload(cs, "k0.r0", 1, save_np(good), state_hash(good), chunk=1 << 20)  # the model itself is stored
        assert meta.round == 1
    finally:
        store.close()
