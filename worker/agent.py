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

RPCs are serialized by one lock and their answers processed in order, so an old
heartbeat answer can never overtake a newer ReportRound answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch

from bagel.coordinator.spec import RunSpec, parse_spec
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.client import CoordinatorClient, SpecMismatch, backoff_delay_s, is_retryable
from bagel.protocol.discovery import CoordinatorRecordValidator, lookup_coordinator, resolve_coordinator
from bagel.protocol.identity import Identity
from bagel.protocol.joinstring import JoinInfo, parse_join_string
from bagel.worker import ddp
from bagel.worker.display import Display
from bagel.worker.localstate import LocalCheckpoint, LocalStateError, LocalStore, atomic_write
from bagel.worker.profile import DEFAULT_UPLINK_MBPS, Profile, measure
from bagel.worker.rounds import RoundWork, corrupt, fresh_feedback, reduce_round, train_round
from bagel.worker.trainer import CellRuntime, build_runtime, pick_device

log = logging.getLogger(__name__)

FAST_HEARTBEAT_S = 0.25  # while READY/REDUCING: the freeze and the verdict come sooner
RPC_TIMEOUT_S = 10.0
SOFTWARE_VERSION = "bagel-worker/0.1"


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
    resolve_timeout_s: float = 120.0
    sync_timeout_s: float = 120.0
    keep_round_history: bool = False  # also keep a checkpoint per committed round (tests)


@dataclass
class _SyncJob:
    target: tuple[str, int, str]  # (cell, committed_round, committed_hash)
    task: asyncio.Task


