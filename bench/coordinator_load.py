"""Load benchmark of the coordinator daemon.

A real coordinator process (`python -m bagel.coordinator serve`) and, in a separate
process, a load generator: N simulated workers, each with its own Ed25519 key, register
and then heartbeat every 5 s (phases spread uniformly), over a few shared gRPC channels.
The workers follow the round protocol with the real worker's own decisions
(`bagel.worker.reconciler.decide`, see `Fleet`) so the coordinator does its real work
(rounds open, freeze and commit, with SQLite writes, for the workers that get a cell);
only the heavy parts are instant: TRAIN -> READY on the next beat, REDUCE -> ReportRound
with a hash all honest members agree on, SYNC -> adopt the committed state.

Reported per point: heartbeats/s sustained (answered heartbeats over the measurement
window), p50/p99 heartbeat latency (client-side round trip, so it includes the
generator's own queueing: an honest upper bound on the server's), target rate, errors,
the generator's worst lag behind its schedule, and CPU used by the coordinator process
(per heartbeat and in cores) and by the generator. Stall attribution over the window:
`srv>25ms`, how many of the server's tick-timer samples (4 a second, from its /metrics)
fired more than 25 ms late, i.e. the event loop was stalled; `srv gc2 ms`, its full GC
passes; `gen stall`, the generator's own worst stall (a 10 ms timer's lateness, ms); and
`gen gc ms`, the generator's GC passes (none: it holds its cyclic GC from the warm-up to
the end of the window, so its pauses do not pass for the server's; the JSON has more).
At most `--max-inflight` heartbeats are in flight: past that the generator waits (closed
loop), so an overloaded coordinator shows a rate below target and a growing lag instead
of an unbounded queue.
Every request is freshly signed (a fresh nonce each time, as the protocol requires):
signing runs in the generator and competes for the same CPU as the coordinator.

Peer in the same run (`--baseline`, on by default): the same generator against a bare
grpc.aio server on uvloop that answers every RPC of the service with a constant reply
(no signature check, no core, no store). It is the ceiling this harness and grpc.aio
reach on this machine; the coordinator's figures are read against it, because absolute
rates on a shared 2-core machine drift from run to run.

Held watches (`--watch`): each point is also measured with every worker holding a
`WatchInstruction` long poll, as the real worker does while it waits on the coordinator
(IDLE, READY, REDUCING: every load worker's phase, since its training is instant): an
upper bound, since a real worker holds none while it trains. Each worker keeps one
watch of the instruction it follows, across its beats: it is sent again when answered
(the coordinator holds it at most a lease) or when a heartbeat's answer brings another
instruction (the held one is cancelled). A changed answer that came while none of the
worker's calls was in flight, and with no answer handled since, is acted on and
heartbeated at once (outside the schedule), as `worker/link.py` does. Reported next to
the point without watches: the watches answered per second (`watch/s`, of which
`changed`), the extra heartbeats they prompted, and the server's held-calls gauge
(`bagel_watches_held`) at the end of the window.

    python bench/coordinator_load.py [--quick] [--workers 1000 5000 10000]
        [--period-s 5] [--measure-s 30] [--no-baseline] [--watch] [--json FILE]

Target: 10k workers (2,000 heartbeats/s) at p99 <= 50 ms on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import heapq
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPEC = """
[run]
id = "loadrun"

[data]
source = "digits"
clusters = 2

[cells]
timestep_ranges = 2
router = true

[diloco]
inner_steps = 2
group_batch = 32

[schedule]
min_replicas = 2
max_replicas = 8
lease_s = {lease_s}
heartbeat_s = {period_s}
deadline_slack = 3.0
min_round_s = 5.0
quorum = 0.5

[checkpoint]
every_rounds = 1000000

