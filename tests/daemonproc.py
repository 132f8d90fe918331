"""Helper for tests that run `python -m bagel.coordinator serve` as a real process.

Reads its stdout for the `listening:` and `join:` lines, and always kills it in `close`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DaemonProcess:
    def __init__(self, spec_path: Path, data_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        cmd = [
            sys.executable,
            "-m",
            "bagel.coordinator",
            "serve",
            "--run",
            str(spec_path),
            "--data-dir",
            str(data_dir),
            *args,
        ]
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
