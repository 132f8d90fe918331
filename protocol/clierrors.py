"""One line for every failure of a command: what is wrong and what to do, and a documented exit code.

Every command (`bagel-coordinator`, `bagel-worker`, `bagel-sim`) keeps to two codes besides 0:

- `EXIT_USAGE` (2): the command cannot succeed as given: a bad flag or value, a bad run
  spec, a path that is not what it must be, a data dir of another run or held by another
  process. Fix the command line or the spec;
- `EXIT_RUNTIME` (1): the command was right but failed: a port in use, a damaged file in
  the data dir, the store failing while serving, an internal error.

(The worker also exits 3 when the coordinator it reached runs another spec or is not the
pinned server; a second SIGTERM/SIGINT exits 128 + the signal's number,
`bagel.protocol.shutdown`.)

A command raises `UsageError` or `RuntimeFailure` with the one line, or lets a known
exception through; `guarded` runs its `main`, prints exactly one line on stderr for either,
and turns anything unexpected into one line too (`internal error: ...`), with the traceback
only when `BAGEL_DEBUG=1`. `OneLineParser` makes argparse's own errors one line as well.
The `check_*` helpers validate the flags every command shares (endpoints, multiaddrs, paths).
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sqlite3
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # SIGINT before the command installed its own handlers


class CommandError(Exception):
    """A failure with its one line (what is wrong; what to do) and exit code."""

    code = EXIT_RUNTIME


class UsageError(CommandError):
    """The command line or the spec is wrong (exit 2)."""

    code = EXIT_USAGE


class RuntimeFailure(CommandError):
    """The command was right but failed (exit 1)."""

    code = EXIT_RUNTIME


def version_text(prog: str) -> str:
    """`PROG VERSION` of the installed bagel package (for `--version`)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("bagel")
    except PackageNotFoundError:
        v = "unknown"
    return f"{prog} {v}"


class OneLineParser(argparse.ArgumentParser):
    """argparse with its usage errors as one line (`PROG: error: ...; see PROG --help`), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def one_line(e: BaseException) -> tuple[str, int]:
    """The line and exit code for an exception a command let through."""
    if isinstance(e, CommandError):
        return _flat(str(e)), e.code
    if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
        return f"{_flat(str(e))}: another process uses that port; stop it or choose another port", EXIT_RUNTIME
    if isinstance(e, sqlite3.DatabaseError):
        return (
            f"the SQLite store is damaged ({_flat(str(e))}): restore the data dir from a backup, "
            "or start the run again in an empty data dir",
            EXIT_RUNTIME,
        )
    if isinstance(e, OSError):
        return f"{_flat(str(e))}", EXIT_RUNTIME
    return (
        f"internal error: {type(e).__name__}: {_flat(str(e))} (run with BAGEL_DEBUG=1 for the traceback, "
        "and please report it)",
        EXIT_RUNTIME,
    )


def _flat(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " / ".join(lines)[:600] or "(no message)"


def guarded(prefix: str, main: Callable[[], int]) -> int:
    """Run `main()`; any failure becomes one line `PREFIX<what is wrong>` on stderr and its code."""
    try:
        return main()
    except KeyboardInterrupt:
        print(f"{prefix}interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001  (the one place a command's failure becomes its line)
        if os.environ.get("BAGEL_DEBUG") == "1":
            traceback.print_exc()
        line, code = one_line(e)
        print(f"{prefix}{line}", file=sys.stderr)
        return code


# ---------------------------------------------------------------------------- shared checks


def check_host_port(flag: str, value: str) -> tuple[str, int]:
    """HOST:PORT with an explicit port 0-65535 (0 = any free port); `[v6]:PORT` for IPv6.

    gRPC would take `localhost` alone as port 443: refused here."""
    host, sep, port_s = value.rpartition(":")
    if not sep or not host or not port_s.isdigit() or host.count(":") and not host.startswith("["):
        raise UsageError(f"{flag} {value!r}: give HOST:PORT with an explicit port, e.g. 0.0.0.0:7070 (0 = any free)")
    port = int(port_s)
    if port > 65535:
        raise UsageError(f"{flag} {value!r}: port {port} is out of range (0-65535)")
    return host.strip("[]"), port


def check_multiaddr(flag: str, value: str) -> str:
    """A parseable libp2p multiaddr, e.g. /ip4/0.0.0.0/tcp/7071."""
    from hivemind.utils.multiaddr import Multiaddr

    try:
        Multiaddr(value)
    except Exception as e:  # noqa: BLE001  (the parser raises several types)
        raise UsageError(f"{flag} {value!r} is not a multiaddr ({_flat(str(e))}); e.g. /ip4/0.0.0.0/tcp/7071") from None
    return value


def check_dir_arg(flag: str, path: Path) -> Path:
    """A directory, or a path where one can be created (not a file, not under a file)."""
    p = path
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {path} is a file, not a directory: give a directory (it is created if missing)")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"{flag} {path}: {parent} is a file, so no directory can be created there")
            if not p.exists() and not os.access(parent, os.W_OK | os.X_OK):
                raise UsageError(f"{flag} {path}: cannot create it, {parent} is not writable")
            break
    return path


def check_port_free(flag: str, host: str, port: int) -> None:
    """RuntimeFailure now if HOST:PORT cannot be bound (in use, or no such local address);
    a port of 0 is always fine. The bind is released at once (a race with another process
    remains possible; then the server's own bind error is reported)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise UsageError(f"{flag} {host}:{port}: unknown host ({e.strerror})") from None
    family, socktype, proto, _, addr = infos[0]
    with socket.socket(family, socktype, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise RuntimeFailure(
                    f"{flag} {host}:{port}: the port is in use; stop what listens there or choose another port"
                ) from None
            raise RuntimeFailure(f"{flag} {host}:{port}: cannot listen there ({e.strerror})") from None


__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_RUNTIME",
    "EXIT_USAGE",
    "CommandError",
    "OneLineParser",
    "RuntimeFailure",
    "UsageError",
    "check_dir_arg",
    "check_host_port",
    "check_multiaddr",
    "check_port_free",
    "guarded",
    "one_line",
    "version_text",
]