# the load generator measures the coordinator, not admission: one process registers 10k
# identities from one address (bench/admission_pow.py measures the proof of work)
[security]
pow_bits = 0
ip_rate_per_s = 1000000.0
ip_burst = 1000000
register_rate_per_s = 1000000.0
register_burst = 1000000
"""

CHANNELS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(url: str) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value}."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def _server_stalls(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    if "bagel_event_loop_lag_seconds_count" not in after:  # no /metrics, or a coordinator without them
        return {}

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    lag = "bagel_event_loop_lag_seconds"
    gc2 = 'bagel_gc_pause_seconds_{}{{generation="2"}}'
    return {
        "server_lag_samples": delta(f"{lag}_count"),
        "server_lag_over_25ms": delta(f"{lag}_count") - delta(f'{lag}_bucket{{le="0.025"}}'),
        "server_lag_over_100ms": delta(f"{lag}_count") - delta(f'{lag}_bucket{{le="0.1"}}'),
        "server_full_gc_passes": delta(gc2.format("count")),
        "server_full_gc_ms": 1000.0 * delta(gc2.format("sum")),
        "server_gc_ms": 1000.0 * sum(delta(k) for k in after if k.startswith("bagel_gc_pause_seconds_sum")),
    }


# ---------------------------------------------------------------------------- generator


@dataclass
class LoadWork:
    """The round one load worker works on: trained at once, then one report."""

    cell_id: str
    round: int
    round_attempt: int
    samples: int
    catch_up: bool = False
    reduce_attempt: int = 0
    pending_hash: str | None = None
    reporting: bool = False


@dataclass
class LoadWorker:
    identity: Any
    local: Any = None  # the committed LocalState held (None: nothing)
    work: LoadWork | None = None
    missing: set[tuple[str, int, int, int]] = field(default_factory=set)
    tag: int = 0  # Instruction.tag of the last instruction acted on
    answers: int = 0  # calls answered so far
    inflight: int = 0  # calls on the wire now (a watch's answer that comes meanwhile is dropped)
    watch: Any = None  # the held watch's task
    watch_tag: int = 0  # the tag it was sent with


class Fleet:
    """The generator's workers following their instructions with `reconciler.decide`, the
    real worker's decisions; training and downloads take no time, an exchange is a report."""

    def __init__(self, n: int, stubs: list[Any], errors: dict[str, int], spawn: Any) -> None:
        from bagel.protocol.identity import Identity

        self.sims = [LoadWorker(Identity.generate()) for _ in range(n)]
        self.stubs = stubs
        self.errors = errors
        self.spawn = spawn

    def local_pb(self, i: int) -> Any:
        from bagel.protocol import bagel_pb2 as pb
        from bagel.protocol.convert import local_to_pb

        local = self.sims[i].local
        return local_to_pb(local) if local is not None else pb.LocalState()

    def heartbeat(self, i: int) -> Any:
        from bagel.protocol import bagel_pb2 as pb

        w = self.sims[i].work
        if w is None:
            return pb.HeartbeatRequest(phase=pb.PHASE_IDLE, local=self.local_pb(i))
        if w.reduce_attempt or w.pending_hash is not None:
            return pb.HeartbeatRequest(
                phase=pb.PHASE_REDUCING,
                cell_id=w.cell_id,
                round=w.round,
                local=self.local_pb(i),
                round_attempt=w.round_attempt,
                reduce_attempt=w.reduce_attempt,
            )
        return pb.HeartbeatRequest(
            phase=pb.PHASE_READY,
            cell_id=w.cell_id,
            round=w.round,
            inner_step=2,
            samples=w.samples,
            local=self.local_pb(i),
            round_attempt=w.round_attempt,
        )

    def act(self, i: int, instruction: Any) -> None:
        from bagel.protocol.convert import instruction_from_pb
        from bagel.protocol.messages import LocalState
        from bagel.worker import reconciler as rc

        s = self.sims[i]
        ins = instruction_from_pb(instruction)
        w = s.work
        view = rc.WorkerView(
            s.identity.worker_id,
            s.local,
            None
            if w is None
            else rc.Work(
                w.cell_id,
                w.round,
                w.round_attempt,
                ready=True,
                catch_up=w.catch_up,
                reduce_attempt=w.reduce_attempt,
                exchanging=w.reporting,
                pending_hash=w.pending_hash,
                pending_attempt=w.reduce_attempt,
            ),
            missing_reported=frozenset(s.missing),
        )
        for a in rc.decide(ins, view):
            if isinstance(a, rc.StartTrain):
                p = ins.plan
                assert p is not None
                s.work = LoadWork(
                    ins.cell_id, ins.round, ins.round_attempt, p.micro_batch * p.grad_accum * p.inner_steps
                )
            elif isinstance(a, rc.StartCatchUp):
                s.work = LoadWork(ins.cell_id, ins.round, ins.round_attempt, 0, catch_up=True)
            elif isinstance(a, rc.StartReduce) and s.work is not None:
                w = s.work
                text = (
                    f"{ins.cell_id}|{ins.round}|{ins.committed_hash}|{','.join(m.worker_id for m in ins.contributors)}"
                )
                w.reduce_attempt, w.pending_hash, w.reporting = (
                    a.reduce_attempt,
                    hashlib.sha256(text.encode()).hexdigest(),
                    True,
                )
                self.spawn(self._report(i, w))
            elif isinstance(a, rc.StartSync):
                s.local = LocalState(a.cell_id, a.committed_round, a.committed_hash)
            elif isinstance(a, rc.BuildInitialState):
                s.local = LocalState(a.cell_id, 0, "")
            elif isinstance(a, rc.AdoptPending) and s.work is not None:
                s.local = LocalState(s.work.cell_id, s.work.round, s.work.pending_hash or "")
                s.work = None
            elif isinstance(a, rc.DropWork):
                s.work = None
            elif isinstance(a, rc.ReportMissing):
                s.missing.add((a.cell_id, a.round, a.round_attempt, a.reduce_attempt))
                self.spawn(self._report_missing(i, a))
            # Leave, Upload, ReReport: every load worker keeps beating (no checkpoints, no outages)

    async def _report(self, i: int, w: LoadWork) -> None:
        import grpc

        from bagel.protocol import bagel_pb2 as pb
        from bagel.protocol.convert import verdict_from_pb
        from bagel.protocol.envelope import sign_request
        from bagel.protocol.messages import LocalState
        from bagel.worker import reconciler as rc

        s = self.sims[i]
        s.inflight += 1
        req = pb.ReportRoundRequest(
            cell_id=w.cell_id,
            round=w.round,
            state_hash=w.pending_hash,
            samples=w.samples,
            loss=0.5,
            compute_ms=100,
            comm_ms=10,
            reduce_attempt=w.reduce_attempt,
        )
        try:
            resp = await self.stubs[i % CHANNELS].ReportRound(
                sign_request(s.identity, req, run_id="loadrun", method="ReportRound"), timeout=30
            )
        except grpc.aio.AioRpcError as e:
            self.errors[f"ReportRound:{e.code().name}"] = self.errors.get(f"ReportRound:{e.code().name}", 0) + 1
            w.reporting = False
            return
        finally:
            s.inflight -= 1
        w.reporting = False
        s.answers += 1
        s.tag = resp.instruction.tag
        for a in rc.decide_verdict(verdict_from_pb(resp.verdict), reported_outcome=True, current=s.work is w):
            if isinstance(a, rc.AdoptPending):
                s.local, s.work = LocalState(w.cell_id, w.round, w.pending_hash or ""), None
            elif isinstance(a, rc.DropWork):
                s.work = None
        self.act(i, resp.instruction)

    async def _report_missing(self, i: int, a: Any) -> None:
        import grpc

        from bagel.protocol import bagel_pb2 as pb
        from bagel.protocol.envelope import sign_request

        req = pb.ReportRoundRequest(
            cell_id=a.cell_id,
            round=a.round,
            failed=True,
            reduce_attempt=a.reduce_attempt,
            reason="this contributor lost its contribution (restarted)",
        )
        try:
            await self.stubs[i % CHANNELS].ReportRound(
                sign_request(self.sims[i].identity, req, run_id="loadrun", method="ReportRound"), timeout=30
            )
        except grpc.aio.AioRpcError as e:
            self.errors[f"ReportRound:{e.code().name}"] = self.errors.get(f"ReportRound:{e.code().name}", 0) + 1


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))
    return xs[k]


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _generate(
    target: str,
    n: int,
    period_s: float,
    warmup_s: float,
    measure_s: float,
    server_pid: int,
    max_inflight: int,
    metrics_url: str | None = None,
    watch: bool = False,
) -> dict[str, Any]:
    import grpc

    from bagel.protocol import bagel_pb2 as pb
    from bagel.protocol import bagel_pb2_grpc as pb_grpc
    from bagel.protocol.envelope import sign_request
    from bagel.protocol.grpc_options import channel_options

    channels = [grpc.aio.insecure_channel(target, options=channel_options()) for _ in range(CHANNELS)]
    stubs = [pb_grpc.CoordinatorStub(ch) for ch in channels]
    for ch in channels:
        await asyncio.wait_for(ch.channel_ready(), 60)
    rng = random.Random(0)
    measuring = {"on": False}
    tasks: set[asyncio.Task[None]] = set()

    def spawn(coro: Any) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    errors: dict[str, int] = {}
    fleet = Fleet(n, stubs, errors, spawn)
    # the generator's own full collections (over 10k keys and states) would show up as
    # heartbeat latency; keep what exists now out of the collector's reach, as the daemon does
    import gc

    gc.collect()
    gc.freeze()
    own_gc = {"started": 0.0, "passes": 0, "s": 0.0, "max_s": 0.0}

    def gc_callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            own_gc["started"] = time.perf_counter()
        elif measuring["on"]:
            d = time.perf_counter() - own_gc["started"]
            own_gc["passes"] += 1
            own_gc["s"] += d
            own_gc["max_s"] = max(own_gc["max_s"], d)

    gc.callbacks.append(gc_callback)

    def peer(i: int) -> pb.PeerAddress:
        alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
        tail = "".join(alphabet[(i * 7 + k * 13) % 58] for k in range(44))
        return pb.PeerAddress(peer_id="12D3KooW" + tail, maddrs=["/ip4/127.0.0.1/tcp/1"])

    async def register(i: int) -> None:
        req = pb.RegisterRequest(
            profile=pb.WorkerProfile(
                name=f"load{i}",
                device_kind="cpu",
                vram_bytes=8 << 30,
                num_devices=1,
                link_bandwidth_bytes_per_s=1e8,
                software_version="bench",
            ),
            peer=peer(i),
            local=fleet.local_pb(i),
        )
        signed = sign_request(fleet.sims[i].identity, req, run_id="loadrun", method="Register")
        resp = await stubs[i % CHANNELS].Register(signed, timeout=30)
        fleet.sims[i].answers += 1
        fleet.sims[i].tag = resp.instruction.tag
        fleet.act(i, resp.instruction)

    # Registration runs concurrently with the heartbeat schedule: a worker starts beating
    # (from a random phase) as soon as it is registered, so registering 10k workers,
    # which takes longer than a lease, never lets the first ones expire.
    loop = asyncio.get_running_loop()
    heap: list[tuple[float, int]] = []
    sem = asyncio.Semaphore(64)
    registered_at: dict[int, float] = {}

    async def reg(i: int) -> None:
        async with sem:
            for _ in range(5):
                try:
                    await register(i)
                    if i not in registered_at:
                        registered_at[i] = loop.time()
                        heapq.heappush(heap, (loop.time() + rng.random() * period_s, i))
                    return
                except grpc.aio.AioRpcError as e:
                    errors[f"Register:{e.code().name}"] = errors.get(f"Register:{e.code().name}", 0) + 1
                    await asyncio.sleep(0.5)

    own_lag = {"max_s": 0.0, "over_10ms": 0}

    async def lag_sampler() -> None:
        # how late a 10 ms timer fires in the generator: its own stalls (CPU, GC, signing
        # bursts) end up in the latencies it reports, so they are reported next to them
        while True:
            t = loop.time()
            await asyncio.sleep(0.01)
            late = loop.time() - t - 0.01
            if measuring["on"]:
                own_lag["max_s"] = max(own_lag["max_s"], late)
                own_lag["over_10ms"] += late > 0.01

    sampler = asyncio.ensure_future(lag_sampler())
    t0 = time.perf_counter()
    registering = asyncio.ensure_future(asyncio.gather(*(reg(i) for i in range(n))))

    latencies: list[float] = []
    sent = {"n": 0}
    watched = {"answered": 0, "changed": 0, "extra_beats": 0}
    hold_ms = 60_000  # as the worker asks (the coordinator holds a watch at most a lease)

    inflight = asyncio.Semaphore(max_inflight)

    async def beat(i: int) -> None:
        try:
            await beat_once(i)
        finally:
            inflight.release()

    async def extra_beat(i: int) -> None:
        await inflight.acquire()
        if measuring["on"]:
            watched["extra_beats"] += 1
        await beat(i)

    def arm(i: int) -> None:
        """Hold a watch of worker i's current instruction, unless one is held already."""
        s = fleet.sims[i]
        held = s.watch
        if held is not None and not held.done():
            if s.watch_tag == s.tag:
                return
            held.cancel()  # it watches an instruction the worker no longer follows
        s.watch_tag = s.tag
        s.watch = asyncio.get_running_loop().create_task(watch_once(i, s.tag))
        tasks.add(s.watch)
        s.watch.add_done_callback(tasks.discard)

    async def watch_once(i: int, tag: int) -> None:
        s = fleet.sims[i]
        me = asyncio.current_task()
        req = pb.WatchInstructionRequest(known_tag=tag, wait_ms=hold_ms)
        try:
            resp = await stubs[i % CHANNELS].WatchInstruction(
                sign_request(s.identity, req, run_id="loadrun", method="WatchInstruction"),
                timeout=hold_ms / 1000.0 + 10,
            )
        except grpc.aio.AioRpcError as e:
            key = f"WatchInstruction:{e.code().name}"
            errors[key] = errors.get(key, 0) + 1
            return  # the next heartbeat holds another
        if measuring["on"]:
            watched["answered"] += 1
            watched["changed"] += resp.changed
        if s.watch is not me:
            return  # superseded meanwhile
        s.watch = None
        if resp.changed and resp.instruction.tag != s.tag and not s.inflight:
            s.answers += 1
            s.tag = resp.instruction.tag
            fleet.act(i, resp.instruction)
            spawn(extra_beat(i))  # and heartbeat at once, as the real worker does
        else:
            arm(i)  # its hold ran out, or its answer may be older than a call in flight

    async def beat_once(i: int) -> None:
        req = fleet.heartbeat(i)
        start = time.perf_counter()
        fleet.sims[i].inflight += 1
        try:
            resp = await stubs[i % CHANNELS].Heartbeat(
                sign_request(fleet.sims[i].identity, req, run_id="loadrun", method="Heartbeat"), timeout=10
            )
        except grpc.aio.AioRpcError as e:
            key = f"Heartbeat:{e.code().name}"
            errors[key] = errors.get(key, 0) + 1
            if e.code() == grpc.StatusCode.NOT_FOUND:  # lease lost under load: re-register
                spawn(reg(i))
            return
        finally:
            fleet.sims[i].inflight -= 1
        if measuring["on"]:
            latencies.append((time.perf_counter() - start) * 1000.0)
        fleet.sims[i].answers += 1
        fleet.sims[i].tag = resp.instruction.tag
        fleet.act(i, resp.instruction)
        if watch:
            arm(i)

    # fixed-rate schedule: each worker beats every period_s from a random phase; the
    # warm-up starts once every worker is registered, then the measurement window
    end_warm = end = float("inf")
    register_s = float("nan")
    lag_max = 0.0
    measured_start = None
    cpu0 = own0 = 0.0
    while True:
        now = loop.time()
        if end_warm == float("inf") and registering.done():
            register_s = time.perf_counter() - t0
            end_warm = now + warmup_s
            # No cyclic GC in the generator from the warm-up to the end of the window: grpc.aio
            # calls leave reference cycles behind (~15 tracked objects a heartbeat here), and
            # collecting them cost the generator ~40 passes/s; its pauses are not the
            # coordinator's latency (they counted ~1 s of a 30 s window in a 10k-worker run).
            # The garbage (a few hundred MB at most) waits until the window is over.
            gc.disable()
            end = end_warm + measure_s
        if now >= end:
            break
        if not measuring["on"] and now >= end_warm:
            measuring["on"] = True
            measured_start = time.perf_counter()
            cpu0, own0 = _cpu_s(server_pid), time.process_time()
            errors.clear()
            scrape0 = await asyncio.to_thread(_scrape, metrics_url) if metrics_url else {}
        burst = 0
        # bounded bursts: when behind schedule, the outer checks (registration done, end of
        # the window) still run between bursts
        while heap and heap[0][0] <= now and now < end and burst < max_inflight:
            burst += 1
            due, i = heapq.heappop(heap)
            # closed loop beyond max_inflight: an overloaded coordinator shows up as a lower
            # rate and a generator lag, not as an unbounded queue of doomed requests
            await inflight.acquire()
            now = loop.time()
            lag_max = max(lag_max, now - due) if measuring["on"] else lag_max
            spawn(beat(i))
            if measuring["on"]:
                sent["n"] += 1
            heapq.heappush(heap, (due + period_s, i))
        await asyncio.sleep(max(0.0, min(heap[0][0] - loop.time(), 0.01)) if heap else 0.01)
    measured_s = time.perf_counter() - (measured_start or time.perf_counter())
    server_cpu, own_cpu = _cpu_s(server_pid) - cpu0, time.process_time() - own0
    scrape1 = await asyncio.to_thread(_scrape, metrics_url) if metrics_url else {}
    answered = len(latencies)
    pending: list[asyncio.Future[Any]] = [*tasks, registering, sampler]
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, registering, sampler, return_exceptions=True)
    gc.callbacks.remove(gc_callback)
    gc.enable()
    for ch in channels:
        await ch.close()
    per_s = 1.0 / measured_s if measured_s > 0 else 0.0
    return {
        "workers": n,
        "watch": watch,
        "watches_answered_per_s": watched["answered"] * per_s,
        "watches_changed_per_s": watched["changed"] * per_s,
        "extra_heartbeats_per_s": watched["extra_beats"] * per_s,
        "watches_held_at_end": scrape1.get("bagel_watches_held", float("nan")),
        "heartbeats_per_s": answered / measured_s if measured_s > 0 else 0.0,
        "target_per_s": n / period_s,
        "sent_per_s": sent["n"] / measured_s if measured_s > 0 else 0.0,
        "p50_ms": _percentile(latencies, 0.50),
        "p99_ms": _percentile(latencies, 0.99),
        "max_ms": max(latencies) if latencies else float("nan"),
        "generator_max_lag_ms": lag_max * 1000.0,
        # CPU per answered heartbeat (the rest of the server's load included: reports, ticks)
        "server_cpu_us_per_hb": 1e6 * server_cpu / answered if answered else float("nan"),
        "server_cpu_cores": server_cpu / measured_s if measured_s > 0 else float("nan"),
        "generator_cpu_cores": own_cpu / measured_s if measured_s > 0 else float("nan"),
        "register_s": register_s,
        "errors": dict(errors),
        # stall attribution over the window: the server's (from its /metrics, when it has
        # one: the tick timer's lateness, sampled 4 times a second, and its full GC passes)
        # and the generator's own (a 10 ms timer's lateness, its GC passes)
        **_server_stalls(scrape0, scrape1),
        "generator_lag_max_ms": own_lag["max_s"] * 1000.0,
        "generator_lag_over_10ms": own_lag["over_10ms"],
        "generator_gc_passes": own_gc["passes"],
        "generator_gc_ms": own_gc["s"] * 1000.0,
        "generator_gc_max_ms": own_gc["max_s"] * 1000.0,
    }


