"""Suite-wide fixtures: fail a test that leaks child processes, and reap any at the end.

hivemind runs its DHT and averager in child processes, and our end-to-end tests start
coordinators and workers; a test that forgets one must fail instead of leaking it
(hivemind's own tests/conftest.py reaps leftovers the same way).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest


# torch starts one `torch_shm_manager` per process the first time a tensor is shared
# (hivemind's DHT does this); it lives for the whole session by design. Killing it breaks
# every later DHT in the session ("Broken pipe"), so it is not counted as a leak.
_SESSION_HELPERS = (b"torch_shm_manager",)


def _is_session_helper(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return any(name in cmdline for name in _SESSION_HELPERS)


def _children(pid: int) -> set[int]:
    """Live (non-zombie) descendants of pid, read from /proc, minus session-wide helpers."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            continue
        parents[int(entry.name)] = int(fields[1])
    out: set[int] = set()
    frontier = [pid]
    while frontier:
        p = frontier.pop()
        for child, parent in parents.items():
            if parent == p and child not in out:
                out.add(child)
                frontier.append(child)
    return {p for p in out if not _is_session_helper(p)}


def _kill(pids: set[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.fixture(autouse=True)
def no_leaked_processes():
    before = _children(os.getpid())
    yield
    deadline = time.monotonic() + 10.0
    leaked = _children(os.getpid()) - before
    while leaked and time.monotonic() < deadline:
        time.sleep(0.2)
        leaked = _children(os.getpid()) - before
    if leaked:
        _kill(leaked)
        pytest.fail(f"test leaked child processes: {sorted(leaked)}")


def pytest_sessionfinish(session, exitstatus):
    # torch_shm_manager is left alone: it exits by itself once this process is gone.
    _kill(_children(os.getpid()))
