"""The worker's heartbeat loop (`worker/link.py`): a phase change is never left waiting
for the interval, a changed instruction its watch answers is taken at once (if it is the
newest answer the worker has), and a held watch lives across heartbeats that change nothing.
An outage the link noticed ends with the coordinator's next answer, a refusal included.

The link's coordinator client is replaced by a recorder (these tests are about the loop's
timing of requests, not the RPC); the interval is a minute, so a heartbeat that waited for
it would miss the tests' few-second wait by far.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.identity import Identity
from bagel.protocol.joinstring import JoinInfo
from bagel.worker.display import Display
from bagel.worker.link import REDIAL_AFTER_S, RPC_TIMEOUT_S, WATCH_HOLD_S, CoordinatorLink

from simworkers import fake_peer_id

pytestmark = pytest.mark.timeout(30)

INTERVAL_S = 60.0
WAIT_S = 5.0


class _Owner:
    """Turns READY when told to (the test decides when: during the call or its answer)."""

    def __init__(self) -> None:
        self.phase = pb.PHASE_TRAINING
        self.link: CoordinatorLink | None = None
        self.ready_on_answer = False
        self.instructions: list[pb.Instruction] = []

    def heartbeat_request(self) -> pb.HeartbeatRequest:
        return pb.HeartbeatRequest(phase=self.phase)

    def become_ready(self) -> None:
        assert self.link is not None
        self.phase = pb.PHASE_READY
        self.link.wake_heartbeat()

    def on_instruction(self, instr: pb.Instruction) -> None:
        self.instructions.append(instr)
        if self.ready_on_answer and self.phase != pb.PHASE_READY:
            self.become_ready()  # the answer's instruction completed at once


class _Client:
    """Records each heartbeat's phase; the first one is held until `release` is set.
    Heartbeats answer an instruction tagged `hb_tag` (1). A watch is held until the test
    answers it (`answer_watch`) or sets `watch_release` (answering `watch_answer`, then
    and from then on), as a coordinator holds it while nothing changes."""

    def __init__(self) -> None:
        self.phases: list[int] = []
        self.in_flight = asyncio.Event()
        self.release = asyncio.Event()
        self.second = asyncio.Event()
        self.hb_tag = 1
        self.watches: list[tuple[int, int]] = []  # (known_tag, wait_ms)
        self.held: list[asyncio.Future[pb.WatchInstructionResponse]] = []  # one per watch, in order
        self.cancelled: list[int] = []  # watches (by index) the link cancelled
        self.watching = asyncio.Event()
        self.watch_release = asyncio.Event()
        self.watch_answer = pb.WatchInstructionResponse()

    async def watch_instruction(self, known_tag: int, wait_ms: int) -> pb.WatchInstructionResponse:
        k = len(self.watches)
        self.watches.append((known_tag, wait_ms))
        fut: asyncio.Future[pb.WatchInstructionResponse] = asyncio.get_running_loop().create_future()
        self.held.append(fut)
        self.watching.set()
        release = asyncio.ensure_future(self.watch_release.wait())
        try:
            await asyncio.wait({fut, release}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self.cancelled.append(k)
            raise
        finally:
            release.cancel()
        return fut.result() if fut.done() else self.watch_answer

    def answer_watch(self, k: int, resp: pb.WatchInstructionResponse) -> None:
        self.held[k].set_result(resp)

    async def call(self, name: str, req: pb.HeartbeatRequest) -> Any:
        assert name == "Heartbeat"
        self.phases.append(req.phase)
        if len(self.phases) == 1:
            self.in_flight.set()
            await self.release.wait()
        else:
            self.second.set()
        return SimpleNamespace(instruction=pb.Instruction(tag=self.hb_tag))


async def _until(pred: Any, what: str) -> None:
    for _ in range(int(WAIT_S / 0.01)):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _link(owner: _Owner, client: _Client) -> CoordinatorLink:
    join = JoinInfo("run", Identity.generate().public_key, ("/ip4/127.0.0.1/tcp/1/p2p/" + fake_peer_id("j"),))
    link = CoordinatorLink(owner, join, Identity.generate(), Display("json", stream=io.StringIO()), asyncio.Event())  # type: ignore[arg-type]
    link.client = client  # type: ignore[assignment]
    link.hb_interval_s = INTERVAL_S
    owner.link = link
    return link


@contextlib.asynccontextmanager
async def _waiting(phase: pb.Phase) -> AsyncIterator[tuple[_Owner, _Client, CoordinatorLink]]:
    """A link whose worker waits on the coordinator in `phase`, its first heartbeat
    answered and its first watch held; the heartbeats stop on the way out."""
    owner, client = _Owner(), _Client()
    owner.phase = phase
    link = _link(owner, client)
    client.release.set()
    link.start_heartbeats()
    try:
        await asyncio.wait_for(client.watching.wait(), WAIT_S)
        yield owner, client, link
    finally:
        await link.stop_heartbeats()


@pytest.mark.parametrize("when", ["while the heartbeat is in flight", "while its answer is handled"])
async def test_a_phase_change_during_a_heartbeat_is_sent_at_once(when: str) -> None:
    """The wake used to be cleared after the answer came back, so a READY reached while a
    heartbeat was on the wire (or by the answer itself: a round all trained ahead is READY
    on its TRAIN) waited a whole interval; the round could not freeze meanwhile."""
    owner, client = _Owner(), _Client()
    owner.ready_on_answer = when == "while its answer is handled"
    link = _link(owner, client)
    link.start_heartbeats()
    try:
        await asyncio.wait_for(client.in_flight.wait(), WAIT_S)
        if not owner.ready_on_answer:
            owner.become_ready()
        client.release.set()
        await asyncio.wait_for(client.second.wait(), WAIT_S)
        assert client.phases[:2] == [pb.PHASE_TRAINING, pb.PHASE_READY]
    finally:
        await link.stop_heartbeats()


async def test_without_a_phase_change_the_next_heartbeat_waits_for_the_interval() -> None:
    """The other side of the rule: an answer that changes nothing does not start another
    heartbeat at once (no busy loop)."""
    owner, client = _Owner(), _Client()
    link = _link(owner, client)
    client.release.set()
    link.start_heartbeats()
    try:
        await asyncio.wait_for(client.in_flight.wait(), WAIT_S)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.second.wait(), 0.5)
        assert client.phases == [pb.PHASE_TRAINING]
        assert client.watches == [], "a training worker holds no watch"
    finally:
        await link.stop_heartbeats()


async def test_a_changed_instruction_from_the_watch_is_taken_and_heartbeated_at_once() -> None:
    """Between heartbeats a waiting worker holds a watch with the last answer's tag; a changed
    instruction it answers reaches the owner, and the next heartbeat goes at once (it says
    what the worker now does), not an interval later."""
    async with _waiting(pb.PHASE_READY) as (owner, client, link):  # waiting for the freeze
        assert client.watches == [(1, int(WATCH_HOLD_S * 1000))]
        assert not client.second.is_set(), "held: no heartbeat while nothing changed"
        freeze = pb.Instruction(order=pb.ORDER_REDUCE, round=1, tag=2)
        client.watch_answer = pb.WatchInstructionResponse(instruction=freeze, changed=True)
        client.watch_release.set()
        await asyncio.wait_for(client.second.wait(), WAIT_S)
        assert owner.instructions[1] == freeze


async def test_a_watch_answer_that_came_while_another_call_was_in_flight_is_dropped() -> None:
    """Answers are taken in the order they are the newest: one that came while a report was
    on the wire may be older than that report's answer, so it is dropped, and the watch is
    sent again with the tag the report's answer brought."""
    async with _waiting(pb.PHASE_REDUCING) as (owner, client, link):  # its report awaits the verdict
        await link.lock.acquire()  # a ReportRound in flight
        stale = pb.Instruction(order=pb.ORDER_REDUCE, round=1, tag=2)
        client.answer_watch(0, pb.WatchInstructionResponse(instruction=stale, changed=True))
        await asyncio.sleep(0.1)  # the watch's answer comes while the report is on the wire
        link.answers += 1  # what `rpc` does with the report's answer
        link.known_tag = 3
        link.lock.release()
        await _until(lambda: len(client.watches) == 2, "the watch sent again")
        assert client.watches[1][0] == 3
        assert stale not in owner.instructions
        assert len(client.phases) == 1, "no heartbeat: nothing was taken"


