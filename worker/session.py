"""The worker's link to the coordinator: registration, heartbeats, and what it reads on the way.

A mixin of `Agent` (`agent.py`), split out along the seam a reader would name: everything
here talks to the coordinator or prepares what a Register carries.

- `_rpc`: every call goes through one lock, so answers are processed in the order the
  requests were made (an old heartbeat answer can never overtake a newer ReportRound
  answer); UNAVAILABLE / DEADLINE_EXCEEDED mark the coordinator down (the caller retries
  with full-jitter backoff, and after a few seconds the DHT record is looked up again in
  case the coordinator moved); NOT_FOUND means "register again" (with our LocalState).
- `_register`: the profile needs the run spec (samples/s of each cell's model), which the
  coordinator sends in its Register answer. The spec is cached per spec hash in the data
  dir, so only the first contact with a run registers twice (first without throughput).
  Profiles are cached too, so a restart after a crash does not re-benchmark.
- `_heartbeat_loop`: its own task, every `heartbeat_interval`, every 250 ms while READY or
  REDUCING (the freeze and the verdict arrive sooner), and at once when the phase changes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import grpc

from bagel.protocol.runspec import RunSpec, parse_spec
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.client import CoordinatorClient, backoff_delay_s, is_retryable
from bagel.protocol.discovery import lookup_coordinator
from bagel.worker import ddp
from bagel.worker.localstate import atomic_write
from bagel.worker.profile import MeasuredProfile, measure

log = logging.getLogger(__name__)

FAST_HEARTBEAT_S = 0.25  # while READY/REDUCING: the freeze and the verdict come sooner
RPC_TIMEOUT_S = 10.0
SOFTWARE_VERSION = "bagel-worker/0.1"
PROFILE_MAX_AGE_S = 24 * 3600.0


class CoordinatorLink:
    """Coordinator-facing half of the Agent (state lives on the Agent; see agent.py)."""

    cfg: Any
    display: Any
    ctx: ddp.DistContext
    client: CoordinatorClient | None

    async def _stop_heartbeats(self) -> None:
        if self._hb_task is not None:
            self._hb_task.cancel()
            await asyncio.gather(self._hb_task, return_exceptions=True)
            self._hb_task = None

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


def _cached_profile(path: Path, key: dict[str, Any], name: str) -> MeasuredProfile | None:
    """A profile measured earlier under the same key (run spec, device, throttle, ...)."""
    try:
        body = json.loads(path.read_text())
        if body.get("key") != key or time.time() - float(body["measured_unix_s"]) > PROFILE_MAX_AGE_S:
            return None
        p = body["profile"]
        return MeasuredProfile(
            name=name, device_kind=str(p["device_kind"]), device_name=str(p["device_name"]),
            vram_bytes=int(p["vram_bytes"]), num_devices=int(p["num_devices"]),
            link_bandwidth_bytes_per_s=float(p["link_bandwidth_bytes_per_s"]),
            samples_per_s={str(k): float(v) for k, v in p["samples_per_s"].items()},
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
