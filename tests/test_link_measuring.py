"""A worker measuring its speed, between the Register that brought it the run spec and the
one that carries its speeds, heartbeats through its link (`CoordinatorLink.register`). A
real in-process coordinator then holds it by the run's lease however long it measures, and
loses it within that lease when it dies mid-measurement, instead of after the five-minute
lease of a worker that sends nothing while it measures.

The link's owner stands in for the agent: its second `hello` is the measurement, and lasts
until the test ends it (or kills the worker)."""

from __future__ import annotations

import asyncio
import io
import time
from pathlib import Path

import pytest

from bagel.coordinator.core.records import WorkerState
from bagel.coordinator.daemon import CoordinatorHandle, start_coordinator
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.client import CoordinatorClient
from bagel.protocol.identity import Identity
from bagel.protocol.joinstring import JoinInfo
from bagel.protocol.runspec import parse_spec
from bagel.worker.display import Display
from bagel.worker.link import CoordinatorLink

from simworkers import cluster_spec_text, fake_peer_id, uniform_cells

pytestmark = pytest.mark.timeout(60)

# a 3 s lease: the coordinator and the worker share this process's event loop, which a
# loaded machine can stall for a second or two; a worker that sends nothing while it
# measures keeps the 300 s measuring lease instead
LEASE_S = 3.0
HEARTBEAT_S = 0.3
RUN = "mrun"


class _Measuring:
    """Registers first without speeds; the second `hello` measures until `measured` is set."""

    def __init__(self, cell_ids: list[str]) -> None:
        self.cell_ids = cell_ids
        self.hellos = 0
        self.measuring = asyncio.Event()
        self.measured = asyncio.Event()
        self.instructions: list[pb.Instruction] = []

    async def hello(self) -> tuple[pb.WorkerProfile, pb.PeerAddress, pb.LocalState]:
        self.hellos += 1
        speeds: dict[str, float] = {}
        if self.hellos > 1:
            self.measuring.set()
            await self.measured.wait()
            speeds = {c: 100.0 for c in self.cell_ids}
        profile = pb.WorkerProfile(name="m", device_kind="cpu", vram_bytes=8 << 30, num_devices=1, samples_per_s=speeds)
        peer = pb.PeerAddress(peer_id=fake_peer_id("m"), maddrs=["/ip4/127.0.0.1/tcp/1"])
        return profile, peer, pb.LocalState()

    async def registered(self, resp: pb.RegisterResponse) -> bool:
        if self.hellos == 1:
            return False  # the spec is known now: measure, then register again
        self.instructions.append(resp.instruction)
        return True

    def heartbeat_request(self) -> pb.HeartbeatRequest:
        return pb.HeartbeatRequest(phase=pb.PHASE_IDLE)

    def on_instruction(self, instr: pb.Instruction) -> None:
        self.instructions.append(instr)

    def request_stop(self, reason: str = "signal") -> None:
        raise AssertionError(f"the link asked to stop: {reason}")


async def _measuring_worker(
    tmp_path: Path,
) -> tuple[CoordinatorHandle, str, _Measuring, CoordinatorLink, asyncio.Task[bool]]:
    """A coordinator, and a worker that registered once and is measuring now."""
    spec = parse_spec(cluster_spec_text(RUN, lease_s=LEASE_S, heartbeat_s=HEARTBEAT_S))
    h = await start_coordinator(spec, tmp_path / "coord", cells=uniform_cells(spec.cell_ids), tick_ms=50)
    ident = Identity.generate()
    owner = _Measuring(list(spec.cell_ids))
    join = JoinInfo(RUN, h.identity.public_key, ("/ip4/127.0.0.1/tcp/1/p2p/" + fake_peer_id("j"),))
    link = CoordinatorLink(owner, join, ident, Display("json", stream=io.StringIO()), asyncio.Event())
    link.client = CoordinatorClient(f"127.0.0.1:{h.port}", ident, RUN)
    registering = asyncio.create_task(link.register())
    await asyncio.wait_for(owner.measuring.wait(), 10)
    return h, ident.worker_id, owner, link, registering


def _state(h: CoordinatorHandle, worker_id: str) -> WorkerState:
    return h.state.roster.workers[worker_id].state


async def test_a_measuring_worker_is_held_by_the_runs_lease_and_registers_with_its_speeds(tmp_path: Path) -> None:
    h, wid, owner, link, registering = await _measuring_worker(tmp_path)
    try:
        # measuring for three leases: still active, and (from its first heartbeat, sent as
        # it starts measuring) never promised more than one lease ahead
        await asyncio.sleep(HEARTBEAT_S)
        end = time.monotonic() + 3 * LEASE_S
        while time.monotonic() < end:
            await asyncio.sleep(0.1)
            assert _state(h, wid) is WorkerState.ACTIVE
            lease_ms = h.state.worker_phase(wid)[4]
            assert lease_ms - time.time() * 1000 <= LEASE_S * 1000 + 100, "a measuring lease, not the run's"
        assert not registering.done()
        owner.measured.set()
        assert await asyncio.wait_for(registering, 10) is True
        assert owner.hellos == 2 and h.state.roster.workers[wid].throughput
    finally:
        registering.cancel()
        await link.close()
        await h.stop()


async def test_a_worker_that_dies_while_measuring_is_lost_within_the_runs_lease(tmp_path: Path) -> None:
    h, wid, _owner, link, registering = await _measuring_worker(tmp_path)
    try:
        await asyncio.sleep(1.5 * LEASE_S)
        assert _state(h, wid) is WorkerState.ACTIVE  # heartbeating while it measures
        registering.cancel()  # the worker dies mid-measurement: its heartbeats stop
        await asyncio.gather(registering, return_exceptions=True)
        await link.close()
        died = time.monotonic()
        while _state(h, wid) is WorkerState.ACTIVE:
            assert time.monotonic() - died < 10 * LEASE_S, "still active long after the run's lease ran out"
            await asyncio.sleep(0.05)
        assert _state(h, wid) is WorkerState.LOST
    finally:
        registering.cancel()
        await link.close()
        await h.stop()
