"""Coordinator checkpoint store: safetensors files plus JSON metadata, written atomically.

A committed contributor streams its cell state to `UploadCheckpoint`; the coordinator keeps
the last `checkpoint.keep` checkpoints per cell as the fallback donor for joiners and for
orphaned cells. Everything here distrusts its input:

- an upload is written chunk by chunk to a temp file in the destination directory and is
  refused as soon as it passes its declared size or `checkpoint.max_bytes`
  (`CheckpointTooLarge`);
- the file's sha256 and size must equal the declared ones, its safetensors header is
  parsed by the safetensors library (never pickle, never `torch.load`), it must hold
  exactly the cell's state as the run spec builds it (every tensor name, dtype and shape
  of `models.experts.cell_state_schema`, nothing more), and the canonical
  state hash (`bagel.protocol.statehash`) over its tensors must equal the committed hash
  before the file becomes visible (`CheckpointRejected`);
- it becomes visible with the usual atomic sequence: fsync the temp file, `os.replace`,
  fsync the directory; the JSON metadata is written the same way, then the SQLite index
  row is added (the index is what readers trust; a file without a row is garbage);
- reads re-hash the bytes they stream and fail with `CheckpointCorrupt` on a mismatch.

Blocking file I/O: the server runs `Upload.verify` (hashing, parsing) in a worker thread
and `Upload.publish` (which writes the SQLite index) on the store's writer thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from safetensors import SafetensorError, safe_open

from bagel.protocol.atomicfile import atomic_write
from bagel.protocol.statehash import state_hash

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20  # download chunk: 1 MiB, well under the gRPC message limit
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header


class CheckpointError(Exception):
    """Base of checkpoint failures."""


class CheckpointTooLarge(CheckpointError):
    """An upload passed its declared size or the spec's checkpoint.max_bytes."""


class CheckpointRejected(CheckpointError):
    """An upload's bytes do not match its declared sha256/size or the committed state hash,
    or they are not a valid safetensors file."""


class CheckpointNotFound(CheckpointError):
    """No checkpoint for that cell (and round)."""


class CheckpointCorrupt(CheckpointError):
    """A stored checkpoint's bytes no longer match the sha256 recorded for it."""


@dataclass(frozen=True)
class CheckpointMeta:
    cell_id: str
    round: int
    state_hash: str
    sha256: str
    total_bytes: int
    path: str  # relative to the checkpoint root
    created_unix_ms: int
    uploader: str = ""


class CheckpointIndex(Protocol):
    """The durable index (implemented by `bagel.coordinator.store.Store`)."""

    def add_checkpoint(self, meta: CheckpointMeta) -> None: ...

    def remove_checkpoint(self, cell_id: str, round: int) -> None: ...

    def list_checkpoints(self, cell_id: str | None = None) -> list[CheckpointMeta]: ...


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


atomic_write_bytes = atomic_write


