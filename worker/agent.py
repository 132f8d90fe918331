"""The worker's lifecycle: join a run, then follow the coordinator's instructions, round after round.

`bagel-worker join` runs one `Agent` (rank 0 of a multi-GPU worker; the other ranks run
`ddp_follower`). In order:

1. identity (Ed25519, 0600 key file) -> own hivemind DHT node bootstrapped from the join
   string's peers -> the coordinator's signed DHT record -> a signed gRPC client over
   TLS pinned to the record's certificate fingerprint (`bagel.protocol.tls`);
2. the local checkpoint (if any) -> profile -> Register with that `LocalState`;
3. the control loop. The protocol is level-triggered: every Register/Heartbeat/ReportRound
   answer carries the worker's current `Instruction`, and `_reconcile` compares it with
   what the worker is doing and acts, so a lost message or a coordinator restart changes
   nothing:
   - SYNC: fetch (cell, committed round) from the named donors over P2P (`statesync`), or
     the coordinator's checkpoint, and verify the committed hash; round 0 is built locally;
   - TRAIN: H inner steps in a thread (`trainer`), so the event loop keeps heartbeating;
   - READY: heartbeat PHASE_READY with the samples; the freeze arrives through the link's
     held `WatchInstruction` (`link.py`), about a network latency after it happens;
   - REDUCE: pseudo-gradient (+ error feedback, codec) averaged over exactly the frozen
     contributors (`averaging`), outer Nesterov step (`diloco`), hash, ReportRound. A
     failed exchange is reported `failed=True` and the delta is kept for a re-freeze
     (higher reduce_attempt); an abort rolls back, which costs nothing: the committed
     state is never touched until the round commits;
   - after a commit: local checkpoint (atomic), serve the state to joiners, upload a
     checkpoint when told; LEAVE: exit.
4. Heartbeats run on their own task. Coordinator unreachable: keep training the current
   round and retry with backoff (re-resolving its DHT record); NOT_FOUND: re-register.
5. SIGTERM/Ctrl-C: finish a running exchange (bounded) or abandon training, Leave, close
   the data plane and the DHT, exit 0.

Layout: this file is the lifecycle, the control loop, checkpoint uploads and what a
Register carries (profile, spec cache). `_reconcile` builds what the worker holds and does
into a `reconciler.WorkerView`, asks the pure `reconciler.decide` what to do about the
current instruction (the same function the simulator and the test workers follow), and
performs the actions. The agent composes two objects: `link` (`link.py`: the coordinator
client, RPC ordering, registration, heartbeats) and `orders` (`orders.py`: the committed
state, the round work, and the SYNC / TRAIN / REDUCE jobs and verdicts). `roundwork.py`
holds the round work itself (train, exchange, outer step) and the other ranks of a DDP
worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.atomicfile import atomic_write
from bagel.protocol.cellmemory import MemoryBudget, fits
from bagel.protocol.client import SpecMismatch
from bagel.protocol.clierrors import UsageError
from bagel.protocol.convert import instruction_from_pb
from bagel.protocol.discovery import (
    BootstrapUnreachable,
    CoordinatorNotFound,
    CoordinatorRecordValidator,
    DhtStartTimeout,
    DiscoveryError,
    resolve_coordinator,
    start_dht,
    start_relay_dht,
)
from bagel.protocol.identity import Identity
from bagel.protocol.joinstring import JoinInfo, parse_join_string
from bagel.protocol.messages import Instruction, Reachability
from bagel.protocol.relay import install_p2pd_args
from bagel.protocol.runspec import RunSpec, parse_spec
from bagel.protocol.shutdown import StopSignals
from bagel.protocol.tls import TLSError
from bagel.protocol.validation import MAX_REACHABILITY_DETAIL_CHARS
from bagel.worker import ddp, reachability, reconciler, waiting
from bagel.worker.display import Display
from bagel.worker.link import CoordinatorLink
from bagel.worker.localstate import LocalStore
from bagel.worker.metrics import WorkerMetrics
from bagel.worker.orders import Orders
from bagel.worker.profile import (
    DEFAULT_UPLINK_MBPS,
    MeasuredProfile,
    bench_micro_batches,
    cached_profile,
    host_memory_bytes,
    measure,
    memory_bytes,
    profile_key,
    read_memory,
)
from bagel.worker.roundwork import BAD_REDUCER_SCALE, LIAR_SAMPLES_PER_S, ddp_follower
from bagel.worker.stopping import StopBudget, in_daemon_thread
from bagel.worker.trainer import pick_device

log = logging.getLogger(__name__)

SOFTWARE_VERSION = "bagel-worker/0.1"
# A stop on SIGTERM/SIGINT takes at most --leave-grace-s plus this much (the training thread's
# current inner step, closing the data plane and the DHT child); past that the worker exits
# anyway (`bagel.protocol.shutdown`).
STOP_MARGIN_S = 15.0
# Each step of the stop waits at most this long, and all of them together no longer than
# what is left of the stop's one deadline (`bagel.worker.stopping.StopBudget`).
CLOSE_STEP_S = 5.0
LEAVE_RPC_S = 5.0  # the Leave call, the wait for the RPC lock included
# a discovery failure this soon before a stop request is taken as the stop's doing (a signal
# to the process group reaches the p2p daemon too), not as a fatal error
STOP_FOLLOWS_S = 1.0
_UNREACHABLE = "the coordinator is unreachable"
_UNREACHABLE_HINT = "check that it runs and that its DHT port is reachable from here"


def stop_bound_s(leave_grace_s: float) -> float:
    """The documented bound of a graceful stop: `leave_grace_s` plus `STOP_MARGIN_S`."""
    return leave_grace_s + STOP_MARGIN_S


@dataclass
class AgentConfig:
    join: str
    data_dir: Path
    device: str = "auto"
    max_vram_gb: float | None = None
    max_ram_gb: float | None = None
    name: str = ""
    throttle: float = 1.0
    uplink_mbps: float = DEFAULT_UPLINK_MBPS
    byzantine: str = ""  # "" or one of roundwork.BYZANTINE_MODES (fault injection)
    dht_listen: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    # at most this long an exchange (None: until the coordinator's reduce deadline for it,
    # `roundwork.exchange_timeout_s`)
    reduce_timeout_s: float | None = None
    # a graceful leave waits at most this long for a running exchange: below the 30 s that
    # torchrun, systemd and Kubernetes give a SIGTERMed process before they SIGKILL it
    leave_grace_s: float = 15.0
    resolve_timeout_s: float = 120.0
    sync_timeout_s: float = 120.0
    keep_round_history: bool = False  # also keep a checkpoint per committed round (tests)
    join_token: bytes = b""  # a permissioned run's join token (`bagel-worker join --token`)
    metrics_listen: str = ""  # HOST:PORT of this worker's Prometheus endpoint ("" = none)
    fetch_data: str = "auto"  # datafetch.FETCH_MODES: fetch the cell's shards from the coordinator
    cpu_threads: int | None = None  # `--cpu-threads`: torch's intra- and inter-op threads
    max_upload_mbps: float | None = None  # `--max-upload-mbps`: the cap on everything this worker sends
    relay: bool = False  # serve as a libp2p circuit relay for volunteers behind NATs (`--relay`)


class Agent:
    """One worker process's lifecycle (rank 0). `await run()` returns the exit code."""

    def __init__(self, cfg: AgentConfig, display: Display | None = None, ctx: ddp.DistContext | None = None) -> None:
        self.cfg = cfg
        self.display = display or Display("quiet")
        self.ctx = ctx or ddp.DistContext()
        self.device = pick_device(self.ctx.device_for(cfg.device))
        self.join: JoinInfo = parse_join_string(cfg.join)
        self.identity = Identity.load_or_create(Path(cfg.data_dir) / "identity.key")
        self.worker_id = self.identity.worker_id
        self.name = cfg.name or f"{socket.gethostname()}-{os.getpid()}"
        self.spec: RunSpec | None = None
        self.instr: Instruction | None = None  # the current instruction (replaced by every answer)
        self.profile: MeasuredProfile | None = None
        self._uploads: set[tuple[str, int]] = set()  # (cell, committed round) uploaded or uploading
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.dht: Any = None
        self.reach: reachability.Reach | None = None  # how peers reach this worker (checked at start)
        self.p2p: Any = None
        self.dataplane: Any = None
        self.stateserver: Any = None
        self.link = CoordinatorLink(self, self.join, self.identity, self.display, self._stop)
        self.link.join_token = cfg.join_token
        self.orders = Orders(
            self, self.link, cfg, self.display, self.ctx, self.device, self.join.run_id, self.worker_id
        )
        self.exit_reason = ""
        self.metrics: WorkerMetrics | None = WorkerMetrics() if cfg.metrics_listen else None
        self.metrics_port: int | None = None
        self.orders.metrics = self.metrics
        self._signals: StopSignals | None = None
        # the graceful stop's one deadline: every step of it shares what is left
        self.stopping = StopBudget(stop_bound_s(cfg.leave_grace_s))
        self.datafetch: Any = None  # a datafetch.DataFetcher once the spec says this worker fetches
        self._local_data_checked = False
        # pause / resume (SIGUSR1 / SIGUSR2): what the volunteer asked for, and where we are
        self._want_paused = False
        self.paused = False
        if cfg.max_upload_mbps is not None:
            from bagel.worker import pacing

            pacing.install(pacing.UploadPacer.from_mbps(cfg.max_upload_mbps))

    # ================================================================== lifecycle

    def request_stop(self, reason: str = "signal") -> None:
        """Leave gracefully (SIGTERM / Ctrl-C / ORDER_LEAVE)."""
        if not self._stop.is_set():
            self.exit_reason = reason
            self.stopping.start()
            self.display.event("stopping", message=reason)
            self._stop.set()
            self._wake.set()

    async def run(self, handle_signals: bool = False) -> int:
        """The whole lifecycle; with handle_signals, SIGTERM/SIGINT leave gracefully (a second one aborts)."""

        from bagel.worker.averaging import DataPlane
        from bagel.worker.statesync import StateServer

        self.display.update(worker=self.worker_id, phase="starting")
        self.display.event("identity", worker_id=self.worker_id, device=str(self.device))
        if handle_signals:  # the DHT child resets what it inherits (`bagel.protocol.shutdown`)
            self._install_signal_handlers()
        try:
            if self.metrics is not None:
                host, _, port = self.cfg.metrics_listen.rpartition(":")
                self.metrics_port = self.metrics.serve(host or "127.0.0.1", int(port))
                self.display.event("metrics", url=f"http://{host or '127.0.0.1'}:{self.metrics_port}/metrics")
            install_p2pd_args()
            relay_plan, src = reachability.plan(self.cfg.relay, self.join.initial_peers)
            # a relay for others restarts its node until the relay serves with our limits
            starter = start_relay_dht if relay_plan.serve else start_dht
            self.dht = await waiting.retry(
                lambda: asyncio.to_thread(
                    starter,
                    initial_peers=list(self.join.initial_peers),
                    host_maddrs=list(self.cfg.dht_listen),
                    record_validators=[CoordinatorRecordValidator(self.join.run_id, self.join.coordinator_public_key)],
                    **relay_plan.dht_kwargs(),
                ),
                what=lambda e: "the DHT node is slow to start" if isinstance(e, DhtStartTimeout) else _UNREACHABLE,
                hint=lambda e: "is this machine overloaded?" if isinstance(e, DhtStartTimeout) else _UNREACHABLE_HINT,
                retryable=(BootstrapUnreachable, DhtStartTimeout),
                display=self.display,
                stop=self._stop,
            )
            if self.dht is None:
                return 0
            record = await self._until_stopped(
                waiting.retry(
                    lambda: resolve_coordinator(self.join, dht=self.dht, timeout_s=self.cfg.resolve_timeout_s),
                    what="no coordinator record in the DHT",
                    hint="is the coordinator of this join string running?",
                    retryable=(CoordinatorNotFound,),
                    display=self.display,
                    stop=self._stop,
                )
            )
            if record is None:
                return 0
            if self.metrics is not None:
                self.metrics.set_run(self.join.run_id, record.spec_hash)
            self.display.event(
                "coordinator",
                endpoint=record.endpoint,
                spec_hash=record.spec_hash[:12],
                tls=f"sha256 {record.tls_sha256[:16]}" if record.tls_sha256 else "off",
            )
            self.p2p = await self.dht.replicate_p2p()
            self.reach = await reachability.probe(self.p2p, relay_plan, src)
            self.display.event(
                "reachability",
                level="warning" if self.reach.kind == Reachability.UNREACHABLE else "info",
                reachability=self.reach.kind.name.lower(),
                message=self.reach.detail,
                maddrs=list(self.reach.maddrs),
            )
            self.dataplane = DataPlane(
                self.p2p,
                self.join.run_id,
                identity=self.identity,
                doctor=BAD_REDUCER_SCALE if self.cfg.byzantine == "bad-reducer" else 0.0,
            )
            self.dataplane.dial_circuits = self.reach.kind != Reachability.DIRECT
            await self.dataplane.start()
            self.stateserver = StateServer(self.p2p, self.join.run_id)
            await self.stateserver.start()
            if not await self.link.connect(self.dht, record):
                return 0
            store = LocalStore(self.cfg.data_dir, self.join.run_id, record.spec_hash)
            self.orders.attach(self.p2p, self.dataplane, self.stateserver, store)
            self.orders.load_local()
            self.spec = self._cached_spec(record.spec_hash)
            if self.spec is not None:
                self._prefetch_data(self.spec)
            if not await self.link.register():
                return 0
            self.link.start_heartbeats()
            await self._control_loop()
            if not self.paused:  # a paused worker has left already
                await self._leave()
            return 0
        except (SpecMismatch, TLSError, DiscoveryError) as e:  # another spec, not the pinned server, no record
            if isinstance(e, DiscoveryError) and await self._stop_follows(STOP_FOLLOWS_S):
                # a signal to the whole process group also ends our p2p daemon, and the DHT call
                # that fails with it can reach us before the signal's handler has run: a stop
                return 0
            self.display.event("fatal", level="error", message=str(e))
            return 3
        finally:
            self.stopping.start()  # a run that ends without a stop request (a fatal error) closes under the bound too
            await self._stop_step("stopping heartbeats", self.link.stop_heartbeats())
            await self._close()
            self.display.event("stop-steps", seconds=round(self.stopping.elapsed(), 3), steps=self.stopping.summary())
            # what the watchdog names if the rest overruns: asyncio.run joins the loop's
            # executor threads without a bound, then the children are ended
            self.stopping.enter("the event loop's teardown and the exit")
            if self._signals is not None:
                # the watchdog stays armed through the loop's teardown (`stop_finished`)
                self._signals.remove(disarm=False)

    def stop_finished(self) -> None:
        """The process is about to exit: the stop's watchdog is no longer needed. Called by
        the command once the event loop is closed and the children are ended, so that a
        teardown that blocks (a thread the loop joins) is still ended at the bound."""
        if self._signals is not None:
            self._signals.disarm()

    def _install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: leave gracefully within `stop_bound_s`; a second one exits at once.
        SIGUSR1 pauses, SIGUSR2 resumes."""
        self._signals = StopSignals(
            "bagel-worker", self.request_stop, stop_bound_s(self.cfg.leave_grace_s), progress=self.stopping.progress
        )
        self._signals.install()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGUSR1, self.request_pause, True)
        loop.add_signal_handler(signal.SIGUSR2, self.request_pause, False)

    def request_pause(self, paused: bool) -> None:
        """Pause (leave the run, keep the committed state, stay up) or resume (join again)."""
        if paused != self._want_paused:
            self._want_paused = paused
            self.display.event("pause-requested" if paused else "resume-requested")
        self._wake.set()

    async def _stop_follows(self, within_s: float) -> bool:
        """Whether a stop is requested now or within `within_s`."""
        try:
            await asyncio.wait_for(self._stop.wait(), within_s)
        except TimeoutError:
            return False
        return True

    async def _until_stopped(self, coro: Any, wait_cancelled: bool = True) -> Any:
        """Await `coro` unless a stop is requested first (then cancel it and return None;
        with `wait_cancelled`, once it has ended, else at once)."""
        task = asyncio.ensure_future(coro)
        stopper = asyncio.create_task(self._stop.wait())
        done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if task in done:
            return task.result()
        task.cancel()
        if wait_cancelled:
            await asyncio.gather(task, return_exceptions=True)
        return None

    async def _close(self) -> None:
        """Close everything, each step bounded by `CLOSE_STEP_S` and all of them by what is
        left of the stop's deadline; a step that overruns is logged and left behind."""
        if self.metrics is not None:
            self.metrics.stop()
        o = self.orders
        if o.work is not None:
            o.work.stop.set()
        # the training thread stops at its next inner step; it must be out of its
        # collectives before rank 0 tells the other ranks to exit
        if o.train_task is not None and not o.train_task.done():
            await self._stop_step("the training thread", asyncio.wait({o.train_task}), 120.0)
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await self._stop_step("the tasks", asyncio.wait(set(self._tasks)), CLOSE_STEP_S)
        if self.ctx.enabled:
            await self._stop_step(
                "the other ranks", in_daemon_thread(lambda: ddp.send_command(self.ctx, {"op": "exit"}), "ddp-exit")
            )
        for name, closing in (
            ("the state server", self.stateserver.close if self.stateserver is not None else None),
            ("the data plane", self.dataplane.close if self.dataplane is not None else None),
            ("the coordinator link", self.link.close if self.link is not None else None),
            ("the p2p replica", self.p2p.shutdown if self.p2p is not None else None),
            # a daemon thread: the loop's teardown would join an executor's thread without a bound
            ("the DHT", self._shutdown_dht if self.dht is not None else None),
        ):
            if closing is not None:
                await self._stop_step(name, closing())
        self.display.update(phase="stopped")

    def _shutdown_dht(self) -> asyncio.Future[Any]:
        return in_daemon_thread(self.dht.shutdown, "dht-shutdown")

    async def _stop_step(self, name: str, aw: Any, cap_s: float = CLOSE_STEP_S) -> bool:
        """One step of the stop under `self.stopping`; True if it finished in time."""
        ok, _ = await self.stopping.run(name, aw, cap_s)
        if not ok:
            log.warning("stopping: %s did not finish in time; going on", name)
            self.display.event("stop-step-overran", level="warning", step=name)
        return ok

    async def _pause(self) -> None:
        """Leave the run cleanly as for a stop (finish a running exchange, bounded; abandon
        training; Leave, uploading first if we are the last holder), but keep the process,
        its DHT node and the committed state: `_resume` registers again with it."""
        self.display.event("pausing", message="finishing the running exchange, then leaving the run")
        await self._leave("paused by the volunteer")
        self.instr = None
        self.paused = True
        self.display.update(phase="paused")
        self.display.event("paused", message="out of the run, committed state kept; SIGUSR2 resumes")

    async def _resume(self) -> None:
        self.display.event("resuming", message="joining the run again")
        self.paused = False
        if await self.link.register():
            self.link.start_heartbeats()
            self.display.event("resumed")

    async def _leave(self, reason: str = "") -> None:
        """Finish a running exchange (bounded) or abandon training, then Leave.

        Every wait here is bounded by the leave grace and, during a stop, by what is left of
        the stop's deadline (`self.stopping`), so the stop keeps its documented bound."""
        w = self.orders.work
        loop = asyncio.get_running_loop()
        # one grace for all of it (torchrun, systemd and Kubernetes SIGKILL after theirs)
        deadline = loop.time() + self.cfg.leave_grace_s
        if w is not None and w.reduce_task is not None and not w.reduce_task.done():
            self.display.event("leaving", message="finishing the running exchange first")
            grace = self.cfg.leave_grace_s
            if self.cfg.reduce_timeout_s is not None:
                grace = min(self.cfg.reduce_timeout_s, grace)
            # asyncio.wait: the exchange is not cancelled by the wait; drop_work cancels it below
            await self._stop_step("the running exchange", asyncio.wait({w.reduce_task}), grace)
        self.orders.drop_work("leaving")
        # else a heartbeat after Leave would re-register us
        await self._stop_step("stopping heartbeats", self.link.stop_heartbeats())
        client = self.link.client
        if client is not None:
            reason = reason or self.exit_reason or "leaving"
            try:
                ok, resp = await self._leave_call(client, reason, self.orders.held is not None)
                if ok and resp is not None and resp.upload_first:
                    # we are the last holder of a round with no checkpoint yet
                    budget = min(deadline - loop.time(), self.stopping.left() - LEAVE_RPC_S)
                    await self._upload_before_leaving(instruction_from_pb(resp.instruction), budget)
                    ok, resp = await self._leave_call(client, reason, False)
                if ok and resp is not None:
                    self.display.event("left", message=reason)
                else:
                    self.display.event("leave-failed", level="warning", message="the Leave call did not finish in time")
            except grpc.aio.AioRpcError as e:
                self.display.event("leave-failed", level="warning", message=e.details() or str(e.code()))
        await self._stop_step("saving the local state", self.orders.save_local())

    async def _leave_call(self, client: Any, reason: str, offer_checkpoint: bool) -> tuple[bool, Any]:
        """One Leave call, the wait for the RPC lock included, within `LEAVE_RPC_S` and the
        stop's deadline. An RPC error is raised; (False, None) if it did not finish in time."""

        async def call() -> Any:
            async with self.link.lock:
                return await client.leave(reason, offer_checkpoint=offer_checkpoint, timeout_s=LEAVE_RPC_S)

        task = asyncio.ensure_future(call())
        if not await self._stop_step("the Leave call", task, LEAVE_RPC_S + 0.5) or task.cancelled():
            return False, None
        error = task.exception()
        if error is not None:
            raise error
        return True, task.result()

    async def _upload_before_leaving(self, i: Instruction, budget_s: float) -> None:
        """Upload the committed state the coordinator has no checkpoint of, within what is
        left of the leave grace; on failure or timeout we leave anyway (the cell then falls
        back to its checkpoint when someone needs the state)."""
        held = self.orders.held
        if held is None or not reconciler.holds(
            self.orders.held_local(), i.cell_id, i.committed_round, i.committed_hash
        ):
            return
        if budget_s < 1.0:
            self.display.event("checkpoint-upload-failed", level="warning", message="no leave grace left to upload")
            return
        self.display.event(
            "leaving", message=f"uploading {i.cell_id} round {i.committed_round} first: no one else holds it"
        )
        up = reconciler.Upload(i.cell_id, i.committed_round, i.committed_hash)
        try:
            await asyncio.wait_for(self._upload(up, held.state), budget_s)
        except TimeoutError:
            self.display.event("checkpoint-upload-failed", level="warning", message="timed out")

    # ================================================================== control

    async def _control_loop(self) -> None:
        while not self._stop.is_set():
            await self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                if self._want_paused != self.paused:
                    await (self._pause() if self._want_paused else self._resume())
                    self._wake.set()  # a signal may have come meanwhile
                    continue
                if self.paused:
                    continue
                # a stop does not wait for what the instruction started (a model being built,
                # data being fetched): the stop's steps have their own bounds
                await self._until_stopped(self._reconcile(), wait_cancelled=False)
            except Exception:
                log.exception("reconciling the instruction failed")
                self.display.event(
                    "error", level="error", message="internal error while following an instruction; see log"
                )
                await self.sleep(1.0)
                self._wake.set()

    async def _reconcile(self) -> None:
        """Do what the current instruction says, as `reconciler.decide` decides: the actions
        in order, until one says the rest no longer applies."""
        i = self.instr
        if i is None:
            return
        for a in reconciler.decide(i, self.orders.view(frozenset(self._uploads))):
            if isinstance(a, reconciler.Leave):
                self.request_stop(f"ordered to leave: {a.reason}")
                return
            if isinstance(a, reconciler.Upload):
                self._maybe_upload(a)
            elif not await self.orders.perform(i, a):
                break
        self.display.update(phase=pb.Phase.Name(self.orders.phase()).removeprefix("PHASE_").lower())

    # ------------------------------------------------------------------ what Orders and the link ask of the agent

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("task %s failed", name, exc_info=t.exception())
                self.display.event(
                    "error", level="error", message=f"{name}: {type(t.exception()).__name__}: {t.exception()}"
                )
            self._wake.set()

        task.add_done_callback(done)
        return task

    def wake(self) -> None:
        self._wake.set()

    async def sleep(self, s: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), s)
        except TimeoutError:
            pass

    def still_current(self, i: Instruction) -> bool:
        return not self._stop.is_set() and self.instr is i

    def on_instruction(self, instr: pb.Instruction) -> None:
        self.instr = instruction_from_pb(instr)
        self._wake.set()

    def heartbeat_request(self) -> pb.HeartbeatRequest:
        return self.orders.heartbeat_request()

    async def hello(self) -> tuple[pb.WorkerProfile, pb.PeerAddress, pb.LocalState]:
        if self.spec is not None and self.profile is None:
            await self._measure_profile()
        return self._profile_pb(), self._peer_pb(), self.orders.local_pb()

    async def registered(self, resp: pb.RegisterResponse) -> bool:
        """The profile needs the run spec (samples/s of each cell's model), which the
        coordinator sends in its Register answer. The spec is cached per spec hash in the
        data dir, so only the first contact with a run registers twice (first without
        throughput)."""
        if self.spec is None:
            # the initial weights' digest comes beside the text (the spec hash covers both)
            self.spec = dataclasses.replace(parse_spec(resp.spec_toml), init_sha256=resp.init_sha256)
            self._cache_spec(resp.spec_toml, resp.spec_hash)
            self._prefetch_data(self.spec)
            await self._send_spec_to_ranks(resp.spec_toml, resp.init_sha256)
            return False  # registered without throughput: measure, then register again
        self.display.event("registered", worker_id=resp.worker_id, cell=resp.instruction.cell_id or "-")
        self.on_instruction(resp.instruction)
        return True

    # ------------------------------------------------------------------ checkpoint uploads

    def _maybe_upload(self, a: reconciler.Upload) -> None:
        held = self.orders.held
        assert held is not None  # decide uploads only what we hold
        key = (a.cell_id, a.committed_round)
        self._uploads.add(key)
        state = held.state  # now: held moves on with the next commit

        async def upload() -> None:
            if not await self._upload(a, state):
                self._uploads.discard(key)

        self.spawn(upload(), "upload")

    async def _upload(self, a: reconciler.Upload, state: Any) -> bool:
        """Stream `state` as the checkpoint of (cell, committed round) `a` names; True if
        the coordinator took it (or had it already), False after an RPC error."""
        client = self.link.client
        assert client is not None
        data = await asyncio.to_thread(state.to_safetensors)
        from bagel.worker import pacing

        pacer = pacing.current()
        try:
            resp = await client.upload_checkpoint(
                a.cell_id, a.committed_round, a.committed_hash, data, pace=pacer.take if pacer is not None else None
            )
        except grpc.aio.AioRpcError as e:
            self.display.event("checkpoint-upload-failed", level="warning", message=f"{e.code().name}: {e.details()}")
            return False
        self.orders.moved_checkpoint(len(data), 0)
        self.display.event(
            "checkpoint-uploaded", cell=a.cell_id, round=a.committed_round, stored=resp.stored, nbytes=len(data)
        )
        return True

    # ------------------------------------------------------------------ what a Register carries

    def _profile_pb(self) -> pb.WorkerProfile:
        p = self.profile
        if p is None:  # before the spec is known: everything but the per-cell throughput
            from bagel.worker.profile import device_name

            return pb.WorkerProfile(
                name=self.name,
                device_kind=self.device.type,
                device_name=device_name(self.device),
                vram_bytes=memory_bytes(self.device, self.cfg.max_vram_gb, self.cfg.max_ram_gb),
                host_memory_bytes=host_memory_bytes(self.cfg.max_ram_gb),
                num_devices=self.ctx.world_size,
                link_bandwidth_bytes_per_s=self.cfg.uplink_mbps * 1e6 / 8,
                software_version=SOFTWARE_VERSION,
            )
        return pb.WorkerProfile(
            name=p.name,
            device_kind=p.device_kind,
            device_name=p.device_name,
            vram_bytes=p.vram_bytes,
            num_devices=p.num_devices,
            link_bandwidth_bytes_per_s=p.link_bandwidth_bytes_per_s,
            samples_per_s=(
                {c: LIAR_SAMPLES_PER_S for c in p.samples_per_s}
                if self.cfg.byzantine == "budget-liar"
                else p.samples_per_s
            ),
            software_version=SOFTWARE_VERSION,
            host_memory_bytes=p.host_memory_bytes,
            reachability=f"PEER_REACHABILITY_{self.reach.kind.name}" if self.reach is not None else None,
            reachability_detail=self.reach.detail[:MAX_REACHABILITY_DETAIL_CHARS] if self.reach is not None else "",
        )

    def _peer_pb(self) -> pb.PeerAddress:
        maddrs = list(self.reach.maddrs) if self.reach is not None else []
        return pb.PeerAddress(
            peer_id=self.p2p.peer_id.to_base58(), maddrs=maddrs or [str(m) for m in self.dht.get_visible_maddrs()]
        )

    async def _measure_profile(self) -> None:
        """Benchmark every cell of the run, or reuse this worker's recent measurement (a
        restart after a crash should not spend its first seconds re-benchmarking)."""
        from bagel.models.experts import cell_config, cell_task

        spec = self.spec
        assert spec is not None
        cache = Path(self.cfg.data_dir) / "runs" / self.join.run_id / "profile.json"
        # one reading of the memory: the micro-batches are sized by it and the profile declares it
        memory = read_memory(self.device, self.cfg.max_vram_gb, self.cfg.max_ram_gb)
        budget = MemoryBudget.of(self.device.type, *memory)
        micro_batches = bench_micro_batches(spec, budget)
        if not any(micro_batches.values()):
            raise UsageError(self._holds_no_cell(spec, budget))
        key = profile_key(
            self.device,
            micro_batches,
            spec_hash=spec.spec_hash,
            software=SOFTWARE_VERSION,
            throttle=self.cfg.throttle,
            max_vram_gb=self.cfg.max_vram_gb,
            max_ram_gb=self.cfg.max_ram_gb,
            world=self.ctx.world_size,
            uplink_mbps=self.cfg.uplink_mbps,
        )
        self.profile = cached_profile(cache, key, self.name, self.device, memory)
        cached = self.profile is not None
        if self.profile is None:
            self.display.update(phase="profiling")
            tasks: list[tuple[str, Any]]
            if self.datafetch is not None:  # no data yet: time the step on zeros of the right shape
                from bagel.worker.datafetch import SyntheticDataTask

                tasks = [(c, (lambda c=c: SyntheticDataTask(cell_task(spec, c)))) for c in spec.cell_ids]
            else:
                tasks = [(c, (lambda c=c: cell_task(spec, c))) for c in spec.cell_ids]
            self.profile = await asyncio.to_thread(
                measure,
                self.name,
                self.device,
                tasks,
                max_vram_gb=self.cfg.max_vram_gb,
                max_ram_gb=self.cfg.max_ram_gb,
                throttle=self.cfg.throttle,
                num_devices=self.ctx.world_size,
                uplink_mbps=self.cfg.uplink_mbps,
                same_model={c: cell_config(spec, c) for c in spec.cell_ids},
                micro_batches=micro_batches,
                memory=memory,
            )
            body = {"key": key, "measured_unix_s": time.time(), "profile": dataclasses.asdict(self.profile)}
            await asyncio.to_thread(atomic_write, cache, json.dumps(body).encode())
        sps = ", ".join(f"{c} {v:.0f}" for c, v in self.profile.samples_per_s.items())
        self.display.event(
            "profile",
            device=self.profile.device_name,
            vram_gb=round(self.profile.vram_bytes / 2**30, 1),
            ram_gb=round(self.profile.host_memory_bytes / 2**30, 1),
            samples_per_s=sps,
            cached=cached,
        )

    def _holds_no_cell(self, spec: RunSpec, budget: MemoryBudget) -> str:
        """One line: which memory holds none of the run's cells, and what the smallest needs."""
        from bagel.models.experts import cell_memory_sizes

        sizes = [cell_memory_sizes(spec, c) for c in spec.cell_ids]
        h = spec.schedule.vram_headroom

        def size(n: int) -> str:
            return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

        keep = f"and the run keeps {h:.0%} of a worker's memory free (schedule.vram_headroom)"
        if budget.shared:  # a CPU worker: training and the host's copies share its RAM
            need = min(one + host for one, _, host in sizes)
            flags = (("--max-vram-gb", self.cfg.max_vram_gb), ("--max-ram-gb", self.cfg.max_ram_gb))
            caps = " and ".join(f for f, v in flags if v is not None)
            capped = f", capped by {caps}" if caps else ""
            return (
                f"this cpu worker's free RAM ({size(budget.device_bytes)}{capped}) holds none of the run's cells: "
                f"the smallest needs {size(need)} with a micro-batch of one (training, and the committed states and "
                f"the exchange beside it), {keep}; free some RAM or join with a machine that has more"
            )
        if not any(fits(MemoryBudget(budget.device_bytes), one, host, h) for one, _, host in sizes):
            need = min(one for one, _, _ in sizes)
            capped = ", capped by --max-vram-gb" if self.cfg.max_vram_gb is not None else ""
            return (
                f"this {self.device.type} worker's memory ({size(budget.device_bytes)}{capped}) holds none of the "
                f"run's cells: the smallest needs {size(need)} with a micro-batch of one, {keep}; join with a "
                "device that has more"
            )
        need = min(host for one, _, host in sizes if fits(MemoryBudget(budget.device_bytes), one, host, h))
        capped = ", capped by --max-ram-gb" if self.cfg.max_ram_gb is not None else ""
        return (
            f"this {self.device.type} worker's card holds a cell but its host's free RAM ({size(budget.host_bytes)}"
            f"{capped}) does not: the smallest such cell keeps {size(need)} on the host (committed states and the "
            f"exchange's working copies), {keep}; free some RAM or join with a machine that has more"
        )

    def _prefetch_data(self, spec: RunSpec) -> None:
        """Load (and cluster) the run's dataset in the background: the first round needs it.
        Without a local copy (`datafetch.needs_fetch`), the cell's shards are fetched from
        the coordinator when a cell is first trained or measured instead."""
        from bagel.worker.datafetch import DataFetcher, needs_fetch

        if needs_fetch(spec, self.cfg.fetch_data):
            # rank 0 fetches; the other ranks get each cell's data from it (`share_cell_data`)
            if self.datafetch is None:
                root = Path(self.cfg.data_dir) / "runs" / self.join.run_id / "datashards"
                self.datafetch = DataFetcher(root, lambda: self.link.client, self.display, on_bytes=self._data_bytes)
                self.display.event("data", message=f"no local copy of {spec.data.source} data: fetching shards")
            return
        from bagel.models.data import load_dataset

        self.spawn(asyncio.to_thread(load_dataset, spec), "prefetch-data")

    def _data_bytes(self, n: int) -> None:
        self.orders.counters.bytes_received += n

    async def ensure_data(self, cell_id: str) -> None:
        spec = self.spec
        if spec is None:
            return
        if self.datafetch is None and not self._local_data_checked:
            self._local_data_checked = True
            if spec.data.source != "digits" and self.cfg.fetch_data == "auto":
                await self._check_local_data(spec, cell_id)
        if self.datafetch is not None:
            await self.datafetch.ensure(spec, cell_id)

    async def _check_local_data(self, spec: RunSpec, cell_id: str) -> None:
        """A local folder / .npy copy must give the coordinator's partition; else fetch."""
        from bagel.models.data import DataError, cluster_manifest
        from bagel.worker.datafetch import DataFetcher

        root = Path(self.cfg.data_dir) / "runs" / self.join.run_id / "datashards"
        fetcher = DataFetcher(root, lambda: self.link.client, self.display, on_bytes=self._data_bytes)
        try:
            local = (await asyncio.to_thread(cluster_manifest, spec)).sha256
        except (DataError, OSError) as e:
            why = f"the local copy at {spec.data.path!r} does not load ({e})"
        else:
            same = await fetcher.same_partition(cell_id, local)
            if same is not False:
                return
            why = f"the local copy at {spec.data.path!r} is not the coordinator's data (another partition)"
        self.display.event("data", level="warning", message=f"{why}: fetching shards instead")
        self.datafetch = fetcher

    async def _send_spec_to_ranks(self, spec_toml: str, init_sha256: str = "") -> None:
        if self.ctx.enabled:
            cmd = {"op": "spec", "spec_toml": spec_toml, "init_sha256": init_sha256}
            await asyncio.to_thread(ddp.send_command, self.ctx, cmd)

    def _spec_cache_path(self, spec_hash: str) -> Path:
        return Path(self.cfg.data_dir) / "runs" / self.join.run_id / f"spec-{spec_hash[:16]}.toml"

    def _cached_spec(self, spec_hash: str) -> RunSpec | None:
        p = self._spec_cache_path(spec_hash)
        try:
            text = p.read_text()
        except OSError:
            return None
        if hashlib.sha256(text.encode()).hexdigest() != spec_hash:
            return None
        spec = parse_spec(text)
        # the initial weights' digest is not in the text: such a spec comes from Register only
        return None if spec.model.init_from else spec

    def _cache_spec(self, text: str, spec_hash: str) -> None:
        atomic_write(self._spec_cache_path(spec_hash), text.encode())


def ensure_dirs(data_dir: Path) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(data_dir, 0o700)


__all__ = ["Agent", "AgentConfig", "ddp_follower", "ensure_dirs"]