def _generator_main(
    target: str,
    n: int,
    period_s: float,
    warmup_s: float,
    measure_s: float,
    server_pid: int,
    max_inflight: int,
    metrics_url: str | None,
    watch: bool,
    out: Any,
) -> None:
    import uvloop

    out.put(
        uvloop.run(_generate(target, n, period_s, warmup_s, measure_s, server_pid, max_inflight, metrics_url, watch))
    )


# ---------------------------------------------------------------------------- baseline peer


async def _serve_baseline(target: str) -> None:
    """A bare grpc.aio Coordinator: constant replies, nothing verified, parsed or stored."""
    import grpc

    from bagel.protocol import bagel_pb2 as pb
    from bagel.protocol import bagel_pb2_grpc as pb_grpc
    from bagel.protocol.grpc_options import server_options

    wait = pb.Instruction(order=pb.ORDER_WAIT)
    register = pb.RegisterResponse(worker_id="w" + "0" * 40, heartbeat_interval_ms=5000, instruction=wait)
    heartbeat = pb.HeartbeatResponse(lease_expires_unix_ms=1, instruction=wait)

    class Bare(pb_grpc.CoordinatorServicer):
        async def Register(self, request: Any, context: Any) -> Any:
            return register

        async def Heartbeat(self, request: Any, context: Any) -> Any:
            return heartbeat

    server = grpc.aio.server(options=server_options())
    pb_grpc.add_CoordinatorServicer_to_server(Bare(), server)
    server.add_insecure_port(target)
    await server.start()
    print("listening:", target, flush=True)
    await server.wait_for_termination()