async def test_a_watch_answer_that_came_after_another_answer_is_taken() -> None:
    """An answer handled before the watch's came is older than it (one connection delivers
    answers in the order they were written), so the watch's answer is taken."""
    async with _waiting(pb.PHASE_REDUCING) as (owner, client, link):
        link.answers += 1  # a report answered while the watch was held, its instruction unchanged
        commit = pb.Instruction(order=pb.ORDER_TRAIN, round=2, tag=2)
        client.answer_watch(0, pb.WatchInstructionResponse(instruction=commit, changed=True))
        await asyncio.wait_for(client.second.wait(), WAIT_S)
        assert owner.instructions[1] == commit


async def test_a_held_watch_lives_across_heartbeats_until_an_answer_brings_another_instruction() -> None:
    """A waiting worker does not send a watch with every heartbeat: the one it holds still
    watches the instruction it follows. An answer with another instruction replaces it."""
    async with _waiting(pb.PHASE_READY) as (owner, client, link):
        for n in (2, 3, 4):  # heartbeats whose answers change nothing
            link.wake_heartbeat()
            await _until(lambda n=n: len(client.phases) == n, f"heartbeat {n}")
        await asyncio.sleep(0.1)
        assert client.watches == [(1, int(WATCH_HOLD_S * 1000))] and client.cancelled == []
        client.hb_tag = 5  # the next heartbeat's answer brings another instruction
        link.wake_heartbeat()
        await _until(lambda: len(client.watches) == 2, "a watch of the new instruction")
        assert client.watches[1][0] == 5
        await _until(lambda: client.cancelled == [0], "the old watch cancelled")


