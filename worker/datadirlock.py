"""One worker per data dir: an advisory lock held for the process's life.

The data dir holds the worker's identity key; two processes on it would be one worker id
twice (one trains, the other sits at "syncing" with no message). `DataDirLock.acquire`
takes `fcntl.flock(LOCK_EX | LOCK_NB)` on the directory itself (so nothing is written
into a data dir the worker then refuses to use); a second worker gets `DataDirBusy`. The
kernel drops the lock when the process ends, however it ends, so a crash leaves no stale
lock behind. The DHT child, forked later, closes its copy of the descriptor first thing
(`bagel.protocol.shutdown.close_in_children`), so a worker restarted right after a SIGKILL
is not refused while the old DHT child is still on its way out.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from bagel.protocol.shutdown import close_in_children, keep_in_children


class DataDirBusy(Exception):
    """Another worker process holds this data dir."""


class DataDirLock:
    """The held lock on a worker data dir (release it, or let the process end)."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path

    @classmethod
    def acquire(cls, data_dir: Path) -> DataDirLock:
        fd = os.open(data_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DataDirBusy(
                f"another worker is running on --data-dir {data_dir}: stop it, "
                "or give this one its own --data-dir (each data dir is one worker identity)"
            ) from None
        close_in_children(fd)
        return cls(fd, data_dir)

    def release(self) -> None:
        if self.fd >= 0:
            keep_in_children(self.fd)
            with contextlib.suppress(OSError):
                os.close(self.fd)  # releases the flock
            self.fd = -1


__all__ = ["DataDirBusy", "DataDirLock"]
