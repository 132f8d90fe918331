"""Process supervision for `bagel-sim chaos`: start, signal, watch and reap real processes.

Every process starts in its own session, so it leads a process group that also holds what
it forks (hivemind's DHT child and its p2pd daemon). Signals go to the whole group: a
SIGKILL of a worker is the machine dying, a SIGSTOP freezes all of it (hivemind's tests
and `worker/procs.py` use process groups the same way).

The supervisor also keeps the evidence the leak invariants need
(`sim/invariants.py`: `no_process_leaked`, `no_port_leaked`): every pid ever seen in one
of its groups, and every TCP port such a pid was seen listening on, sampled by `sample()`
(the chaos driver calls it periodically and before every kill). Both are read from
/proc (Linux), never guessed.

Stdout of each process is read line by line by an asyncio task, copied to its log file
and handed to a callback (the chaos driver parses the coordinator's `listening:` /
`join:` lines and the workers' `--log-json` events); stderr goes straight to a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

LineHandler = Callable[["Proc", str], None]
MAX_LINE = 1 << 20


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to 0, read, close)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------- /proc


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of a pid, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw.rsplit(")", 1)[1].split()
    return rest[0], int(rest[1]), int(rest[2])


def pid_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def pids_in_groups(pgids: Iterable[int]) -> set[int]:
    """Live pids whose process group is one of `pgids`."""
    groups = set(pgids)
    out: set[int] = set()
    if not groups:
        return out
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        st = _stat(int(entry.name))
        if st is not None and st[2] in groups and st[0] not in ("Z", "X"):
            out.add(int(entry.name))
    return out


def _listen_inodes(net_dir: str = "/proc/net") -> dict[int, int]:
    """socket inode -> port of every TCP socket in LISTEN state (IPv4 and IPv6) of one network
    namespace: /proc/net is this process's, /proc/<pid>/net that pid's."""
    out: dict[int, int] = {}
    for table in (f"{net_dir}/tcp", f"{net_dir}/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A":  # 0A = TCP_LISTEN
                out[int(f[9])] = int(f[1].rsplit(":", 1)[1], 16)
    return out


def _netns_inodes(pids: Iterable[int]) -> dict[int, int]:
    """The listening sockets of every network namespace one of `pids` lives in (a process on
    the network test bed holds its sockets in its own namespace). Socket inodes are unique
    machine-wide, so the tables merge without clashes."""
    out: dict[int, int] = {}
    seen: set[str] = set()
    for pid in pids:
        try:
            ns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if ns not in seen:
            seen.add(ns)
            out.update(_listen_inodes(f"/proc/{pid}/net"))
    return out


def listening_ports(pids: Iterable[int] | None = None) -> set[int]:
    """TCP ports in LISTEN state: held by `pids` (in whichever network namespace each one
    lives), or by anyone in this process's namespace when `pids` is None."""
    if pids is None:
        return set(_listen_inodes().values())
    pids = list(pids)
    inodes = _netns_inodes(pids)
    ports: set[int] = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                port = inodes.get(int(target[8:-1]))
                if port is not None:
                    ports.add(port)
    return ports


def port_owners(ports: Iterable[int]) -> dict[int, set[int]]:
    """For each port in LISTEN state among `ports`: the pids holding its socket (an empty set
    when no readable process holds it, e.g. another user's)."""
    wanted = set(ports)
    by_inode = {inode: port for inode, port in _listen_inodes().items() if port in wanted}
    out: dict[int, set[int]] = {port: set() for port in by_inode.values()}
    if not by_inode:
        return out
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                port = by_inode.get(int(target[8:-1]))
                if port is not None:
                    out[port].add(int(entry.name))
    return out


# ---------------------------------------------------------------------------- processes


