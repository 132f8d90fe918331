"""How the long-running commands stop on SIGTERM and SIGINT, and how their DHT child behaves.

Both `bagel-coordinator serve` and `bagel-worker join` keep the same contract:

- the first SIGTERM or SIGINT starts a graceful stop (the command's own `on_first`), and
  arms a watchdog: a stop that has not finished within the command's documented bound
  ends the process anyway (`EXIT_STOP_TIMEOUT`, one line on stderr);
- a second one exits at once with `128 + signal number` (130 for SIGINT, 143 for SIGTERM),
  one line on stderr, no traceback: every descendant process is killed first, then
  `os._exit` (atexit handlers are skipped on purpose: multiprocessing's would join the
  DHT child, which is what used to hang for minutes);
- no child process outlives the command.

A signal sent to the process group (Ctrl-C in a terminal, `timeout`, systemd's default
`KillMode=control-group`) reaches the hivemind DHT child and its p2pd daemon directly,
too. `prepare_child` runs first thing in that child (`bagel.protocol.discovery.start_dht`
uses it): SIGTERM gets its default action back (the child is forked after the parent's
handlers may be installed, and an inherited asyncio handler would swallow SIGTERM, so
hivemind's own `terminate()` could never stop it), SIGINT stays ignored as hivemind wants
(the parent decides how to stop), and the kernel sends the child SIGKILL when its parent
dies, within `PARENT_POLL_S`, so even a SIGKILLed parent leaves no DHT node behind.

A group signal can also kill the DHT child halfway through taking a file descriptor from
its parent (every hivemind DHT call sends the child a future whose pipe travels by fd
passing); the parent's handover thread would print that as a traceback although nothing in
the parent failed. `quiet_handover_errors` turns it into one log line.

The descendant scan reads /proc (Linux); elsewhere it finds nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection
from types import TracebackType

log = logging.getLogger(__name__)

EXIT_STOP_TIMEOUT = 1  # the graceful stop ran past its bound
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
PARENT_POLL_S = 0.5  # how soon a DHT child notices that its parent is gone


def exit_code_for(sig: int) -> int:
    """The exit status of a second (immediate) stop signal, as a shell reports a signal death."""
    return 128 + int(sig)


def descendants(pid: int | None = None) -> list[int]:
    """Every live descendant of `pid` (default: this process), parents before children.

    Read from /proc/*/stat (field 4 is the parent's pid); a process that exits during the
    scan is simply skipped. Empty where there is no /proc."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name (field 2) is in parentheses and may hold spaces or ')'
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) < 2 or fields[0] == b"Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    out: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def kill_descendants(sig: int = signal.SIGKILL, spare: Collection[int] = ()) -> list[int]:
    """Send `sig` to every descendant of this process but those in `spare`; returns their pids."""
    pids = [p for p in descendants() if p not in spare]
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)
    return pids


def end_descendants(grace_s: float = 2.0, spare: Collection[int] = ()) -> list[int]:
    """At the end of a graceful stop: SIGTERM whatever descendant is still running (torch's
    shm manager, a DHT child that outlived its shutdown), SIGKILL it after `grace_s`.

    `spare`: descendants that were running before the command started (a command called
    in-process, e.g. by a test, must not end its caller's own children: killing a process's
    torch shm manager breaks every later tensor it shares)."""
    pids = kill_descendants(signal.SIGTERM, spare)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = [p for p in pids if _running(p)]
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    return pids


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :].split()[:1] != [b"Z"]


def hard_exit(code: int, line: str) -> None:
    """Kill every descendant, print `line` on stderr, and leave now (no atexit, no finally)."""
    kill_descendants()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        os.write(2, (line.rstrip("\n") + "\n").encode())
    os._exit(code)


_CLOSE_IN_CHILDREN: set[int] = set()


def close_in_children(fd: int) -> None:
    """Have `prepare_child` close `fd` in every DHT child forked from now on (a lock held for
    this process's life must not be held on by a child after this process is gone)."""
    _CLOSE_IN_CHILDREN.add(fd)


def keep_in_children(fd: int) -> None:
    _CLOSE_IN_CHILDREN.discard(fd)


def prepare_child(poll_s: float = PARENT_POLL_S) -> None:
    """First thing in a forked DHT child: SIGTERM kills it, SIGINT is ignored, it dies with its parent.

    The parent's death is noticed by a thread polling `os.getppid()` (the kernel's
    PR_SET_PDEATHSIG would fire when the parent's forking *thread* ends, and the DHT is
    started from a thread pool): the child then terminates its own children (p2pd) and
    exits."""
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)  # the parent's event loop's wakeup pipe is not ours
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for name in ("SIGUSR1", "SIGUSR2"):  # the worker's pause and resume are its own, not the DHT child's
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    for fd in list(_CLOSE_IN_CHILDREN):
        with contextlib.suppress(OSError):
            os.close(fd)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        kill_descendants(signal.SIGTERM)
        os._exit(0)

    threading.Thread(target=watch, name="bagel-parent-watch", daemon=True).start()


_HANDOVER_FILE = os.path.join("multiprocessing", "resource_sharer.py")


def _in_handover(tb: TracebackType | None) -> bool:
    """Was the exception caught by multiprocessing's fd handover thread? (Its server loop
    catches everything and hands it to sys.excepthook: the traceback starts in its frame.)"""
    return tb is not None and tb.tb_frame.f_code.co_filename.endswith(_HANDOVER_FILE)


def quiet_handover_errors() -> None:
    """Log one line, not a traceback, when a child dies while taking a file descriptor from
    this process.

    A pipe sent to another process through a multiprocessing connection (hivemind pickles
    one into every DHT call it hands its DHT child) travels as a file descriptor: the
    receiver connects back to a server thread of the sender (`multiprocessing.
    resource_sharer`) to take it. When the receiver dies during that exchange (a signal to
    the process group kills the DHT child at once, by design), the server thread passes
    the connection error to `sys.excepthook`, which prints a traceback although nothing in
    this process failed. Only a connection error (OSError, EOFError) caught by that thread
    is turned into a log line; every other exception reaches the previous hook unchanged.
    Installing it twice is a no-op."""
    prev = sys.excepthook
    if getattr(prev, "bagel_handover", False):
        return

    def hook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if issubclass(tp, (OSError, EOFError)) and _in_handover(tb):
            log.info("a child process ended while taking a file descriptor from this one (%s): ignored", tp.__name__)
            return
        prev(tp, value, tb)

    hook.bagel_handover = True  # type: ignore[attr-defined]
    sys.excepthook = hook


class StopSignals:
    """SIGTERM/SIGINT on an asyncio loop: the first calls `on_first(signal name)` and arms a
    watchdog of `bound_s` seconds; the second (or the watchdog) ends the process at once
    through `hard_exit`. `prog` prefixes the one line printed."""

    def __init__(
        self,
        prog: str,
        on_first: Callable[[str], None],
        bound_s: float,
        progress: Callable[[], str] | None = None,
    ) -> None:
        self.prog = prog
        self.on_first = on_first
        self.bound_s = bound_s
        # what the graceful stop is doing (the step it is in): the watchdog's line says it
        self.progress = progress
        self.received: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: threading.Timer | None = None

    def install(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Handle the stop signals on `loop` (default: the running one). A signal to the
        process group may kill the DHT child mid-handover, so this also installs
        `quiet_handover_errors`."""
        self._loop = loop or asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            self._loop.add_signal_handler(sig, self._on_signal, sig)
        quiet_handover_errors()

    def remove(self, disarm: bool = True) -> None:
        """Take the handlers off the loop (it is about to close). Until the process ends, a
        further SIGTERM/SIGINT still exits at once with its documented code (the default
        action would kill the process by the signal, and SIGINT's would raise a traceback).

        `disarm=False` keeps the watchdog running: the loop's teardown joins its executor's
        threads without a bound, so a command whose stop must stay bounded through it
        disarms only once that is over."""
        if self._loop is not None and not self._loop.is_closed():
            for sig in STOP_SIGNALS:
                with contextlib.suppress(Exception):
                    self._loop.remove_signal_handler(sig)
        if disarm:
            self.disarm()
        for sig in STOP_SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread
                signal.signal(sig, self._on_late_signal)

    def _on_late_signal(self, signum: int, _frame: object) -> None:
        hard_exit(exit_code_for(signum), f"{self.prog}: {signal.Signals(signum).name} while exiting: exiting now")

    def disarm(self) -> None:
        """Cancel the watchdog (the graceful stop has finished)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _on_signal(self, sig: signal.Signals) -> None:
        self.received.append(sig.name)
        if len(self.received) > 1:
            hard_exit(exit_code_for(sig), f"{self.prog}: second {sig.name}: exiting now, without a graceful stop")
        self._watchdog = threading.Timer(self.bound_s, self._overdue)
        self._watchdog.daemon = True
        self._watchdog.start()
        self.on_first(sig.name)

    def _overdue(self) -> None:
        # where every thread was, for whoever reads the log; the last line names the step
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        where = ""
        if self.progress is not None:
            with contextlib.suppress(Exception):
                where = f" ({self.progress()})"
        hard_exit(
            EXIT_STOP_TIMEOUT,
            f"{self.prog}: the graceful stop took more than {self.bound_s:g}s{where}: exiting now "
            "(a second SIGTERM/SIGINT exits at once)",
        )


__all__ = [
    "EXIT_STOP_TIMEOUT",
    "STOP_SIGNALS",
    "StopSignals",
    "close_in_children",
    "descendants",
    "end_descendants",
    "exit_code_for",
    "hard_exit",
    "keep_in_children",
    "kill_descendants",
    "prepare_child",
]
