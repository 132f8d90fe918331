"""Atomic file writes, shared by every place that persists state (checkpoints, local state).

A crash at any instant must leave either the old file or the new one, never a torn one:
write a temp file in the same directory, fsync it, `os.replace` it over the target, then
fsync the directory so the rename itself is durable.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically: temp file, fsync, replace, fsync the directory."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    atomic_write_with(path, write)


def atomic_write_with(path: Path, write: Callable[[str], object]) -> None:
    """Like `atomic_write`, but `write(tmp_path)` writes the file itself: for a writer that
    streams to a path (safetensors' `save_file`) without first building the bytes in memory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