@dataclass
class Proc:
    """One supervised process (the leader of its own process group)."""

    name: str
    argv: list[str]
    log_path: Path
    process: asyncio.subprocess.Process
    started_s: float
    lines: int = 0
    stopped: bool = False  # SIGSTOPped and not yet continued
    term_timed_out: bool = False  # ignored a SIGTERM for the whole grace period (then SIGKILLed)
    _reader: asyncio.Task[None] | None = field(default=None, repr=False)
    _waiters: list[tuple[Callable[[str], bool], asyncio.Future[str]]] = field(default_factory=list, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def pgid(self) -> int:
        return self.process.pid  # start_new_session: the leader's pid is the group id

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def alive(self) -> bool:
        return self.process.returncode is None

    async def wait_line(self, predicate: Callable[[str], bool], timeout_s: float) -> str:
        """The first line (from now on) for which `predicate` holds; TimeoutError, or
        ProcessExited if the process ends first."""
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiters.append((predicate, fut))
        try:
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove((predicate, fut))


class ProcessExited(RuntimeError):
    """A supervised process ended while we waited for it to say something."""


class Supervisor:
    """Starts processes in their own groups, signals groups, records pids and ports, reaps."""

    def __init__(self, log_dir: Path, *, clock: Callable[[], float] = time.time) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self.procs: list[Proc] = []
        self.seen_pids: set[int] = set()  # every pid ever seen in one of our groups
        self.seen_ports: set[int] = set()  # every port such a pid was seen listening on
        self.extra_ports: set[int] = set()  # ports bound in this process (proxies)

    async def spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        on_line: LineHandler | None = None,
        cwd: str | Path | None = None,
    ) -> Proc:
        log_path = self.log_dir / f"{name}.log"
        err = open(self.log_dir / f"{name}.err", "ab")  # noqa: SIM115 - handed to the child
        starting = asyncio.ensure_future(
            asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
                limit=MAX_LINE,
            )
        )
        cancelled = False
        try:
            try:
                process = await asyncio.shield(starting)
            except asyncio.CancelledError:
                # the child may exist already: register it (so it is stopped), then give up
                cancelled = True
                process = await starting
        finally:
            err.close()
        proc = Proc(name, list(argv), log_path, process, self.clock())
        self.procs.append(proc)
        self.seen_pids.add(process.pid)
        proc._reader = asyncio.create_task(self._read(proc, on_line), name=f"read-{name}")
        log.info("started %s (pid %d)", name, process.pid)
        if cancelled:
            raise asyncio.CancelledError
        return proc

    async def _read(self, proc: Proc, on_line: LineHandler | None) -> None:
        assert proc.process.stdout is not None
        with open(proc.log_path, "a", encoding="utf-8", errors="replace") as out:
            while True:
                try:
                    raw = await proc.process.stdout.readline()
                except (ValueError, asyncio.LimitOverrunError):  # an absurdly long line: skip it
                    continue
                if not raw:
                    break
                line = raw.decode("utf-8", "replace").rstrip("\n")
                proc.lines += 1
                out.write(line + "\n")
                if on_line is not None:
                    try:
                        on_line(proc, line)
                    except Exception:  # a parser bug must not stop the log copy
                        log.exception("line handler failed on %s", proc.name)
                for pred, fut in list(proc._waiters):
                    if not fut.done() and pred(line):
                        fut.set_result(line)
            out.flush()
        await proc.process.wait()
        for _, fut in proc._waiters:
            if not fut.done():
                fut.set_exception(ProcessExited(f"{proc.name} exited with {proc.process.returncode}"))

    # ------------------------------------------------------------------ signals

    def signal(self, proc: Proc, sig: signal.Signals) -> bool:
        """Send `sig` to the process's whole group; False if the group is gone."""
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            self.sample()  # record what is about to vanish or freeze
        try:
            os.killpg(proc.pgid, sig)
        except ProcessLookupError:
            return False
        if sig == signal.SIGSTOP:
            proc.stopped = True
        elif sig in (signal.SIGCONT, signal.SIGKILL):
            proc.stopped = False
        return True

    async def kill(self, proc: Proc, timeout_s: float = 10.0) -> None:
        """SIGKILL the group and wait for the leader to be reaped."""
        self.signal(proc, signal.SIGKILL)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.process.wait(), timeout_s)

    async def stop(self, proc: Proc, grace_s: float) -> None:
        """SIGCONT + SIGTERM the leader (graceful), then SIGKILL the group after `grace_s`."""
        if proc.alive():
            if proc.stopped:
                self.signal(proc, signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                proc.process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.process.wait(), grace_s)
            except TimeoutError:
                proc.term_timed_out = True
                log.warning("%s did not stop within %.0fs of SIGTERM: SIGKILL", proc.name, grace_s)
        # whatever the leader left behind in its group goes too
        self.signal(proc, signal.SIGKILL)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.process.wait(), 10.0)

    # ------------------------------------------------------------------ evidence

    def sample(self) -> None:
        """Record every pid in our groups and every port they listen on (call periodically)."""
        pids = pids_in_groups(p.pgid for p in self.procs)
        self.seen_pids |= pids
        if pids:
            self.seen_ports |= listening_ports(pids)

    def bound_ports(self) -> set[int]:
        return self.seen_ports | self.extra_ports

    def alive_pids(self) -> set[int]:
        """Pids we saw that are still alive (not zombies) and still in one of our groups."""
        groups = {p.pgid for p in self.procs}
        out: set[int] = set()
        for pid in self.seen_pids:
            st = _stat(pid)
            if st is not None and st[0] not in ("Z", "X") and st[2] in groups:
                out.add(pid)
        return out

    async def shutdown(self, grace_s: float = 10.0, order: Sequence[Proc] | None = None) -> None:
        """Stop every process (graceful first), then reap; safe to call twice."""
        self.sample()
        procs = list(order) if order is not None else list(reversed(self.procs))
        procs += [p for p in self.procs if p not in procs]
        await asyncio.gather(*(self.stop(p, grace_s) for p in procs if p.alive()), return_exceptions=True)
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pgid, signal.SIGKILL)  # stragglers of already-dead leaders
        readers = [p._reader for p in self.procs if p._reader is not None]
        if readers:
            await asyncio.wait(readers, timeout=10.0)

    def kill_all_now(self) -> None:
        """Synchronous last resort (e.g. from an atexit hook): SIGKILL every group."""
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pgid, signal.SIGCONT)
                os.killpg(p.pgid, signal.SIGKILL)


__all__ = [
    "Proc",
    "ProcessExited",
    "Supervisor",
    "free_port",
    "listening_ports",
    "pid_alive",
    "pids_in_groups",
    "port_owners",
]
