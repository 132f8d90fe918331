"""Data for a worker without a local copy of the run's dataset: fetch its cell's shards.

A folder or `.npy` dataset lives on the operator's machine. A worker that finds nothing at
the spec's `data.path` (no readable folder with entries, no `images.npy`; or is told
`--fetch-data always`) asks the coordinator which shards its
cell needs (`GetDataManifest`: the cluster's training shards and the guard's held-out
shard, never the whole dataset for an expert cell) and fetches each one
(`FetchDataShard`), one stream at a time:

- content-addressed: a shard is stored as `DATA_DIR/runs/RUN/datashards/<sha256>`; one
  already there is verified and reused, so a restart or a move back costs nothing;
- resumable: bytes are appended to `<sha256>.part` as they arrive; a broken stream is
  resumed from the part's length (the coordinator answers from that offset);
- verified: offsets, sizes and the count of bytes are checked as they arrive, and the whole
  file must hash to its name before it is renamed into place; a shard that does not is
  deleted and refused (`ShardTampered`), and the cell is retried only after a back-off;
- bounded: per shard `MAX_SHARD_BYTES`, per cell `max_cell_bytes`, at most
  `MAX_SHARDS_PER_CELL` shards, a deadline per stream from the shard's size.

The verified tensors are decoded (`models/datashards.py`), assembled in the order the
dataset itself gives, and installed for the process, so `CellTask.train_data()` and
`heldout_data()` return them and training is bit-identical to a worker with the data.

The scikit-learn digits default is bundled with scikit-learn, which every worker installs,
so `auto` never fetches it (`always` does, e.g. to test this path on one machine). A worker
that has a folder or `.npy` copy of its own checks, before its first cell, that the copy
gives the coordinator's partition (`same_partition`: the cluster manifests' sha256); one
that does not (other files at the same path) fetches instead of training on other data.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import torch

from bagel.models import datashards
from bagel.models.datashards import MAX_SHARD_BYTES, MAX_SHARDS_PER_CELL, ShardError, ShardRef, ShardTampered
from bagel.protocol.client import is_retryable

log = logging.getLogger(__name__)

FETCH_MODES = ("auto", "always", "never")
DEFAULT_MAX_CELL_BYTES = 4 << 30
MIN_RATE_BYTES_PER_S = 32 << 10  # a stream slower than this on average is cut (and resumed)
STREAM_SLACK_S = 30.0
ATTEMPTS = 4  # per shard, resuming each time
RETRY_AFTER_FAILURE_S = 30.0  # a cell whose data failed is not fetched again sooner


class DataFetchError(RuntimeError):
    """The cell's data could not be fetched or was refused; the message says why."""


def needs_fetch(spec: Any, mode: str) -> bool:
    """Whether this worker fetches its data (see the module docstring)."""
    if mode == "always":
        return True
    if mode == "never" or spec.data.source == "digits":
        return False
    return not _local_copy(spec.data.source, Path(spec.data.path))


def _local_copy(source: str, path: Path) -> bool:
    """Is there something at `path` that could be the data (`models/data.py`'s layouts)?"""
    try:
        if source == "folder":
            return path.is_dir() and os.access(path, os.R_OK) and any(path.iterdir())
        img = path / "images.npy" if path.is_dir() else path
        return img.is_file() and os.access(img, os.R_OK)
    except OSError:
        return False


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while piece := f.read(1 << 20):
            h.update(piece)
    return h.hexdigest()


