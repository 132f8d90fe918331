"""The worker's lifecycle: join a run, then follow the coordinator's instructions, round after round.

`bagel-worker join` runs one `Agent` (rank 0 of a multi-GPU worker; the other ranks run
`ddp_follower`). In order (design sections 4 and 6, BRIEF "round protocol"):

1. identity (Ed25519, 0600 key file) -> own hivemind DHT node bootstrapped from the join
   string's peers -> the coordinator's signed DHT record -> a signed gRPC client;
2. the local checkpoint (if any) -> profile -> Register with that `LocalState`;
3. the control loop. The protocol is level-triggered: every Register/Heartbeat/ReportRound
   answer carries the worker's current `Instruction`, and `_reconcile` compares it with
   what the worker is doing and acts, so a lost message or a coordinator restart changes
   nothing:
   - SYNC: fetch (cell, committed round) from the named donor over P2P (`statesync`), or
     the coordinator's checkpoint, and verify the committed hash; round 0 is built locally;
   - TRAIN: H inner steps in a thread (`trainer`), so the event loop keeps heartbeating;
   - READY: heartbeat PHASE_READY with the samples (every ~250 ms while READY/REDUCING);
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

Layout: this file is the lifecycle, the control loop and the local checkpoints;
`session.py` talks to the coordinator (register, heartbeats, RPC ordering, caches);
`orders.py` carries out SYNC / TRAIN / REDUCE and the verdicts; `rounds.py` holds the round
work itself (train, exchange, outer step) and the other ranks of a DDP worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from bagel.protocol.runspec import RunSpec
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.client import CoordinatorClient, SpecMismatch
from bagel.protocol.discovery import CoordinatorRecordValidator, resolve_coordinator, start_dht
from bagel.protocol.identity import Identity
from bagel.protocol.joinstring import JoinInfo, parse_join_string
from bagel.worker import ddp
from bagel.worker.display import Display
from bagel.worker.localstate import LocalCheckpoint, LocalStateError, LocalStore, atomic_write
from bagel.worker.orders import OrderHandlers, _SyncJob
from bagel.worker.profile import DEFAULT_UPLINK_MBPS, MeasuredProfile
from bagel.worker.roundwork import RoundWork, ddp_follower
from bagel.worker.session import RPC_TIMEOUT_S, CoordinatorLink
from bagel.worker.trainer import CellRuntime, pick_device

log = logging.getLogger(__name__)



@dataclass
class AgentConfig:
    join: str
    data_dir: Path
    device: str = "auto"
    max_vram_gb: float | None = None
    name: str = ""
    throttle: float = 1.0
    uplink_mbps: float = DEFAULT_UPLINK_MBPS
    byzantine: str = ""  # "" | sign-flip | scale | nan | zero | stale (fault injection, issue 6)
    dht_listen: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    reduce_timeout_s: float = 60.0  # safety net; the coordinator re-freezes or aborts sooner
    # a graceful leave waits at most this long for a running exchange: below the 30 s that
    # torchrun, systemd and Kubernetes give a SIGTERMed process before they SIGKILL it
    leave_grace_s: float = 15.0
    resolve_timeout_s: float = 120.0
    sync_timeout_s: float = 120.0
    keep_round_history: bool = False  # also keep a checkpoint per committed round (tests)


@dataclass
class _Counters:
    bytes_sent: int = 0
    bytes_received: int = 0
    exchange_sent: int = 0  # pseudo-gradient exchange only (what DDP's all-reduce replaces)
    exchange_received: int = 0
    rounds_committed: int = 0
    samples: int = 0


class Agent(CoordinatorLink, OrderHandlers):
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
        self.held: LocalCheckpoint | None = None  # committed state we hold
        self.runtime: CellRuntime | None = None
        self.work: RoundWork | None = None
        self.sync: _SyncJob | None = None
        self.instr: pb.Instruction | None = None
        self.counters = _Counters()
        self.hb_interval_s = 2.0
        self.profile: MeasuredProfile | None = None
        self._reset_optimizer = True
        self._uploads: set[tuple[str, int]] = set()
        self._missing_reported: set[tuple[str, int, int, int]] = set()
        self._last_delta: dict[str, torch.Tensor] | None = None
        self._stop = asyncio.Event()
        self._wake = asyncio.Event()
        self._hb_wake = asyncio.Event()
        self._rpc_lock = asyncio.Lock()
        self._save_lock = asyncio.Lock()
        self._coord_epoch = 0  # bumps whenever the coordinator answers again after failing
        self._down_since: float | None = None
        self._tasks: set[asyncio.Task] = set()
        self._hb_task: asyncio.Task | None = None
        self._train_task: asyncio.Task | None = None
        self.dht: Any = None
        self.p2p: Any = None
        self.dataplane: Any = None
        self.stateserver: Any = None
        self.client: CoordinatorClient | None = None
        self.store: LocalStore | None = None
        self.exit_reason = ""

    # ================================================================== lifecycle

    def request_stop(self, reason: str = "signal") -> None:
        """Leave gracefully (SIGTERM / Ctrl-C / ORDER_LEAVE)."""
        if not self._stop.is_set():
            self.exit_reason = reason
            self.display.event("stopping", message=reason)
            self._stop.set()
            self._wake.set()

    async def run(self, handle_signals: bool = False) -> int:
        """The whole lifecycle; with handle_signals, SIGTERM/SIGINT leave gracefully (a second one aborts)."""

        from bagel.worker.averaging import DataPlane
        from bagel.worker.statesync import StateServer

        self.display.update(worker=self.worker_id, phase="starting")
        self.display.event("identity", worker_id=self.worker_id, device=str(self.device))
        try:
            self.dht = await asyncio.to_thread(
                start_dht,
                initial_peers=list(self.join.initial_peers),
                host_maddrs=list(self.cfg.dht_listen),
                record_validators=[CoordinatorRecordValidator(self.join.run_id, self.join.coordinator_public_key)],
            )
            if handle_signals:
                self._install_signal_handlers()
            record = await self._until_stopped(
                resolve_coordinator(self.join, dht=self.dht, timeout_s=self.cfg.resolve_timeout_s)
            )
            if record is None:
                return 0
            self.display.event("coordinator", endpoint=record.endpoint, spec_hash=record.spec_hash[:12])
            self.p2p = await self.dht.replicate_p2p()
            self.dataplane = DataPlane(self.p2p, self.join.run_id)
            await self.dataplane.start()
            self.stateserver = StateServer(self.p2p, self.join.run_id)
            await self.stateserver.start()
            self.client = CoordinatorClient(
                record.endpoint, self.identity, self.join.run_id, spec_hash=record.spec_hash, timeout_s=RPC_TIMEOUT_S
            )
            self.store = LocalStore(self.cfg.data_dir, self.join.run_id, record.spec_hash)
            self._load_local()
            self.spec = self._cached_spec(record.spec_hash)
            if self.spec is not None:
                self._prefetch_data()
            if not await self._register():
                return 0
            self._hb_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
            await self._control_loop()
            await self._leave()
            return 0
        except SpecMismatch as e:
            self.display.event("fatal", level="error", message=str(e))
            return 3
        finally:
            await self._stop_heartbeats()
            await self._close()

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        seen = {"n": 0}

        def on_signal(sig: signal.Signals) -> None:
            seen["n"] += 1
            if seen["n"] == 1:
                self.request_stop(sig.name)
            elif main is not None:
                main.cancel()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)

    async def _until_stopped(self, coro: Any) -> Any:
        """Await `coro` unless a stop is requested first (then cancel it and return None)."""
        task = asyncio.ensure_future(coro)
        stopper = asyncio.create_task(self._stop.wait())
        done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None

    async def _close(self) -> None:
        if self.work is not None:
            self.work.stop.set()
        # the training thread stops at its next inner step; it must be out of its
        # collectives before rank 0 tells the other ranks to exit
        if self._train_task is not None and not self._train_task.done():
            await asyncio.wait({self._train_task}, timeout=120)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.ctx.enabled:
            await asyncio.to_thread(ddp.send_command, self.ctx, {"op": "exit"})
        for closer in (self.stateserver, self.dataplane, self.client):
            if closer is not None:
                try:
                    await closer.close()
                except Exception as e:  # shutting down: report, keep closing the rest
                    log.debug("close failed: %s", e)
        if self.p2p is not None:
            try:
                await self.p2p.shutdown()
            except Exception as e:
                log.debug("p2p replica shutdown: %s", e)
        if self.dht is not None:
            await asyncio.to_thread(self.dht.shutdown)
        self.display.update(phase="stopped")

    async def _leave(self) -> None:
        """Finish a running exchange (bounded) or abandon training, then Leave."""
        w = self.work
        loop = asyncio.get_running_loop()
        # one grace for all of it (torchrun, systemd and Kubernetes SIGKILL after theirs)
        deadline = loop.time() + self.cfg.leave_grace_s
        if w is not None and w.reduce_task is not None and not w.reduce_task.done():
            self.display.event("leaving", message="finishing the running exchange first")
            try:
                grace = min(self.cfg.reduce_timeout_s, self.cfg.leave_grace_s)
                await asyncio.wait_for(asyncio.shield(w.reduce_task), grace)
            except (TimeoutError, asyncio.CancelledError, Exception):
                pass
        self._drop_work("leaving")
        await self._stop_heartbeats()  # else a heartbeat after Leave would re-register us
        if self.client is not None:
            reason = self.exit_reason or "leaving"
            try:
                async with self._rpc_lock:
                    resp = await self.client.leave(reason, offer_checkpoint=self.held is not None, timeout_s=5.0)
                if resp.upload_first:  # we are the last holder of a round with no checkpoint yet
                    await self._upload_before_leaving(resp.instruction, deadline - loop.time())
                    async with self._rpc_lock:
                        await self.client.leave(reason, timeout_s=5.0)
                self.display.event("left", message=self.exit_reason)
            except grpc.aio.AioRpcError as e:
                self.display.event("leave-failed", level="warning", message=e.details() or str(e.code()))
        await self._save_local()

    async def _upload_before_leaving(self, i: pb.Instruction, budget_s: float) -> None:
        """Upload the committed state the coordinator has no checkpoint of, within what is
        left of the leave grace; on failure or timeout we leave anyway (the cell then falls
        back to its checkpoint when someone needs the state)."""
        if not self._holds(i.cell_id, i.committed_round, i.committed_hash):
            return
        if budget_s < 1.0:
            self.display.event("checkpoint-upload-failed", level="warning", message="no leave grace left to upload")
            return
        self.display.event("leaving", message=f"uploading {i.cell_id} round {i.committed_round} first: no one else holds it")
        try:
            await asyncio.wait_for(self._upload(i, self.held.state), budget_s)  # type: ignore[union-attr]
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
                await self._reconcile()
            except Exception:
                log.exception("reconciling the instruction failed")
                self.display.event("error", level="error", message="internal error while following an instruction; see log")
                await self._sleep(1.0)
                self._wake.set()

    async def _sleep(self, s: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), s)
        except TimeoutError:
            pass

    def _holds(self, cell: str, committed_round: int, committed_hash: str) -> bool:
        h = self.held
        if h is None or h.cell_id != cell or h.committed_round != committed_round:
            return False
        return committed_hash == h.state_hash or (committed_round == 0 and committed_hash == "")

    async def _reconcile(self) -> None:
        i = self.instr
        if i is None:
            return
        self._check_pending(i)
        o = i.order
        if o == pb.ORDER_LEAVE:
            self.request_stop(f"ordered to leave: {i.reason}")
            return
        if i.upload_checkpoint:
            self._maybe_upload(i)
        if o == pb.ORDER_WAIT:
            self._cancel_sync()
            self._drop_work("ordered to wait")
        elif o == pb.ORDER_SYNC:
            await self._on_sync(i)
        elif o == pb.ORDER_TRAIN:
            await self._on_train(i)
        elif o == pb.ORDER_REDUCE:
            await self._on_reduce(i)
        self.display.update(phase=pb.Phase.Name(self._phase()).removeprefix("PHASE_").lower())

    def _check_pending(self, i: pb.Instruction) -> None:
        """A reported round commits when the instructions show it as the committed one."""
        w = self.work
        if w is None or w.pending is None or i.cell_id != w.cell_id:
            return
        if i.committed_round == w.round and i.committed_hash == w.pending.state_hash:
            self._commit(w)
        elif i.committed_round >= w.round:
            self._drop_work(f"round {w.round} committed with another hash")

    # ------------------------------------------------------------------ checkpoints

    def _maybe_upload(self, i: pb.Instruction) -> None:
        key = (i.cell_id, i.committed_round)
        if key in self._uploads or not i.committed_hash or not self._holds(i.cell_id, i.committed_round, i.committed_hash):
            return
        self._uploads.add(key)
        state = self.held.state  # type: ignore[union-attr]  # now: held moves on with the next commit

        async def upload() -> None:
            if not await self._upload(i, state):
                self._uploads.discard(key)

        self._spawn(upload(), "upload")

    async def _upload(self, i: pb.Instruction, state: Any) -> bool:
        """Stream `state` as the checkpoint of (cell, committed round) `i` names; True if
        the coordinator took it (or had it already), False after an RPC error."""
        data = await asyncio.to_thread(state.to_safetensors)
        try:
            resp = await self.client.upload_checkpoint(i.cell_id, i.committed_round, i.committed_hash, data)  # type: ignore[union-attr]
        except grpc.aio.AioRpcError as e:
            self.display.event("checkpoint-upload-failed", level="warning", message=f"{e.code().name}: {e.details()}")
            return False
        self.counters.bytes_sent += len(data)
        self.display.event("checkpoint-uploaded", cell=i.cell_id, round=i.committed_round, stored=resp.stored, nbytes=len(data))
        return True

    def _load_local(self) -> None:
        assert self.store is not None
        try:
            cp = self.store.load()
        except LocalStateError as e:
            self.display.event("local-checkpoint-ignored", level="warning", message=str(e))
            return
        if cp is not None:
            self.held = cp
            self._reset_optimizer = True
            self.display.event("resumed", cell=cp.cell_id, round=cp.committed_round, hash=cp.state_hash[:12])
            self.display.update(committed=cp.committed_round, cell=cp.cell_id)

    async def _save_local(self, cp: LocalCheckpoint | None = None, event: str = "", fields: dict[str, Any] | None = None) -> None:
        """Write `cp` (default: the held state) atomically, then announce `event`: a
        "committed" event is only emitted once the state it names is on disk."""
        cp = cp or self.held
        if cp is None or self.store is None:
            return
        async with self._save_lock:
            await asyncio.to_thread(self.store.save, cp)
            if self.cfg.keep_round_history:
                hist = self.store.path.parent / "history" / f"{cp.cell_id}.r{cp.committed_round}.safetensors"
                await asyncio.to_thread(atomic_write, hist, self.store.path.read_bytes())
        if event:
            self.display.event(event, **(fields or {}))

    # ------------------------------------------------------------------ tasks

    def _spawn(self, coro: Any, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)

        def done(t: asyncio.Task) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("task %s failed", name, exc_info=t.exception())
                self.display.event("error", level="error", message=f"{name}: {type(t.exception()).__name__}: {t.exception()}")
            self._wake.set()

        task.add_done_callback(done)
        return task


def ensure_dirs(data_dir: Path) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(data_dir, 0o700)




__all__ = ["Agent", "AgentConfig", "ddp_follower", "ensure_dirs"]
