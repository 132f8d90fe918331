"""Suite-wide fixtures: fail a test that leaks child processes, reap any at the end, and
never let one stuck test hang the whole run.

hivemind runs its DHT and averager in child processes, and our end-to-end tests start
coordinators and workers; a test that forgets one must fail instead of leaking it
(hivemind's own tests/conftest.py reaps leftovers the same way).

Why a watchdog on top of pytest-timeout. pytest-timeout's signal method bounds only the
test function: once it fires, the teardown (closing the asyncio runner, which in Python
3.11 joins the default executor's threads without a timeout) is unbounded, so one thread
stuck in a blocking call can hang CI for hours with nothing printed. The watchdog bounds
setup + call + teardown of every item: past its timeout plus a grace it prints every
thread's stack, kills the item's child processes (which unblocks threads waiting on
their pipes), and if that does not free it, interrupts the session so pytest still
prints its report.

Stale hivemind sockets. hivemind's libp2p daemon and its client listen on unix sockets
named /tmp/hivemind-p2pd-*.sock and /tmp/hivemind-p2pclient-*.sock, which a graceful
shutdown removes. Many tests SIGKILL a coordinator or a worker on purpose (or in teardown),
which leaves the two files behind: about a hundred a run. At the end of the session the
controller removes the ones created during it that no live socket is bound to, in any
network namespace (the test bed's namespaces have their own view of bound sockets).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

_WATCHDOG_GRACE_S = float(os.environ.get("BAGEL_TEST_WATCHDOG_GRACE_S", "60"))  # after the item's own timeout
_WATCHDOG_STEP_S = 30.0  # between escalations


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


_HIVEMIND_SOCKETS = "hivemind-p2p*.sock"


def _bound_unix_paths() -> set[str]:
    """Paths of bound unix sockets, over every network namespace a live process is in
    (/proc/net/unix lists only the reader's namespace)."""
    seen: set[int] = set()
    out: set[str] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ns = os.stat(entry / "ns" / "net").st_ino
            if ns in seen:
                continue
            lines = (entry / "net" / "unix").read_text().splitlines()[1:]
        except OSError:
            continue
        seen.add(ns)
        for line in lines:
            fields = line.split()
            if len(fields) >= 8:
                out.add(fields[7])
    return out


def _remove_stale_sockets(since: float) -> int:
    """Remove the hivemind sockets created at or after `since` that nothing is bound to."""
    tmp = Path("/tmp")
    try:
        found = [p for p in tmp.glob(_HIVEMIND_SOCKETS) if p.lstat().st_mtime >= since]
    except OSError:
        return 0
    if not found:
        return 0
    bound = _bound_unix_paths()
    removed = 0
    for p in found:
        if str(p) not in bound:
            with contextlib.suppress(OSError):
                p.unlink()
                removed += 1
    return removed


def pytest_sessionstart(session):
    session.config._bagel_started_at = time.time() - 1.0  # file times may lag the clock a little


def pytest_sessionfinish(session, exitstatus):
    # torch_shm_manager is left alone: it exits by itself once this process is gone.
    _kill(_children(os.getpid()))
    if not hasattr(session.config, "workerinput"):  # the controller: every test process is done
        _remove_stale_sockets(session.config._bagel_started_at)


def _item_timeout_s(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    return float(item.config.getini("timeout") or 120)


class _Watchdog:
    """Escalates when one item (setup + call + teardown) outlives its budget."""

    def __init__(self, name: str, budget_s: float, before: set[int]) -> None:
        self.name, self.budget_s, self.before = name, budget_s, before
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bagel-test-watchdog", daemon=True)

    def _say(self, text: str) -> None:
        sys.stderr.write(f"\n[watchdog] {self.name}: {text}\n")
        sys.stderr.flush()

    def _run(self) -> None:
        if self.done.wait(self.budget_s):
            return
        self._say(f"still running {self.budget_s:.0f}s after it started; stacks of every thread:")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        stray = _children(os.getpid()) - self.before
        self._say(f"killing its child processes {sorted(stray)}")
        _kill(stray)
        if self.done.wait(_WATCHDOG_STEP_S):
            return
        self._say("still stuck; interrupting the session so the report is printed")
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        if self.done.wait(_WATCHDOG_STEP_S):
            return
        self._say("the interrupt did not end it either; exiting")
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _kill(_children(os.getpid()))
        os._exit(3)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    dog = _Watchdog(item.nodeid, _item_timeout_s(item) + _WATCHDOG_GRACE_S, _children(os.getpid()))
    dog.thread.start()
    try:
        yield
    finally:
        dog.done.set()
