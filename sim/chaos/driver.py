"""The chaos driver: start the real processes, apply the faults on schedule, stop everything.

`ChaosRun(scenario, out_dir).run()` is the whole of `bagel-sim chaos` but the command line
(sim/chaos.py, whose docstring draws the topology). It owns the processes (through a
`sim.procs.Supervisor`), the `FaultProxy` in front of the coordinator, and the fault
schedule; what it sees goes to `sim/chaos_evidence.py`, the verdicts come from
`sim/invariants.py`, and `sim/chaos_report.py` writes the report.

With `chaos.bed = true` the run lives on the network test bed (`sim/chaos/bed.py`): no
proxy and no bootstrap node; the coordinator serves on the public segment, workers join
from their own namespaces with the join string it prints (stable across its restarts),
and `partition` / `bandwidth` / `loss` act on the bed's links.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import random
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bagel.sim.chaos import invariants as inv
from bagel.sim.chaos.bed import ChaosBed
from bagel.sim.chaos.evidence import (
    FiredFault,
    Observations,
    leaked_ports,
    local_hashes,
    read_commit_log,
    runner_checks,
)
from bagel.sim.chaos.proxy import FaultProxy
from bagel.sim.chaos.scenario import LINK_KINDS, ChaosScenario
from bagel.sim.chaos.supervisor import Proc, ProcessExited, Supervisor, free_port
from bagel.sim.faults import Fault, FaultKind

log = logging.getLogger("bagel.sim.chaos")

SAMPLE_EVERY_S = 2.0
STARTUP_LINE_TIMEOUT_S = 120.0
# a worker may take its --leave-grace-s (15 s by default) to finish an exchange or upload
# the state it alone holds, plus its Leave calls: SIGKILL only after that (as Kubernetes'
# default 30 s termination grace)
WORKER_GRACE_S = 30.0
COORDINATOR_GRACE_S = 10.0
_BOOT_RE = re.compile(r"--initial_peers (/\S+/p2p/\S+)")
RUN_MARKER = "chaos-run.json"


@dataclass
class WorkerSlot:
    index: int
    data_dir: Path
    throttle: float
    byzantine: str
    proc: Proc | None = None
    worker_id: str = ""
    starts: int = 0
    expected_exit: bool = True  # we killed/stopped it, or it is not running
    unexpected_exits: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"w{self.index}"


class ChaosRun:
    """One chaos run: `await ChaosRun(scenario, out).run()` returns the result document."""

    def __init__(
        self, scenario: ChaosScenario, out_dir: Path, *, python: str = sys.executable, echo: bool = True
    ) -> None:
        self.sc = scenario
        self.out = Path(out_dir)
        self.python = python
        self.echo = echo
        self.origin = time.time()  # run time 0 (wall clock: the store's commit times are wall clock too)
        self.sup = Supervisor(self.out / "logs")
        self.coord_dir = self.out / "coordinator"
        self.spec_path = self.out / "run.toml"
        self.coord_port = 0
        self.proxy: FaultProxy | None = None
        self.coordinator: Proc | None = None
        self.bootstrap: Proc | None = None
        self.bootstrap_maddr = ""
        self.join = ""
        self.coordinator_key = b""
        self.coordinator_starts = 0
        self.coordinator_expected_exit = True
        self.coordinator_unexpected: list[str] = []
        self.bed = ChaosBed(scenario.bed) if scenario.bed is not None else None
        self.join_strings: list[str] = []  # every join string the coordinator printed, per start
        self.workers = [
            WorkerSlot(i, self.out / "workers" / f"w{i}", scenario.throttle_of(i), scenario.byzantine.get(i, ""))
            for i in range(scenario.workers)
        ]
        self.obs = Observations()
        self.commit_logs: list[inv.CommitLogRead] = []
        self._settle_seen = 0  # acknowledgements seen at the last look at the commit log
        self.fired = [FiredFault(i, f) for i, f in enumerate(scenario.faults)]
        self.rng = random.Random(scenario.seed)
        self.t_zero: float | None = None
        self.end_s = 0.0
        self.stop_reason = ""
        self.commit_records: tuple[Any, ...] = ()
        self.n_local_checkpoints = 0
        self._bg: set[asyncio.Task[Any]] = set()
        self._commit_event = asyncio.Event()

    # ------------------------------------------------------------------ time and output

    def now(self) -> float:
        return time.time() - self.origin

    def say(self, msg: str) -> None:
        line = f"[chaos {self.now():7.1f}s] {msg}"
        log.info(msg)
        if self.echo:
            print(line, file=sys.stderr, flush=True)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        # two cores shared by every process of the run: one math thread each
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.setdefault("BAGEL_LOG_LEVEL", "WARNING")
        return env

    # ------------------------------------------------------------------ processes

    async def start_bootstrap(self) -> None:
        argv = [
            self.python,
            "-m",
            "hivemind.hivemind_cli.run_dht",
            "--host_maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--identity_path",
            str(self.out / "bootstrap.key"),
        ]
        boot_log = self.out / "logs" / "bootstrap.err"
        # hivemind logs to stderr; read the announce line from its log file
        self.bootstrap = await self.sup.spawn("bootstrap", argv, env=self._env())
        deadline = time.monotonic() + STARTUP_LINE_TIMEOUT_S
        while time.monotonic() < deadline:
            text = boot_log.read_text(errors="replace") if boot_log.exists() else ""
            m = _BOOT_RE.search(text)
            if m:
                self.bootstrap_maddr = m.group(1)
                return
            if not self.bootstrap.alive():
                raise RuntimeError(f"the bootstrap DHT node exited ({self.bootstrap.returncode}); see {boot_log}")
            await asyncio.sleep(0.2)
        raise RuntimeError(f"the bootstrap DHT node did not announce itself within {STARTUP_LINE_TIMEOUT_S:.0f}s")

    def _coordinator_argv(self) -> list[str]:
        if self.bed is not None:
            ip, grpc_port, dht_port = self.bed.coordinator_addr()
            # fixed ports inside the coordinator's namespace: a restart on the same data dir
            # prints the same join string (its DHT key persists there)
            return self.bed.argv(
                "coord",
                [
                    self.python, "-m", "bagel.coordinator", "serve",
                    "--run", str(self.spec_path), "--data-dir", str(self.coord_dir),
                    "--listen", f"{ip}:{grpc_port}", "--dht-listen", f"/ip4/{ip}/tcp/{dht_port}",
                    "--tick-ms", str(self.sc.tick_ms), "--grace-s", "2", "--log-level", "WARNING",
                ],
            )  # fmt: skip
        listen = f"127.0.0.1:{self.coord_port}"
        advertise = self.proxy.address if self.proxy is not None else listen
        return [
            self.python,
            "-m",
            "bagel.coordinator",
            "serve",
            "--run",
            str(self.spec_path),
            "--data-dir",
            str(self.coord_dir),
            "--listen",
            listen,
            "--advertise-endpoint",
            advertise,
            "--dht-listen",  # a free port each start (the default is the gRPC port + 1)
            "/ip4/127.0.0.1/tcp/0",
            "--initial-peers",
            self.bootstrap_maddr,
            "--tick-ms",
            str(self.sc.tick_ms),
            "--grace-s",
            "2",
            "--log-level",
            "WARNING",
        ]

    def make_join(self) -> str:
        """The workers' join string, known before the coordinator runs: the coordinator's key
        is created here in its data dir (the daemon loads an existing key, `KEY_FILE`), and
        the initial peer is the bootstrap node, which outlives coordinator restarts."""
        from bagel.coordinator.daemon import KEY_FILE
        from bagel.protocol.identity import Identity
        from bagel.protocol.joinstring import make_join_string

        self.coord_dir.mkdir(parents=True, exist_ok=True)
        self.coordinator_key = Identity.load_or_create(self.coord_dir / KEY_FILE).public_key
        self.join = make_join_string(self.sc.spec.run.id, self.coordinator_key, [self.bootstrap_maddr])
        return self.join

    async def start_coordinator(self) -> None:
        self.coordinator_starts += 1
        name = f"coordinator-{self.coordinator_starts}"

        proc = await self.sup.spawn(name, self._coordinator_argv(), env=self._env())
        self.coordinator = proc
        try:
            line = await proc.wait_line(lambda s: s.startswith("join: "), STARTUP_LINE_TIMEOUT_S)
        except (TimeoutError, ProcessExited) as e:
            raise RuntimeError(f"{name} did not start: {e}; see {self.out / 'logs' / (name + '.err')}") from None
        from bagel.protocol.joinstring import parse_join_string

        printed = line.split(" ", 1)[1].strip()
        self.join_strings.append(printed)
        info = parse_join_string(printed)
        if self.bed is not None and not self.join:
            # on the bed the workers join with what the coordinator prints, as volunteers do
            self.join, self.coordinator_key = printed, info.coordinator_public_key
        elif self.bed is not None and printed != self.join:
            self.say(f"{name} printed another join string than the first start: {printed}")
        if info.coordinator_public_key != self.coordinator_key:
            raise RuntimeError(f"{name} serves with another key than the one created for it in {self.coord_dir}")
        self.coordinator_expected_exit = False
        self._watch(proc, self._on_coordinator_exit)

    def _on_coordinator_exit(self, proc: Proc) -> None:
        if not self.coordinator_expected_exit and proc is self.coordinator:
            msg = f"{proc.name} exited on its own with code {proc.returncode} at {self.now():.1f}s"
            self.coordinator_unexpected.append(msg)
            self.say("UNEXPECTED: " + msg)

    async def start_worker(self, slot: WorkerSlot) -> None:
        slot.starts += 1
        argv = [
            self.python,
            "-m",
            "bagel.worker",
            "join",
            self.join,
            "--data-dir",
            str(slot.data_dir),
            "--device",
            "cpu",
            "--log-json",
            "--name",
            slot.label,
            "--throttle",
            str(slot.throttle),
            "--keep-round-history",
            "--reduce-timeout-s",
            str(self.sc.reduce_timeout_s),
        ]
        if self.bed is None:
            argv += ["--dht-listen", "/ip4/127.0.0.1/tcp/0"]
        if slot.byzantine:
            argv += ["--byzantine", slot.byzantine]
        argv += list(self.sc.extra_worker_args)
        if self.bed is not None:
            argv = self.bed.argv(self.bed.worker_node(slot.index), argv)
        slot.data_dir.mkdir(parents=True, exist_ok=True)
        name = f"{slot.label}-{slot.starts}"
        slot.proc = await self.sup.spawn(
            name, argv, env=self._env(), on_line=lambda p, line: self._on_worker_line(slot, line)
        )
        slot.expected_exit = False
        self._watch(slot.proc, lambda p: self._on_worker_exit(slot, p))

    def _on_worker_exit(self, slot: WorkerSlot, proc: Proc) -> None:
        # a worker the coordinator banned is told to leave, and does: that exit is expected
        if not slot.expected_exit and proc is slot.proc and slot.index not in self.obs.banned:
            msg = f"{proc.name} exited on its own with code {proc.returncode} at {self.now():.1f}s"
            slot.unexpected_exits.append(msg)
            self.say("UNEXPECTED: " + msg)

    def _watch(self, proc: Proc, on_exit: Any) -> None:
        async def watch() -> None:
            await proc.process.wait()
            on_exit(proc)

        self._spawn(watch())

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        t = asyncio.ensure_future(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)
        return t

    # ------------------------------------------------------------------ worker events

    def _on_worker_line(self, slot: WorkerSlot, line: str) -> None:
        if not line.startswith("{"):
            return
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            return
        name = ev.get("event")
        if name == "step" or not isinstance(name, str) or not isinstance(ev, dict):
            return  # per-inner-step progress: not needed here
        if name == "identity":
            slot.worker_id = str(ev.get("worker_id", ""))
        t = float(ev.get("ts", time.time())) - self.origin
        note = self.obs.on_event(slot.index, slot.worker_id, ev, t)
        if note:
            self.say(f"{slot.label} {note}")
        if name == "committed":
            self._commit_event.set()

    # ------------------------------------------------------------------ commit log

    def read_commit_log(self, label: str) -> inv.CommitLogRead:
        """Read the coordinator's commit log now (label says when: before a kill, ...)."""
        from bagel.coordinator.store import StoreError

        t = self.now()
        try:
            read, records = read_commit_log(self.coord_dir, label, t, self.origin)
        except StoreError as e:
            self.say(f"commit log unreadable at '{label}': {e}")
            read, records = inv.CommitLogRead(t, label, ()), ()
        else:
            self.commit_records = records  # the latest full records (loss, contributors) for the report
        self.commit_logs.append(read)
        self.say(f"commit log '{label}': {len(read.commits)} commits")
        return read

    # ------------------------------------------------------------------ faults

    def _live_workers(self) -> list[WorkerSlot]:
        return [w for w in self.workers if w.proc is not None and w.proc.alive()]

    def _targets(self, f: Fault) -> list[WorkerSlot]:
        if f.workers:
            return [self.workers[i] for i in f.workers]
        live = sorted(self._live_workers(), key=lambda w: w.index)
        n = f.count if f.count > 0 else max(1, round(f.fraction * len(live)))
        return self.rng.sample(live, min(n, len(live)))

    async def _after(self, delay_s: float, fn: Any, *args: Any) -> None:
        await asyncio.sleep(max(0.0, delay_s))
        await fn(*args)

    async def fire(self, ff: FiredFault) -> None:
        f = ff.fault
        try:
            await self._fire(ff, f)
        except Exception as e:  # noqa: BLE001 - a fault that could not be applied is reported, and fails the run
            ff.error = f"{type(e).__name__}: {e}"
            self.say(f"fault {ff.index} ({f.kind.value}) FAILED: {ff.error}")

    async def _fire(self, ff: FiredFault, f: Fault) -> None:
        kind = f.kind
        if kind in (FaultKind.KILL, FaultKind.LEAVE, FaultKind.STOP):
            targets = self._targets(f)
            if not targets:
                raise RuntimeError("no live worker to hit")
            spacing = f.within_s / len(targets) if f.within_s > 0 else 0.0
            hits = []
            for k, slot in enumerate(targets):
                hits.append(self._spawn(self._after(k * spacing, self._hit_worker, ff, f, slot)))
            await asyncio.gather(*hits)
            return
        ff.fired_s = self.now()
        if kind is FaultKind.COORDINATOR_KILL:
            await self._coordinator_kill(ff, f)
            return
        if self.bed is not None and kind in LINK_KINDS:
            await self._link_fault(ff, f, self.bed)
            return
        proxy = self.proxy
        assert proxy is not None  # the scenario parser refuses proxy faults without a proxy
        ff.targets = [f"proxy {proxy.address} -> 127.0.0.1:{self.coord_port}"]
        if kind is FaultKind.RESET:
            n = proxy.reset()
            ff.detail = f"reset {n} open connections"
            ff.ended_s = ff.fired_s
        elif kind is FaultKind.HANG:
            proxy.hang()
            ff.detail = f"hang for {f.duration_s:g}s"
            self.say(f"proxy hangs for {f.duration_s:g}s")
            await asyncio.sleep(f.duration_s)
            proxy.resume()
            ff.ended_s = self.now()
        elif kind is FaultKind.LATENCY:
            before = proxy.latency_s * 1000.0
            proxy.set_latency(f.latency_ms)
            ff.detail = f"+{f.latency_ms:g} ms each direction" + (
                f" for {f.duration_s:g}s" if f.duration_s else " until the end"
            )
            self.say(f"proxy latency +{f.latency_ms:g} ms")
            if f.duration_s > 0:
                await asyncio.sleep(f.duration_s)
                proxy.set_latency(before)
                ff.ended_s = self.now()
            else:
                ff.ended_s = ff.fired_s  # a lasting degradation: progress must resume under it
        elif kind is FaultKind.BANDWIDTH:
            before = proxy.bandwidth_bytes_per_s
            proxy.set_bandwidth(f.bandwidth_bytes_per_s)
            ff.detail = f"cap {f.bandwidth_bytes_per_s:g} B/s per direction per connection" + (
                f" for {f.duration_s:g}s" if f.duration_s else " until the end"
            )
            self.say(ff.detail)
            if f.duration_s > 0:
                await asyncio.sleep(f.duration_s)
                proxy.set_bandwidth(before)
                ff.ended_s = self.now()
            else:
                ff.ended_s = ff.fired_s
        else:  # pragma: no cover - parse_chaos_scenario refuses the rest
            raise RuntimeError(f"unsupported fault kind {kind.value}")

    async def _hit_worker(self, ff: FiredFault, f: Fault, slot: WorkerSlot) -> None:
        proc = slot.proc
        if proc is None or not proc.alive():
            raise RuntimeError(f"{slot.label} is not running")
        t = self.now()
        ff.fired_s = t if ff.fired_s is None else min(ff.fired_s, t)
        ff.targets.append(f"{slot.label} ({slot.worker_id or 'id unknown'})")
        slot.expected_exit = True
        if f.kind is FaultKind.KILL:
            self.say(f"SIGKILL {slot.label} (pid {proc.pid})")
            await self.sup.kill(proc)
            if f.duration_s > 0:
                await asyncio.sleep(f.duration_s)
                self.say(f"restart {slot.label} on the same data dir")
                await self.start_worker(slot)
                ff.detail = f"restarted after {f.duration_s:g}s"
            ff.ended_s = max(ff.ended_s or 0.0, self.now())
        elif f.kind is FaultKind.LEAVE:
            self.say(f"SIGTERM {slot.label} (graceful leave)")
            await self.sup.stop(proc, WORKER_GRACE_S)
            ff.detail = f"exit code {proc.returncode}"
            ff.ended_s = max(ff.ended_s or 0.0, self.now())
        elif f.kind is FaultKind.STOP:
            self.say(f"SIGSTOP {slot.label} for {f.duration_s:g}s")
            self.sup.signal(proc, signal.SIGSTOP)
            await asyncio.sleep(f.duration_s)
            self.sup.signal(proc, signal.SIGCONT)
            slot.expected_exit = False
            self.say(f"SIGCONT {slot.label}")
            ff.ended_s = max(ff.ended_s or 0.0, self.now())

    async def _link_fault(self, ff: FiredFault, f: Fault, bed: ChaosBed) -> None:
        """A partition, cap or loss on a bed link for `duration_s` (0: until the end), read
        back from the kernel when applied and when undone; a fault still active when the run
        stops is undone at teardown."""
        behind = [self.workers[i].label for i in bed.workers_behind(f.link)]
        ff.targets = [f"link {f.link} ({', '.join(behind) or 'no worker'})"]
        rec = await asyncio.to_thread(bed.apply, ff.index, f)
        ff.detail = rec.want
        self.say(f"bed: {rec.want}")
        if f.duration_s <= 0:
            ff.ended_s = ff.fired_s  # a lasting degradation: progress must resume under it
            return
        # until the scheduled end, not duration_s after the apply finished: on a loaded host the
        # apply's tc and nft calls take a while, and a relative end would run into the next fault
        assert self.t_zero is not None  # faults fire only once the schedule has started
        await asyncio.sleep(max(0.0, self.t_zero + f.at_s + f.duration_s - self.now()))
        await asyncio.to_thread(bed.undo, ff.index)
        ff.ended_s = self.now()
        ff.detail += "; undone, read back"
        self.say(f"bed: {f.kind.value} on {f.link} undone")

    async def _coordinator_kill(self, ff: FiredFault, f: Fault) -> None:
        proc = self.coordinator
        if proc is None or not proc.alive():
            raise RuntimeError("the coordinator is not running")
        n = self.coordinator_starts
        self.read_commit_log(f"before coordinator kill #{n}")
        self.coordinator_expected_exit = True
        ff.targets = [f"coordinator (pid {proc.pid})"]
        self.say(f"SIGKILL coordinator (pid {proc.pid}); restart in {f.duration_s:g}s")
        await self.sup.kill(proc)
        await asyncio.sleep(f.duration_s)
        await self.start_coordinator()
        ff.ended_s = self.now()
        ff.detail = f"down {ff.ended_s - (ff.fired_s or ff.ended_s):.1f}s (restart on the same data dir)"
        self.say(f"coordinator back ({ff.detail})")
        self.read_commit_log(f"after coordinator restart #{n}")

    # ------------------------------------------------------------------ the run

    async def run(self) -> dict[str, Any]:
        self.out.mkdir(parents=True, exist_ok=True)
        self.spec_path.write_text(self.sc.run_spec_text)
        (self.out / RUN_MARKER).write_text(json.dumps({"scenario": self.sc.name, "started_unix_s": self.origin}))
        atexit.register(self.sup.kill_all_now)  # last resort if the loop dies abnormally
        if self.bed is not None:
            atexit.register(self.bed.teardown)  # registered after: atexit runs it first
        self._spawn(self._sample_loop())
        error = ""
        try:
            await self._drive()
        except asyncio.CancelledError:  # Ctrl-C / SIGTERM: stop everything, still write the report
            self.stop_reason = error = "interrupted"
        except Exception as e:  # noqa: BLE001 - any failure ends the run, which still writes its report
            self.stop_reason = f"error: {type(e).__name__}: {e}"
            error = self.stop_reason
            self.say(self.stop_reason)
        finally:
            # stopping must finish even if a signal arrives meanwhile: a second Ctrl-C/SIGTERM
            # SIGKILLs every group at once, and the (shielded) stop then completes quickly
            stopper = asyncio.ensure_future(self._stop_all())
            while not stopper.done():
                try:
                    await asyncio.shield(stopper)
                except asyncio.CancelledError:
                    error = error or "interrupted"
                    self.stop_reason = self.stop_reason or "interrupted"
                    self.say("interrupted while stopping: SIGKILL every process group")
                    self.sup.kill_all_now()
            atexit.unregister(self.sup.kill_all_now)
            if self.bed is not None:
                self._teardown_bed()  # already done by the stop, unless that was cut short
                atexit.unregister(self.bed.teardown)
        return self._result(error)

    def _teardown_bed(self) -> None:
        """Undo the link faults and delete the bed's namespaces (synchronous: it must finish
        even while signals arrive; SIGKILLs whatever still runs in them)."""
        assert self.bed is not None
        if self.bed.torn_down:
            return
        try:
            self.bed.teardown()
        except Exception as e:  # noqa: BLE001 - reported; remove_bed retried below
            self.say(f"bed teardown: {type(e).__name__}: {e}")
            from bagel.sim.netlab.bed import remove_bed

            remove_bed(self.bed.lab.topology.prefix)
        left = self.bed.namespaces_left
        self.say(f"bed {self.bed.plan.tag!r} torn down" + (f"; LEFT: {left}" if left else ""))

    async def _drive(self) -> None:
        if self.bed is not None:
            await self._drive_bed_start(self.bed)
        else:
            await self._drive_loopback_start()
        await self._drive_schedule()

    async def _drive_bed_start(self, bed: ChaosBed) -> None:
        await asyncio.to_thread(bed.start)
        placed = ", ".join(f"{w.label} {bed.worker_node(w.index)}" for w in self.workers)
        self.say(f"bed {bed.plan.tag!r} up: coordinator on {bed.coordinator_addr()[0]}; {placed}")
        await self.start_coordinator()
        for slot in self.workers:
            await self.start_worker(slot)
        self.say(f"coordinator up; {len(self.workers)} workers started")

    async def _drive_loopback_start(self) -> None:
        self.coord_port = free_port()
        if self.sc.proxy:
            self.proxy = await FaultProxy("127.0.0.1", self.coord_port).start()
            self.sup.extra_ports.add(self.proxy.port)
            self.say(f"fault proxy {self.proxy.address} -> coordinator 127.0.0.1:{self.coord_port}")
        self.sup.extra_ports.add(self.coord_port)
        await self.start_bootstrap()
        self.say(f"bootstrap DHT node {self.bootstrap_maddr}")
        self.make_join()
        # workers start with the coordinator: they import torch and start their DHT nodes
        # while it starts, then find its record (start-up is most of a short run's time)
        for slot in self.workers:
            await self.start_worker(slot)
        await self.start_coordinator()
        self.say(f"coordinator up; {len(self.workers)} workers started")

    async def _drive_schedule(self) -> None:
        # t = 0 of the schedule: the first committed round
        deadline = time.monotonic() + self.sc.startup_timeout_s
        while self.obs.first_commit_s is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no round committed within startup_timeout_s = {self.sc.startup_timeout_s:g}s")
            self._commit_event.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._commit_event.wait(), 1.0)
        self.t_zero = self.obs.first_commit_s
        self.say(f"first round committed: t = 0 of the fault schedule (run time {self.t_zero:.1f}s)")
        pending = [
            self._spawn(self._after(self.t_zero + ff.fault.at_s - self.now(), self.fire, ff)) for ff in self.fired
        ]
        cap = self.t_zero + self.sc.max_duration_s
        last_progress = 0.0
        while True:
            now = self.now()
            done = all(t.done() for t in pending)
            if done:
                last_end = max([ff.ended_s or ff.fired_s or 0.0 for ff in self.fired], default=self.t_zero)
                settled = await self._settled(last_end)
                if settled is not None:
                    after, stalled = settled
                    if len(after) >= self.sc.settle_commits and not stalled:
                        self.stop_reason = f"{len(after)} rounds committed after the last fault ended, in every cell"
                        break
                    if len(after) >= self.sc.settle_commits and now > last_end + self.sc.progress_bound_s:
                        self.stop_reason = (
                            f"{len(after)} rounds committed after the last fault ended; cells {sorted(stalled)} "
                            f"did not commit within progress_bound_s"
                        )
                        break
            if now >= cap:
                self.stop_reason = f"max_duration_s = {self.sc.max_duration_s:g}s reached"
                break
            if now - last_progress >= 10.0:
                last_progress = now
                rounds = len({(c.cell_id, c.round) for c in self.obs.acknowledged})
                fired = sum(ff.fired_s is not None for ff in self.fired)
                self.say(
                    f"t={now - self.t_zero:+.0f}s committed rounds {rounds}, faults fired {fired}/{len(self.fired)}"
                )
            await asyncio.sleep(0.5)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self.say(f"stopping: {self.stop_reason}")

    async def _settled(self, last_end: float) -> tuple[set[tuple[str, int]], set[str]] | None:
        """The rounds the coordinator committed after `last_end` and the cells that
        committed before it but not since; None while no new acknowledgement asks for a look.

        The stop is judged on the coordinator's commit log, the record the invariants read,
        not on the workers' acknowledgements: a round committed just before a fault ended is
        often acknowledged just after it, and stopping on that ack leaves the run without
        the commit after the fault that `progress_resumes` looks for."""
        from bagel.coordinator.store import StoreError

        seen = len(self.obs.acknowledged)
        if seen == self._settle_seen:
            return None
        try:
            read, _ = await asyncio.to_thread(read_commit_log, self.coord_dir, "settle", self.now(), self.origin)
        except StoreError:
            return None  # the coordinator is restarting; look again at the next acknowledgement
        self._settle_seen = seen
        return inv.settled_after(read.commits, last_end)

    async def _sample_loop(self) -> None:
        while True:
            await asyncio.to_thread(self.sup.sample)
            await asyncio.sleep(SAMPLE_EVERY_S)

    async def _stop_all(self) -> None:
        """Cancel pending faults, read the log while running, stop workers then the
        coordinator, read it again."""
        self.end_s = self.now()
        for w in self.workers:
            w.expected_exit = True
        self.coordinator_expected_exit = True
        bg = list(self._bg)  # fault tasks (no fault may fire while stopping), watchers, the sampler
        for t in bg:
            t.cancel()
        await asyncio.gather(*bg, return_exceptions=True)
        if self.coordinator is not None and self.coordinator.alive():
            with contextlib.suppress(Exception):
                self.read_commit_log("end (running)")
        for w in self.workers:
            w.expected_exit = True
        self.coordinator_expected_exit = True
        workers = [w.proc for w in self.workers if w.proc is not None]
        await asyncio.gather(*(self.sup.stop(p, WORKER_GRACE_S) for p in workers if p.alive()), return_exceptions=True)
        if self.coordinator is not None:
            await self.sup.stop(self.coordinator, COORDINATOR_GRACE_S)
        await self.sup.shutdown(grace_s=5.0)
        if self.proxy is not None:
            await self.proxy.close()
        if self.bed is not None:
            self._teardown_bed()
        if (self.coord_dir / "coordinator.sqlite3").exists():
            with contextlib.suppress(Exception):
                self.read_commit_log("final (stopped)")

    # ------------------------------------------------------------------ checks and result

    def history(self) -> inv.History:
        local = local_hashes([(w.worker_id, w.data_dir) for w in self.workers], self.sc.spec, self.end_s)
        self.n_local_checkpoints = len(local)
        faults = tuple(
            inv.FaultRecord(ff.fired_s, ff.fault.kind.value, ff.ended_s, ", ".join(ff.targets))
            for ff in self.fired
            if ff.fired_s is not None
        )
        return inv.History(
            commit_logs=tuple(self.commit_logs),
            acknowledged=tuple(self.obs.acknowledged),
            hashes=tuple(self.obs.hashes) + tuple(local),
            faults=faults,
            end_s=self.end_s,
            progress_bound_s=self.sc.progress_bound_s,
            byzantine_workers=frozenset(w.worker_id for w in self.workers if w.byzantine and w.worker_id),
            started_pids=tuple(sorted(self.sup.seen_pids)),
            alive_pids_at_end=tuple(sorted(self.sup.alive_pids())),
            bound_ports=tuple(sorted(self.sup.bound_ports())),
            listening_ports_at_end=leaked_ports(self.sup),
        )

    def _result(self, error: str) -> dict[str, Any]:
        from bagel.sim.chaos.report import build_summary

        h = self.history()
        unexpected = self.coordinator_unexpected + [m for w in self.workers for m in w.unexpected_exits]
        results = {**inv.check_history(h), **runner_checks(self.fired, unexpected, error)}
        return build_summary(self, h, results)


__all__ = ["RUN_MARKER", "ChaosRun", "WorkerSlot"]
