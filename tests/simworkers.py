"""Simulated workers: asyncio clients that speak the real protocol over real gRPC, no training.

Each `SimWorker` has its own Ed25519 identity, registers, heartbeats on its own task and
follows the level-triggered instructions of the round protocol (team brief):

- WAIT   -> heartbeat IDLE;
- SYNC   -> "download" (a short sleep), adopt the committed (round, hash), heartbeat IDLE;
- TRAIN  -> heartbeat TRAINING, sleep planned samples / samples_per_s (or a fixed
  `train_s`), heartbeat READY with its planned samples;
- REDUCE -> heartbeat REDUCING, sleep `reduce_s`, then ReportRound with a hash derived
  deterministically from (cell, round, previous committed hash, contributors), so honest
  contributors agree; a worker with `bad_hash=True` reports a different one;
- NOT_FOUND -> re-register with its LocalState; UNAVAILABLE -> retry (coordinator restart).

Faults are scripted: `crash()` stops a worker without a Leave (its lease must expire),
`leave()` is the polite exit. Used by the in-process cluster tests, the crash test and the
simulator's chaos mode; `bench/coordinator_load.py` has its own leaner heartbeat loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field

import grpc
import numpy as np
from safetensors.numpy import save as save_safetensors

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.client import CoordinatorClient
from bagel.protocol.identity import Identity
from bagel.protocol.statehash import state_hash

log = logging.getLogger(__name__)

_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
RETRY_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def fake_peer_id(seed: str) -> str:
    """A syntactically valid libp2p peer id (base58), unique per seed; no node behind it."""
    digest = hashlib.sha256(seed.encode()).digest()
    n = int.from_bytes(digest, "big")
    out = []
    for _ in range(44):
        n, r = divmod(n, 58)
        out.append(_B58[r])
    return "12D3KooW" + "".join(out)


def sim_state(cell_id: str, round: int, prev_hash: str, contributors: Sequence[str]) -> dict[str, np.ndarray]:
    """The (tiny) cell state every honest contributor of a round ends with: a pure function
    of (cell, round, previous committed hash, contributors), so honest members agree, and
    real tensors, so it can be uploaded as a checkpoint and verified by its state hash."""
    text = f"{cell_id}|{round}|{prev_hash}|{','.join(sorted(contributors))}"
    seed = np.frombuffer(hashlib.sha256(text.encode()).digest(), dtype=np.uint8).astype(np.float32)
    return {"w.p": seed / 255.0, "m.p": np.zeros_like(seed)}


def honest_hash(cell_id: str, round: int, prev_hash: str, contributors: Sequence[str]) -> str:
    """What every honest contributor of a round reports: the state hash of `sim_state`."""
    return state_hash(sim_state(cell_id, round, prev_hash, contributors))


@dataclass
class SimStats:
    registrations: int = 0
    heartbeats: int = 0
    reports: int = 0
    verdicts: list[tuple[str, int, int]] = field(default_factory=list)  # (cell, round, verdict)
    sync_orders: list[tuple[str, int, str]] = field(default_factory=list)  # (cell, committed_round, reason)
    rounds_trained: list[tuple[str, int, int]] = field(default_factory=list)  # (cell, round, attempt)
    uploads: list[tuple[str, int]] = field(default_factory=list)  # checkpoints stored
    errors: list[str] = field(default_factory=list)


class SimWorker:
    """One simulated worker (see the module docstring)."""

    def __init__(
        self,
        target: str,
        run_id: str,
        *,
        name: str = "sim",
        identity: Identity | None = None,
        vram_bytes: int = 16 << 30,
        samples_per_s: float = 100.0,
        cells: Sequence[str] = (),
        train_s: float | None = None,
        reduce_s: float = 0.02,
        heartbeat_s: float | None = None,
        bad_hash: bool = False,
        upload: bool = True,
        seed: int = 0,
    ) -> None:
        self.identity = identity or Identity.generate()
        self.client = CoordinatorClient(target, self.identity, run_id, timeout_s=5.0)
        self.name = name
        self.vram_bytes = vram_bytes
        self.samples_per_s = samples_per_s
        self.cells = tuple(cells)
        self.train_s, self.reduce_s = train_s, reduce_s
        self.heartbeat_s = heartbeat_s
        self.bad_hash = bad_hash
        self.upload = upload
        self.states: dict[tuple[str, int], dict[str, np.ndarray]] = {}  # (cell, round) -> tensors
        self._uploading: set[tuple[str, int]] = set()
        self._bg: set[asyncio.Task[None]] = set()
        self.rng = random.Random(seed)
        self.stats = SimStats()
        # what the worker holds and does
        self.local = pb.LocalState()
        self.phase = pb.PHASE_IDLE
        self.cell_id = ""
        self.round = 0
        self.round_attempt = 0
        self.reduce_attempt = 0
        self.inner_step = 0
        self.samples = 0
        self.pending: tuple[str, int, str] | None = None  # (cell, round, hash) computed, not yet committed
        self.instruction = pb.Instruction()
        self._action: asyncio.Task[None] | None = None
        self._action_key: tuple[object, ...] = ()
        self._loop_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._registered = False
        self.stopped = False

    @property
    def worker_id(self) -> str:
        return self.identity.worker_id

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._run(), name=f"sim-{self.name}")

    async def crash(self) -> None:
        """Stop dead: no Leave, no more heartbeats (the coordinator must notice by lease)."""
        self.stopped = True
        tasks = [t for t in (self._action, self._loop_task, *self._bg) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def leave(self, reason: str = "test") -> None:
        await self.crash()
        try:
            await self.client.leave(reason)
        except grpc.aio.AioRpcError as e:
            self.stats.errors.append(f"leave: {e.code().name}")

    async def close(self) -> None:
        await self.crash()
        await self.client.close()

    # ------------------------------------------------------------------ protocol

    def _profile(self) -> pb.WorkerProfile:
        return pb.WorkerProfile(
            name=self.name,
            device_kind="cpu",
            device_name="simulated",
            vram_bytes=self.vram_bytes,
            num_devices=1,
            link_bandwidth_bytes_per_s=100e6,
            samples_per_s={c: self.samples_per_s for c in self.cells},
            software_version="sim",
        )

    def _peer(self) -> pb.PeerAddress:
        return pb.PeerAddress(peer_id=fake_peer_id(self.worker_id), maddrs=["/ip4/127.0.0.1/tcp/1"])

    async def _register(self) -> None:
        resp = await self.client.register(self._profile(), self._peer(), self.local)
        self.stats.registrations += 1
        self._registered = True
        if self.heartbeat_s is None:
            self.heartbeat_s = resp.heartbeat_interval_ms / 1000.0
        self._act(resp.instruction)

    async def _heartbeat(self) -> None:
        req = pb.HeartbeatRequest(
            phase=self.phase,  # type: ignore[arg-type]
            cell_id=self.cell_id if self.phase in (pb.PHASE_TRAINING, pb.PHASE_READY, pb.PHASE_REDUCING) else "",
            round=self.round if self.phase in (pb.PHASE_TRAINING, pb.PHASE_READY, pb.PHASE_REDUCING) else 0,
            inner_step=self.inner_step,
            samples=self.samples if self.phase == pb.PHASE_READY else 0,
            local=self.local,
            reduce_attempt=self.reduce_attempt if self.phase == pb.PHASE_REDUCING else 0,
            round_attempt=self.round_attempt if self.phase in (pb.PHASE_TRAINING, pb.PHASE_READY) else 0,
        )
        resp: pb.HeartbeatResponse = await self.client.call("Heartbeat", req)  # type: ignore[assignment]
        self.stats.heartbeats += 1
        self._act(resp.instruction)

    async def _run(self) -> None:
        backoff = 0.05
        while not self.stopped:
            try:
                if not self._registered:
                    await self._register()
                else:
                    await self._heartbeat()
                backoff = 0.05
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    self._registered = False  # the coordinator forgot us (lease lost): re-register
                    self._reset_activity()
                    continue
                if e.code() in RETRY_CODES:
                    await asyncio.sleep(backoff * (0.5 + self.rng.random()))
                    backoff = min(backoff * 2, 1.0)
                    continue
                if e.code() == grpc.StatusCode.PERMISSION_DENIED:  # banned: a real worker exits
                    self.stats.errors.append(f"banned: {e.details()}")
                    self.stopped = True
                    return
                self.stats.errors.append(f"{e.code().name}: {e.details()}")
                log.warning("%s: %s %s", self.name, e.code().name, e.details())
                await asyncio.sleep(0.2)
                continue
            try:
                await asyncio.wait_for(self._wake.wait(), self.heartbeat_s or 1.0)
            except TimeoutError:
                pass
            self._wake.clear()

    def _reset_activity(self) -> None:
        if self._action is not None:
            self._action.cancel()
        self._action, self._action_key = None, ()
        self.phase = pb.PHASE_IDLE
        self.inner_step = 0

    def _start(self, key: tuple[object, ...], make: Callable[[], Coroutine[object, object, None]]) -> None:
        if self._action_key == key and self._action is not None:
            return  # already doing exactly that
        if self._action is not None:
            self._action.cancel()
        self._action_key = key
        self._action = asyncio.create_task(make())

    def _adopt_committed(self, ins: pb.Instruction) -> None:
        """A pending result of ours matching the committed round becomes our local state."""
        if self.pending is not None:
            cell, rnd, h = self.pending
            if ins.cell_id == cell and ins.committed_round == rnd and ins.committed_hash == h:
                self.local = pb.LocalState(cell_id=cell, committed_round=rnd, state_hash=h)
                self.pending = None
            elif ins.cell_id != cell or ins.committed_round >= rnd:
                self.pending = None

    def _act(self, ins: pb.Instruction) -> None:
        if self.stopped:
            return
        self.instruction = ins
        self._adopt_committed(ins)
        if ins.upload_checkpoint and self.upload:
            self._maybe_upload(ins.cell_id, ins.committed_round, ins.committed_hash)
        order = ins.order
        if order == pb.ORDER_WAIT:
            if self._action_key[:1] not in ((pb.ORDER_REDUCE,), (pb.ORDER_SYNC,)):
                self._reset_activity()
        elif order == pb.ORDER_SYNC:
            self.stats.sync_orders.append((ins.cell_id, ins.committed_round, ins.reason))
            self._start((pb.ORDER_SYNC, ins.cell_id, ins.committed_round, ins.committed_hash), lambda: self._sync(ins))
        elif order == pb.ORDER_TRAIN:
            self._start((pb.ORDER_TRAIN, ins.cell_id, ins.round, ins.round_attempt), lambda: self._train(ins))
        elif order == pb.ORDER_REDUCE:
            self._start(
                (pb.ORDER_REDUCE, ins.cell_id, ins.round, ins.round_attempt, ins.reduce_attempt),
                lambda: self._reduce(ins),
            )
        elif order == pb.ORDER_LEAVE:
            self.stopped = True

    async def _sync(self, ins: pb.Instruction) -> None:
        self.phase = pb.PHASE_SYNCING
        await asyncio.sleep(self.reduce_s)
        self.local = pb.LocalState(
            cell_id=ins.cell_id, committed_round=ins.committed_round, state_hash=ins.committed_hash
        )
        self.pending = None
        self.phase = pb.PHASE_IDLE
        self._wake.set()

    async def _train(self, ins: pb.Instruction) -> None:
        self.cell_id, self.round, self.round_attempt = ins.cell_id, ins.round, ins.round_attempt
        self.phase, self.inner_step, self.samples = pb.PHASE_TRAINING, 0, 0
        self._wake.set()
        plan = ins.plan
        samples = plan.micro_batch * plan.grad_accum * plan.inner_steps
        await asyncio.sleep(self.train_s if self.train_s is not None else samples / self.samples_per_s)
        self.inner_step = plan.inner_steps
        self.samples = samples
        self.stats.rounds_trained.append((ins.cell_id, ins.round, ins.round_attempt))
        self.phase = pb.PHASE_READY
        self._wake.set()

    async def _reduce(self, ins: pb.Instruction) -> None:
        self.cell_id, self.round, self.reduce_attempt = ins.cell_id, ins.round, ins.reduce_attempt
        self.phase = pb.PHASE_REDUCING
        self._wake.set()
        await asyncio.sleep(self.reduce_s)
        contributors = [m.worker_id for m in ins.contributors]
        tensors = sim_state(ins.cell_id, ins.round, ins.committed_hash, contributors)
        h = state_hash(tensors)
        self.states[(ins.cell_id, ins.round)] = tensors
        if self.bad_hash:
            h = hashlib.sha256(f"liar|{self.worker_id}|{ins.round}".encode()).hexdigest()
        self.pending = (ins.cell_id, ins.round, h)
        while not self.stopped:
            try:
                resp = await self.client.report_round(
                    cell_id=ins.cell_id,
                    round=ins.round,
                    state_hash=h,
                    samples=self.samples,
                    loss=0.5,
                    compute_ms=int(
                        1000 * (self.train_s if self.train_s is not None else self.samples / self.samples_per_s)
                    ),
                    comm_ms=int(self.reduce_s * 1000),
                    reduce_attempt=ins.reduce_attempt,
                )
                break
            except grpc.aio.AioRpcError as e:
                if e.code() in RETRY_CODES:
                    await asyncio.sleep(0.1 + 0.2 * self.rng.random())
                    continue
                self.stats.errors.append(f"report: {e.code().name}: {e.details()}")
                self.phase = pb.PHASE_IDLE
                self._action, self._action_key = None, ()
                self._wake.set()
                return
        else:
            return
        self.stats.reports += 1
        self.stats.verdicts.append((ins.cell_id, ins.round, resp.verdict))
        if resp.verdict == pb.VERDICT_COMMITTED:
            self.local = pb.LocalState(cell_id=ins.cell_id, committed_round=ins.round, state_hash=h)
            self.pending = None
        elif resp.verdict in (pb.VERDICT_RESYNC, pb.VERDICT_ABORTED):
            self.pending = None
        self.phase = pb.PHASE_IDLE
        # this task is done: the next instruction (also in this response) starts fresh
        self._action, self._action_key = None, ()
        self._act(resp.instruction)
        self._wake.set()


    def _maybe_upload(self, cell_id: str, round: int, committed_hash: str) -> None:
        key = (cell_id, round)
        tensors = self.states.get(key)
        if tensors is None or key in self._uploading or state_hash(tensors) != committed_hash:
            return
        self._uploading.add(key)

        async def go() -> None:
            try:
                resp = await self.client.upload_checkpoint(cell_id, round, committed_hash, save_safetensors(tensors))
                if resp.stored:
                    self.stats.uploads.append(key)
            except grpc.aio.AioRpcError as e:
                self.stats.errors.append(f"upload: {e.code().name}: {e.details()}")

        task = asyncio.get_running_loop().create_task(go())
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)


async def start_workers(
    target: str,
    run_id: str,
    n: int,
    *,
    cells: Sequence[str],
    **kwargs: object,
) -> list[SimWorker]:
    workers = [SimWorker(target, run_id, name=f"sim{i:03d}", cells=cells, seed=i, **kwargs) for i in range(n)]  # type: ignore[arg-type]
    for w in workers:
        w.start()
    return workers


async def stop_workers(workers: Sequence[SimWorker]) -> None:
    await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)


def cluster_spec_text(
    run_id: str = "simrun",
    *,
    lease_s: float = 2.0,
    heartbeat_s: float = 0.4,
    min_replicas: int = 2,
    max_replicas: int = 8,
    quorum: float = 0.5,
    every_rounds: int = 1000,
    deadline_slack: float = 2.0,
    min_round_s: float = 1.0,
    extra: str = "",
) -> str:
    """A run spec for cluster tests: short leases and heartbeats, tiny rounds."""
    return f"""
[run]
id = "{run_id}"
seed = 0

[data]
source = "digits"
clusters = 2

[cells]
timestep_ranges = 2
router = true

[diloco]
inner_steps = 2
group_batch = 16
max_micro_batch = 16

[schedule]
min_replicas = {min_replicas}
max_replicas = {max_replicas}
lease_s = {lease_s}
heartbeat_s = {heartbeat_s}
deadline_slack = {deadline_slack}
min_round_s = {min_round_s}
quorum = {quorum}

[checkpoint]
every_rounds = {every_rounds}
keep = 2
{extra}
"""


def uniform_cells(cell_ids: Sequence[str], memory_bytes: int = 1 << 30) -> list[object]:
    """CellConfigs with equal targets and a fixed size (skips loading the dataset)."""
    from bagel.coordinator.core.records import CellConfig

    return [CellConfig(c, memory_bytes, 1.0 / len(cell_ids), 1 << 20) for c in cell_ids]
