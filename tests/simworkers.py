"""Simulated workers: asyncio clients that speak the real protocol over real gRPC, no training.

Each `SimWorker` has its own Ed25519 identity, registers, heartbeats on its own task and
follows the level-triggered instructions of the round protocol with the real worker's own
decisions (`bagel.worker.reconciler.decide`), faking the heavy parts:

- SYNC   -> "download" (sleep `sync_s`, by default `reduce_s`), adopt the committed (round, hash);
- TRAIN  -> sleep planned samples / samples_per_s (or a fixed `train_s`), then heartbeat
  READY with its planned samples (round 0 is "built" at once);
- REDUCE -> sleep `reduce_s` (and `report_delay_s`), then ReportRound with a hash derived deterministically from
  (cell, round, previous committed hash, contributors), so honest contributors agree
  (catch-up contributors too, with zero samples); a worker with `bad_hash=True` reports a
  different one; the verdict is read with `reconciler.decide_verdict`;
- NOT_FOUND -> re-register with its LocalState; UNAVAILABLE -> retry (coordinator restart),
  and report a pending outcome again once the coordinator is back (it may have lost it).

Faults are scripted: `crash()` stops a worker without a Leave (its lease must expire),
`leave()` is the polite exit. Used by the in-process cluster tests, the crash test and the
checkpoint tests; `bench/coordinator_load.py` has its own leaner generator on the same
`decide`.
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
from bagel.protocol.convert import instruction_from_pb, local_to_pb, verdict_from_pb
from bagel.protocol.identity import Identity
from bagel.protocol.messages import Instruction, LocalState, Order
from bagel.protocol.statehash import state_hash
from bagel.worker import reconciler
from bagel.worker.reconciler import (
    AdoptPending,
    BuildInitialState,
    CancelSync,
    DropWork,
    Leave,
    NotAMember,
    ReportMissing,
    ReReport,
    StartCatchUp,
    StartReduce,
    StartSync,
    StartTrain,
    Sync,
    Upload,
    Work,
    WorkerView,
)

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


def sim_profile(
    cells: Sequence[str],
    *,
    name: str = "sim",
    samples_per_s: float = 100.0,
    vram_bytes: int = 16 << 30,
    device_kind: str = "cpu",
    device_name: str = "simulated",
) -> pb.WorkerProfile:
    """The profile a simulated worker registers: 100 MB/s, `samples_per_s` on every cell of
    `cells` (none: a first contact, which has not measured yet)."""
    return pb.WorkerProfile(
        name=name,
        device_kind=device_kind,
        device_name=device_name,
        vram_bytes=vram_bytes,
        num_devices=1,
        link_bandwidth_bytes_per_s=100e6,
        samples_per_s={c: samples_per_s for c in cells},
        software_version="sim",
    )


def sim_peer(worker_id: str) -> pb.PeerAddress:
    """A simulated worker's peer address (nothing listens there)."""
    return pb.PeerAddress(peer_id=fake_peer_id(worker_id), maddrs=["/ip4/127.0.0.1/tcp/1"])


def sim_state(cell_id: str, round: int, prev_hash: str, contributors: Sequence[str]) -> dict[str, np.ndarray]:
    """The (tiny) cell state every honest contributor of a round ends with: a pure function
    of (cell, round, previous committed hash, contributors), so honest members agree, and
    real tensors, so it can be uploaded as a checkpoint and verified by its state hash."""
    text = f"{cell_id}|{round}|{prev_hash}|{','.join(sorted(contributors))}"
    seed = np.frombuffer(hashlib.sha256(text.encode()).digest(), dtype=np.uint8).astype(np.float32)
    return {"w.p": seed / 255.0, "m.p": np.zeros_like(seed)}


