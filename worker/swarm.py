"""Processes of a local Bagel swarm: a coordinator and workers as real subprocesses on loopback.

Used by `make demo` (`bagel.worker.demo`) and by the multi-process end-to-end tests. Each
process starts in its own session (process group), so stopping it also stops what it
started (hivemind's DHT child process and its p2pd daemon): `stop()` sends SIGTERM to the
leader (graceful: the worker Leaves, the coordinator drains), waits, then SIGKILLs the
whole group; `kill()` SIGKILLs the group at once (a crash). Output goes to a log file,
and the coordinator's `listening:` / `join:` lines are read from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Managed:
    """A subprocess in its own process group, logging to `log_path`."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None

    def start(self) -> Managed:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=self.env,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole group (a crash: nothing is flushed or announced)."""
        self._signal_group(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)

    def terminate(self) -> None:
        """SIGTERM the leader (its graceful stop), without waiting."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM the leader, wait up to timeout_s, then SIGKILL the group. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        rc = self.proc.poll()
        self._signal_group(signal.SIGKILL)  # leftovers of the group (DHT child, p2pd)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        return rc

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_for_line(self, prefix: str, timeout_s: float) -> str:
        """The rest of the first log line starting with `prefix`; TimeoutError/RuntimeError."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log_text().splitlines():
                if line.startswith(prefix):
                    return line[len(prefix) :].strip()
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited ({self.proc.returncode if self.proc else '?'}):\n{self.log_text()[-3000:]}"
                )
            time.sleep(0.1)
        raise TimeoutError(f"{self.name}: no {prefix!r} line after {timeout_s}s:\n{self.log_text()[-3000:]}")


@dataclass
class CoordinatorProc(Managed):
    endpoint: str = ""
    join: str = ""
    tls_fingerprint: str = ""  # from its `tls: sha256 HEX` line; "" = plaintext

    @classmethod
    def make(
        cls,
        spec: Path,
        data_dir: Path,
        log_path: Path,
        *,
        port: int = 0,
        dht_port: int = 0,
        tick_ms: int = 100,
        python: str = sys.executable,
        extra: Sequence[str] = (),
        module: Sequence[str] = ("-m", "bagel.coordinator"),
    ) -> CoordinatorProc:
        argv = [
            python,
            *module,
            "serve",
            "--run",
            str(spec),
            "--data-dir",
            str(data_dir),
            "--listen",
            f"127.0.0.1:{port}",
            "--dht-listen",
            f"/ip4/127.0.0.1/tcp/{dht_port}",
            "--tick-ms",
            str(tick_ms),
            "--log-level",
            "WARNING",
            *extra,
        ]
        return cls("coordinator", argv, log_path, env=_env())

    def start_and_wait(self, timeout_s: float = 60.0) -> CoordinatorProc:
        self.start()
        self.endpoint = self.wait_for_line("listening:", timeout_s)
        tls = self.wait_for_line("tls:", timeout_s)
        self.tls_fingerprint = tls.removeprefix("sha256 ") if tls.startswith("sha256 ") else ""
        self.join = self.wait_for_line("join:", timeout_s)
        return self


@dataclass
class WorkerProc(Managed):
    data_dir: Path = field(default_factory=Path)

    @classmethod
    def make(
        cls,
        join: str,
        data_dir: Path,
        log_path: Path,
        *,
        name: str = "",
        throttle: float = 1.0,
        python: str = sys.executable,
        extra: Sequence[str] = (),
    ) -> WorkerProc:
        argv = [
            python,
            "-m",
            "bagel.worker",
            "join",
            join,
            "--data-dir",
            str(data_dir),
            "--dht-listen",
            "/ip4/127.0.0.1/tcp/0",
            "--log-json",
            "--throttle",
            str(throttle),
            *extra,
        ]
        if name:
            argv += ["--name", name]
        return cls(name or data_dir.name, argv, log_path, env=_env(), data_dir=data_dir)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The worker's --log-json events (optionally only those named `kind`)."""
        out = []
        for line in self.log_text().splitlines():
            if not line.startswith("{"):
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if kind is None or rec.get("event") == kind:
                out.append(rec)
        return out


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # every process on a shared 2-core box: one intra-op thread each avoids oversubscription
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@contextlib.contextmanager
def cleanup(procs: list[Managed], timeout_s: float = 15.0) -> Iterator[list[Managed]]:
    """Stop every process in `procs` (also ones appended later) on exit, whatever happens:
    the workers all at once, then the coordinators (a worker's graceful leave may still
    talk to its coordinator). Each stage waits at most `timeout_s` in all, not per process:
    a worker's leave can take its whole `--leave-grace-s`, and ten of them one after the
    other held a teardown for minutes."""
    try:
        yield procs
    finally:
        workers = [p for p in procs if not isinstance(p, CoordinatorProc)]
        stop_all(workers, timeout_s)
        stop_all([p for p in procs if isinstance(p, CoordinatorProc)], timeout_s)


def stop_all(procs: Sequence[Managed], timeout_s: float) -> None:
    """SIGTERM every live leader at once, wait for them under one deadline of `timeout_s`,
    then SIGKILL every group (what is left of it: a DHT child, a p2p daemon)."""
    for p in procs:
        if p.alive():
            p.terminate()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        if p.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        p.kill()


def get_status(endpoint: str, timeout_s: float = 5.0, *, tls_fingerprint: str = "", key: Path | None = None) -> Any:
    """The coordinator's GetStatus over a short-lived channel, TLS pinned to `tls_fingerprint`
    (the daemon's `tls: sha256 HEX` line) or plaintext if "": the aggregate view, or with
    `key` (the coordinator's `DATA_DIR/coordinator.key`) signed, with every worker."""
    import grpc

    from bagel.protocol import bagel_pb2 as pb
    from bagel.protocol import bagel_pb2_grpc as pb_grpc
    from bagel.protocol.envelope import sign_request
    from bagel.protocol.identity import Identity
    from bagel.protocol.tls import pinned_credentials

    if tls_fingerprint:
        pinned = pinned_credentials(endpoint, tls_fingerprint, timeout_s)
        channel = grpc.secure_channel(endpoint, pinned.credentials(), options=pinned.channel_options())
    else:
        channel = grpc.insecure_channel(endpoint)
    with channel as ch:
        stub = pb_grpc.CoordinatorStub(ch)
        req = pb.GetStatusRequest()
        if key is not None:
            run_id = stub.AdmissionChallenge(pb.AdmissionChallengeRequest(), timeout=timeout_s).run_id
            req.auth.CopyFrom(
                sign_request(Identity.load(key), pb.StatusAuthRequest(), run_id=run_id, method="GetStatus")
            )
        return stub.GetStatus(req, timeout=timeout_s)
