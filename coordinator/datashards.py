"""The data shards a coordinator serves to workers with no local copy of the dataset.

Built on the first request (a run whose workers all hold the data never pays for it): the
run's dataset (`models/data.py`, already loaded for sizing) cut by `models/datashards.py`
into content-addressed safetensors files under `DATA_DIR/datashards/<sha256>`, written
atomically. An existing file of the right name is kept, not re-checked here: every byte is
verified by the worker against its name, so a file damaged on this disk is refused there
(the operator then deletes it and it is rebuilt on the next start).

`manifest(cell_id)` answers the shards one cell needs (`partition` only the cluster
manifest's sha256, for a worker checking its own copy, and builds nothing), and `read(sha256, offset)` yields
the file's bytes from `offset` on in bounded chunks (a resumed download asks for the rest).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc

from bagel.coordinator.interceptor import ShellError
from bagel.models.datashards import ShardRef, build_shards, cell_shards
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.atomicfile import atomic_write
from bagel.protocol.runspec import RunSpec

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20


class ShardNotFound(ShellError):
    status = grpc.StatusCode.NOT_FOUND
    reason = "shard_not_found"


class ShardRangeError(ShellError):
    status = grpc.StatusCode.OUT_OF_RANGE
    reason = "shard_range"


class DataUnavailable(ShellError):
    """The coordinator cannot read its own copy of the dataset (moved, deleted, unreadable)."""

    status = grpc.StatusCode.FAILED_PRECONDITION
    reason = "data_unavailable"


class DataShardStore:
    """The run's shards on disk and their index (see the module docstring)."""

    def __init__(self, root: Path, spec: RunSpec) -> None:
        self.root = Path(root)
        self.spec = spec
        self._refs: dict[str, ShardRef] | None = None
        self._lock = asyncio.Lock()
        self._cluster_sha = ""
        self._counts: tuple[dict[int, int], dict[int, int]] = ({}, {})

    def _build(self) -> dict[str, ShardRef]:
        from bagel.models.data import DataError, load_dataset

        try:
            ds = load_dataset(self.spec)
        except (DataError, OSError) as e:
            raise DataUnavailable(f"the coordinator cannot read the run's data: {e}") from None
        self.root.mkdir(parents=True, exist_ok=True)
        refs: dict[str, ShardRef] = {}
        train: dict[int, int] = {}
        held: dict[int, int] = {}
        for ref, blob in build_shards(ds, self.spec.guard.eval_samples):
            path = self.root / ref.sha256
            if not path.is_file() or path.stat().st_size != ref.nbytes:
                atomic_write(path, blob)
            refs[ref.sha256] = ref
            (train if ref.split == "train" else held)[ref.cluster] = (train if ref.split == "train" else held).get(
                ref.cluster, 0
            ) + ref.count
        self._cluster_sha = ds.manifest.sha256
        self._counts = (train, held)
        log.info("data shards: %d files, %d bytes in %s", len(refs), sum(r.nbytes for r in refs.values()), self.root)
        return refs

    async def refs(self) -> dict[str, ShardRef]:
        if self._refs is None:
            async with self._lock:
                if self._refs is None:
                    self._refs = await asyncio.to_thread(self._build)
        return self._refs

    async def partition(self, cell_id: str) -> pb.DataManifest:
        """Only the cluster manifest's sha256 (no shard is built for it)."""
        from bagel.models.data import DataError, cluster_manifest

        try:
            sha = (await asyncio.to_thread(cluster_manifest, self.spec)).sha256
        except (DataError, OSError) as e:
            raise DataUnavailable(f"the coordinator cannot read the run's data: {e}") from None
        return pb.DataManifest(cell_id=cell_id, cluster_manifest_sha256=sha)

    async def manifest(self, cell_id: str) -> pb.DataManifest:
        refs = list((await self.refs()).values())
        mine = cell_shards(refs, cell_id)
        train = sum(r.count for r in mine if r.split == "train")
        held = sum(r.count for r in mine if r.split == "heldout")
        return pb.DataManifest(
            cell_id=cell_id,
            cluster_manifest_sha256=self._cluster_sha,
            shards=[
                pb.DataShardRef(sha256=r.sha256, nbytes=r.nbytes, split=r.split, cluster=r.cluster, count=r.count)
                for r in mine
            ],
            train_count=train,
            heldout_count=held,
        )

    async def lookup(self, sha256: str, offset: int) -> ShardRef:
        ref = (await self.refs()).get(sha256)
        if ref is None:
            raise ShardNotFound(f"no data shard {sha256[:16]} in this run")
        if not 0 <= offset <= ref.nbytes:
            raise ShardRangeError(f"offset {offset} outside the shard's {ref.nbytes} bytes")
        return ref

    def read(self, ref: ShardRef, offset: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The file's bytes from `offset` on, at most `chunk_bytes` at a time (blocking reads)."""
        with (self.root / ref.sha256).open("rb") as f:
            f.seek(offset)
            left = ref.nbytes - offset
            while left > 0:
                piece = f.read(min(chunk_bytes, left))
                if not piece:
                    return  # shorter than indexed: the worker sees the gap and refuses
                left -= len(piece)
                yield piece


__all__ = ["DataShardStore", "DataUnavailable", "ShardNotFound", "ShardRangeError"]