def _refs(manifest: Any, cell_id: str, max_cell_bytes: int) -> list[ShardRef]:
    """The manifest's shards, each field checked (a hostile or broken coordinator)."""
    if manifest.cell_id != cell_id:
        raise ShardError(f"asked for the data of {cell_id}, got {manifest.cell_id!r}'s")
    if not 0 < len(manifest.shards) <= MAX_SHARDS_PER_CELL:
        raise ShardError(f"{len(manifest.shards)} shards, expected 1..{MAX_SHARDS_PER_CELL}")
    refs, total = [], 0
    for s in manifest.shards:
        if not datashards.is_sha256(s.sha256) or s.split not in datashards.SPLITS:
            raise ShardError(f"bad shard entry {s.sha256[:16]!r} ({s.split!r})")
        if not 0 < s.nbytes <= MAX_SHARD_BYTES or s.count < 0:
            raise ShardError(f"shard {s.sha256[:12]} of {s.nbytes} bytes, the limit is {MAX_SHARD_BYTES}")
        total += s.nbytes
        refs.append(ShardRef(s.sha256, int(s.nbytes), s.split, int(s.cluster), int(s.count)))
    if total > max_cell_bytes:
        raise ShardError(f"the cell's data takes {total} bytes, more than this worker's {max_cell_bytes}")
    if len({r.sha256 for r in refs}) != len(refs):
        raise ShardError("a shard is listed twice")
    return refs