@dataclass
class _Counters:
    bytes_sent: int = 0
    bytes_received: int = 0
    exchange_sent: int = 0  # pseudo-gradient exchange only (what DDP's all-reduce replaces)
    exchange_received: int = 0
    rounds_committed: int = 0
    samples: int = 0


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
        self.held: LocalCheckpoint | None = None  # committed state we hold
        self.runtime: CellRuntime | None = None
        self.work: RoundWork | None = None
        self.sync: _SyncJob | None = None
        self.instr: pb.Instruction | None = None
        self.counters = _Counters()
        self.hb_interval_s = 2.0
        self.profile: Profile | None = None
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

    async def run(self) -> int:
        import hivemind

        from bagel.worker.averaging import DataPlane
        from bagel.worker.statesync import StateServer

        self.display.update(worker=self.worker_id, phase="starting")
        self.display.event("identity", worker_id=self.worker_id, device=str(self.device))
        try:
            self.dht = await asyncio.to_thread(
                hivemind.DHT,
                initial_peers=list(self.join.initial_peers),
                host_maddrs=list(self.cfg.dht_listen),
                record_validators=[CoordinatorRecordValidator(self.join.run_id, self.join.coordinator_public_key)],
                start=True,
            )
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
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.work is not None:
            self.work.stop.set()
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

    async def _stop_heartbeats(self) -> None:
        if self._hb_task is not None:
            self._hb_task.cancel()
            await asyncio.gather(self._hb_task, return_exceptions=True)
            self._hb_task = None

    async def _leave(self) -> None:
        """Finish a running exchange (bounded) or abandon training, then Leave."""
        w = self.work
        if w is not None and w.reduce_task is not None and not w.reduce_task.done():
            self.display.event("leaving", message="finishing the running exchange first")
            try:
                await asyncio.wait_for(asyncio.shield(w.reduce_task), self.cfg.reduce_timeout_s)
            except (TimeoutError, asyncio.CancelledError, Exception):
                pass
        self._drop_work("leaving")
        await self._stop_heartbeats()  # else a heartbeat after Leave would re-register us
        if self.client is not None:
            try:
                async with self._rpc_lock:
                    await self.client.leave(self.exit_reason or "leaving", timeout_s=5.0)
                self.display.event("left", message=self.exit_reason)
            except grpc.aio.AioRpcError as e:
                self.display.event("leave-failed", level="warning", message=e.details() or str(e.code()))
        await self._save_local()

    # ================================================================== coordinator calls

    async def _rpc(self, fn: Any) -> Any:
        """One coordinator call under the RPC lock. Returns None (after noting the outage)
        if it is unavailable; re-registers on NOT_FOUND; raises other errors."""
        assert self.client is not None
        async with self._rpc_lock:
            try:
                resp = await fn()
            except grpc.aio.AioRpcError as e:
                if is_retryable(e):
                    if self._down_since is None:
                        self._down_since = time.monotonic()
                        self.display.event("coordinator-unreachable", level="warning", message=str(e.code().name))
                    return None
                raise
        if self._down_since is not None:
            self._down_since = None
            self._coord_epoch += 1
            self.display.event("coordinator-back")
        return resp

    def _profile_pb(self) -> pb.WorkerProfile:
        p = self.profile
        if p is None:  # before the spec is known: everything but the per-cell throughput
            from bagel.worker.profile import device_name, memory_bytes

            return pb.WorkerProfile(
                name=self.name, device_kind=self.device.type, device_name=device_name(self.device),
                vram_bytes=memory_bytes(self.device, self.cfg.max_vram_gb), num_devices=self.ctx.world_size,
                link_bandwidth_bytes_per_s=self.cfg.uplink_mbps * 1e6 / 8, software_version=SOFTWARE_VERSION,
            )
        return pb.WorkerProfile(
            name=p.name, device_kind=p.device_kind, device_name=p.device_name, vram_bytes=p.vram_bytes,
            num_devices=p.num_devices, link_bandwidth_bytes_per_s=p.link_bandwidth_bytes_per_s,
            samples_per_s=p.samples_per_s, software_version=SOFTWARE_VERSION,
        )

    def _peer_pb(self) -> pb.PeerAddress:
        return pb.PeerAddress(
            peer_id=self.p2p.peer_id.to_base58(), maddrs=[str(m) for m in self.dht.get_visible_maddrs()]
        )

    def _local_pb(self) -> pb.LocalState:
        h = self.held
        if h is None:
            return pb.LocalState()
        # round 0 is the deterministic initial state, whose committed hash is "" on the wire
        return pb.LocalState(cell_id=h.cell_id, committed_round=h.committed_round, state_hash=h.state_hash if h.committed_round else "")

    async def _register(self) -> bool:
        """Register (retrying while the coordinator is down); False if stopped meanwhile."""
        assert self.client is not None
        attempt = 0
        while not self._stop.is_set():
            if self.spec is not None and self.profile is None:
                await self._measure_profile()
            profile, peer, local = self._profile_pb(), self._peer_pb(), self._local_pb()
            try:
                resp = await self._rpc(lambda: self.client.register(profile, peer, local))
            except grpc.aio.AioRpcError as e:
                self.display.event("register-refused", level="error", message=f"{e.code().name}: {e.details()}")
                resp = None
            if resp is None:
                attempt += 1
                await self._sleep(backoff_delay_s(attempt, max_s=self.hb_interval_s * 2))
                await self._maybe_reresolve()
                continue
            first_contact = self.spec is None
            if first_contact:
                self.spec = parse_spec(resp.spec_toml)
                self._cache_spec(resp.spec_toml, resp.spec_hash)
                self._prefetch_data()
                await self._send_spec_to_ranks(resp.spec_toml)
            self.hb_interval_s = max(0.05, resp.heartbeat_interval_ms / 1000.0) if resp.heartbeat_interval_ms else 2.0
            if first_contact:  # registered without throughput: measure, then register again
                continue
            self.display.event("registered", worker_id=resp.worker_id, cell=resp.instruction.cell_id or "-")
            self._on_instruction(resp.instruction)
            return True
        return False

    def _prefetch_data(self) -> None:
        """Load (and cluster) the run's dataset in the background: the first round needs it."""
        from bagel.models.data import load_dataset

        spec = self.spec
        self._spawn(asyncio.to_thread(load_dataset, spec), "prefetch-data")

    async def _send_spec_to_ranks(self, spec_toml: str) -> None:
        if self.ctx.enabled:
            await asyncio.to_thread(ddp.send_command, self.ctx, {"op": "spec", "spec_toml": spec_toml})

    async def _measure_profile(self) -> None:
        """Benchmark every cell of the run, or reuse this worker's recent measurement (a
        restart after a crash should not spend its first seconds re-benchmarking)."""
        from bagel.models.experts import cell_task

        spec = self.spec
        assert spec is not None
        cache = Path(self.cfg.data_dir) / "runs" / self.join.run_id / "profile.json"
        key = {
            "spec_hash": spec.spec_hash, "device": str(self.device), "throttle": self.cfg.throttle,
            "world": self.ctx.world_size, "max_vram_gb": self.cfg.max_vram_gb, "uplink_mbps": self.cfg.uplink_mbps,
        }
        self.profile = _cached_profile(cache, key, self.name)
        if self.profile is None:
            self.display.update(phase="profiling")
            tasks = [(c, (lambda c=c: cell_task(spec, c))) for c in spec.cell_ids]
            self.profile = await asyncio.to_thread(
                measure, self.name, self.device, tasks, max_vram_gb=self.cfg.max_vram_gb, throttle=self.cfg.throttle,
                num_devices=self.ctx.world_size, uplink_mbps=self.cfg.uplink_mbps,
            )
            body = {"key": key, "measured_unix_s": time.time(), "profile": dataclasses.asdict(self.profile)}
            await asyncio.to_thread(atomic_write, cache, json.dumps(body).encode())
        sps = ", ".join(f"{c} {v:.0f}" for c, v in self.profile.samples_per_s.items())
        self.display.event("profile", device=self.profile.device_name, vram_gb=round(self.profile.vram_bytes / 2**30, 1), samples_per_s=sps)

    async def _maybe_reresolve(self) -> None:
        """After a few seconds without the coordinator, look its record up again (new endpoint?)."""
        if self._down_since is None or time.monotonic() - self._down_since < 3.0 or self.client is None:
            return
        try:
            record, _ = await lookup_coordinator(self.dht, self.join)
        except Exception as e:  # the DHT may be unreachable too; try later
            log.debug("re-resolving the coordinator failed: %s", e)
            return
        if record is not None and record.endpoint != self.client.target:
            self.display.event("coordinator-moved", endpoint=record.endpoint)
            old = self.client
            self.client = CoordinatorClient(
                record.endpoint, self.identity, self.join.run_id, spec_hash=record.spec_hash, timeout_s=RPC_TIMEOUT_S
            )
            await old.close()

    # ================================================================== heartbeats

    def _phase(self) -> int:
        if self.sync is not None:
            return pb.PHASE_SYNCING
        w = self.work
        if w is None:
            return pb.PHASE_IDLE
        if w.reduce_attempt or w.pending is not None:
            return pb.PHASE_REDUCING
        return pb.PHASE_READY if w.result is not None else pb.PHASE_TRAINING

    def _heartbeat_pb(self) -> pb.HeartbeatRequest:
        phase = self._phase()
        req = pb.HeartbeatRequest(phase=phase, local=self._local_pb())  # type: ignore[arg-type]
        w = self.work
        if self.sync is not None:
            req.cell_id = self.sync.target[0]
        elif w is not None:
            req.cell_id, req.round, req.round_attempt = w.cell_id, w.round, w.round_attempt
            req.inner_step, req.loss = w.inner_step, w.last_loss if w.last_loss == w.last_loss else 0.0
            if w.result is not None:
                req.samples = w.result.samples
            req.reduce_attempt = w.reduce_attempt
        elif self.held is not None:
            req.cell_id = self.held.cell_id
        return req

    async def _heartbeat_loop(self) -> None:
        failures = 0
        while True:
            req = self._heartbeat_pb()
            try:
                resp = await self._rpc(lambda: self.client.call("Heartbeat", req))  # type: ignore[union-attr]
            except grpc.aio.AioRpcError as e:
                resp = None
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    self.display.event("re-register", level="warning", message=e.details() or "unknown worker")
                    await self._register()
                else:
                    self.display.event("heartbeat-refused", level="warning", message=f"{e.code().name}: {e.details()}")
            if resp is not None:
                failures = 0
                self._on_instruction(resp.instruction)
                delay = FAST_HEARTBEAT_S if req.phase in (pb.PHASE_READY, pb.PHASE_REDUCING) else self.hb_interval_s
            else:
                failures += 1
                await self._maybe_reresolve()
                delay = min(self.hb_interval_s, backoff_delay_s(failures, base_s=0.2, max_s=self.hb_interval_s) + 0.1)
            self._hb_wake.clear()
            try:
                await asyncio.wait_for(self._hb_wake.wait(), delay)
            except TimeoutError:
                pass

    def _on_instruction(self, instr: pb.Instruction) -> None:
        self.instr = instr
        self._wake.set()

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

    # ------------------------------------------------------------------ SYNC

    async def _on_sync(self, i: pb.Instruction) -> None:
        target = (i.cell_id, i.committed_round, i.committed_hash)
        if self._holds(*target):
            self._cancel_sync()
            self._drop_work("synced")
            return
        if self.sync is not None and self.sync.target == target and not self.sync.task.done():
            return
        self._cancel_sync()
        self._drop_work("resync")
        self.sync = _SyncJob(target, self._spawn(self._sync(i), "sync"))
        self._hb_wake.set()

    def _cancel_sync(self) -> None:
        if self.sync is not None:
            self.sync.task.cancel()
            self.sync = None

    async def _sync(self, i: pb.Instruction) -> None:
        from bagel.worker.statesync import StateSyncError, fetch_state, verify_state_bytes

        cell, rnd, want = i.cell_id, i.committed_round, i.committed_hash
        assert self.spec is not None and self.client is not None
        self.display.update(phase="syncing", cell=cell, round=rnd)
        try:
            if rnd == 0 and not want:
                from bagel.worker.diloco import CellState

                rt = await self._runtime_for(cell)
                state = CellState.from_model(rt.task.build_model())
                source = "initial state (built locally)"
            else:
                state, source = None, ""
                donor = i.donor
                if donor.worker_id and donor.peer.peer_id:
                    try:
                        synced = await fetch_state(
                            self.p2p, donor.peer.peer_id, run_id=self.join.run_id, cell_id=cell, committed_round=rnd,
                            state_hash=want, max_nbytes=self.spec.checkpoint.max_bytes,
                            donor_maddrs=list(donor.peer.maddrs), timeout_s=self.cfg.sync_timeout_s,
                        )
                        state, source = synced.state, f"donor {donor.worker_id} ({synced.nbytes} bytes)"
                        self.counters.bytes_received += synced.nbytes
                    except StateSyncError as e:
                        self.display.event("sync-donor-failed", level="warning", donor=donor.worker_id, message=str(e))
                if state is None:
                    resp = await self._rpc(lambda: self.client.download_checkpoint(cell, rnd))  # type: ignore[union-attr]
                    if resp is None:
                        raise StateSyncError("coordinator unreachable for the checkpoint fallback")
                    info, data = resp
                    state = await asyncio.to_thread(verify_state_bytes, data, want)
                    source = f"coordinator checkpoint ({len(data)} bytes)"
                    self.counters.bytes_received += len(data)
            h = state.state_hash()
            self.held = LocalCheckpoint(cell, rnd, state, h, {})
            self._reset_optimizer = True
            self.stateserver.withdraw()
            if rnd:
                self.stateserver.publish(cell, rnd, state)
            self.display.event("synced", cell=cell, round=rnd, hash=h[:12], source=source)
            self.display.update(committed=rnd)
            await self._save_local()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # grpc errors, integrity errors: retry on the next instruction
            self.display.event("sync-failed", level="warning", cell=cell, round=rnd, message=f"{type(e).__name__}: {e}")
            await self._sleep(1.0)
        finally:
            if self.sync is not None and self.sync.task is asyncio.current_task():
                self.sync = None
            self._wake.set()
            self._hb_wake.set()

    async def _runtime_for(self, cell: str) -> CellRuntime:
        if self.runtime is None or self.runtime.cell_id != cell:
            assert self.spec is not None
            collective = self.ctx if self.ctx.enabled else None
            self.runtime = await asyncio.to_thread(
                build_runtime, self.spec, cell, self.device, throttle=self.cfg.throttle, collective=collective
            )
            self._reset_optimizer = False  # a fresh trainer has a fresh optimizer
        return self.runtime

    # ------------------------------------------------------------------ TRAIN

    async def _on_train(self, i: pb.Instruction) -> None:
        if self.sync is not None:
            return  # finishing a sync; the coordinator will see our new LocalState
        if not self._holds(i.cell_id, i.committed_round, i.committed_hash):
            if i.committed_round == 0 and not i.committed_hash:
                await self._sync(i)  # round 0: build the initial state locally (instant)
                if not self._holds(i.cell_id, 0, ""):
                    return
            else:
                self._drop_work("told to train from a state we do not hold")
                return
        w = self.work
        if w is not None and w.matches(i.cell_id, i.round, i.round_attempt):
            return
        ids = [m.worker_id for m in i.plan.members]
        if self.worker_id not in ids:
            self.display.event("not-a-member", level="warning", cell=i.cell_id, round=i.round)
            return
        self._drop_work("a new round")
        rt = await self._runtime_for(i.cell_id)
        if self._stop.is_set() or self.instr is not i:
            self._wake.set()  # things changed while the model was built: look again
            return
        reset = self._reset_optimizer
        self._reset_optimizer = False
        w = RoundWork.from_instruction(i, ids.index(self.worker_id))
        self.work = w
        self.display.update(cell=i.cell_id, round=i.round, step=0, steps=i.plan.inner_steps, deadline_unix_ms=i.plan.deadline_unix_ms)
        self.display.event("train", cell=i.cell_id, round=i.round, attempt=i.round_attempt, micro_batch=i.plan.micro_batch, grad_accum=i.plan.grad_accum, members=len(ids))
        w.task = self._spawn(self._train(w, rt, reset), "train")
        self._hb_wake.set()

    async def _train(self, w: RoundWork, rt: CellRuntime, reset_optimizer: bool) -> None:
        assert self.held is not None and self.spec is not None
        held = self.held

        def on_step(p: Any) -> None:
            w.inner_step, w.last_loss = p.step, p.loss
            self.display.update(step=p.step, loss=p.loss, samples_per_s=p.samples_per_s)

        try:
            res, delta = await asyncio.to_thread(
                train_round, self.join.run_id, rt, held.state, w, self.ctx, reset_optimizer, on_step
            )
        except Exception as e:
            log.exception("training failed")
            self.display.event("train-failed", level="error", message=f"{type(e).__name__}: {e}")
            if self.work is w:
                self.work = None
            self._wake.set()
            return
        if self.work is not w or not res.completed:
            return
        if self.cfg.byzantine:
            honest = delta
            delta = corrupt(honest, self.cfg.byzantine, self._last_delta)
            self._last_delta = honest
        w.result, w.delta = res, delta
        self.counters.samples += res.samples
        self.display.event("ready", cell=w.cell_id, round=w.round, samples=res.samples, loss=round(res.mean_loss, 5), compute_s=round(res.compute_s, 2))
        self._hb_wake.set()
        self._wake.set()

    def _drop_work(self, why: str) -> None:
        """Abandon the current round (training, ready or reducing); the committed state is intact."""
        w = self.work
        if w is None:
            return
        w.stop.set()
        if w.reduce_task is not None and not w.reduce_task.done():
            w.reduce_task.cancel()
        self.work = None
        log.info("dropped round %s/%d: %s", w.cell_id, w.round, why)
        self.display.update(step=0)

    # ------------------------------------------------------------------ REDUCE

    async def _on_reduce(self, i: pb.Instruction) -> None:
        me = next((m for m in i.contributors if m.worker_id == self.worker_id), None)
        if me is None:
            return  # not ours (a stale answer): the next heartbeat corrects it
        w = self.work
        ours = w is not None and w.matches(i.cell_id, i.round, i.round_attempt)
        if me.max_samples == 0 and not (ours and w is not None and w.catch_up):
            # catch-up contributor: we hold the round's base state but trained nothing (we
            # synced during the round, or missed the freeze): exchange a zero pseudo-gradient
            # (weight 0) and apply the same outer step, so we hold the new state without a sync
            if self.sync is not None or not self._holds(i.cell_id, i.committed_round, i.committed_hash):
                return
            self._drop_work("catching up through the exchange")
            w = RoundWork.catch_up(i, self.held.state)  # type: ignore[union-attr]
            self.work = w
            self.display.event("catch-up", cell=i.cell_id, round=i.round, reduce_attempt=i.reduce_attempt)
        elif not ours:
            key = (i.cell_id, i.round, i.round_attempt, i.reduce_attempt)
            already = self.held is not None and self.held.cell_id == i.cell_id and self.held.committed_round >= i.round
            if not already and key not in self._missing_reported and self.sync is None:
                # we are a weighted contributor but lost our contribution (restart): say so,
                # so the coordinator re-freezes without us instead of waiting for its deadline
                self._missing_reported.add(key)
                self._spawn(self._report_missing(i), "report-missing")
            return
        assert w is not None
        if w.result is None or w.delta is None:
            return  # still training: a freeze names us only once we are ready
        if w.pending is not None and w.pending_attempt == i.reduce_attempt:
            if w.report_epoch != self._coord_epoch and (w.reduce_task is None or w.reduce_task.done()):
                w.report_epoch = self._coord_epoch  # the coordinator restarted: our report may be lost
                w.reduce_task = self._spawn(self._report(w), "re-report")
            return
        if i.reduce_attempt <= w.reduce_attempt:
            return  # this attempt is running, done, or failed (wait for a re-freeze or abort)
        if w.reduce_task is not None and not w.reduce_task.done():
            w.reduce_task.cancel()
        w.reduce_attempt = i.reduce_attempt
        w.contributors = sum(1 for m in i.contributors if m.max_samples > 0)
        w.pending = None
        w.reduce_task = self._spawn(self._reduce(w, i), "reduce")
        self._hb_wake.set()

    async def _reduce(self, w: RoundWork, i: pb.Instruction) -> None:
        from bagel.worker.averaging import ExchangeError

        assert self.spec is not None and self.held is not None and w.result is not None
        held = self.held
        self.display.update(phase="reducing")
        # a catch-up exchange sends nothing, so it must not touch our residuals
        ef = fresh_feedback(held.residuals) if self.spec.diloco.error_feedback and not w.catch_up else None
        try:
            out = await reduce_round(
                self.dataplane, self.spec, self.worker_id, held.state, w, i, ef, self.cfg.reduce_timeout_s
            )
            if w.catch_up or not self.spec.diloco.error_feedback:
                out.residuals = dict(held.residuals) if w.catch_up else {}
        except ExchangeError as e:
            self.display.event("exchange-failed", level="warning", round=w.round, round_attempt=w.round_attempt, reduce_attempt=i.reduce_attempt, message=str(e))
            await self._report(w, failed=True, reason=str(e)[:500])
            return
        self.counters.bytes_sent += out.bytes_sent
        self.counters.bytes_received += out.bytes_received
        self.counters.exchange_sent += out.bytes_sent
        self.counters.exchange_received += out.bytes_received
        self.display.update(bytes_sent=self.counters.bytes_sent, bytes_received=self.counters.bytes_received)
        w.pending, w.pending_attempt, w.report_epoch = out, i.reduce_attempt, self._coord_epoch
        await self._report(w)

    async def _report(self, w: RoundWork, *, failed: bool = False, reason: str = "") -> None:
        """ReportRound, retried while the coordinator is down; then act on the verdict."""
        assert w.result is not None
        out = w.pending
        kw: dict[str, Any] = dict(
            cell_id=w.cell_id, round=w.round, samples=w.result.samples, loss=w.result.mean_loss,
            compute_ms=int(w.result.compute_s * 1000), reduce_attempt=w.reduce_attempt, failed=failed, reason=reason,
        )
        if out is not None and not failed:
            kw.update(state_hash=out.state_hash, comm_ms=int(out.comm_s * 1000), bytes_sent=out.bytes_sent, bytes_received=out.bytes_received)
        attempt = 0
        while self.work is w:
            try:
                resp = await self._rpc(lambda: self.client.report_round(**kw))  # type: ignore[union-attr]
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    await self._register()
                    return
                self.display.event("report-refused", level="warning", message=f"{e.code().name}: {e.details()}")
                return
            if resp is not None:
                break
            attempt += 1
            await asyncio.sleep(backoff_delay_s(attempt, max_s=self.hb_interval_s))
            await self._maybe_reresolve()
        else:
            return
        v = resp.verdict
        self.display.event(
            "verdict", cell=w.cell_id, round=w.round, round_attempt=w.round_attempt, reduce_attempt=w.reduce_attempt,
            verdict=pb.Verdict.Name(v).removeprefix("VERDICT_").lower(), failed=failed,
            next=pb.Order.Name(resp.instruction.order).removeprefix("ORDER_").lower(),
        )
        if v == pb.VERDICT_COMMITTED and out is not None and not failed and self.work is w:
            self._commit(w)
        elif v in (pb.VERDICT_RESYNC, pb.VERDICT_ABORTED):
            if self.work is w:
                self._drop_work(pb.Verdict.Name(v))
        self._on_instruction(resp.instruction)
        self._hb_wake.set()

    async def _report_missing(self, i: pb.Instruction) -> None:
        try:
            await self._rpc(lambda: self.client.report_round(  # type: ignore[union-attr]
                cell_id=i.cell_id, round=i.round, failed=True, reduce_attempt=i.reduce_attempt,
                reason="this contributor lost its contribution (restarted)",
            ))
        except grpc.aio.AioRpcError as e:
            log.info("reporting a lost contribution: %s", e.details())

    def _commit(self, w: RoundWork) -> None:
        out = w.pending
        assert out is not None and w.result is not None
        cp = LocalCheckpoint(w.cell_id, w.round, out.state, out.state_hash, out.residuals)
        self.held = cp
        self.work = None
        self.counters.rounds_committed += 1
        self.stateserver.publish(w.cell_id, w.round, out.state)  # keeps the last few per cell
        self.display.update(committed=w.round, step=0)
        event = dict(
            cell=w.cell_id, round=w.round, hash=out.state_hash, loss=round(w.result.mean_loss, 5),
            samples=w.result.samples, contributors=w.contributors, inner_steps=w.plan.inner_steps,
            micro_batch=w.plan.micro_batch, grad_accum=w.plan.grad_accum, catch_up=w.catch_up,
            bytes_sent=out.bytes_sent, bytes_received=out.bytes_received,
            exchange_sent_total=self.counters.exchange_sent, exchange_received_total=self.counters.exchange_received,
            bytes_sent_total=self.counters.bytes_sent, bytes_received_total=self.counters.bytes_received,
        )
        self._spawn(self._save_local(cp, "committed", event), "save")

    # ------------------------------------------------------------------ checkpoints

    def _maybe_upload(self, i: pb.Instruction) -> None:
        key = (i.cell_id, i.committed_round)
        if key in self._uploads or not i.committed_hash or not self._holds(i.cell_id, i.committed_round, i.committed_hash):
            return
        self._uploads.add(key)
        state = self.held.state  # type: ignore[union-attr]

        async def upload() -> None:
            data = await asyncio.to_thread(state.to_safetensors)
            try:
                resp = await self.client.upload_checkpoint(i.cell_id, i.committed_round, i.committed_hash, data)  # type: ignore[union-attr]
                self.counters.bytes_sent += len(data)
                self.display.event("checkpoint-uploaded", cell=i.cell_id, round=i.committed_round, stored=resp.stored, nbytes=len(data))
            except grpc.aio.AioRpcError as e:
                self._uploads.discard(key)
                self.display.event("checkpoint-upload-failed", level="warning", message=f"{e.code().name}: {e.details()}")

        self._spawn(upload(), "upload")

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

    def _spec_cache_path(self, spec_hash: str) -> Path:
        return Path(self.cfg.data_dir) / "runs" / self.join.run_id / f"spec-{spec_hash[:16]}.toml"

    def _cached_spec(self, spec_hash: str) -> RunSpec | None:
        import hashlib

        p = self._spec_cache_path(spec_hash)
        try:
            text = p.read_text()
        except OSError:
            return None
        if hashlib.sha256(text.encode()).hexdigest() != spec_hash:
            return None
        return parse_spec(text)

    def _cache_spec(self, text: str, spec_hash: str) -> None:
        atomic_write(self._spec_cache_path(spec_hash), text.encode())

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