def _events(link: CoordinatorLink) -> list[str]:
    stream = link.display.stream
    assert isinstance(stream, io.StringIO)
    return [json.loads(line)["event"] for line in stream.getvalue().splitlines()]


async def test_an_outage_ends_with_any_answer_a_refusal_too() -> None:
    """After a partition the coordinator may answer NOT_FOUND (the worker's lease ran out
    meanwhile): it is reachable again, so the outage is over then, not only once the
    worker's registration is answered (which may take a while: admission, proof of work)."""
    owner, client = _Owner(), _Client()
    link = _link(owner, client)

    def failing(code: grpc.StatusCode) -> Any:
        async def call() -> Any:
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")

        return call

    assert await link.rpc(failing(grpc.StatusCode.UNAVAILABLE)) is None
    assert await link.rpc(failing(grpc.StatusCode.DEADLINE_EXCEEDED)) is None
    assert _events(link) == ["coordinator-unreachable"] and link.down_since is not None and link.epoch == 0
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await link.rpc(failing(grpc.StatusCode.NOT_FOUND))
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND  # still the caller's to handle (re-register)
    assert _events(link) == ["coordinator-unreachable", "coordinator-back"]
    assert link.down_since is None and link.epoch == 1
    # answers while nothing was down change nothing
    client.release.set()
    with pytest.raises(grpc.aio.AioRpcError):
        await link.rpc(failing(grpc.StatusCode.PERMISSION_DENIED))
    await link.rpc(lambda: client.call("Heartbeat", pb.HeartbeatRequest()))
    assert _events(link) == ["coordinator-unreachable", "coordinator-back"] and link.epoch == 1


class _Channel:
    def __init__(self) -> None:
        self.closed_with: list[float | None] = []

    async def close(self, grace: float | None = None) -> None:
        self.closed_with.append(grace)


class _Redialing:
    """A client that counts redials, each handing back the channel it replaced."""

    def __init__(self) -> None:
        self.old: list[_Channel] = []

    def redial(self) -> _Channel:
        self.old.append(_Channel())
        return self.old[-1]


async def test_a_long_outage_redials_at_most_once_per_interval_and_the_old_channels_close() -> None:
    """A connection can stay stuck after a network cut heals (TCP backoff, a NAT that lost
    its mapping): after `REDIAL_AFTER_S` without an answer the link dials a new one, then
    at most once per `REDIAL_AFTER_S` while the outage lasts, and none once it is over."""
    owner, client = _Owner(), _Redialing()
    link = _link(owner, client)  # type: ignore[arg-type]
    t0 = 1000.0
    assert not link.maybe_redial(t0)  # no outage
    link.down_since = t0
    assert not link.maybe_redial(t0 + REDIAL_AFTER_S - 0.1)
    assert link.maybe_redial(t0 + REDIAL_AFTER_S)
    assert not link.maybe_redial(t0 + REDIAL_AFTER_S + 1.0)  # not again so soon
    assert link.maybe_redial(t0 + 2 * REDIAL_AFTER_S)
    assert len(client.old) == 2
    await _until(lambda: all(c.closed_with for c in client.old), "the replaced channels to close")
    assert all(c.closed_with == [RPC_TIMEOUT_S + 1.0] for c in client.old)  # after their calls' deadline
    link.down_since = None  # the coordinator answered
    assert not link.maybe_redial(t0 + 10 * REDIAL_AFTER_S)