class DataFetcher:
    """Fetches, caches and installs the data of the cells this worker trains."""

    def __init__(
        self,
        root: Path,
        client: Callable[[], Any],
        display: Any,
        *,
        max_cell_bytes: int = DEFAULT_MAX_CELL_BYTES,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        self.root = Path(root)
        self._client = client  # the current CoordinatorClient (it changes when the coordinator moves)
        self.display = display
        self.max_cell_bytes = max_cell_bytes
        self.on_bytes = on_bytes
        self._lock = asyncio.Lock()  # one cell, one stream at a time
        self._failed: dict[str, tuple[float, str]] = {}
        self.fetched_bytes = 0  # over the network, this process
        self.reused = 0  # shards found verified in the cache

    async def ensure(self, spec: Any, cell_id: str) -> None:
        """Make `cell_id`'s data available to its task (DataFetchError if it cannot be)."""
        if datashards.installed(spec, cell_id) is not None:
            return
        async with self._lock:
            if datashards.installed(spec, cell_id) is not None:
                return
            failed = self._failed.get(cell_id)
            if failed is not None and time.monotonic() - failed[0] < RETRY_AFTER_FAILURE_S:
                raise DataFetchError(failed[1])
            try:
                data = await self._fetch(spec, cell_id)
            except (ShardError, DataFetchError, grpc.aio.AioRpcError, OSError) as e:
                why = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
                msg = f"data of {cell_id}: {type(e).__name__}: {why}"
                self._failed[cell_id] = (time.monotonic(), msg)
                self.display.event("data-fetch-failed", level="error", cell=cell_id, message=msg)
                raise DataFetchError(msg) from None
            self._failed.pop(cell_id, None)
            datashards.install(spec, cell_id, data)

    async def same_partition(self, cell_id: str, local_sha256: str) -> bool | None:
        """Whether a local copy of the data gives the coordinator's partition (its cluster
        manifest's sha256, `ClusterManifest.sha256`); None when the coordinator cannot say."""
        client = self._client()
        if client is None:
            return None
        try:
            manifest = await client.get_data_manifest(cell_id, partition_only=True)
        except grpc.aio.AioRpcError as e:
            log.info("no data manifest to compare the local copy with: %s", e.details())
            return None
        return bool(manifest.cluster_manifest_sha256) and manifest.cluster_manifest_sha256 == local_sha256

    async def _fetch(self, spec: Any, cell_id: str) -> datashards.CellData:
        client = self._client()
        if client is None:
            raise DataFetchError("not connected to the coordinator")
        manifest = await client.get_data_manifest(cell_id)
        refs = _refs(manifest, cell_id, self.max_cell_bytes)
        self.root.mkdir(parents=True, exist_ok=True)
        total = sum(r.nbytes for r in refs)
        self.display.event("data-fetch", cell=cell_id, shards=len(refs), nbytes=total)
        t0 = time.monotonic()
        shards = []
        for ref in refs:
            blob = await self._shard(ref)
            shards.append(
                await asyncio.to_thread(
                    datashards.decode_shard,
                    blob,
                    ref,
                    channels=spec.model.channels,
                    image_size=spec.model.image_size,
                    clusters=spec.data.clusters,
                )
            )
        data = await asyncio.to_thread(
            datashards.assemble,
            cell_id,
            shards,
            train_count=int(manifest.train_count),
            heldout_count=int(manifest.heldout_count),
        )
        self.display.event(
            "data-ready",
            cell=cell_id,
            samples=len(data.x_train),
            heldout=len(data.x_heldout),
            shards=len(refs),
            reused=self.reused,
            fetched_bytes=self.fetched_bytes,
            seconds=round(time.monotonic() - t0, 2),
        )
        return data

    async def _shard(self, ref: ShardRef) -> bytes:
        """The verified bytes of one shard: from the cache, else downloaded (resuming)."""
        final = self.root / ref.sha256
        if final.is_file():
            blob = await asyncio.to_thread(final.read_bytes)
            if len(blob) == ref.nbytes and hashlib.sha256(blob).hexdigest() == ref.sha256:
                self.reused += 1
                return blob
            self.display.event(
                "data-shard-refused", level="warning", shard=ref.sha256[:12], message="cached copy corrupt"
            )
            final.unlink(missing_ok=True)
        for attempt in range(ATTEMPTS):
            try:
                if await self._download(ref):
                    break
            except grpc.aio.AioRpcError as e:
                if not is_retryable(e) or attempt == ATTEMPTS - 1:
                    raise
                log.info("shard %s: %s, resuming", ref.sha256[:12], e.code().name)
            await asyncio.sleep(min(5.0, 0.5 * 2**attempt))
        else:
            raise DataFetchError(f"shard {ref.sha256[:12]}: incomplete after {ATTEMPTS} attempts")
        return await asyncio.to_thread(final.read_bytes)

    async def _download(self, ref: ShardRef) -> bool:
        """One stream from where the part file ends; True once the shard is verified in place."""
        part = self.root / f"{ref.sha256}.part"
        have = part.stat().st_size if part.is_file() else 0
        if have > ref.nbytes:
            part.unlink()
            have = 0
        client = self._client()
        if client is None:
            raise DataFetchError("not connected to the coordinator")
        deadline_s = STREAM_SLACK_S + (ref.nbytes - have) / MIN_RATE_BYTES_PER_S
        call = client.fetch_data_shard(ref.sha256, have, timeout_s=deadline_s)
        try:
            with part.open("ab") as f:
                async for chunk in call:
                    n = len(chunk.data)
                    if chunk.offset != have or chunk.total_bytes != ref.nbytes or have + n > ref.nbytes:
                        raise ShardError(
                            f"shard {ref.sha256[:12]}: chunk at {chunk.offset} of {chunk.total_bytes} bytes, "
                            f"expected {have} of {ref.nbytes}"
                        )
                    await asyncio.to_thread(f.write, chunk.data)
                    have += n
                    self.fetched_bytes += n
                    if self.on_bytes is not None:
                        self.on_bytes(n)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            call.cancel()
            raise
        if have < ref.nbytes:
            return False  # the stream ended early: resume
        if await asyncio.to_thread(_sha256_file, part) != ref.sha256:
            part.unlink(missing_ok=True)
            self.display.event("data-shard-refused", level="error", shard=ref.sha256[:12], message="sha256 mismatch")
            raise ShardTampered(f"shard {ref.sha256[:12]}: the downloaded bytes do not hash to its name; refused")
        os.replace(part, self.root / ref.sha256)
        return True


class SyntheticDataTask:
    """A cell's task whose training data is zeros of the right shape: the profile measures
    the speed of the inner step, which does not depend on the pixels, before any shard is
    fetched (so profiling never downloads the dataset)."""

    def __init__(self, task: Any, samples: int = 256) -> None:
        self._task = task
        self._samples = samples

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def train_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        m = self._task.spec.model
        x = torch.zeros(self._samples, m.channels, m.image_size, m.image_size)
        return x, torch.zeros(self._samples, dtype=torch.int64)


__all__ = ["FETCH_MODES", "DataFetchError", "DataFetcher", "SyntheticDataTask", "needs_fetch"]