PROFILE_MAX_AGE_S = 24 * 3600.0


def _cached_profile(path: Path, key: dict[str, Any], name: str) -> Profile | None:
    """A profile measured earlier under the same key (run spec, device, throttle, ...)."""
    try:
        body = json.loads(path.read_text())
        if body.get("key") != key or time.time() - float(body["measured_unix_s"]) > PROFILE_MAX_AGE_S:
            return None
        p = body["profile"]
        return Profile(
            name=name, device_kind=str(p["device_kind"]), device_name=str(p["device_name"]),
            vram_bytes=int(p["vram_bytes"]), num_devices=int(p["num_devices"]),
            link_bandwidth_bytes_per_s=float(p["link_bandwidth_bytes_per_s"]),
            samples_per_s={str(k): float(v) for k, v in p["samples_per_s"].items()},
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ====================================================================== other ranks


def ddp_follower(ctx: ddp.DistContext, device_req: str, throttle: float) -> None:
    """Ranks > 0 of a multi-GPU worker: train rank 0's rounds until it says exit."""
    device = pick_device(ctx.device_for(device_req))
    state: dict[str, Any] = {"spec": None, "rt": None}

    def on_spec(cmd: dict[str, Any]) -> None:
        state["spec"] = parse_spec(cmd["spec_toml"])

    def on_train(cmd: dict[str, Any]) -> None:
        from bagel.worker.rounds import follow_round

        rt = state["rt"]
        if rt is None or rt.cell_id != cmd["cell_id"]:
            rt = build_runtime(state["spec"], cmd["cell_id"], device, throttle=throttle, collective=ctx)
            state["rt"] = rt
        follow_round(ctx, rt, cmd)

    ddp.follow(ctx, {"spec": on_spec, "train": on_train})


def ensure_dirs(data_dir: Path) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(data_dir, 0o700)


