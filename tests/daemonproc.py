"""Helper for tests that run `python -m bagel.coordinator serve` as a real process.

Reads its stdout for the `listening:` and `join:` lines, and always kills it in `close`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DaemonProcess:
    def __init__(
        self,
        spec_path: Path,
        data_dir: Path,
        *args: str,
        env: dict[str, str] | None = None,
        launcher: tuple[str, ...] = ("-m", "bagel.coordinator"),
    ) -> None:
        # `launcher`: what runs the coordinator's command line (a test may pass a script
        # that patches the real code first, then calls `bagel.coordinator.cli.main`)
        cmd = [sys.executable, *launcher, "serve", "--run", str(spec_path), "--data-dir", str(data_dir), *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            start_new_session=True,  # its own process group: the DHT child dies with it
        )
        self.lines: list[str] = []
        self.stderr: list[str] = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True).start()
        threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr), daemon=True).start()

    def _read(self, stream, sink: list[str]) -> None:
        for line in stream:
            with self._cv:
                sink.append(line.rstrip("\n"))
                self._cv.notify_all()

    def wait_line(self, prefix: str, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return line[len(prefix) :].strip()
                if self.proc.poll() is not None:
                    raise AssertionError(
                        f"daemon exited with {self.proc.returncode} before printing {prefix!r}:\n"
                        + "\n".join(self.stderr[-30:])
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {prefix!r} line within {timeout_s}s:\n" + "\n".join(self.stderr[-30:]))
                self._cv.wait(min(left, 0.5))

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill9(self) -> None:
        """SIGKILL the daemon and everything in its process group (its DHT child too)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def wait(self, timeout_s: float = 30.0) -> int:
        return self.proc.wait(timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill9()
        else:
            try:  # a clean exit must not leave its DHT child behind either
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclass
class ForkLauncher:
    """One forkrun.py process and the cases it forked."""

    proc: subprocess.Popen[str]
    pids: dict[str, int] = field(default_factory=dict)
    codes: dict[str, int] = field(default_factory=dict)
    cv: threading.Condition = field(default_factory=threading.Condition)

    @classmethod
    def start(cls, prog: str, cases: list[dict], hold_s: float = 0.0) -> ForkLauncher:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "forkrun.py"), prog, str(hold_s), json.dumps(cases)],
            stdout=subprocess.PIPE,
            text=True,
            cwd=HERE,
        )
        self = cls(proc)
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, name, value = line.split()
            with self.cv:
                (self.pids if kind == "pid" else self.codes)[name] = int(value)
                self.cv.notify_all()

    def wait_code(self, name: str, timeout_s: float) -> int | None:
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while name not in self.codes and time.monotonic() < deadline:
                self.cv.wait(0.2)
            return self.codes.get(name)

    def wait_pids(self, n: int, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while len(self.pids) < n and time.monotonic() < deadline:
                self.cv.wait(0.2)
        assert len(self.pids) == n, self.pids

    def close(self) -> None:
        """SIGKILL every case's process group (whatever is left of it), then the launcher."""
        for p in self.pids.values():
            try:
                os.killpg(p, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.kill()
        self.proc.wait(10)