def sim_schema(cell_id: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What a checkpoint of a simulated worker's state holds (`sim_state`), for the
    coordinator's check of an upload against its cell's model."""
    return {"w.p": ("F32", (32,)), "m.p": ("F32", (32,))}


def honest_hash(cell_id: str, round: int, prev_hash: str, contributors: Sequence[str]) -> str:
    """What every honest contributor of a round reports: the state hash of `sim_state`."""
    return state_hash(sim_state(cell_id, round, prev_hash, contributors))


@dataclass
class SimWork:
    """The round a simulated worker works on (what the real worker's RoundWork tracks)."""

    cell_id: str
    round: int
    round_attempt: int
    samples: int = 0  # planned (or 0: catch-up) samples, reported once trained
    inner_steps: int = 0
    ready: bool = False
    catch_up: bool = False
    reduce_attempt: int = 0
    pending_hash: str | None = None  # reported, waiting for the commit
    pending_attempt: int = 0
    report_epoch: int = 0
    train_task: asyncio.Task[None] | None = None
    reduce_task: asyncio.Task[None] | None = None

    def cancel(self) -> None:
        for t in (self.train_task, self.reduce_task):
            if t is not None and t is not asyncio.current_task():
                t.cancel()


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
        sync_s: float | None = None,
        report_delay_s: float = 0.0,
        heartbeat_s: float | None = None,
        bad_hash: bool = False,
        upload: bool = True,
        seed: int = 0,
        device_name: str = "simulated",
        device_kind: str = "cpu",
        heldout: float | None = None,
        state_fn: Callable[[str, int, str, Sequence[str]], dict[str, np.ndarray]] | None = None,
    ) -> None:
        self.identity = identity or Identity.generate()
        self.client = CoordinatorClient(target, self.identity, run_id, timeout_s=5.0)
        self.name = name
        self.vram_bytes = vram_bytes
        self.samples_per_s = samples_per_s
        self.cells = tuple(cells)
        self.train_s, self.reduce_s = train_s, reduce_s
        self.sync_s = reduce_s if sync_s is None else sync_s
        self.report_delay_s = report_delay_s  # after the exchange (the real worker's outer step and held-out loss)
        self.heartbeat_s = heartbeat_s
        self.bad_hash = bad_hash
        self.upload = upload
        self.device_name, self.device_kind = device_name, device_kind
        self.heldout = heldout  # the held-out loss it reports for new and base state (None: unmeasured)
        # what an honest round ends with (default `sim_state`); a test that needs real model
        # weights in the checkpoints passes its own pure function of the same arguments
        self.state_fn = state_fn or sim_state
        self.states: dict[tuple[str, int], dict[str, np.ndarray]] = {}  # (cell, round) -> tensors
        self._uploading: set[tuple[str, int]] = set()
        self._bg: set[asyncio.Task[None]] = set()
        self.rng = random.Random(seed)
        self.stats = SimStats()
        # what the worker holds and does
        self.local = LocalState()  # the committed state it holds ("" cell: nothing)
        self.work: SimWork | None = None
        self.sync: tuple[LocalState, asyncio.Task[None]] | None = None
        self.missing_reported: set[tuple[str, int, int, int]] = set()
        self.epoch = 0  # bumps whenever the coordinator answers again after failing
        self._down = False
        self.instruction = Instruction(Order.UNSPECIFIED)
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
        w = self.work
        jobs = (w.train_task, w.reduce_task) if w is not None else ()
        sync = (self.sync[1],) if self.sync is not None else ()
        tasks = [t for t in (*jobs, *sync, self._loop_task, *self._bg) if t is not None]
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
        return sim_profile(
            self.cells,
            name=self.name,
            samples_per_s=self.samples_per_s,
            vram_bytes=self.vram_bytes,
            device_kind=self.device_kind,
            device_name=self.device_name,
        )

    def _peer(self) -> pb.PeerAddress:
        return sim_peer(self.worker_id)

    async def _register(self) -> None:
        resp = await self.client.register(self._profile(), self._peer(), local_to_pb(self.local))
        self._answered()
        self.stats.registrations += 1
        self._registered = True
        if self.heartbeat_s is None:
            self.heartbeat_s = resp.heartbeat_interval_ms / 1000.0
        self._act(instruction_from_pb(resp.instruction))

    def _phase(self) -> int:
        return int(reconciler.phase(self._view()))

    async def _heartbeat(self) -> None:
        # the real worker's heartbeat (worker/orders.py), without progress or loss
        req = pb.HeartbeatRequest(phase=self._phase(), local=local_to_pb(self.local))  # type: ignore[arg-type]
        w = self.work
        if self.sync is not None:
            req.cell_id = self.sync[0].cell_id
        elif w is not None:
            req.cell_id, req.round, req.round_attempt = w.cell_id, w.round, w.round_attempt
            if w.ready:
                req.inner_step, req.samples = w.inner_steps, w.samples
            req.reduce_attempt = w.reduce_attempt
        elif self.local.cell_id:
            req.cell_id = self.local.cell_id
        resp: pb.HeartbeatResponse = await self.client.call("Heartbeat", req)  # type: ignore[assignment]
        self._answered()
        self.stats.heartbeats += 1
        self._act(instruction_from_pb(resp.instruction))

    def _answered(self) -> None:
        if self._down:
            self._down = False
            self.epoch += 1

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
                    continue
                if e.code() in RETRY_CODES:
                    self._down = True
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

    # ------------------------------------------------------------------ following instructions

    def _view(self) -> WorkerView:
        w = self.work
        work = None
        if w is not None:
            exchanging = w.reduce_task is not None and not w.reduce_task.done()
            work = Work(
                w.cell_id,
                w.round,
                w.round_attempt,
                ready=w.ready,
                catch_up=w.catch_up,
                reduce_attempt=w.reduce_attempt,
                exchanging=exchanging,
                pending_hash=w.pending_hash,
                pending_attempt=w.pending_attempt,
                report_stale=w.report_epoch != self.epoch,
            )
        sync = Sync(self.sync[0], running=not self.sync[1].done()) if self.sync is not None else None
        return WorkerView(
            self.worker_id,
            self.local if self.local.cell_id else None,
            work,
            sync,
            frozenset(self._uploading),
            frozenset(self.missing_reported),
        )

    def _act(self, ins: Instruction) -> None:
        """An answer's instruction: it becomes the one to follow."""
        if self.stopped:
            return
        self.instruction = ins
        if ins.order is Order.SYNC:
            self.stats.sync_orders.append((ins.cell_id, ins.committed_round, ins.reason))
        self._reconcile()

    def _reconcile(self) -> None:
        """Do what the current instruction says (again after a job ends, as the real worker)."""
        if self.stopped:
            return
        ins = self.instruction
        for a in reconciler.decide(ins, self._view()):
            self._perform(ins, a)

    def _perform(self, ins: Instruction, a: reconciler.Action) -> None:
        """One action of `decide`, with sleeps for the heavy parts."""
        w = self.work
        if isinstance(a, Leave):
            self.stopped = True
        elif isinstance(a, Upload):
            # an upload changes nothing the coordinator must hear sooner: no early heartbeat
            # (waking here would answer every heartbeat that repeats the request with another
            # at once, a loop that spends the worker's whole rate-limit bucket)
            if self.upload:
                self._maybe_upload(a.cell_id, a.committed_round, a.committed_hash)
            return
        elif isinstance(a, NotAMember):
            return  # nothing to do, nothing to tell sooner
        elif isinstance(a, AdoptPending):
            assert w is not None and w.pending_hash is not None
            self._commit(w)
        elif isinstance(a, DropWork):
            if w is not None:
                w.cancel()
            self.work = None
        elif isinstance(a, CancelSync):
            if self.sync is not None:
                self.sync[1].cancel()
            self.sync = None
        elif isinstance(a, StartSync):
            target = LocalState(a.cell_id, a.committed_round, a.committed_hash)
            self.sync = (target, self._spawn(self._sync(target)))
        elif isinstance(a, BuildInitialState):
            self.local = LocalState(a.cell_id, 0, "")
        elif isinstance(a, StartTrain):
            assert ins.plan is not None
            plan = ins.plan
            samples = plan.micro_batch * plan.grad_accum * plan.inner_steps
            w = self.work = SimWork(
                ins.cell_id, ins.round, ins.round_attempt, samples=samples, inner_steps=plan.inner_steps
            )
            w.train_task = self._spawn(self._train(w))
        elif isinstance(a, StartCatchUp):
            self.work = SimWork(ins.cell_id, ins.round, ins.round_attempt, ready=True, catch_up=True)
        elif isinstance(a, StartReduce):
            assert w is not None
            if w.reduce_task is not None and w.reduce_task is not asyncio.current_task():
                w.reduce_task.cancel()
            w.reduce_attempt, w.pending_hash = a.reduce_attempt, None
            w.reduce_task = self._spawn(self._reduce(w, ins))
        elif isinstance(a, ReReport):
            assert w is not None
            w.report_epoch = self.epoch
            w.reduce_task = self._spawn(self._report(w))
        elif isinstance(a, ReportMissing):
            self.missing_reported.add((a.cell_id, a.round, a.round_attempt, a.reduce_attempt))
            self._spawn(self._report_missing(a))
        self._wake.set()

    def _spawn(self, coro: Coroutine[object, object, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._bg.add(task)
        task.add_done_callback(self._bg.discard)
        return task

    def _commit(self, w: SimWork) -> None:
        assert w.pending_hash is not None
        self.local = LocalState(w.cell_id, w.round, w.pending_hash)
        if self.work is w:
            self.work = None

    async def _sync(self, target: LocalState) -> None:
        await asyncio.sleep(self.sync_s)
        self.local = target
        self.sync = None
        self._reconcile()
        self._wake.set()

    async def _train(self, w: SimWork) -> None:
        await asyncio.sleep(self.train_s if self.train_s is not None else w.samples / self.samples_per_s)
        if self.work is not w:
            return
        w.ready = True
        self.stats.rounds_trained.append((w.cell_id, w.round, w.round_attempt))
        self._reconcile()
        self._wake.set()

    async def _reduce(self, w: SimWork, ins: Instruction) -> None:
        await asyncio.sleep(self.reduce_s)
        contributors = [m.worker_id for m in ins.contributors]
        tensors = self.state_fn(ins.cell_id, ins.round, ins.committed_hash, contributors)
        h = state_hash(tensors)
        self.states[(ins.cell_id, ins.round)] = tensors
        if self.bad_hash:
            h = hashlib.sha256(f"liar|{self.worker_id}|{ins.round}".encode()).hexdigest()
        if self.report_delay_s > 0:  # still exchanging, as the real worker measures before it reports
            await asyncio.sleep(self.report_delay_s)
        w.pending_hash, w.pending_attempt, w.report_epoch = h, ins.reduce_attempt, self.epoch
        await self._report(w)

    async def _report(self, w: SimWork) -> None:
        assert w.pending_hash is not None
        while not self.stopped and self.work is w:
            try:
                resp = await self.client.report_round(
                    cell_id=w.cell_id,
                    round=w.round,
                    state_hash=w.pending_hash,
                    samples=w.samples,
                    loss=0.5,
                    compute_ms=int(
                        1000 * (self.train_s if self.train_s is not None else w.samples / self.samples_per_s)
                    ),
                    comm_ms=int(self.reduce_s * 1000),
                    reduce_attempt=w.reduce_attempt,
                    round_metrics=self.round_metrics(w.samples),
                    heldout_loss=self.heldout,
                    heldout_loss_base=self.heldout,
                )
                self._answered()
                break
            except grpc.aio.AioRpcError as e:
                if e.code() in RETRY_CODES:
                    self._down = True
                    await asyncio.sleep(0.1 + 0.2 * self.rng.random())
                    continue
                self.stats.errors.append(f"report: {e.code().name}: {e.details()}")
                return  # the next instruction says what to do
        else:
            return
        self.stats.reports += 1
        self.stats.verdicts.append((w.cell_id, w.round, resp.verdict))
        for a in reconciler.decide_verdict(
            verdict_from_pb(resp.verdict), reported_outcome=True, current=self.work is w
        ):
            if isinstance(a, AdoptPending):
                self._commit(w)
            elif isinstance(a, DropWork):
                self.work = None
        self._act(instruction_from_pb(resp.instruction))
        self._wake.set()

    def round_metrics(self, samples: int) -> dict[str, int]:
        """Plausible round metrics for a report: the simulated training time split into
        data / forward-backward / optimizer, the simulated exchange, fixed memory figures."""
        train_ms = int(1000 * (self.train_s if self.train_s is not None else samples / self.samples_per_s))
        out = {
            "data_ms": train_ms // 10,
            "forward_backward_ms": train_ms * 7 // 10,
            "optimizer_ms": train_ms // 5,
            "encode_ms": 1,
            "exchange_ms": int(self.reduce_s * 1000),
            "outer_step_ms": 1,
            "waiting_ms": 5,
            "rss_bytes": 300 << 20,
        }
        if self.device_kind == "cuda":
            out |= {"cuda_free_bytes": self.vram_bytes // 2, "cuda_peak_allocated_bytes": self.vram_bytes // 4}
        return out

    async def _report_missing(self, a: ReportMissing) -> None:
        try:
            await self.client.report_round(
                cell_id=a.cell_id,
                round=a.round,
                failed=True,
                reduce_attempt=a.reduce_attempt,
                reason="this contributor lost its contribution (restarted)",
            )
        except grpc.aio.AioRpcError as e:
            self.stats.errors.append(f"report-missing: {e.code().name}: {e.details()}")

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

        self._spawn(go())


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