def _unlink_quiet(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


class _LazyTensors(Mapping[str, Any]):
    """Tensors of an open safetensors file, loaded one at a time as `state_hash` asks for
    them, so hashing a 2 GiB checkpoint holds one tensor in memory, not all."""

    def __init__(self, handle: Any) -> None:
        self._h = handle
        self._keys = list(handle.keys())

    def __getitem__(self, key: str) -> Any:
        return self._h.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


# {tensor name: (safetensors dtype, shape)}: what a cell's checkpoint must hold
Schema = Mapping[str, tuple[str, tuple[int, ...]]]


def check_schema(path: Path, schema: Schema) -> None:
    """CheckpointRejected unless the file holds exactly `schema`'s tensors, with its dtypes
    and shapes. Reads only the safetensors header (no tensor data)."""
    try:
        with safe_open(str(path), framework="numpy") as h:
            got = {k: (h.get_slice(k).get_dtype(), tuple(h.get_slice(k).get_shape())) for k in h.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise CheckpointRejected(f"not a valid safetensors file: {e}") from None
    missing = sorted(set(schema) - set(got))
    extra = sorted(set(got) - set(schema))
    if missing or extra:
        raise CheckpointRejected(
            f"not this cell's model: {len(missing)} tensors missing {missing[:3]}, {len(extra)} unexpected {extra[:3]}"
        )
    for name in sorted(schema):
        if got[name] != schema[name]:
            (dt, shape), (want_dt, want_shape) = got[name], schema[name]
            raise CheckpointRejected(
                f"tensor {name!r} is {dt} {list(shape)}, the cell's model has {want_dt} {list(want_shape)}"
            )


def safetensors_state_hash(path: Path) -> str:
    """Canonical state hash of a safetensors file; CheckpointRejected if it does not parse.

    numpy is used unless a tensor is bfloat16 (numpy has no bf16); then torch reads it,
    still through safetensors' own parser, never pickle.
    """
    try:
        with safe_open(str(path), framework="numpy") as h:
            dtypes = {h.get_slice(k).get_dtype() for k in h.keys()}  # noqa: SIM118 (a safe_open handle: no __iter__)
            if "BF16" not in dtypes:
                return state_hash(_LazyTensors(h))
        with safe_open(str(path), framework="pt") as h:
            return state_hash(_LazyTensors(h))
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise CheckpointRejected(f"not a valid safetensors file: {e}") from None


class Upload:
    """One in-progress upload: bytes go to a temp file; `finish` verifies and publishes."""

    def __init__(
        self,
        store: CheckpointStore,
        cell_id: str,
        round: int,
        state_hash_hex: str,
        total_bytes: int,
        sha256_hex: str,
        uploader: str,
    ) -> None:
        self._store = store
        self.cell_id, self.round = cell_id, round
        self.state_hash, self.total_bytes, self.sha256 = state_hash_hex, total_bytes, sha256_hex
        self.uploader = uploader
        self.received = 0
        self._hash = hashlib.sha256()
        cell_dir = store.cell_dir(cell_id)
        cell_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cell_dir, prefix=".upload-", suffix=".tmp")
        self._tmp = Path(tmp)
        self._f = os.fdopen(fd, "wb")
        self._closed = False
        self._verified = False

    def write(self, chunk: bytes) -> None:
        if self.received + len(chunk) > self.total_bytes:
            self.abort()
            raise CheckpointTooLarge(f"upload passed its declared size of {self.total_bytes} bytes")
        self._f.write(chunk)
        self._hash.update(chunk)
        self.received += len(chunk)

    def verify(self) -> None:
        """Check size, sha256, safetensors format and state hash (slow: any thread).

        On failure the temp file is removed and the error raised; nothing became visible.
        """
        try:
            if self.received != self.total_bytes:
                raise CheckpointRejected(f"upload has {self.received} bytes, declared {self.total_bytes}")
            if self._hash.hexdigest() != self.sha256:
                raise CheckpointRejected("upload bytes do not match the declared sha256")
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self._closed = True
            if self._store.schema is not None:
                check_schema(self._tmp, self._store.schema(self.cell_id))
            got = safetensors_state_hash(self._tmp)
            if got != self.state_hash:
                raise CheckpointRejected(
                    f"state hash of the uploaded tensors is {got[:12]}..., committed is {self.state_hash[:12]}..."
                )
            if self._store.describe is not None:
                meta = {**self._store.describe(self.cell_id), "round": str(self.round), "state_hash": self.state_hash}
                self._describe(meta)
            self._verified = True
        except BaseException:
            self.abort()
            raise

    def _describe(self, metadata: Mapping[str, str]) -> None:
        """Rewrite the verified temp file with `metadata` as its safetensors `__metadata__`
        (the model config, so the stored file is self-describing). Only the header changes:
        tensor offsets are relative to the end of the header, so the data bytes are copied
        as they are and the state hash is unchanged; size and sha256 become the new file's."""
        fd, tmp = tempfile.mkstemp(dir=self._tmp.parent, prefix=".upload-", suffix=".tmp")
        new = Path(tmp)
        h = hashlib.sha256()
        size = 0
        try:
            with open(self._tmp, "rb") as src, os.fdopen(fd, "wb") as dst:
                (n,) = struct.unpack("<Q", src.read(8))
                if n > MAX_HEADER_BYTES:
                    raise CheckpointRejected(f"safetensors header of {n} bytes")
                header = json.loads(src.read(n))
                if not isinstance(header, dict):
                    raise CheckpointRejected("safetensors header is not a JSON object")
                header["__metadata__"] = dict(metadata)  # the coordinator's description, not the uploader's
                raw = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
                raw += b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8 bytes
                for chunk in (struct.pack("<Q", len(raw)), raw):
                    dst.write(chunk)
                    h.update(chunk)
                    size += len(chunk)
                while chunk := src.read(CHUNK_BYTES):
                    dst.write(chunk)
                    h.update(chunk)
                    size += len(chunk)
                dst.flush()
                os.fsync(dst.fileno())
            with safe_open(str(new), framework="numpy") as check:
                if dict(check.metadata() or {}) != dict(metadata):
                    raise CheckpointRejected("the described checkpoint does not read back")
        except (OSError, ValueError, SafetensorError) as e:
            _unlink_quiet(new)
            raise CheckpointRejected(f"cannot describe the checkpoint: {e}") from None
        except BaseException:
            _unlink_quiet(new)
            raise
        _unlink_quiet(self._tmp)
        self._tmp, self.sha256, self.total_bytes = new, h.hexdigest(), size

    def publish(self, now_ms: int) -> CheckpointMeta:
        """Make a verified upload visible (atomic replace + index row + retention).

        Touches the SQLite index: call it from the thread that owns the store."""
        if not self._verified:
            raise CheckpointRejected("upload was not verified")
        try:
            return self._store._publish(self, now_ms)
        except BaseException:
            self.abort()
            raise

    def finish(self, now_ms: int) -> CheckpointMeta:
        """`verify` then `publish`, for callers that own the store's thread."""
        self.verify()
        return self.publish(now_ms)

    def abort(self) -> None:
        if not self._closed:
            self._f.close()
            self._closed = True
        _unlink_quiet(self._tmp)


class CheckpointStore:
    """Checkpoint files under `root/<cell_id>/`, indexed durably by `index`."""

    def __init__(
        self,
        root: Path,
        index: CheckpointIndex,
        *,
        keep: int,
        max_bytes: int,
        schema: Callable[[str], Schema] | None = None,
        describe: Callable[[str], Mapping[str, str]] | None = None,
    ) -> None:
        """schema: a cell's expected tensors (the daemon passes the run spec's
        `cell_state_schema`); None skips that check (unit tests of the file handling).
        describe: a cell's model description (`models.export.cell_metadata`), written into
        every stored file's safetensors metadata with its round and state hash; None
        stores the uploaded bytes as they are."""
        self.root = Path(root)
        self.schema = schema
        self.describe = describe
        self.root.mkdir(parents=True, exist_ok=True)
        self._index = index
        self.keep = keep
        self.max_bytes = max_bytes
        # Readers (downloads, on the event loop) use this in-memory copy of the index, so
        # they never touch the SQLite connection the writer thread is using. It is replaced
        # as a whole (atomic under the GIL) after every durable index change.
        self._by_cell: dict[str, tuple[CheckpointMeta, ...]] = {}
        for meta in index.list_checkpoints():
            self._by_cell[meta.cell_id] = (*self._by_cell.get(meta.cell_id, ()), meta)
        self._sweep_temp_files()

    def cell_dir(self, cell_id: str) -> Path:
        # cell ids are validated (k<c>.r<r> or "router") before they get here; the check
        # below is belt and braces against path traversal.
        if "/" in cell_id or cell_id in ("", ".", "..") or "\\" in cell_id:
            raise CheckpointRejected(f"bad cell id {cell_id!r}")
        return self.root / cell_id

    def begin_upload(
        self,
        cell_id: str,
        round: int,
        state_hash_hex: str,
        total_bytes: int,
        sha256_hex: str,
        uploader: str = "",
    ) -> Upload:
        if total_bytes > self.max_bytes:
            raise CheckpointTooLarge(f"checkpoint of {total_bytes} bytes exceeds checkpoint.max_bytes={self.max_bytes}")
        return Upload(self, cell_id, round, state_hash_hex, total_bytes, sha256_hex, uploader)

    def _publish(self, up: Upload, now_ms: int) -> CheckpointMeta:
        cell_dir = self.cell_dir(up.cell_id)
        name = f"{up.round:010d}.safetensors"
        final = cell_dir / name
        os.replace(up._tmp, final)
        fsync_dir(cell_dir)
        meta = CheckpointMeta(
            cell_id=up.cell_id,
            round=up.round,
            state_hash=up.state_hash,
            sha256=up.sha256,
            total_bytes=up.total_bytes,
            path=f"{up.cell_id}/{name}",
            created_unix_ms=now_ms,
            uploader=up.uploader,
        )
        atomic_write_bytes(final.with_suffix(".json"), json.dumps(asdict(meta), indent=1).encode())
        self._index.add_checkpoint(meta)
        metas = sorted(
            (*(m for m in self._by_cell.get(up.cell_id, ()) if m.round != meta.round), meta), key=lambda m: m.round
        )
        self._by_cell[up.cell_id] = tuple(metas)
        self._retain(up.cell_id)
        return meta

    def _retain(self, cell_id: str) -> None:
        metas = list(self._by_cell.get(cell_id, ()))
        drop, keep = metas[: max(0, len(metas) - self.keep)], metas[max(0, len(metas) - self.keep) :]
        self._by_cell[cell_id] = tuple(keep)  # readers stop seeing them first
        for old in drop:
            # index before file: a crash between the two leaves an unindexed file (swept
            # by nobody but harmless), never an index row without its file.
            self._index.remove_checkpoint(old.cell_id, old.round)
            path = self.root / old.path
            _unlink_quiet(path)
            _unlink_quiet(path.with_suffix(".json"))

    def list(self, cell_id: str | None = None) -> list[CheckpointMeta]:
        if cell_id is not None:
            return list(self._by_cell.get(cell_id, ()))
        return [m for cell in sorted(self._by_cell) for m in self._by_cell[cell]]

    def latest(self, cell_id: str) -> CheckpointMeta | None:
        metas = self._by_cell.get(cell_id, ())
        return max(metas, key=lambda m: m.round) if metas else None

    def get(self, cell_id: str, round: int = 0) -> CheckpointMeta:
        """Metadata of `round` (0 = the latest) of `cell_id`; CheckpointNotFound if none."""
        metas = self._by_cell.get(cell_id, ())
        if round == 0:
            if not metas:
                raise CheckpointNotFound(f"no checkpoint of cell {cell_id}")
            return max(metas, key=lambda m: m.round)
        for m in metas:
            if m.round == round:
                return m
        raise CheckpointNotFound(f"no checkpoint of cell {cell_id} at round {round}")

    def iter_chunks(self, meta: CheckpointMeta, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
        """Stream the file in chunks, hashing as it goes; CheckpointCorrupt at the end if the
        bytes differ from the recorded sha256 (the receiver checks the same sha256 too)."""
        h = hashlib.sha256()
        n = 0
        with open(self.root / meta.path, "rb") as f:
            while chunk := f.read(chunk_bytes):
                h.update(chunk)
                n += len(chunk)
                yield chunk
        if n != meta.total_bytes or h.hexdigest() != meta.sha256:
            raise CheckpointCorrupt(f"checkpoint {meta.path} does not match its sha256")

    def verify(self, meta: CheckpointMeta) -> None:
        """Re-read the file; CheckpointCorrupt if its bytes or tensors changed."""
        for _ in self.iter_chunks(meta):
            pass
        if safetensors_state_hash(self.root / meta.path) != meta.state_hash:
            raise CheckpointCorrupt(f"checkpoint {meta.path} does not match its state hash")

    def read_verified(self, meta: CheckpointMeta) -> bytes:
        """The whole file, sha256-checked (small checkpoints, tests and tools)."""
        return b"".join(self.iter_chunks(meta))

    def _sweep_temp_files(self) -> None:
        """Remove uploads a crash left half-written; they were never indexed."""
        for tmp in self.root.glob("*/.*.tmp"):
            _unlink_quiet(tmp)