# ---------------------------------------------------------------------------- driver


def run_point(
    n: int,
    period_s: float,
    warmup_s: float,
    measure_s: float,
    workdir: Path,
    max_inflight: int = 256,
    server: str = "coordinator",
) -> dict[str, Any]:
    """One point: `server` is "baseline" (the bare peer), "coordinator", or "coord+watch"
    (the coordinator, every worker holding a watch between its beats)."""
    watch = server == "coord+watch"
    spec = workdir / f"load-{n}.toml"
    spec.write_text(SPEC.format(lease_s=max(15.0, 3 * period_s), period_s=period_s))
    port = _free_port()
    target = f"127.0.0.1:{port}"
    log_path = workdir / f"{server}-{n}.log"
    log = log_path.open("w")
    metrics_url = None
    if server == "baseline":
        argv = [sys.executable, str(Path(__file__).resolve()), "--serve-baseline", target]
    else:
        metrics_port = _free_port()
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        argv = [
            sys.executable,
            "-m",
            "bagel.coordinator",
            "serve",
            "--run",
            str(spec),
            "--data-dir",
            str(workdir / f"data-{server}-{n}"),
            "--listen",
            target,
            "--no-dht",
            "--insecure",  # plaintext gRPC: the figures measure the coordinator, not TLS record encryption
            "--tick-ms",
            "250",
            "--log-level",
            "WARNING",
            "--metrics-listen",
            f"127.0.0.1:{metrics_port}",
        ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("listening:"):
                break
        else:
            raise RuntimeError(f"coordinator exited with {proc.wait()}")
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        gen = ctx.Process(
            target=_generator_main,
            args=(target, n, period_s, warmup_s, measure_s, proc.pid, max_inflight, metrics_url, watch, q),
        )
        gen.start()
        result = q.get(timeout=1800 + warmup_s + measure_s)
        result["server"] = server
        gen.join(30)
        if proc.poll() is not None or result["errors"]:
            tail = log_path.read_text().splitlines()[-15:]
            print(f"coordinator exit={proc.poll()}; log tail:\n  " + "\n  ".join(tail), file=sys.stderr)
        return result
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workers", type=int, nargs="+", default=None, help="registered workers per point (default 1000 5000 10000)"
    )
    p.add_argument(
        "--period-s", type=float, default=5.0, help="heartbeat period per worker in seconds; default %(default)s"
    )
    p.add_argument(
        "--warmup-s", type=float, default=None, help="seconds of load before measuring (default: 1.5 periods)"
    )
    p.add_argument(
        "--measure-s", type=float, default=None, help="measurement window in seconds (default 30; --quick 8)"
    )
    p.add_argument("--quick", action="store_true", help="short run: 200 and 1000 workers, 8 s windows")
    p.add_argument(
        "--max-inflight",
        type=int,
        default=256,
        help="most heartbeats in flight at once (closed loop beyond it); default %(default)s",
    )
    p.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="skip the bare grpc.aio peer measured at each point",
    )
    p.add_argument(
        "--watch",
        action="store_true",
        help="also measure each point with every worker holding a WatchInstruction between its beats",
    )
    p.add_argument("--serve-baseline", metavar="HOST:PORT", help=argparse.SUPPRESS)
    p.add_argument(
        "--json", type=Path, default=None, metavar="FILE", help="write {'points': [...], 'baseline': [...]} to FILE"
    )
    args = p.parse_args(argv)
    if args.serve_baseline:
        import uvloop

        uvloop.run(_serve_baseline(args.serve_baseline))
        return 0
    workers = args.workers or ([200, 1000] if args.quick else [1000, 5000, 10000])
    measure_s = args.measure_s or (8.0 if args.quick else 30.0)
    warmup_s = args.warmup_s if args.warmup_s is not None else 1.5 * args.period_s
    points: list[dict[str, Any]] = []
    baseline: list[dict[str, Any]] = []
    print(
        f"{'server':>11} {'workers':>8} {'target/s':>9} {'hb/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
        f"{'gen lag ms':>10} "
        f"{'srv us/hb':>9} {'srv cores':>9} {'gen cores':>9} {'reg s':>6} {'srv>25ms':>8} {'srv gc2 ms':>10} "
        f"{'gen stall':>9} {'gen gc ms':>9} {'watch/s':>8} {'changed':>8} {'extra hb':>8} {'held':>6}  errors"
    )
    servers = ["baseline"] if args.baseline else []
    servers += ["coordinator"] + (["coord+watch"] if args.watch else [])
    with tempfile.TemporaryDirectory(prefix="bagel-load-") as tmp:
        for n, server in [(n, srv) for n in workers for srv in servers]:
            r = run_point(n, args.period_s, warmup_s, measure_s, Path(tmp), args.max_inflight, server)
            (baseline if server == "baseline" else points).append(r)
            w = r["watch"]
            print(
                f"{server:>11} {r['workers']:>8} {r['target_per_s']:>9.0f} {r['heartbeats_per_s']:>9.1f} "
                f"{r['p50_ms']:>8.2f} "
                f"{r['p99_ms']:>8.2f} {r['max_ms']:>8.1f} {r['generator_max_lag_ms']:>10.1f} "
                f"{r['server_cpu_us_per_hb']:>9.0f} {r['server_cpu_cores']:>9.2f} {r['generator_cpu_cores']:>9.2f} "
                f"{r['register_s']:>6.1f} {r.get('server_lag_over_25ms', float('nan')):>8.0f} "
                f"{r.get('server_full_gc_ms', float('nan')):>10.1f} {r['generator_lag_max_ms']:>9.1f} "
                f"{r['generator_gc_ms']:>9.1f} "
                f"{r['watches_answered_per_s'] if w else float('nan'):>8.1f} "
                f"{r['watches_changed_per_s'] if w else float('nan'):>8.1f} "
                f"{r['extra_heartbeats_per_s'] if w else float('nan'):>8.1f} "
                f"{r['watches_held_at_end'] if w else float('nan'):>6.0f}  "
                f"{r['errors'] or '-'}",
                flush=True,
            )
    meta = {"cpus": os.cpu_count(), "period_s": args.period_s, "measure_s": measure_s, "loadavg": os.getloadavg()}
    if args.json:
        args.json.write_text(json.dumps({"points": points, "baseline": baseline, "meta": meta}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
